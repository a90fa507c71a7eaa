"""Which decodes of a step share which leading pages: the groups of a grouped cascade decode.

Sort the decodes' block tables lexicographically (only pages wholly before each one's newest
token count) and every set of decodes that shares its first ``k`` pages becomes a contiguous run
of the sorted order. The runs nest like a trie: a system prompt shared by many requests, inside
it each request's prompt shared by its samples. Each kept run is a :class:`Group` that attends
its pages ``[page_lo, page_hi)`` once with all its queries; a group's level is the number of
kept groups around it, so the groups of one level are disjoint and one kernel launch attends
them all. Each decode then attends its own pages from its deepest group's ``page_hi`` on, and
the parts are merged by their log-sum-exp (attention/cascade.py).

When grouping pays (benchmarks/results/LOG.md): a group must save at least ``MIN_TOKENS`` key reads
((rows - 1) x its tokens), a level (one more launch and merge input per layer) at least
``(MIN_SEQS - 1) * MIN_TOKENS`` and ``ROW_TOKENS`` per decode of the step; at most
``MAX_LEVELS`` levels. ``ROW_TOKENS`` was 512 for the first cascade kernels (an H100: workload
s's 4 system prompts grouped made its decode steps slower); with today's (exact segments, our
Triton decode for the own pages, one merge) 64 groups s and runs it faster on an H200: 10,709
against 10,376 tok/s at max_num_seqs 256, 12,606 against 11,345 at 1,024; p unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

MIN_SEQS = 8  # a level must save what MIN_SEQS decodes sharing MIN_TOKENS tokens save
MIN_TOKENS = 256  # a group must save at least this many key reads
ROW_TOKENS = 64  # and a level at least this many per decode of the step
MAX_LEVELS = 3


@dataclass(frozen=True)
class Group:
    """Sorted positions ``start:end`` share pages ``page_lo:page_hi`` (and those before them,
    attended by the groups around this one)."""

    start: int
    end: int
    page_lo: int
    page_hi: int
    pages: tuple[int, ...] = field(default=(), compare=False)  # its physical pages

    @property
    def rows(self) -> int:
        return self.end - self.start

    def saved(self, block_size: int) -> int:
        """Key reads this group saves against every row reading its pages itself."""
        return (self.rows - 1) * (self.page_hi - self.page_lo) * block_size


@dataclass
class CascadeLayout:
    """A decode batch's sharing. ``order[k]``: the decode row at sorted position ``k``;
    ``levels[l]``: level ``l``'s groups, by start; ``suffix_pages[r]``: leading pages of row ``r``
    its groups attend (its own attention starts there)."""

    order: list[int]
    levels: list[list[Group]]
    suffix_pages: list[int]
    block_size: int
    _device_inputs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def num_groups(self) -> int:
        return sum(len(level) for level in self.levels)

    @property
    def saved_tokens(self) -> int:
        """Key reads per layer and KV head the groups save in one step."""
        return sum(g.saved(self.block_size) for level in self.levels for g in level)

    def segments(self) -> int:
        """Segments a level of this layout needs in one varlen call: each group one, a filler
        before each group that does not start where the last ended, a trailing filler and one
        empty segment (attention/cascade.py)."""
        most = 0
        for level in self.levels:
            at, n = 0, 0
            for g in level:
                n += 1 + (g.start > at)
                at = g.end
            most = max(most, n)
        return most + 2

    def positions(self) -> list[int]:
        """``positions()[r]``: the sorted position of decode row ``r``."""
        pos = [0] * len(self.order)
        for k, r in enumerate(self.order):
            pos[r] = k
        return pos


def find_layout(tables: np.ndarray, seq_lens: Sequence[int], block_size: int,
                max_levels: int = MAX_LEVELS) -> CascadeLayout | None:
    """The groups worth attending once among decodes with block tables ``tables`` ([rows,
    width] ints, 0-padded) and lengths ``seq_lens`` (their newest token included); None when
    no group pays."""
    rows = len(seq_lens)
    if rows < 2 or max_levels < 1:
        return None
    full = np.minimum((np.asarray(seq_lens, dtype=np.int64) - 1) // block_size, tables.shape[1])
    width = int(full.max(initial=0))
    if width * block_size < MIN_TOKENS:
        return None
    keys = np.where(np.arange(width)[None, :] < full[:, None], tables[:, :width], -1)
    order = np.lexsort(keys.T[::-1])  # row-wise lexicographic; shorter tables first
    keys = keys[order]
    same = (keys[1:] == keys[:-1]) & (keys[1:] >= 0)
    lcp = np.cumprod(same, axis=1).sum(axis=1).tolist()  # pages sorted k and k+1 share
    banned: set[tuple[int, int]] = set()
    while True:  # drop levels that do not pay until every level does
        levels = _keep(lcp, 0, rows, 0, 0, block_size, max_levels, banned)
        least = max((MIN_SEQS - 1) * MIN_TOKENS, rows * ROW_TOKENS)
        weak = [lv for lv in levels if sum(g.saved(block_size) for g in lv) < least]
        if not weak:
            break
        banned |= {(g.start, g.page_hi) for g in weak[0]}
    if not levels:
        return None
    order_list = order.tolist()
    suffix = [0] * rows
    for level in levels:
        for i, g in enumerate(level):
            level[i] = g = replace(g, pages=tuple(keys[g.start, g.page_lo:g.page_hi].tolist()))
            for k in range(g.start, g.end):
                suffix[order_list[k]] = g.page_hi
    return CascadeLayout(order_list, levels, suffix, block_size)


def _keep(lcp: list[int], lo: int, hi: int, depth: int, covered: int, block_size: int,
          max_levels: int, banned: set[tuple[int, int]], level: int = 0) -> list[list[Group]]:
    """The kept groups among sorted positions ``lo:hi``, which share ``depth`` pages (the first
    ``covered`` of them attended by kept groups around them, at levels below ``level``)."""
    levels: list[list[Group]] = []
    k = lo
    while k < hi - 1:
        if lcp[k] <= depth:
            k += 1
            continue
        end = k + 1  # a run of rows sharing more than ``depth`` pages: positions k..end
        while end < hi - 1 and lcp[end] > depth:
            end += 1
        shared = min(lcp[k:end])
        g = Group(k, end + 1, covered, shared)
        inner_level, inner_covered = level, covered
        if (g.start, g.page_hi) not in banned and g.saved(block_size) >= MIN_TOKENS:
            _add(levels, 0, [g])
            inner_level, inner_covered = level + 1, shared
        if inner_level < max_levels:
            inner = _keep(lcp, g.start, g.end, shared, inner_covered, block_size, max_levels,
                          banned, inner_level)
            for i, gs in enumerate(inner):
                _add(levels, i + inner_level - level, gs)
        k = end + 1
    return levels


def _add(levels: list[list[Group]], i: int, groups: list[Group]) -> None:
    while len(levels) <= i:
        levels.append([])
    levels[i].extend(groups)
