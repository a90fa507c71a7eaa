"""Shared fixtures: random paged batches, tiny Hugging Face checkpoints, the GPU marker."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagedgen.attention.backend import AttentionMetadataBuilder, LayerSpec, ScheduledSeq


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class PagedBatch:
    """A random paged batch: cache already holding each sequence's context, plus new q/k/v."""

    spec: LayerSpec
    kv_cache: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    prefills: list[ScheduledSeq]
    decodes: list[ScheduledSeq]
    block_size: int

    def metadata(self, device=None):
        return AttentionMetadataBuilder(self.block_size, torch.device(device or self.q.device)
                                        ).build(self.prefills, self.decodes)


def make_paged_batch(seed: int, *, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32, device="cpu", num_prefills=2, num_decodes=3,
                     max_context=70, max_new=40, sliding_window=None, soft_cap=None,
                     cache_dtype=None) -> PagedBatch:
    """Sequences with random cached context (0 for some) and random new-token counts; blocks are
    shuffled across the cache so block tables are not contiguous."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(num_prefills + num_decodes):
        is_prefill = i < num_prefills
        ctx = rng.choice([0, rng.randint(1, max_context), block_size, 2 * block_size])
        ctx = 0 if (is_prefill and i == 0) else ctx
        if not is_prefill:
            ctx = max(ctx, rng.choice([0, 1, block_size - 1]))
        new = rng.randint(1, max_new) if is_prefill else 1
        seqs.append((ctx, new))
    nblocks = [-(-(c + n) // block_size) for c, n in seqs]
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=gen).tolist()
    tables, start = [], 0
    for nb in nblocks:
        tables.append(perm[start:start + nb])
        start += nb
    cache_dtype = cache_dtype or dtype
    kv = torch.randn(total, 2, block_size, num_kv_heads, head_size, generator=gen)
    kv_cache = kv.to(cache_dtype).to(device)
    sched = [ScheduledSeq(t, c, n) for t, (c, n) in zip(tables, seqs)]
    n_tok = sum(n for _, n in seqs)
    q = torch.randn(n_tok, num_heads, head_size, generator=gen).to(dtype).to(device)
    k = torch.randn(n_tok, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
    v = torch.randn(n_tok, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
    spec = LayerSpec(num_heads, num_kv_heads, head_size, head_size ** -0.5,
                     sliding_window=sliding_window, logits_soft_cap=soft_cap)
    return PagedBatch(spec, kv_cache, q, k, v, sched[:num_prefills], sched[num_prefills:],
                      block_size)


def dense_reference(batch: PagedBatch) -> torch.Tensor:
    """Attention computed without paging: each sequence's K/V assembled from its context
    (read block by block) and its new tokens, then a plain masked softmax in float64."""
    spec, bs = batch.spec, batch.block_size
    outs, t = [], 0
    group = spec.num_heads // spec.num_kv_heads
    for s in batch.prefills + batch.decodes:
        ks, vs = [], []
        for pos in range(s.num_context):
            blk, off = s.block_table[pos // bs], pos % bs
            ks.append(batch.kv_cache[blk, 0, off].double())
            vs.append(batch.kv_cache[blk, 1, off].double())
        k = torch.stack(ks + [batch.k[t + i].double() for i in range(s.num_new)])
        v = torch.stack(vs + [batch.v[t + i].double() for i in range(s.num_new)])
        q = batch.q[t:t + s.num_new].double()
        L = s.num_context + s.num_new
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
        if spec.logits_soft_cap:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        qpos = torch.arange(s.num_context, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        ok = kpos <= qpos
        if spec.sliding_window:
            ok &= kpos > qpos - spec.sliding_window
        scores = scores.masked_fill(~ok, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        t += s.num_new
    return torch.cat(outs)
