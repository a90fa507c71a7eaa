"""Grouped cascade decode: which decodes share which pages (attention/cascade_layout.py), on the
CPU. The kernels are checked in test_triton.py and test_flash_attn.py (CPU) and the GPU tests."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedgen.attention import cascade_layout as cl
from pagedgen.attention.cascade import _layout_tensors
from pagedgen.attention.cascade_layout import MIN_SEQS, MIN_TOKENS, find_layout
from pagedgen.attention.cases import make_grouped_batch
from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
from pagedgen.runtime.worker.cuda_graphs import cascade_segments

PAGE = 16
SHARED = MIN_TOKENS // PAGE  # pages


@pytest.fixture(autouse=True)
def no_per_row_floor(monkeypatch):
    """The tests below check the group and level rules; the per-decode floor has its own."""
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)


def layout_of(seqs: list[ScheduledSeq], page: int = PAGE, max_levels: int = 3):
    width = max(len(s.block_table) for s in seqs)
    tables = np.array([list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs])
    return find_layout(tables, [s.num_context + 1 for s in seqs], page, max_levels)


def groups(lay) -> list[list[tuple[int, int, int, int]]]:
    """Each level's groups as (rows, first row, page_lo, page_hi), rows as input indices."""
    return [[(g.rows, min(lay.order[g.start:g.end]), g.page_lo, g.page_hi) for g in level]
            for level in lay.levels]


def test_one_shared_prefix_is_one_group():
    seqs = [ScheduledSeq(list(range(SHARED)) + [500 + r], SHARED * PAGE + 3, 1)
            for r in range(MIN_SEQS)]
    assert groups(layout_of(seqs)) == [[(MIN_SEQS, 0, 0, SHARED)]]


def test_system_prompts_then_prompts_then_samples_nest():
    """Two system prompts (SHARED pages each), behind each three prompts of 8 more pages,
    each sampled four times (rows interleaved): two levels, the samples' suffixes after the
    prompt pages."""
    seqs, page = [], iter(range(10_000))
    system = [[next(page) for _ in range(SHARED)] for _ in range(2)]
    prompts = [[next(page) for _ in range(8)] for _ in range(6)]
    for sample in range(4):
        for p in range(6):
            table = system[p % 2] + prompts[p] + [next(page)]
            seqs.append(ScheduledSeq(table, (SHARED + 8) * PAGE + sample, 1))
    lay = layout_of(seqs)
    assert lay.num_levels == 2
    assert sorted(groups(lay)[0]) == [(12, 0, 0, SHARED), (12, 1, 0, SHARED)]
    assert sorted(groups(lay)[1]) == [(4, p, SHARED, SHARED + 8) for p in range(6)]
    assert lay.suffix_pages == [SHARED + 8] * 24
    assert lay.saved_tokens == (2 * 11 * SHARED + 6 * 3 * 8) * PAGE
    flat = layout_of(seqs, max_levels=1)  # one level: the system prompts' groups only
    assert groups(flat) == groups(lay)[:1] and flat.suffix_pages == [SHARED] * 24


def test_no_cascade_below_the_thresholds():
    few = [ScheduledSeq(list(range(SHARED)) + [500 + r], SHARED * PAGE + 3, 1)
           for r in range(MIN_SEQS - 1)]
    assert layout_of(few) is None  # a level must save (MIN_SEQS - 1) * MIN_TOKENS reads
    short = [ScheduledSeq(list(range(SHARED - 1)) + [500 + r], SHARED * PAGE, 1)
             for r in range(MIN_SEQS)]
    assert layout_of(short) is None
    apart = [ScheduledSeq([100 * r + i for i in range(SHARED + 2)], SHARED * PAGE + 40, 1)
             for r in range(MIN_SEQS)]
    assert layout_of(apart) is None


def test_a_level_must_save_row_tokens_per_decode(monkeypatch):
    """A level saving fewer than ROW_TOKENS reads per decode of the step runs plain (the rule
    at 512, its value for the first kernels on an H100, benchmarks/results/LOG.md; 64 today)."""
    monkeypatch.setattr(cl, "ROW_TOKENS", 512)
    rows = 32
    shared = 512 * rows // ((rows - 1) * PAGE)  # pages: just short of 512 saved per row
    seqs = [ScheduledSeq(list(range(shared)) + [500 + r], shared * PAGE + 3, 1)
            for r in range(rows)]
    assert layout_of(seqs) is None
    seqs = [ScheduledSeq(list(range(shared + 1)) + [500 + r], (shared + 1) * PAGE + 3, 1)
            for r in range(rows)]
    assert layout_of(seqs).saved_tokens >= 512 * rows


def test_a_weak_level_gives_way_to_the_one_inside():
    """All rows share one page (too little to pay for a level); within, pairs share many: the
    pairs become level 0, reading the common page themselves."""
    seqs = []
    for pair in range(MIN_SEQS):
        own = [1000 + 100 * pair + i for i in range(SHARED)]
        seqs += [ScheduledSeq([7] + own + [5000 + 2 * pair + i], (SHARED + 1) * PAGE + 2, 1)
                 for i in range(2)]
    lay = layout_of(seqs)
    assert lay.num_levels == 1 and len(lay.levels[0]) == MIN_SEQS
    assert all(g.page_lo == 0 and g.page_hi == SHARED + 1 for g in lay.levels[0])


def test_every_sequence_keeps_its_newest_token_out_of_its_groups():
    table = list(range(SHARED + 4))  # identical tables (e.g. forked samples)
    # the shortest holds SHARED + 1 pages and one token: its newest token's page is its own
    seqs = [ScheduledSeq(table, (SHARED + 1) * PAGE + (r > 0) * 20, 1) for r in range(MIN_SEQS)]
    assert groups(layout_of(seqs)) == [[(MIN_SEQS, 0, 0, SHARED + 1)]]
    # one ending exactly on a page boundary keeps that whole last page
    seqs[0] = ScheduledSeq(table, (SHARED + 1) * PAGE - 1, 1)
    assert groups(layout_of(seqs))[0][0][3] == SHARED


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_are_consistent(monkeypatch, seed):
    """Random nested sharing (thresholds at their least): every group's rows share its pages;
    a level's groups are disjoint; a group starts where the group around it ends; each row's
    suffix starts after its deepest group; the saved reads are what plain decode reads minus
    what the groups and suffixes read."""
    monkeypatch.setattr(cl, "MIN_TOKENS", 1)
    monkeypatch.setattr(cl, "MIN_SEQS", 1)
    rng = random.Random(seed)
    b = make_grouped_batch(seed, num_decodes=rng.randint(2, 64), block_size=rng.choice([1, 4]))
    seqs, page = b.decodes, b.block_size
    lay = layout_of(seqs, page)
    if lay is None:  # nothing shared
        tables = {tuple(s.block_table[:1]) for s in seqs if s.num_context >= page}
        assert len(tables) == sum(s.num_context >= page for s in seqs)
        return
    assert sorted(lay.order) == list(range(len(seqs)))
    deepest = [0] * len(seqs)
    for _li, level in enumerate(lay.levels):
        assert level, "no empty levels"
        ends = [(g.start, g.end) for g in level]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
        for g in level:
            rows = lay.order[g.start:g.end]
            assert len(rows) >= 2 and g.page_hi > g.page_lo
            first = seqs[rows[0]].block_table[:g.page_hi]
            for r in rows:
                s = seqs[r]
                assert list(s.block_table[:g.page_hi]) == list(first)
                assert g.page_hi * page <= s.num_context  # wholly before its newest token
                assert deepest[r] == g.page_lo  # nested: starts where the outer group ends
                deepest[r] = g.page_hi
            assert list(g.pages) == list(first[g.page_lo:g.page_hi])
    assert lay.suffix_pages == deepest
    plain = sum(s.num_context + 1 for s in seqs)
    reads = sum(s.num_context + 1 - deepest[r] * page for r, s in enumerate(seqs)) + sum(
        (g.page_hi - g.page_lo) * page for level in lay.levels for g in level)
    assert lay.saved_tokens == plain - reads
    # the segments a level needs: exactly what the device tensors fill (the last one empty)
    width = max(g.page_hi - g.page_lo for level in lay.levels for g in level)
    n, segs, dev = len(seqs), lay.segments(), torch.device("cpu")
    _, _, cu_q, kv_lens, *_ = _layout_tensors(lay, n, n, segs, width, dev)
    assert (cu_q[:, -1] == n).all() and (cu_q[:, -2] == n).all() and (kv_lens[:, -1] == 0).all()
    assert (cu_q[:, 1:] >= cu_q[:, :-1]).all()
    with pytest.raises(ValueError, match="needs"):
        _layout_tensors(lay, n, n, segs - 1, width, dev)


def test_graph_segments_double_from_four_up_to_the_batch():
    """A cascade graph holds a power of two of segments a level (from 4) at or above what the
    layout needs, never more than batch + 1: FA4's varlen call pays for every segment held."""
    seqs = [ScheduledSeq(list(range(SHARED)) + [500 + r], SHARED * PAGE + 3, 1)
            for r in range(MIN_SEQS)]
    one = layout_of(seqs)
    assert one.segments() == 3  # the group, a trailing filler, an empty one
    assert cascade_segments(one, 8) == 4 and cascade_segments(one, 2) == 3
    pairs = []  # MIN_SEQS groups of two, each behind its own pages
    for p in range(MIN_SEQS):
        pairs += [ScheduledSeq([1000 * p + i for i in range(SHARED)] + [900 + 2 * p + i],
                               SHARED * PAGE + 3, 1) for i in range(2)]
    lay = layout_of(pairs)
    assert len(lay.levels[0]) == MIN_SEQS and lay.segments() == MIN_SEQS + 2
    assert cascade_segments(lay, 256) == 16 == cascade_segments(lay, 2 * MIN_SEQS)


def test_builder_marks_decode_only_steps():
    seqs = [ScheduledSeq(list(range(SHARED)) + [500 + r], SHARED * PAGE + 3, 1)
            for r in range(MIN_SEQS)]
    dev = torch.device("cpu")
    md = AttentionMetadataBuilder(PAGE, dev, cascade=True).build([], seqs)
    assert md.cascade_levels == 1 and md.cascade.saved_tokens == (MIN_SEQS - 1) * SHARED * PAGE
    assert AttentionMetadataBuilder(PAGE, dev).build([], seqs).cascade is None
    prefill = ScheduledSeq([900], 0, 4)
    md = AttentionMetadataBuilder(PAGE, dev, cascade=True).build([prefill], seqs)
    assert md.cascade is None and md.decode_metadata.cascade is None  # mixed steps run plain
