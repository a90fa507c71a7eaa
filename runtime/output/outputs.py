"""What the engine hands out for a finished request: one ``RequestOutput`` (vLLM's shape) that
every output format, the Python API and the benchmarks read, with nothing left to ask of the
engine: the texts are final (stop strings cut), the prompt's text is there, and each
log-probability entry carries its token's bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    """One token's log-probability and its ``top`` alternatives ``[[id, logprob], ...]``, with
    the bytes each stands for (``token_bytes``, ``top_bytes``)."""

    token_id: int
    logprob: float
    top: list[list]
    token_bytes: bytes = b""
    top_bytes: list[bytes] = field(default_factory=list)
    rank: int | None = None  # in the vocabulary: 1 + the tokens of a higher logprob

    @property
    def token(self) -> str:
        """The token's text: its bytes as UTF-8, U+FFFD for part of a character."""
        return self.token_bytes.decode("utf-8", errors="replace")

    @property
    def top_tokens(self) -> list[str]:
        return [b.decode("utf-8", errors="replace") for b in self.top_bytes]

    def by_id(self) -> dict[int, Logprob]:
        """vLLM's form of this position: the token, then each top alternative, by id."""
        out = {self.token_id: Logprob(self.logprob, self.rank, self.token)}
        for r, ((i, lp), text) in enumerate(zip(self.top, self.top_tokens), start=1):
            out.setdefault(i, Logprob(lp, r, text))
        return out


@dataclass
class Logprob:
    """vLLM's log-probability of one token: its rank (1: the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """When a request arrived, got its first output token and finished (``time.perf_counter``
    seconds, as the engine stamps them; vLLM's names)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str  # a reasoning model's: the answer
    token_ids: list[int]
    # one of sequence.FINISH_REASONS, or for a sample that ended while still reasoning (no
    # answer began) one of sequence.REASONING_FINISH_REASONS
    finish_reason: str
    token_logprobs: list[TokenLogprob] | None = None
    reasoning_content: str | None = None  # a reasoning model's reasoning (its parser's split)
    stop_reason: int | str | None = None  # the stop token id or string that ended it

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """vLLM's form: per output token, its ``Logprob`` and its alternatives', by id."""
        return None if self.token_logprobs is None else [e.by_id() for e in self.token_logprobs]

    @property
    def cumulative_logprob(self) -> float | None:
        """The output tokens' log-probabilities summed, where they were asked for."""
        return None if self.token_logprobs is None else sum(e.logprob
                                                            for e in self.token_logprobs)


@dataclass
class RequestOutput:
    """A finished request: its prompt and its ``n`` samples (``outputs``); ``.text``,
    ``.token_ids``, ``.finish_reason`` and ``.logprobs`` are its first sample's. vLLM's
    ``request_id``, ``finished``, ``metrics`` and ``prompt_logprobs`` are there too."""

    request: Any  # the caller's handle (a line of the input, an API request)
    prompt: str  # the request's text, or its token ids decoded
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # of every prompt token after the first
    prompt_token_logprobs: list[TokenLogprob] | None = None
    n: int = 1  # samples asked for (a line with n > 1 lists its choices)
    metrics: RequestMetrics | None = None

    @property
    def request_id(self) -> str:
        """The request's id (a line's ``id``/``custom_id``, an API prompt's position)."""
        return str(getattr(self.request, "id", ""))

    @property
    def finished(self) -> bool:
        return True  # the engine hands out finished requests only

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's form: None for the first prompt token, then each token's, by id."""
        if self.prompt_token_logprobs is None:
            return None
        return [None] + [e.by_id() for e in self.prompt_token_logprobs]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(o.num_output_tokens for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


def request_output(samples: list, tokenizer, texts_of) -> RequestOutput:
    """The ``RequestOutput`` of a request's finished samples (``Sequence``s, in sample order);
    ``texts_of(seq)`` is a sample's final (text, reasoning or None)."""
    first = samples[0]
    req = first.request
    prompt = getattr(req, "prompt", None)
    if not isinstance(prompt, str):
        prompt = tokenizer.decode(first.prompt_token_ids)
    outputs = []
    for s in samples:
        text, reasoning = texts_of(s)
        outputs.append(CompletionOutput(
            s.sample_index, text, list(s.output_token_ids), _finish_reason(s),
            _logprobs(tokenizer, s.output_token_ids, s.logprobs), reasoning, s.stop_reason))
    prompt_lp = None
    if first.prompt_logprobs is not None:
        prompt_lp = _logprobs(tokenizer, first.prompt_token_ids[1:], first.prompt_logprobs)
    firsts = [s.first_token_time for s in samples if s.first_token_time is not None]
    ends = [s.finish_time for s in samples if s.finish_time is not None]
    metrics = RequestMetrics(first.arrival_time, min(firsts, default=None),
                             max(ends, default=None))
    return RequestOutput(req, prompt, list(first.prompt_token_ids), outputs, prompt_lp,
                         first.params.n, metrics)


def _finish_reason(seq) -> str:
    """A sample's finish reason; ``..._in_reasoning`` where it ended before its answer."""
    r = seq.reasoning
    if r is not None and r.ended_in_reasoning(len(seq.output_token_ids)) \
            and seq.finish_reason in ("stop", "length"):
        return f"{seq.finish_reason}_in_reasoning"
    return seq.finish_reason


def _logprobs(tokenizer, token_ids, entries) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    return [TokenLogprob(t, lp, top, tokenizer.token_bytes(t),
                         [tokenizer.token_bytes(i) for i, _ in top], rank)
            for t, (lp, top, rank) in zip(token_ids, entries)]
