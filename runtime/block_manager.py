"""Fixed-size KV-cache blocks: a free list, per-sequence block tables, reference counts."""

from __future__ import annotations

from collections import deque

from pagedgen.runtime.sequence import Sequence


class BlockManager:
    """Hands out physical blocks of ``block_size`` token slots to sequences.

    Blocks are reference-counted so that a fork can share its parent's full blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
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
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (shared ones only when their last owner lets go)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.appendleft(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Give ``child`` the parent's cached tokens: full blocks are shared, the partly filled
        last block is copied. Returns the (src, dst) block copies for ``copy_blocks``."""
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        child.block_table = parent.block_table[:full]
        for block in child.block_table:
            self.ref_counts[block] += 1
        copies = []
        if partial:
            if not self.free_blocks:
                raise RuntimeError("out of KV-cache blocks")
            dst = self.free_blocks.popleft()
            self.ref_counts[dst] = 1
            child.block_table.append(dst)
            copies.append((parent.block_table[full], dst))
        child.num_computed_tokens = parent.num_computed_tokens
        return copies
