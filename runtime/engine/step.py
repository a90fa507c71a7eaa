"""A launched step: what the host reads back once the device has run it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.runtime.sampling.logprobs import Entry, Logprobs


@dataclass
class StepHandle:
    """A launched step: its sampling sequences and their tokens (and log-probabilities, for
    the sequences that asked), on the host once ``event`` has completed."""

    sampling: list[Sequence]
    tokens: torch.Tensor | None
    event: torch.cuda.Event | None
    logprobs: Logprobs | None = None  # rows: the sampling sequences at ``logprob_rows``
    logprob_rows: list[int] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, Logprobs]] = field(default_factory=list)
    # prompts completed this step that sample nothing (max_tokens 0: scoring only)
    scored: list[Sequence] = field(default_factory=list)
    logits: torch.Tensor | None = None  # queued by ``ModelRunner.forward``, until sampled
    plan: Any = None  # the sampling's reading of the sequences (``ModelRunner.plan_sampling``)
    decode_only: bool = True  # no prefill chunk ran in the step

    def result(self) -> list[tuple[Sequence, int, Entry | None]]:
        """(sequence, sampled token, its log-probabilities or None) per sampling sequence;
        waits for the device."""
        if self.event is not None:
            self.event.synchronize()
        if self.tokens is None:
            return []
        entries: list[Entry | None] = [None] * len(self.sampling)
        if self.logprobs is not None:
            ks = [self.sampling[r].params.logprobs for r in self.logprob_rows]
            for r, e in zip(self.logprob_rows, self.logprobs.entries(ks)):
                entries[r] = e
        return list(zip(self.sampling, self.tokens.tolist(), entries))

    def prompt_results(self) -> list[tuple[Sequence, list[Entry]]]:
        """(sequence, entries for its prompt positions scored this step); after ``result``."""
        if self.event is not None:
            self.event.synchronize()
        return [(seq, lp.entries([seq.params.prompt_logprobs] * lp.chosen.shape[0]))
                for seq, lp in self.prompt_logprobs]
