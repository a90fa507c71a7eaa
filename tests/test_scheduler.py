"""The scheduler alone (no model): seat and token limits, admission while the cache is tight,
which sequence a full cache preempts. ``benchmarks/schedule_replay.py`` drives whole workloads
through the same scheduler and block manager."""

from __future__ import annotations

import random

from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.scheduler import Scheduler
from pagedgen.runtime.engine.sequence import Sequence, SequenceStatus


def test_scheduler_respects_seat_and_token_limits():
    bm = BlockManager(100, 4)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=10)
    for i in range(3):
        sch.add(Sequence(i, list(range(8)), SamplingParams(), 0))
    b = sch.schedule()
    assert [(s.seq_id, n) for s, n in b.prefills] == [(0, 8), (1, 2)]  # second is chunked
    assert len(sch.running) == 2 and len(sch.waiting) == 1


def test_a_tight_cache_admits_nothing_it_would_preempt_at_once():
    # No waiting sequence joins in a step that preempted one, and an admission leaves a page
    # per running sequence besides the pages of the prompts under way; before, a sequence
    # preempted to make room came back in that very step's free pages and was preempted again,
    # and long prompts admitted on a first chunk were preempted mid-prompt (g on an H100: 165
    # preemptions, 62k tokens recomputed; e: 240k; benchmarks/schedule_replay.py).
    from benchmarks.schedule_replay import replay
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(60, 100))] for _ in range(6)]
    bm = BlockManager(60, 4, prefix_caching=True, windows=(8,))
    seen = {"preempting_steps": 0, "admissions": 0}

    def check(sch, batch, waiting_before):
        admitted = [s for s, _ in batch.prefills  # a victim of this step's is waiting too
                    if s in waiting_before or s in batch.preempted]
        seen["preempting_steps"] += bool(batch.preempted)
        seen["admissions"] += len(admitted)
        assert not (batch.preempted and admitted), "admitted in a step that preempted"
        if admitted:
            promised = sum(-(-s.num_tokens // 4) - len(s.block_table) for s in sch.running)
            running_before = len(sch.running) - len(admitted)
            assert sch.bm.num_free_blocks >= running_before + promised, \
                "admission took pages the running sequences need"

    out = replay(Scheduler(bm, 16, 64), prompts, [60] * 6, check)
    assert seen["preempting_steps"] > 0 and seen["admissions"] >= 6
    assert out["preemptions"] > 0 and out["steps"] > 60


def test_a_full_cache_preempts_the_sequence_with_the_least_to_recompute():
    # three decoding sequences of 12, 4 and 12 tokens on pages of 4, one page free: the first
    # takes it; the second, short one is preempted for its own page (4 tokens to recompute)
    # rather than the last admitted (12), which then takes the page that freed
    bm = BlockManager(8, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = []
    for i, n in enumerate((12, 4, 12)):
        seq = Sequence(i, list(range(n)), SamplingParams(), 0)
        bm.allocate(seq, n)
        seq.num_computed_tokens = n
        seq.append_token(1)  # decoding: its next token needs a page of its own
        seq.status = SequenceStatus.RUNNING
        sch.running[seq] = None
        seqs.append(seq)
    assert bm.num_free_blocks == 1
    batch = sch.schedule()
    assert batch.preempted == [seqs[1]] and batch.decodes == [seqs[0], seqs[2]]
    assert list(sch.waiting) == [seqs[1]] and not batch.prefills  # none admitted this step


def test_a_finished_chunk_gives_back_its_window_pages_before_the_decodes():
    # A decodes; B's 40-token prompt is one chunk, holding 10 pages of its window group (of 8
    # tokens) for that step. Once computed, B needs only the last 2 of them: let go before the
    # next step's decodes, A's two new pages fit; held until B's own decode, A was preempted
    # (e on an H100: 9 preemptions recomputing 61k tokens, with this 1 and 12k; schedule_replay)
    bm = BlockManager(25, 4, windows=(8,))
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = Sequence(0, list(range(7)), SamplingParams(), 0)
    bm.allocate(a, 7)
    a.num_computed_tokens = 7
    a.append_token(1)
    a.status = SequenceStatus.RUNNING
    sch.running[a] = None
    b = Sequence(1, list(range(100, 140)), SamplingParams(), 0)
    sch.add(b)
    first = sch.schedule()
    assert first.decodes == [a] and [(s, n) for s, n in first.prefills] == [(b, 40)]
    assert bm.held == [12, 12] and bm.num_free_blocks == 1
    for s, n in ((a, 1), (b, 40)):
        s.num_computed_tokens += n
        s.append_token(1)
    second = sch.schedule()
    assert not second.preempted and second.decodes == [a, b]
    assert bm.held[1] == 3 + 3  # each window's 2 pages and the one its new token opens
