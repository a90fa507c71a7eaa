"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step first keeps the running decodes going (one token each), preempting the most recently
admitted sequences when the cache is full (their blocks are freed and their tokens recomputed
later), then fills the remaining token budget with prefills: unfinished chunks first, then
waiting sequences in arrival order. A prompt larger than the budget is prefilled in chunks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedgen.runtime.block_manager import BlockManager
from pagedgen.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)


class Scheduler:
    """Queues whose cost per step and per finished sequence does not grow with their length:
    ``running`` is an insertion-ordered dict used as a set (admission order, O(1) removal),
    ``waiting`` a deque (preempted sequences go back to its front)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # 1. decodes, preempting from the back when a block is missing
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                break  # preempted below: so is everything admitted after it
            if seq.num_uncomputed != 1:
                continue
            while not self.bm.can_allocate(seq, seq.num_tokens):
                victim = next(reversed(self.running))
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING or budget == 0:
                break
            self.bm.allocate(seq, seq.num_tokens)
            batch.decodes.append(seq)
            budget -= 1
        # 2. unfinished prefill chunks of running sequences
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                n = self._admit_chunk(seq, budget, batch)
                if n == 0:
                    break
                budget -= n
        # 3. waiting sequences, in order, while seats, tokens and blocks last
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit_chunk(seq, budget, batch)
            if n == 0:
                break
            budget -= n
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running[seq] = None
        return batch

    def _admit_chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """Schedule up to ``budget`` of ``seq``'s uncomputed tokens; returns how many."""
        n = min(seq.num_uncomputed, budget)
        # Leave the cache to the running decodes: admit only what fits now.
        while n > 0 and not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            n = (self.bm.num_free_blocks + len(seq.block_table)) * self.bm.block_size \
                - seq.num_computed_tokens
        if n <= 0:
            return 0
        self.bm.allocate(seq, seq.num_computed_tokens + n)
        batch.prefills.append((seq, n))
        return n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free ``seq``'s blocks and put it first in line; its K/V will be recomputed."""
        del self.running[seq]
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's blocks (O(1) for a running sequence)."""
        if seq.status == SequenceStatus.RUNNING:
            del self.running[seq]
        elif seq.status == SequenceStatus.WAITING:
            # preempted while its last token was still on the device: rare, and the waiting
            # queue holds at most a window of sequences (the engine admits requests lazily)
            self.waiting = deque(s for s in self.waiting if s is not seq)
        seq.status = SequenceStatus.FINISHED
        self.bm.free(seq)
