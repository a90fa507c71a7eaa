"""Fixed-size KV-cache blocks: a free queue, per-sequence block tables, reference counts, and
the prefix cache.

With prefix caching, a full block whose K/V are computed is registered under its key
(``prefix_cache.block_keys``). When its last owner lets go it stays cached, at the back of the
free queue; the free queue hands out its front first, so cached blocks are evicted least
recently used first, after every block that holds nothing. A block with a reference is never in
the free queue, so it is never evicted or handed out twice.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedgen.runtime.engine.prefix_cache import BlockKey, block_keys
from pagedgen.runtime.engine.sequence import Sequence


class BlockManager:
    """Hands out physical blocks of ``block_size`` token slots to sequences.

    Blocks are reference-counted: the samples of one request share their prompt's full blocks,
    and with ``prefix_caching`` sequences share the cached blocks of a common prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 state_slots: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # a model with linear-attention layers: a recurrent-state slot per running sequence
        # (one per seat: the scheduler's seats bound how many are held), taken with its first
        # blocks and freed with them
        self.has_state = state_slots > 0
        self.free_slots = list(range(state_slots - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        # blocks with no reference, in the order they are handed out (front first)
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockKey, int] = {}
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.num_evicted = 0  # cached blocks handed out for new contents

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty, or cached but evictable)."""
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its table covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to cover ``num_tokens`` tokens."""
        n = self.blocks_needed(seq, num_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: need {n}, have {self.num_free_blocks}")
        for _ in range(n):
            seq.block_table.append(self._take_free())
        if self.has_state and seq.state_slot is None:
            seq.state_slot = self._take_slot()

    def _take_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no recurrent-state slot free: more running sequences than seats")
        return self.free_slots.pop()

    def _take_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # the least recently used cached block: evict it
            del self.cached[key]
            self.block_key[block] = None
            self.num_evicted += 1
        self.ref_counts[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (shared ones only when their last owner lets go). Cached
        ones stay cached, the sequence's last block nearest the front (evicted first)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.block_key[block] is None:  # holds nothing reusable: hand out first
                    self.free_blocks.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    # ---- prefix caching -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The cached blocks that hold ``seq``'s longest run of leading full blocks within its
        first ``max_tokens`` tokens (no side effects but extending ``seq.block_keys``)."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        for i in range(max_tokens // self.block_size):
            block = self.cached.get(block_keys(seq, self.block_size, i + 1)[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them shrinks it)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start ``seq`` (which holds no blocks) on the cached blocks ``hits``: they join its
        block table with a reference each, and count as computed."""
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
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
            block, key = seq.block_table[i], keys[i]
            if self.block_key[block] is None and key not in self.cached:
                self.cached[key] = block
                self.block_key[block] = key
        seq.num_cached_blocks = n

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (all blocks must be free)."""
        assert len(self.free_blocks) == self.num_blocks, "blocks still referenced"
        self.cached.clear()
        self.block_key = [None] * self.num_blocks

    # ---- parallel sampling ----------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Give ``child`` the parent's first ``num_tokens`` tokens of K/V: full blocks are
        shared, the partly filled last block gets a copy of its own. Returns the (src, dst)
        block copies for ``copy_blocks`` (to run once the parent's K/V are written)."""
        full, partial = divmod(num_tokens, self.block_size)
        child.block_table = parent.block_table[:full]
        for block in child.block_table:
            self.ref_counts[block] += 1
        copies = []
        if partial:
            if not self.free_blocks:
                raise RuntimeError("out of KV-cache blocks")
            dst = self._take_free()
            child.block_table.append(dst)
            copies.append((parent.block_table[full], dst))
        child.num_computed_tokens = num_tokens
        if self.has_state:  # its state is copied in once the step has run
            child.state_slot = self._take_slot()
        child.block_keys = parent.block_keys[:full]
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        return copies
