"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step first keeps the running decodes going (one token each), preempting the sequences
with the fewest computed tokens when the cache is full (their blocks are freed and their tokens
recomputed later: the least recomputation; of equals, the last admitted), then fills the
remaining token budget with prefills: unfinished chunks first, then waiting sequences in
arrival order. A prompt larger than the budget is prefilled in chunks.

Admission from the waiting queue holds back while the cache is tight, so that it does not
preempt again at once what it admits: no sequence is admitted in a step that preempted one
(vLLM's rule); an admission leaves a page free per running sequence (room for the next
``block_size`` tokens of each) besides the pages the prompts still being prefilled will take;
and a prompt is admitted only where all of its pages fit (a long prompt admitted on a first
chunk that fits, and then preempted mid-prompt for the decodes, is computed twice). Replayed on
this scheduler and block manager (``benchmarks/schedule_replay.py``) with the victim rule above:
workload g (gpt-oss-120b, a cache ~15% short on an H100) went from 165 preemptions recomputing
62k tokens to 57 recomputing 24k; workload e (Gemma-3-27B, prompts of 8k-30k) from 22 and 248k
to 9 and 61k.

A prefill chunk holds its window groups' pages for each of its tokens during its step; the
next step lets go of those that slid out of the window before any decode asks for a page (else
the decodes ahead of it found the pool short and preempted: e on an H100, 9 preemptions
recomputing 61k tokens, replayed; with this, 1 and 12k).

A sequence admitted with no blocks starts on the longest run of its leading full blocks that the
prefix cache holds (at least one token is always computed, so the step has logits to sample);
the blocks a prefill chunk fills are cached as it is scheduled, so prompts admitted later in the
same step already share them.
A request with ``n`` samples is admitted as one sequence counting ``n`` of ``max_num_seqs``; the
step that completes its prompt forks the others from it (shared full blocks, a copy of the last).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedgen.errors import PagedgenError
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # samples forked from a prefill that completes this step (sampled from its last row), and
    # the (src, dst) block copies to make once the step's K/V are written
    forked: dict[Sequence, list[Sequence]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots
    # prefix cache: tokens of the sequences admitted (from scratch) this step, how many of them
    # the cache held, and cached blocks evicted for new contents
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_blocks: int = 0

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
        self.reserved_seats = 0  # held for samples still to fork from a running sequence
        self._chunked: list[Sequence] = []  # the last step's prefills: window pages to let go

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        evicted = self.bm.num_evicted
        for seq in self._chunked:
            if seq.status == SequenceStatus.RUNNING:
                self.bm.slide(seq)
        budget = self.max_num_batched_tokens
        # 1. decodes; where a page is missing, the sequence cheapest to recompute is preempted
        scheduled: set[Sequence] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an earlier one's page
            if seq.num_uncomputed != 1 or seq.forks:  # a prompt's last token forks: a prefill
                continue
            while not self.bm.can_allocate(seq, seq.num_tokens):
                victim = self._victim(scheduled)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, seq.num_tokens)
            batch.decodes.append(seq)
            scheduled.add(seq)
            budget -= 1
        # 2. unfinished prefill chunks of running sequences; a chunk that must hold an image
        #    whole (its tokens see each other) and waits on pages only later sequences hold,
        #    in a step that runs nothing else, takes them (they are preempted)
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an earlier one's image
            if (seq.num_uncomputed > 1 or seq.forks) and budget > 0:
                n = self._admit_chunk(seq, budget, batch)
                while n == 0 and batch.is_empty and seq.mm is not None and seq.mm.whole_blocks:
                    if len(self.running) == 1:
                        raise PagedgenError(
                            "an image's tokens see each other and are computed in one step, "
                            "and this one needs more KV pages at once than the cache has: "
                            "give more --kv-cache-memory or --num-blocks")
                    self._preempt(self._victim({seq}), batch)
                    n = self._admit_chunk(seq, budget, batch)
                if n == 0:
                    break
                budget -= n
                self._fork_if_complete(seq, n, batch)
        # 3. waiting sequences, in order, while max_num_seqs, tokens and blocks last (none in a step
        #    that preempted; each whole prompt fitting beside a page per running sequence and
        #    the pages the prompts under way will take)
        admitting = self.waiting and budget > 0 and not batch.preempted
        promised = sum(map(self._prompt_pages_left, self.running)) if admitting else 0
        while admitting and self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + self.reserved_seats + 1 + len(seq.forks) > self.max_num_seqs:
                break
            n = self._admit_chunk(seq, budget, batch, reserve=len(self.running) + promised,
                                  whole_prompt=True)
            if n == 0:
                break
            budget -= n
            promised += self._prompt_pages_left(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running[seq] = None
            self.reserved_seats += len(seq.forks)
            self._fork_if_complete(seq, n, batch)
        batch.evicted_blocks = self.bm.num_evicted - evicted
        if self.bm.windows:
            self._chunked = [seq for seq, _ in batch.prefills]
            self._chunked += [c for children in batch.forked.values() for c in children]
        return batch

    def _admit_chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch,
                     reserve: int = 0, whole_prompt: bool = False) -> int:
        """Schedule up to ``budget`` of ``seq``'s uncomputed tokens, leaving ``reserve`` blocks
        free (and with ``whole_prompt`` none unless group 0's pages for all of them fit);
        returns how many. A sequence holding no blocks first takes its cached prefix."""
        bm, bs = self.bm, self.bm.block_size
        fresh = not seq.block_table
        hits = bm.match_prefix(seq, self._cacheable(seq)) if fresh else None
        computed = len(hits) * bs if fresh else seq.num_computed_tokens
        free = bm.num_free_blocks - (bm.num_free_among(hits) if fresh else 0) - reserve
        # the samples forked when the prompt completes: a copy of its last block in each group
        fork_copies = len(seq.forks) * (1 + len(bm.windows)) if seq.num_tokens % bs else 0

        def short(n: int) -> bool:  # more blocks (of every KV group) than are free?
            need = bm.pages_needed(seq, computed + n, computed, hits)
            if whole_prompt:  # and group 0's pages for the rest of its tokens
                need += -(-seq.num_tokens // bs) - -(-(computed + n) // bs)
            return need + (fork_copies if computed + n == seq.num_tokens else 0) > free

        n = min(seq.num_tokens - computed, budget)
        if short(n):  # leave the cache to the running decodes: admit only what fits now
            fits, over = 0, n  # the most tokens whose blocks fit (need grows with n)
            while over - fits > 1:
                mid = (fits + over) // 2
                fits, over = (fits, mid) if short(mid) else (mid, over)
            n = fits
        if seq.mm is not None:  # a chunk that would end inside an image whose tokens see
            n = seq.mm.chunk_end(computed, computed + n) - computed  # each other ends before it
        if n <= 0:
            return 0
        if fresh:
            bm.take_prefix(seq, hits)
            batch.prefix_queried_tokens += seq.num_tokens
            batch.prefix_hit_tokens += computed
        bm.allocate(seq, computed + n)
        batch.prefills.append((seq, n))
        if seq.num_known_tokens == seq.num_tokens:
            # Its full blocks can serve admissions later in this very step: each layer writes
            # every new token's K/V before it attends. A sequence waiting on a token of the
            # step in flight registers after launch instead (the engine), as it may be dropped
            # from this step when that token turns out to stop it.
            bm.cache_blocks(seq, computed + n)
        return n

    def _prompt_pages_left(self, seq: Sequence) -> int:
        """Group 0's pages a sequence still to be prefilled (a prompt, or a preempted sequence's
        tokens) will take before it decodes."""
        return self.bm.blocks_needed(seq, seq.num_tokens) if seq.num_uncomputed > 1 else 0

    @staticmethod
    def _cacheable(seq: Sequence) -> int:
        """How many leading tokens of ``seq`` may come from the prefix cache: all but the last
        (it gives the logits to sample from), known ones only, and none whose prompt
        log-probabilities are still to be computed (they need the model's output there)."""
        n = min(seq.num_tokens - 1, seq.num_known_tokens)
        return n if seq.prompt_logprobs is None else min(n, len(seq.prompt_logprobs))

    def _fork_if_complete(self, parent: Sequence, n: int, batch: ScheduledBatch) -> None:
        """When this step's ``n`` tokens complete the parent's prompt, its other samples join
        the running set (after it) with its K/V, sampled from its last row as it is."""
        if not parent.forks or parent.num_computed_tokens + n != parent.num_tokens:
            return
        children, parent.forks = parent.forks, []
        for child in children:
            batch.block_copies += self.bm.fork(parent, child, parent.num_tokens)
            if child.state_slot is not None:
                batch.state_copies.append((parent.state_slot, child.state_slot))
            child.status = SequenceStatus.RUNNING
            self.running[child] = None
        self.reserved_seats -= len(children)
        batch.forked[parent] = children

    def _victim(self, scheduled: set[Sequence]) -> Sequence:
        """The running sequence to preempt, of those this step does not run yet: the one with
        the fewest computed tokens (the least to recompute; of equals, the last admitted)."""
        return min((s for s in reversed(self.running) if s not in scheduled),
                   key=lambda s: s.num_computed_tokens)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free ``seq``'s blocks and put it first in line; its K/V will be recomputed."""
        del self.running[seq]
        self.reserved_seats -= len(seq.forks)  # held again when it is readmitted
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
