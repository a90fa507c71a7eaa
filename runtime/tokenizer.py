"""Tokenizers: Hugging Face's from a checkpoint directory, or a byte-level one needing no files."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pagedgen.errors import PagedgenError


class Tokenizer(Protocol):
    eos_token_ids: set[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def apply_chat_template_batch(self, conversations: list[list[dict]]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS (256) and EOS (257). For the built-in presets."""

    BOS, EOS = 256, 257
    vocab_size = 258

    def __init__(self) -> None:
        self.eos_token_ids = {self.EOS}

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def apply_chat_template_batch(self, conversations: list[list[dict]]) -> list[list[int]]:
        return [self.apply_chat_template(c) for c in conversations]


class HFTokenizer:
    """transformers' AutoTokenizer, with its chat template."""

    def __init__(self, path: Path, eos_token_id: int | list[int] | None) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise PagedgenError(f"cannot load the tokenizer from {path}: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}")
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_ids = {i for i in ids if i is not None}
        if self.tok.eos_token_id is not None:
            self.eos_token_ids.add(self.tok.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.apply_chat_template_batch([messages])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """One call into the fast tokenizer for the whole batch (its Rust side runs it in
        parallel); the same ids as ``encode`` one text at a time."""
        return self.tok(texts, return_attention_mask=False)["input_ids"]

    def apply_chat_template_batch(self, conversations: list[list[dict]]) -> list[list[int]]:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; use 'prompt' instead")
        out = self.tok.apply_chat_template(conversations, add_generation_prompt=True,
                                           tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return [list(ids) for ids in out]


class MissingTokenizer:
    """For a checkpoint without tokenizer files: token-id prompts work, text ones do not."""

    def __init__(self, path: Path, eos_token_id: int | list[int] | None) -> None:
        self.path = path
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_ids = {i for i in ids if i is not None}

    def encode(self, text: str) -> list[int]:
        raise ValueError(f"{self.path} has no tokenizer files; use 'prompt_token_ids'")

    def decode(self, ids: list[int]) -> str:
        return ""

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encode("")

    def apply_chat_template_batch(self, conversations: list[list[dict]]) -> list[list[int]]:
        return self.encode("")
