"""KV-cache operations and the block manager."""

from __future__ import annotations

import os

import pytest
import torch

from pagedgen.attention.ops.kv_cache import (
    HAVE_TRITON,
    copy_blocks,
    gather_kv,
    swap_blocks,
    write_kv,
    write_kv_triton,
)
from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.sequence import Sequence


def test_write_then_gather_roundtrip():
    cache = torch.zeros(6, 2, 4, 2, 8)
    table = torch.tensor([5, 2, 0])
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    slots = torch.tensor([table[p // 4].item() * 4 + p % 4 for p in range(10)])
    write_kv(cache, k, v, slots)
    gk, gv = gather_kv(cache, table, 10)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert cache[1].abs().sum() == 0  # untouched block


@pytest.mark.skipif(not HAVE_TRITON or not (torch.cuda.is_available()
                                            or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs a GPU, or TRITON_INTERPRET=1 for CPU tensors")
@pytest.mark.parametrize("layout", ["blocks", "split"])
@pytest.mark.kernels
def test_write_kv_triton_matches_torch(layout):
    """The Triton write (on CPU in the interpreter) into both cache layouts, from k/v that are
    strided views of one projection (as the model passes v), with 3 heads (a masked head tile).
    On a GPU it runs compiled, against the torch write on the CPU."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(7, 2 * 3 * 16, generator=g)
    k, v = kv[:, :48].view(7, 3, 16), kv[:, 48:].view(7, 3, 16)
    slots = torch.tensor([9, 10, 11, 12, 0, 3, 22])  # crosses a page boundary; block 1 unused
    ref = torch.zeros(6, 2, 4, 3, 16)
    write_kv(ref, k, v, slots)
    k, v, slots = k.to(dev), v.to(dev), slots.to(dev)
    if layout == "blocks":  # [blocks, 2, page, H, D]
        cache = torch.zeros(6, 2, 4, 3, 16, device=dev)
        write_kv_triton(cache[:, 0], cache[:, 1], k, v, slots)
    else:  # [2, blocks, page, H, D], as the flash-attn backend keeps it
        split = torch.zeros(2, 6, 4, 3, 16, device=dev)
        write_kv_triton(split[0], split[1], k, v, slots)
        cache = split.transpose(0, 1)
    assert torch.equal(cache.cpu(), ref)


def test_swap_blocks_device_to_host_and_back():
    dev = torch.randn(5, 2, 4, 2, 8)
    host = torch.zeros(3, 2, 4, 2, 8)
    swap_blocks(dev, host, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(host[0], dev[4]) and torch.equal(host[2], dev[1])
    assert host[1].abs().sum() == 0
    back = torch.zeros_like(dev)
    swap_blocks(host, back, torch.tensor([[0, 3]]))
    assert torch.equal(back[3], dev[4])


def test_copy_blocks_in_every_layer():
    caches = [torch.randn(4, 2, 4, 1, 8) for _ in range(3)]
    before = [c.clone() for c in caches]
    copy_blocks(caches, torch.tensor([[0, 3], [2, 1]]))
    for c, b in zip(caches, before):
        assert torch.equal(c[3], b[0]) and torch.equal(c[1], b[2]) and torch.equal(c[0], b[0])


def seq(n_tokens: int, sid: int = 0) -> Sequence:
    return Sequence(sid, list(range(n_tokens)), SamplingParams(), seed=0)


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(9)
    assert bm.blocks_needed(a, 9) == 3
    bm.allocate(a, 9)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(a, 12)  # still 3 blocks
    assert len(a.block_table) == 3
    assert not bm.can_allocate(seq(30), 30)
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = seq(10), seq(10, 1)
    bm.allocate(parent, 10)
    copies = bm.fork(parent, child, 10)
    assert child.block_table[:2] == parent.block_table[:2]
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert bm.num_free_blocks == 4
    bm.free(parent)  # shared blocks stay with the child
    assert bm.num_free_blocks == 5
    bm.free(child)
    assert bm.num_free_blocks == 8
