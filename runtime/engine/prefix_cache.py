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
    images = seq.mm.images if seq.mm is not None else ()
    for i in range(len(keys), num_blocks):
        parent = hash(keys[-1]) if keys else ROOT_HASH
        lo, hi = i * block_size, (i + 1) * block_size
        block = tuple(tokens[lo:hi])
        seen = tuple(im.key for im in images if im.start < hi and im.start + im.num_tokens > lo)
        keys.append((parent, block + seen if seen else block))  # an image's placeholders:
    return keys  # the same ids for every image, so its pixels' hash keys them

