"""A request's life in the engine: its tokens, its block table, its state and timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any
from typing import Sequence as Sequence_

from pagedgen.runtime.config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its KV is recomputed when readmitted)
    RUNNING = "running"  # holds blocks; prefilling (possibly in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)  # identity: queues of thousands must never compare token lists
class Sequence:
    seq_id: int
    prompt_token_ids: Sequence_[int]  # a list, or an array('i') from the prompt store
    params: SamplingParams
    seed: int  # per-request sampling seed
    request: Any = None  # caller's handle (e.g. the JSONL request)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_text_end: int | None = None  # where a stop string starts in the output text
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + output, appended in place

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model; 1 means the sequence is decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
