"""Tokenizers: Hugging Face's from a checkpoint directory (a GGUF file's converted once, then
kept on disk), or a byte-level one needing no files."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Protocol

from pagedgen.errors import PagedgenError, first_line
from pagedgen.meta import cache_file


class Tokenizer(Protocol):
    eos_token_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids``; with special tokens kept, ``spaces_between_special_tokens`` puts
        a space around each (as vLLM's detokenizer does)."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def apply_chat_template_batch(self, conversations: list[list[dict]],
                                  template_kwargs: dict | None = None) -> list[list[int]]:
        """Each conversation through the chat template, with ``template_kwargs`` as more
        template variables (``enable_thinking``, ``reasoning_effort``)."""


def chat_options(template_kwargs: dict | None) -> tuple[bool, bool, dict]:
    """(add_generation_prompt, continue_final_message, the other template variables) of a
    chat's ``template_kwargs``: the assistant's turn opened after the messages by default, not
    where the last message is continued."""
    kwargs = dict(template_kwargs or {})
    cont = bool(kwargs.pop("continue_final_message", False))
    return bool(kwargs.pop("add_generation_prompt", not cont)), cont, kwargs


class ChatRenderer(Protocol):
    def render(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """A conversation's prompt token ids, the assistant's turn left open."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS (256) and EOS (257). For the built-in presets."""

    BOS, EOS = 256, 257
    vocab_size = 258

    def __init__(self) -> None:
        self.eos_token_ids = {self.EOS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS] * add_special_tokens + [*text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """BOS and EOS have no text, kept or not."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if continue_final_message:  # the last message left open
            text = text[:-1]
        return self.encode(text + "<|assistant|>\n" * add_generation_prompt)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def apply_chat_template_batch(self, conversations: list[list[dict]],
                                  template_kwargs: dict | None = None) -> list[list[int]]:
        add, cont, _ = chat_options(template_kwargs)  # no other variables to take
        return [self.apply_chat_template(c, add, cont) for c in conversations]


class HFTokenizer:
    """transformers' AutoTokenizer, with its chat template (from a checkpoint's files, or
    converted from a GGUF file's metadata)."""

    def __init__(self, path: Path, eos_token_id: int | list[int] | None,
                 gguf_file: str | None = None) -> None:
        """``gguf_file``: a GGUF file in ``path`` whose metadata holds the tokenizer."""
        try:
            self.tok = _auto_tokenizer(str(path), gguf_file)
        except Exception as e:
            raise PagedgenError(f"cannot load the tokenizer from {path}: {type(e).__name__}: "
                                f"{first_line(e, '')}")
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_ids = {i for i in ids if i is not None}
        if self.tok.eos_token_id is not None:
            self.eos_token_ids.add(self.tok.eos_token_id)
        self.renderer: ChatRenderer | None = None  # in place of the chat template (harmony)
        self.chat_format: str | None = None  # how chats render, where a model has a choice

    def use_renderer(self, renderer: ChatRenderer | None, why: str) -> None:
        """Render chats with ``renderer`` (``why``: its name), or, when None, with the chat
        template (``why``: the reason)."""
        self.renderer = renderer
        self.chat_format = why if renderer is not None else f"chat template ({why})"

    def ordinary_tokens(self) -> list[tuple[int, bytes]]:
        """Each ordinary (not added) token's id and bytes; empty unless the vocabulary is
        byte-level BPE."""
        if self._byte_of is None:
            return []
        added = set(self.tok.added_tokens_decoder)
        try:
            return [(i, bytes(self._byte_of[c] for c in piece))
                    for piece, i in self.tok.get_vocab().items() if i not in added]
        except KeyError:  # a piece outside GPT-2's byte table
            return []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids:  # runs of ordinary tokens decoded whole, special tokens apart
            if i in self._special_ids:
                if run:
                    parts.append(self.tok.decode(run))
                    run = []
                parts.append(self.tok.decode([i]))
            else:
                run.append(i)
        if run:
            parts.append(self.tok.decode(run))
        return " ".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when it holds part of a UTF-8 character:
        byte-level BPE pieces (GPT-2's byte-to-character table: Llama 3, Qwen) mapped back,
        SentencePiece byte fallback (``<0xE2>``) and ``▁`` for a space; special tokens empty."""
        if token_id in self._special_ids:
            return b""
        piece = self.tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_of is not None:
            try:
                return bytes(self._byte_of[c] for c in piece)
            except KeyError:
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        return set(self.tok.all_special_ids)

    @functools.cached_property
    def _byte_of(self) -> dict[str, int] | None:
        """GPT-2's character -> byte table when the tokenizer decodes byte-level pieces."""
        decoder = getattr(getattr(self.tok, "backend_tokenizer", None), "decoder", None)
        if decoder is None or "ByteLevel" not in type(decoder).__name__ + repr(decoder):
            return None
        return byte_level_table()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.apply_chat_template_batch([messages])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """One call into the fast tokenizer for the whole batch (its Rust side runs it in
        parallel); the same ids as ``encode`` one text at a time."""
        return self.tok(texts, return_attention_mask=False)["input_ids"]

    def apply_chat_template_batch(self, conversations: list[list[dict]],
                                  template_kwargs: dict | None = None) -> list[list[int]]:
        if self.renderer is not None:
            return [self.renderer.render(c, template_kwargs) for c in conversations]
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; use 'prompt' instead")
        add, cont, kwargs = chat_options(template_kwargs)
        out = self.tok.apply_chat_template(conversations, add_generation_prompt=add,
                                           continue_final_message=cont, tokenize=True,
                                           **kwargs)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return [list(ids) for ids in out]


@functools.cache
def byte_level_table() -> dict[str, int]:
    """GPT-2's character -> byte table of byte-level BPE (transformers' ``bytes_to_unicode``
    turned around: printable bytes stand for themselves, the others for 256, 257, ...)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


@functools.lru_cache(maxsize=4)
def _auto_tokenizer(path: str, gguf_file: str | None):
    """transformers' tokenizer of a checkpoint (kept: verify or the tests build several
    engines of one model). A GGUF file's is converted from its metadata once (about 10 s for
    SmolLM2's 49k tokens) and saved; later runs load the saved files."""
    from transformers import AutoTokenizer

    if gguf_file is None:
        return AutoTokenizer.from_pretrained(path)
    saved = converted_tokenizer_dir(Path(path) / gguf_file)
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception:  # damaged or from another transformers: convert again
            pass
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    _save(tok, saved)
    return tok


def converted_tokenizer_dir(gguf: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept: under the file's path, size and
    modification time, and the transformers version that converted it."""
    import transformers

    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_file("tokenizers") / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(tok, saved: Path) -> None:
    """Save ``tok`` whole or not at all (a run killed while saving leaves no half)."""
    tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, saved)
    except OSError:  # read-only cache, or another run saved it first
        shutil.rmtree(tmp, ignore_errors=True)


def has_text(tokenizer) -> bool:
    """Whether ``tokenizer`` turns text into tokens and back (not a ``MissingTokenizer``)."""
    return getattr(tokenizer, "has_text", True)


class MissingTokenizer:
    """For a checkpoint without tokenizer files: token-id prompts work, text ones do not, and
    outputs decode to empty text."""

    has_text = False

    def __init__(self, path: Path, eos_token_id: int | list[int] | None) -> None:
        self.path = path
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_ids = {i for i in ids if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(f"{self.path} has no tokenizer (no tokenizer files, or none in the "
                         "GGUF metadata); use 'prompt_token_ids'")

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encode("")

    def apply_chat_template_batch(self, conversations: list[list[dict]],
                                  template_kwargs: dict | None = None) -> list[list[int]]:
        return self.encode("")
