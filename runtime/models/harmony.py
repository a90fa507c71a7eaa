"""gpt-oss chats in OpenAI's harmony format through ``openai-harmony``, its vocabulary taken
from the checkpoint's own tokenizer: no download at run time.

openai-harmony reads gpt-oss's BPE vocabulary from an ``o200k_base.tiktoken`` file (each
token's bytes in base64 and its rank) and checks the file's SHA-256 against the published one.
``harmony_chat`` writes that file from the checkpoint's ordinary tokens, so a checkpoint whose
vocabulary is gpt-oss's loads the renderer and any other (or an edited one) is refused by the
library's own check; the caller then renders with the checkpoint's chat template and says why.
"""

from __future__ import annotations

import base64
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedgen.errors import first_line
from pagedgen.runtime.models.tokenizer import chat_options

VOCAB_FILE = "o200k_base.tiktoken"  # the name openai-harmony looks up in TIKTOKEN_ENCODINGS_BASE
# harmony's reasoning levels; "minimal" (OpenAI's API has it, gpt-oss does not) reads as low
EFFORTS = {"minimal": "LOW", "low": "LOW", "medium": "MEDIUM", "high": "HIGH"}


def tiktoken_vocab(tokens: Iterable[tuple[int, bytes]]) -> bytes:
    """A tiktoken vocabulary file of ``tokens`` (id, bytes), in id order."""
    return b"".join(base64.b64encode(b) + b" %d\n" % i for i, b in sorted(tokens))


class HarmonyChat:
    """Renders OpenAI-style messages as gpt-oss's prompt: harmony's system message (with the
    reasoning effort and today's date), ``system``/``developer`` messages as the developer's
    instructions, earlier ``assistant`` turns on the ``final`` channel, then the assistant's
    turn left open."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def render(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        import openai_harmony as oh

        add, cont, template_kwargs = chat_options(template_kwargs)
        if cont or not add:
            raise ValueError("gpt-oss's harmony format always opens the assistant's turn: "
                             "'continue_final_message' and 'add_generation_prompt': false do "
                             "not apply")
        system = oh.SystemContent.new().with_conversation_start_date(time.strftime("%Y-%m-%d"))
        effort = template_kwargs.get("reasoning_effort")
        if effort is not None:
            system = system.with_reasoning_effort(oh.ReasoningEffort[EFFORTS[effort]])
        out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        for m in messages:
            role, text = m["role"], m["content"] or ""
            if role in ("system", "developer"):
                out.append(oh.Message.from_role_and_content(
                    oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(text)))
            elif role == "user":
                out.append(oh.Message.from_role_and_content(oh.Role.USER, text))
            elif role == "assistant":
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text)
                           .with_channel("final"))
            else:
                raise ValueError(f"gpt-oss's harmony format has no role '{role}' (system, "
                                 "developer, user or assistant)")
        conversation = oh.Conversation.from_messages(out)
        return list(self.encoding.render_conversation_for_completion(conversation,
                                                                     oh.Role.ASSISTANT))


def harmony_chat(tokens: list[tuple[int, bytes]]) -> tuple[HarmonyChat | None, str]:
    """openai-harmony's gpt-oss renderer over ``tokens`` (the checkpoint's ordinary tokens, id
    and bytes), or None and why not."""
    try:
        import openai_harmony as oh
    except ImportError:
        return None, "openai-harmony is not installed (pip install openai-harmony)"
    if not tokens:
        return None, "the tokenizer is not byte-level BPE, as gpt-oss's is"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / VOCAB_FILE).write_bytes(tiktoken_vocab(tokens))
        before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = d
        try:
            encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as e:  # the library's hash check: not gpt-oss's vocabulary
            reason = first_line(e)
            return None, f"the checkpoint's vocabulary is not gpt-oss's o200k ({reason[:80]})"
        finally:
            if before is None:
                os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = before
    return HarmonyChat(encoding), "harmony (openai-harmony)"
