"""Reasoning output: a reasoning model's thinking split from its answer, token by token.

Reasoning models write their reasoning before the answer. A parser, chosen for the run
(``EngineConfig.reasoning_parser``; ``auto`` from the tokenizer's vocabulary), follows each
sample's tokens as they come (``ReasoningState.token``) and knows at every step whether the
sample is still reasoning; the output splits its tokens into ``reasoning_content`` and the
answer's ``text``, and structured output constrains the answer only (the grammar starts at
the first answer token: ``answer_start``).

* ``think`` (Qwen3, QwQ, DeepSeek-R1 and its distills): reasoning between ``<think>`` and
  ``</think>``. A prompt that ends in an open ``<think>`` (only whitespace after it:
  DeepSeek-R1's template) starts the output in reasoning; otherwise the sample reasons only if
  its first token is ``<think>`` (Qwen3's thinking mode; with thinking off its template closes
  an empty block in the prompt). A ``<think>`` earlier in the prompt (a user's text that
  mentions the tag) opens nothing.
* ``gemma4``: the ``think`` rules on Gemma 4's tags, reasoning between ``<|channel>`` and
  ``<channel|>``; the ``thought`` label the model writes first inside (``<|channel>thought\n``)
  is not reasoning, and is dropped from it (as transformers' ``parse_thinking_output`` does).
* ``harmony`` (gpt-oss): messages ``<|start|>ROLE<|channel|>NAME<|message|>...<|end|>``; the
  ``final`` channel's message is the answer, the others (``analysis``, ``commentary``) the
  reasoning. Text outside any message (a completion of a plain prompt) is answer too: nothing
  the model writes is dropped.

The parser runs on every request of a run, except OpenAI ``/v1/completions`` bodies where the
run does not name one (``SamplingParams.reasoning``: vLLM applies no parser to completions).

``qwen3`` and ``deepseek_r1`` name the ``think`` parser, ``gpt_oss`` the ``harmony`` one;
``auto`` takes harmony, think or gemma4, whichever's tokens the vocabulary holds.

Hand-written, in a few states per sample: openai-harmony's ``StreamableParser`` runs over a
``HarmonyEncoding``, which loads only where the vocabulary is gpt-oss's own (the library checks
the vocabulary file's SHA-256: ``runtime/models/harmony.py``), while this parser must follow any
tokenizer that has the harmony tokens (the gpt-oss presets' byte tokenizer, test checkpoints);
and a batch run keeps every token of a malformed message, which a strict parser would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedgen.runtime.config import REASONING_PARSERS

PARSERS = REASONING_PARSERS
_ALIASES = {"qwen3": "think", "deepseek_r1": "think", "gpt_oss": "harmony"}
HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
TAGS = {"think": ("<think>", "</think>"), "gemma4": ("<|channel>", "<channel|>")}
LABELS = {"gemma4": "thought\n"}  # what the model writes first inside its reasoning tags


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer holds it as one token (an added or special one),
    else None."""
    hf = getattr(tokenizer, "tok", None)
    if hf is None:
        return None
    ids = hf.convert_tokens_to_ids([text])
    unk = getattr(hf, "unk_token_id", None)
    return ids[0] if ids and ids[0] is not None and ids[0] != unk else None


@dataclass(frozen=True)
class ReasoningParser:
    """A run's parser: ``kind`` "think" (``start``/``end`` the tag ids; ``label``: text its
    reasoning begins with that is not reasoning) or "harmony" (``start`` <|channel|>, ``end``
    <|message|>, ``close`` <|end|>, ``role`` <|start|>)."""

    kind: str
    start: int
    end: int
    close: int | None = None
    decode: Any = None  # ids → text (a harmony channel's name; what follows a prompt's tag)
    role: int | None = None
    label: str | None = None

    def reasoning_text(self, text: str) -> str:
        """A reasoning span's text without the ``label`` it begins with."""
        return text[len(self.label):] if self.label and text.startswith(self.label) else text

    def state(self, prompt_ids) -> ReasoningState:
        """A new sample's state, from its prompt."""
        if self.kind == "harmony":
            return ReasoningState(self, phase="between")
        ids = list(prompt_ids[-8:])  # an open tag the template ends in, and whitespace
        opened = max((i for i, t in enumerate(ids) if t == self.start), default=-1)
        after = ids[opened + 1:]
        blank = not after or (self.decode is not None and not self.decode(after).strip()
                              and self.end not in after)
        return ReasoningState(self, phase="reasoning" if opened >= 0 and blank else "maybe")


def make_parser(name: str, tokenizer: Any) -> ReasoningParser | None:
    """The parser ``name`` asks for on this tokenizer (None: ``none``, or ``auto`` on a model
    without reasoning tokens). ValueError when a named parser's tokens are not there."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser '{name}' ({', '.join(PARSERS)})")
    if name == "none":
        return None
    kind = _ALIASES.get(name, name)
    tags = {k: [token_id(tokenizer, t) for t in pair] for k, pair in TAGS.items()}
    harmony = [token_id(tokenizer, t) for t in HARMONY_TOKENS]
    if kind == "auto":
        kind = next((k for k, ids in [("harmony", harmony), *tags.items()] if None not in ids),
                    None)
        if kind is None:
            return None
    decode = lambda ids: tokenizer.decode(ids, True, False)  # noqa: E731
    if kind in TAGS:
        if None in tags[kind]:
            raise ValueError(f"reasoning parser '{name}': the tokenizer has no "
                             f"{' and '.join(TAGS[kind])} tokens")
        return ReasoningParser("think", *tags[kind], decode=decode, label=LABELS.get(kind))
    if None in harmony:
        raise ValueError(f"reasoning parser '{name}': the tokenizer has no harmony tokens "
                         f"({', '.join(HARMONY_TOKENS)})")
    return ReasoningParser("harmony", harmony[0], harmony[1], harmony[2], decode, harmony[3])


@dataclass
class ReasoningState:
    """Where one sample is: ``phase`` "maybe" (its first token decides), "reasoning",
    "answer", or (harmony) "between" messages, in a message's "role" or its channel's
    "header"; the output spans of its reasoning and of its answer (harmony's may be several:
    text outside messages and the final message), and the answer's first index."""

    parser: ReasoningParser
    phase: str
    spans: list[list[int]] = field(default_factory=list)  # [first, end) output indices
    answer_start: int | None = None
    answer_spans: list[list[int]] = field(default_factory=list)  # harmony's
    _header: list[int] = field(default_factory=list)

    @property
    def answered(self) -> bool:
        return self.answer_start is not None

    def ended_in_reasoning(self, num_output_tokens: int) -> bool:
        """Whether a sample that ended after ``num_output_tokens`` tokens ended before its
        answer began (a sample whose first token decides, and had none, did not reason)."""
        return num_output_tokens > 0 and not self.answered and self.phase != "maybe"

    def opener(self) -> int | None:
        """The token a grammar must also allow before its first answer token: ``<think>`` at a
        "maybe" sample's first token (otherwise the grammar would forbid the reasoning)."""
        return self.parser.start if self.phase == "maybe" else None

    def token(self, token: int, i: int) -> None:
        """Output token ``i`` is ``token``."""
        p = self.parser
        if p.kind == "think":
            if self.phase == "maybe":
                if token == p.start:
                    self.phase = "reasoning"
                    self.spans.append([i + 1, i + 1])
                else:
                    self.phase, self.answer_start = "answer", i
            elif self.phase == "reasoning":
                if not self.spans:
                    self.spans.append([i, i])
                if token == p.end:
                    self.phase, self.answer_start = "answer", i + 1
                else:
                    self.spans[-1][1] = i + 1
            return
        if self.phase in ("between", "role") and token == p.start:
            self.phase, self._header = "header", []
        elif self.phase == "between" and token == p.role:
            self.phase = "role"
        elif self.phase == "between":  # text outside any message: the answer's
            self._answer(i, i + 1)
        elif self.phase == "role" and token == p.end:  # a message without a channel
            self._answer(i + 1, i + 1)
        elif self.phase == "header":
            if token == p.end:
                final = p.decode(self._header).strip().split(" ")[0] == "final"
                if final:
                    self._answer(i + 1, i + 1)
                else:
                    self.phase = "reasoning"
                    self.spans.append([i + 1, i + 1])
            else:
                self._header.append(token)
        elif self.phase == "reasoning":
            if token == p.close:
                self.phase = "between"
            else:
                self.spans[-1][1] = i + 1
        elif self.phase == "answer":
            if token == p.close:
                self.phase = "between"
            elif token in (p.start, p.role):  # a message begins after text outside any
                self.phase, self._header = ("header" if token == p.start else "role"), []
            else:
                self.answer_spans[-1][1] = i + 1

    def _answer(self, first: int, end: int) -> None:
        """(harmony) the answer goes on with output indices [first, end)."""
        self.phase = "answer"
        if self.answer_start is None:
            self.answer_start = first
        if self.answer_spans and self.answer_spans[-1][1] == first:
            self.answer_spans[-1][1] = end
        else:
            self.answer_spans.append([first, end])

    def split(self, token_ids: list[int]) -> tuple[list[list[int]], list[int] | None]:
        """The output's reasoning spans' ids and its answer's ids (None: no answer began)."""
        spans = [token_ids[a:b] for a, b in self.spans]
        if self.answer_start is None:
            return spans, None
        if self.parser.kind == "think":
            return spans, token_ids[self.answer_start:]
        return spans, [t for a, b in self.answer_spans for t in token_ids[a:b]]
