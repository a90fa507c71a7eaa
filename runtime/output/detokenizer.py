"""A sample's text as its tokens come, and where a stop string ends it: the output stage's
per-sample state, so a step costs the host the same at token 10 and token 4,000.

``IncrementalDetokenizer`` decodes a short window of tokens per new token (vLLM's prefix and
read offsets): the text of ``[prefix, read)`` is already out; the text of ``[prefix, end)``
minus it is the new text, held back while it ends in an unfinished UTF-8 character (U+FFFD).
Any tokenizer's ``decode`` serves (the window starts at a token already decoded, so
SentencePiece's leading space and special-token spacing come out as in a whole decode).

``StopChecker`` looks for the stop strings only where new text could complete one: the new
text and the ``longest stop - 1`` characters before it. Until a stop is ruled out, that tail
is held back (``visible``): text a stop may still claim is never shown early.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder puts for bytes of an unfinished character


class IncrementalDetokenizer:
    """The text of a growing list of tokens, one short decode per ``add``."""

    __slots__ = ("tokenizer", "skip_special", "spaces", "ids", "prefix", "read", "text", "new")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token: decoded already, for context
        self.read = 0  # tokens whose text is in ``text``
        self.text = ""
        self.new = 0  # characters the last ``add`` gave

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special, self.spaces)

    def add(self, token: int) -> str:
        """Take the next token; returns the text it completes (often all of its own, "" while
        a character is unfinished)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            self.new = 0
            return ""  # nothing new, or a character still to finish
        new = now[len(before):]
        self.text += new
        self.new = len(new)
        self.prefix, self.read = self.read, len(self.ids)  # the new tokens: the next context
        return new

    def finish(self) -> str:
        """All the text, an unfinished last character included (as U+FFFD, as a whole decode
        writes it)."""
        if self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix:self.read])
            self.text += self._decode(self.ids[self.prefix:])[len(before):]
            self.read = len(self.ids)
        return self.text


class StopChecker:
    """Where a sample's text first holds one of ``stops`` (vLLM's rule: the earliest start,
    then the shortest), searching only what new text can complete."""

    __slots__ = ("stops", "include", "reach")

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = stops
        self.include = include_stop_str_in_output
        self.reach = max(map(len, stops), default=1) - 1  # old characters a stop may span

    def check(self, text: str, new: int) -> int | None:
        """With the last ``new`` characters of ``text`` just added: where the text ends at the
        first stop string (after it, with ``include_stop_str_in_output``), or None."""
        hit = self.first(text, new)
        return None if hit is None else hit[0]

    def first(self, text: str, new: int) -> tuple[int, str] | None:
        """Like :meth:`check`, with the stop string found (vLLM's ``stop_reason``)."""
        if not new or not self.stops:
            return None
        start = max(0, len(text) - new - self.reach)
        hits = [(i, len(s), s) for s in self.stops if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        i, n, stop = min(hits)
        return (i + n if self.include else i), stop

    def visible(self, text: str, finished: bool) -> str:
        """The part of ``text`` no stop string can still claim (all of it once finished)."""
        return text if finished or not self.reach else text[:max(0, len(text) - self.reach)]
