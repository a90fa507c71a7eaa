"""Prefix-cache keys: a full KV block is known by its parent block's hash and its own token ids.

Keys chain, so equal keys mean equal whole prefixes: block ``i``'s key is ``(hash of block
i-1's key, block i's token ids)``. The block manager's cache dict is keyed by the key itself, so a
lookup compares the token ids exactly at each level; a false hit would need two different
prefixes whose parent keys collide in Python's 64-bit hash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedgen.runtime.engine.sequence import Sequence

BlockKey = tuple[int, tuple[int, ...]]
ROOT_HASH = 0x5F3759DF  # the parent hash of every sequence's first block


def block_keys(seq: Sequence, block_size: int, num_blocks: int) -> list[BlockKey]:
    """``seq.block_keys``, extended to cover its first ``num_blocks`` full blocks (their token
    ids must be known: no placeholders)."""
    keys = seq.block_keys
    tokens = seq.token_ids
    for i in range(len(keys), num_blocks):
        parent = hash(keys[-1]) if keys else ROOT_HASH
        keys.append((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
    return keys

