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
from pagedgen.runtime.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pagedgen.runtime.engine.outputs import RequestOutput, request_output
from pagedgen.runtime.engine.sequence import Sequence


class OutputStage:
    """The stop rules and texts of one engine's samples; ``max_model_len()`` is the engine's
    context as its KV cache allows."""

    def __init__(self, tokenizer: Any, max_model_len) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def prepare(self, samples: list[Sequence], params: SamplingParams) -> None:
        """New samples of one request: with stop strings, each a detokenizer (one checker)."""
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
        p = seq.params
        if n_out < p.min_tokens:
            pass
        elif not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason = "stop"
            if not p.include_stop_str_in_output:  # the text ends before the stop token's
                seq.stop_text_end = len(self.decode(seq, seq.output_token_ids[:n_out - 1]))
        elif seq.stop_checker is not None and (hit := seq.stop_checker.check(
                seq.detok.text, seq.detok.new)) is not None:
            seq.finish_reason, seq.stop_text_end = "stop", hit
        if seq.finish_reason is None and self.at_length_limit(seq, n_out):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def at_length_limit(self, seq: Sequence, n_out: int) -> bool:
        """Whether ``n_out`` output tokens reach ``seq``'s max_tokens or the model's context."""
        return n_out >= seq.params.max_tokens \
            or seq.num_prompt_tokens + n_out >= self.max_model_len()

    def decode(self, seq: Sequence, ids: list[int]) -> str:
        p = seq.params
        return self.tokenizer.decode(ids, p.skip_special_tokens, p.spaces_between_special_tokens)

    def text(self, seq: Sequence) -> str:
        """A finished sample's text: decoded as it came (with stop strings) or now, cut where
        its stop string or stop token ends it."""
        text = seq.detok.finish() if seq.detok is not None \
            else self.decode(seq, seq.output_token_ids)
        return text if seq.stop_text_end is None else text[:seq.stop_text_end]

    def request_output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of a request whose ``samples`` have all finished."""
        return request_output(samples, self.tokenizer, self.text)
