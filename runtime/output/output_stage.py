"""The engine's output stage: when a sample ends and what its text is.

Each token, once known, goes to ``token``: a sample with stop strings feeds its incremental
detokenizer (``detokenizer.py``); then the stop rules run (EOS, a stop token, a stop string,
none before ``min_tokens``; its length or the model's context). A finished sample's text is
the detokenizer's, or one decode of its tokens, cut where a stop ends it; ``request_output``
makes the request's ``RequestOutput`` (``outputs.py``), which every format writes from.
"""

from __future__ import annotations

from typing import Any

from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.runtime.output.detokenizer import IncrementalDetokenizer, StopChecker
from pagedgen.runtime.output.outputs import RequestOutput, request_output
from pagedgen.runtime.output.reasoning import ReasoningParser, make_parser
from pagedgen.runtime.sampling.json_schema import escape_json_controls


class OutputStage:
    """The stop rules and texts of one engine's samples; ``max_model_len()`` is the engine's
    context as its KV cache allows."""

    def __init__(self, tokenizer: Any, max_model_len, reasoning_parser: str = "none") -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.reasoning: ReasoningParser | None = make_parser(reasoning_parser, tokenizer)

    def prepare(self, samples: list[Sequence], params: SamplingParams) -> None:
        """New samples of one request: with stop strings, each a detokenizer (one checker);
        with a reasoning parser, each its reasoning state (its grammar waiting for the
        answer)."""
        if self.reasoning is not None and params.reasoning:
            for s in samples:
                s.reasoning = self.reasoning.state(s.prompt_token_ids)
                if s.grammar is not None:
                    s.grammar.start = None
                    self._start_grammar(s)
        if not params.stop:
            return
        stops = StopChecker(params.stop, params.include_stop_str_in_output)
        for s in samples:
            s.stop_checker = stops
            s.detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                             params.spaces_between_special_tokens)

    def token(self, seq: Sequence, token: int, n_out: int) -> bool:
        """``seq``'s output token ``n_out`` (1-based) is ``token``: whether the sample stops
        there (its ``finish_reason`` set)."""
        if seq.detok is not None:
            seq.detok.add(token)
        if seq.reasoning is not None:
            self._reasoning(seq, token, n_out - 1)
        p = seq.params
        if n_out < p.min_tokens:
            pass
        elif not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            if not p.include_stop_str_in_output:  # the text ends before the stop token's
                seq.stop_text_end = len(self.decode(seq, seq.output_token_ids[:n_out - 1]))
        elif seq.stop_checker is not None and (hit := seq.stop_checker.first(
                seq.detok.text, seq.detok.new)) is not None:
            seq.finish_reason = "stop"
            seq.stop_text_end, seq.stop_reason = hit
        if seq.finish_reason is None and self.at_length_limit(seq, n_out):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _reasoning(self, seq: Sequence, token: int, i: int) -> None:
        """Follow the sample's reasoning; its grammar starts with the answer."""
        seq.reasoning.token(token, i)
        if seq.grammar is not None and seq.grammar.start is None:
            self._start_grammar(seq)

    @staticmethod
    def _start_grammar(seq: Sequence) -> None:
        """A reasoning sample's grammar: the token it also allows at the first one, and its
        start once the answer has begun."""
        r, g = seq.reasoning, seq.grammar
        g.opener = r.opener()
        if r.answered:
            g.start = r.answer_start

    def at_length_limit(self, seq: Sequence, n_out: int) -> bool:
        """Whether ``n_out`` output tokens reach ``seq``'s max_tokens or the model's context."""
        return n_out >= seq.params.max_tokens \
            or seq.num_prompt_tokens + n_out >= self.max_model_len()

    def decode(self, seq: Sequence, ids: list[int]) -> str:
        p = seq.params
        return self.tokenizer.decode(ids, p.skip_special_tokens, p.spaces_between_special_tokens)

    def text(self, seq: Sequence) -> str:
        """A finished sample's text (a reasoning model's: its answer's)."""
        return self.texts(seq)[0]

    def texts(self, seq: Sequence) -> tuple[str, str | None]:
        """``_texts``, a JSON answer's strings with their control characters escaped (a
        pattern may let the grammar write them raw: ``json_schema.escape_json_controls``)."""
        text, reasoning = self._texts(seq)
        c = seq.params.structured
        if c is not None and c.kind in ("json", "json_object"):
            text = escape_json_controls(text)
        return text, reasoning

    def _texts(self, seq: Sequence) -> tuple[str, str | None]:
        """A finished sample's (answer, reasoning): with a reasoning parser, its reasoning's
        spans decoded (joined by newlines; None where it did not reason) and the answer's
        tokens decoded ("" where no answer began); a stop string cuts either where it ends
        the whole output."""
        r = seq.reasoning
        if r is None:  # decoded as it came (with stop strings) or now, cut at the stop
            text = seq.detok.finish() if seq.detok is not None \
                else self.decode(seq, seq.output_token_ids)
            return (text if seq.stop_text_end is None else text[:seq.stop_text_end]), None
        ids = seq.output_token_ids
        spans, answer = r.split(ids)
        reasoning = "\n".join(self.decode(seq, s) for s in spans) if spans else None
        text = "" if answer is None else self.decode(seq, answer)
        if seq.stop_text_end is not None:  # where the stop cuts the whole output's text
            before = self.decode(seq, ids[:r.answer_start]) if answer is not None else None
            if before is not None and seq.stop_text_end >= len(before):
                text = text[:seq.stop_text_end - len(before)]
            else:
                text = ""
                if reasoning is not None:
                    start = len(self.decode(seq, ids[:r.spans[0][0]]))
                    reasoning = reasoning[:max(0, seq.stop_text_end - start)]
        return text, None if reasoning is None else r.parser.reasoning_text(reasoning)

    def request_output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of a request whose ``samples`` have all finished."""
        return request_output(samples, self.tokenizer, self.texts)
