"""Fixed-size KV-cache pages (blocks) for sequences: one pool of them, a page table per KV group
of a sequence, and the prefix cache.

A model's attention layers fall into KV groups (``kv_groups.py``): group 0 holds a page for
every token of a sequence (``seq.block_table``); a window group ``g`` >= 1 (``windows[g - 1]``,
None for another full group) holds only the pages its sliding window needs
(``seq.group_tables[g - 1]``, whose entries before ``seq.group_first[g - 1]`` were let go:
they keep a stale page id, which a window kernel never reads unmasked). Every group takes its
pages from the one pool, so the cache's memory goes wherever the running sequences need it.

Before a step, a window group's table covers the positions its queries see: from the first
new token's position minus the window (plus one) to the step's last token; the pages wholly
before that are let go then, as the window slides. A sequence's need is counted over every
group, net of the pages it lets go (``pages_needed``).

With prefix caching, a full block whose K/V are computed is registered under its key
(``prefix_cache.block_keys``; a window group's under ``(group, key)``), and stays cached when
its last owner lets go (``block_pool.py``: evicted least recently used first). A prefix is a hit
where group 0 holds every block of it and each window group the blocks its window needs at the
prefix's end (the longest such prefix within group 0's run: ``match_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pagedgen.runtime.engine.block_pool import BlockPool
from pagedgen.runtime.engine.prefix_cache import block_keys
from pagedgen.runtime.engine.sequence import Sequence


class PrefixHit(list):
    """Group 0's cached blocks of a prefix (a list, as before groups), with each further
    group's pages for the window at its end: ``groups[k]`` = (first block index, pages)."""

    groups: list[tuple[int, list[int]]]

    def __init__(self, blocks: list[int], groups: list[tuple[int, list[int]]] | None = None):
        super().__init__(blocks)
        self.groups = groups or []


class BlockManager:
    """Hands out blocks of ``block_size`` token slots to sequences, from one pool shared by
    group 0 and the groups of ``windows`` (each a window in tokens, or None: every token).

    Blocks are reference-counted: the samples of one request share their prompt's full blocks,
    and with ``prefix_caching`` sequences share the cached blocks of a common prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 state_slots: int = 0, windows: Seq[int | None] = ()) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks)
        self.windows = tuple(windows)
        self.held = [0] * (1 + len(self.windows))  # blocks referenced by each group
        self.peak_held = list(self.held)
        self._group = [0] * num_blocks  # the group a referenced block belongs to
        # a model with linear-attention layers: a recurrent-state slot per running sequence
        # (max_num_seqs bounds how many are held), taken with its first blocks and freed with
        # them
        self.has_state = state_slots > 0
        self.free_slots = list(range(state_slots - 1, -1, -1))

    # ---- the pool, as callers read it ---------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty, or cached but evictable)."""
        return self.pool.num_free

    @property
    def ref_counts(self) -> list[int]:
        return self.pool.ref_counts

    @property
    def free_blocks(self):
        return self.pool.free_blocks

    @property
    def cached(self) -> dict:
        return self.pool.cached

    @property
    def block_key(self) -> list:
        return self.pool.block_key

    @property
    def num_evicted(self) -> int:
        return self.pool.num_evicted

    def _take(self, g: int) -> int:
        block = self.pool.take()
        self._held(g, block, 1)
        return block

    def _ref(self, g: int, block: int) -> None:
        if self.pool.ref_counts[block] == 0:
            self._held(g, block, 1)
        self.pool.ref(block)

    def _release(self, block: int) -> None:
        self.pool.release(block)
        if self.pool.ref_counts[block] == 0:
            self._held(self._group[block], block, -1)

    def _held(self, g: int, block: int, change: int) -> None:
        self._group[block] = g
        self.held[g] += change
        self.peak_held[g] = max(self.peak_held[g], self.held[g])

    # ---- what a sequence needs ----------------------------------------------------------

    def _span(self, seq: Sequence, k: int, num_tokens: int, computed: int | None = None
              ) -> tuple[int, int]:
        """Window group ``k + 1``'s block range [lo, hi) for a step of ``seq`` that ends at
        ``num_tokens`` tokens, its first new token at position ``computed``."""
        w, bs = self.windows[k], self.block_size
        computed = seq.num_computed_tokens if computed is None else computed
        lo = 0 if w is None else max(0, computed - w + 1) // bs
        return lo, -(-num_tokens // bs)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New group-0 blocks ``seq`` needs so that its table covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def pages_needed(self, seq: Sequence, num_tokens: int, computed: int | None = None,
                     hit: PrefixHit | None = None) -> int:
        """New blocks of every group ``seq`` needs so that a step from position ``computed``
        (default: its computed tokens) to ``num_tokens`` tokens runs, net of the window
        pages it lets go first; from ``hit`` where it starts on a cached prefix."""
        if hit is not None:  # every group starts on the hit's blocks (the windows' from lo)
            n = max(0, -(-num_tokens // self.block_size) - len(hit))
            for k in range(len(self.windows)):
                lo, hi = self._span(seq, k, num_tokens, computed)
                n += max(0, hi - max(len(hit), lo))
            return n
        n = self.blocks_needed(seq, num_tokens)
        for k in range(len(self.windows)):
            lo, hi = self._span(seq, k, num_tokens, computed)
            table, first = self._table(seq, k)
            n += max(0, hi - max(len(table), lo)) - max(0, min(lo, len(table)) - first)
        return n

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if len(seq.block_table) * self.block_size >= num_tokens:
            return True  # no group takes a page (every table is as long as group 0's)
        return self.pages_needed(seq, num_tokens) <= self.num_free_blocks

    def _table(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        while len(seq.group_tables) <= k:
            seq.group_tables.append([])
            seq.group_first.append(0)
        return seq.group_tables[k], seq.group_first[k]

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s tables to cover ``num_tokens`` tokens (from its computed tokens on:
        window pages before the window let go first)."""
        grows = len(seq.block_table) * self.block_size < num_tokens
        n = self.pages_needed(seq, num_tokens) if grows else 0
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: need {n}, have {self.num_free_blocks}")
        for k in range(len(self.windows)):
            lo, hi = self._span(seq, k, num_tokens)
            table, first = self._table(seq, k)
            if lo <= first and len(table) >= hi:
                continue  # nothing slid out, nothing to add
            self._let_go(seq, k, lo)
            while len(table) < hi:
                table.append(self._take(k + 1) if len(table) >= lo else 0)
            seq.group_first[k] = max(seq.group_first[k], min(lo, hi))
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take(0))
        if self.has_state and seq.state_slot is None:
            seq.state_slot = self._take_slot()

    def _let_go(self, seq: Sequence, k: int, lo: int) -> None:
        """Release window group ``k + 1``'s pages of ``seq`` before block ``lo``."""
        table, first = seq.group_tables[k], seq.group_first[k]
        for i in range(first, min(lo, len(table))):
            self._release(table[i])
        seq.group_first[k] = max(first, min(lo, len(table)))

    def slide(self, seq: Sequence) -> None:
        """Let go of the window pages no later step of ``seq`` reads (those wholly before its
        next token's window). A prefill chunk holds its window groups' pages for every token
        of the chunk; without this they stay taken until the sequence's next step, where the
        decodes scheduled before it may find the pool short and preempt."""
        for k, w in enumerate(self.windows[:len(seq.group_tables)]):
            if w is not None:
                self._let_go(seq, k, max(0, seq.num_computed_tokens - w + 1) // self.block_size)

    def _take_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no recurrent-state slot free: more running sequences than "
                               "max_num_seqs")
        return self.free_slots.pop()

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (shared ones only when their last owner lets go). Cached
        ones stay cached, the sequence's last block nearest the front (evicted first)."""
        for k, table in enumerate(seq.group_tables):
            for block in reversed(table[seq.group_first[k]:]):
                self._release(block)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.group_tables, seq.group_first = [], []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    # ---- prefix caching -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, max_tokens: int) -> PrefixHit:
        """The cached blocks that hold ``seq``'s longest prefix of full blocks within its first
        ``max_tokens`` tokens that every group can resume from (no side effects but extending
        ``seq.block_keys``)."""
        if not self.prefix_caching:
            return PrefixHit([])
        bs = self.block_size
        keys = block_keys(seq, bs, max_tokens // bs)
        hits: list[int] = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        if not self.windows or not hits:
            return PrefixHit(hits)
        pages = [[self.pool.lookup((k + 1, key)) for key in keys[:len(hits)]]
                 for k in range(len(self.windows))]
        runs = []  # per group: how many cached blocks end at each index, in a row
        for found in pages:
            run, n = [], 0
            for block in found:
                n = n + 1 if block is not None else 0
                run.append(n)
            runs.append(run)
        for h in range(len(hits), 0, -1):  # the longest prefix every group resumes from
            spans = [self._span(seq, k, h * bs, h * bs)[0] for k in range(len(self.windows))]
            if all(runs[k][h - 1] >= h - lo for k, lo in enumerate(spans)):
                return PrefixHit(hits[:h], [(lo, pages[k][lo:h]) for k, lo in enumerate(spans)])
        return PrefixHit([])

    def num_free_among(self, blocks: list[int]) -> int:
        """How many blocks of ``blocks`` (a ``PrefixHit``: of every group) sit in the free
        queue (taking them shrinks it)."""
        n = self.pool.num_free_among(blocks)
        for _, pages in getattr(blocks, "groups", ()):
            n += self.pool.num_free_among(pages)
        return n

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start ``seq`` (which holds no blocks) on the cached blocks ``hits`` (a
        ``PrefixHit`` where the model has window groups): they join its tables with a
        reference each, and count as computed."""
        for block in hits:
            self._ref(0, block)
        seq.block_table = list(hits)
        for k, (lo, pages) in enumerate(getattr(hits, "groups", ())):
            self._table(seq, k)
            for block in pages:
                self._ref(k + 1, block)
            seq.group_tables[k], seq.group_first[k] = [0] * lo + list(pages), lo
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register ``seq``'s full blocks within its first ``num_tokens`` tokens, whose K/V are
        computed or being computed by a launched step (their ids must be known). A block whose
        key another block already holds stays unregistered."""
        n = min(num_tokens // self.block_size, len(seq.block_table))
        if not self.prefix_caching or n <= seq.num_cached_blocks:
            return
        keys = block_keys(seq, self.block_size, n)
        for i in range(seq.num_cached_blocks, n):
            self.pool.register(seq.block_table[i], keys[i])
        for k, table in enumerate(seq.group_tables):
            for i in range(max(seq.num_cached_blocks, seq.group_first[k]), min(n, len(table))):
                self.pool.register(table[i], (k + 1, keys[i]))
        seq.num_cached_blocks = n

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (all blocks must be free)."""
        self.pool.reset_cache()

    # ---- parallel sampling ----------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Give ``child`` the parent's first ``num_tokens`` tokens of K/V: full blocks are
        shared, the partly filled last block gets a copy of its own (in every group). Returns
        the (src, dst) block copies for ``copy_blocks`` (to run once the parent's K/V are
        written)."""
        full, partial = divmod(num_tokens, self.block_size)
        copies = []
        tables = [(0, parent.block_table, 0)] + [
            (k + 1, t, parent.group_first[k]) for k, t in enumerate(parent.group_tables)]
        child.group_tables, child.group_first = [], []
        for g, table, first in tables:
            mine = table[:full]
            for block in mine[first:]:
                self._ref(g, block)
            if partial:
                if not self.pool.num_free:
                    raise RuntimeError("out of KV-cache blocks")
                dst = self._take(g)
                mine.append(dst)
                copies.append((table[full], dst))
            if g == 0:
                child.block_table = mine
            else:
                child.group_tables.append(mine)
                child.group_first.append(min(first, len(mine)))
        child.num_computed_tokens = num_tokens
        if self.has_state:  # its state is copied in once the step has run
            child.state_slot = self._take_slot()
        child.block_keys = parent.block_keys[:full]
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        return copies
