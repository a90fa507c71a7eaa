"""The pool of KV-cache pages (blocks) every KV group takes from: reference counts, the free
queue, and the prefix cache's registry of full blocks by key.

A block with no reference sits in the free queue, which hands out its front first. A freed
block that holds nothing reusable goes to the front; one registered in the prefix cache goes to
the back, so cached blocks are evicted least recently used first, after every block that holds
nothing. A block with a reference is never in the queue, so it is never evicted or handed out
twice. ``BlockManager`` keeps one pool for all of a model's KV groups (``kv_groups.py``).
"""

from __future__ import annotations

from collections import OrderedDict

from pagedgen.runtime.engine.prefix_cache import BlockKey


class BlockPool:
    """Blocks ``0 .. num_blocks - 1``, all free and empty at first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # blocks with no reference, in the order they are handed out (front first)
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockKey, int] = {}
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.num_evicted = 0  # cached blocks handed out for new contents

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty, or cached but evictable)."""
        return len(self.free_blocks)

    def take(self) -> int:
        """A free block, with one reference (the least recently used cached one is evicted
        when no empty block is left)."""
        block, _ = self.free_blocks.popitem(last=False)
        key = self.block_key[block]
        if key is not None:
            del self.cached[key]
            self.block_key[block] = None
            self.num_evicted += 1
        self.ref_counts[block] = 1
        return block

    def ref(self, block: int) -> None:
        """One more reference to ``block`` (a cached block taken off the free queue)."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; at none the block is free (cached ones at the back)."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if self.block_key[block] is None:  # holds nothing reusable: hand out first
                self.free_blocks.move_to_end(block, last=False)

    def register(self, block: int, key: BlockKey) -> None:
        """``block`` holds the full block ``key`` (unless the key is held already)."""
        if self.block_key[block] is None and key not in self.cached:
            self.cached[key] = block
            self.block_key[block] = key

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key)

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them shrinks it)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def reset_cache(self) -> None:
        """Drop every cached block (all blocks must be free)."""
        assert len(self.free_blocks) == self.num_blocks, "blocks still referenced"
        self.cached.clear()
        self.block_key = [None] * self.num_blocks
