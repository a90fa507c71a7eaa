"""Per-sequence logits processors: where a constraint or a penalty plugs into sampling.

A processor changes its sequence's row of float32 logits in place, on the device, after the
model and before the sampler: the sampler, and the log-probabilities a request asks for, see
the processed distribution.
Each sample of a request has its own processors (they may keep state: a grammar matcher, token
counts), made by the engine's ``processor_factory``; rows without one pay nothing, and a run
with no factory does no work at all.

Async scheduling launches a decode step before the previous step's tokens reach the host. A
processor that reads the tokens sampled so far says ``needs_tokens``: for a step with such a
sequence the engine reads the previous step's tokens once this step's forward pass is queued,
before sampling (the step still launches ahead). One that does not (a fixed bias, say) may see
``PENDING_TOKEN`` (-1) for tokens still on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch


class LogitsProcessor(ABC):
    needs_tokens: ClassVar[bool] = True

    @abstractmethod
    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> None:
        """Change ``logits`` (one row, float32 [vocab], on the device) in place, given the
        tokens this sequence has sampled so far."""


# (request handle, its sampling settings, sample index) → that sample's processors
ProcessorFactory = Callable[[Any, Any, int], list[LogitsProcessor]]


def apply(logits: torch.Tensor,
          rows: Sequence[tuple[int, Sequence[LogitsProcessor], Sequence[int]]]) -> None:
    """Run each (row, processors, output tokens so far) on its row of ``logits``."""
    for row, processors, tokens in rows:
        for processor in processors:
            processor(tokens, logits[row])
