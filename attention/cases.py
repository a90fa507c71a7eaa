"""Randomized paged attention cases, shared by `pagedgen verify` and the tests.

A case is a batch of sequences with random cached context (block tables scattered over the cache)
and random new tokens: prefills (some with prior context, some of a single token, some ending
exactly on a page boundary) followed by decodes. A shared-prefix case is decodes only, whose
block tables begin with the same pages (what cascade attention reads once for the batch); a
grouped case nests such sharing (groups within groups, groups of one), in shuffled row order.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from pagedgen.attention.backend import AttentionBackend, LayerSpec
from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq


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
    cascade: bool = False  # build metadata that marks the pages every decode shares
    mixed_cascade: bool = False  # ... also with prefills in the step
    sinks: torch.Tensor | None = None  # [num_heads] float32 where ``spec.sinks``

    def metadata(self, device=None):
        return AttentionMetadataBuilder(self.block_size, torch.device(device or self.q.device),
                                        cascade=self.cascade, mixed=self.mixed_cascade
                                        ).build(self.prefills, self.decodes)


def make_paged_batch(seed: int, *, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32, device="cpu", num_prefills=2, num_decodes=3,
                     max_context=70, max_new=40, sliding_window=None, soft_cap=None,
                     cache_dtype=None, min_context=0, sinks=False) -> PagedBatch:
    """Sequences with random cached context (0 for some) and random new-token counts; blocks are
    shuffled across the cache so block tables are not contiguous."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(num_prefills + num_decodes):
        is_prefill = i < num_prefills
        ctx = rng.choice([0, rng.randint(1, max_context), block_size, 2 * block_size])
        ctx = 0 if (is_prefill and i == 0) else max(ctx, min_context)
        if not is_prefill:
            ctx = max(ctx, rng.choice([0, 1, block_size - 1]))
        new = 1
        if is_prefill:  # random, single-token, or ending exactly on a page boundary
            new = rng.choice([rng.randint(1, max_new), 1, block_size - ctx % block_size])
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
    batch = PagedBatch(spec, kv_cache, q, k, v, sched[:num_prefills], sched[num_prefills:],
                       block_size)
    return with_sinks(batch, seed) if sinks else batch


def with_sinks(batch: PagedBatch, seed: int) -> PagedBatch:
    """``batch`` with a random sink logit per query head (about the scores' own size, so each
    takes a real share of its softmax)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    sinks = 2 * torch.randn(batch.spec.num_heads, generator=gen)
    return dataclasses.replace(batch, spec=dataclasses.replace(batch.spec, sinks=True),
                               sinks=sinks.to(batch.q.device))


def make_shared_prefix_batch(seed: int, *, shared_pages: int, num_decodes: int, num_heads=4,
                             num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32,
                             device="cpu", max_suffix=40, soft_cap=None) -> PagedBatch:
    """``num_decodes`` decodes whose block tables start with the same ``shared_pages`` pages,
    each followed by 0 to ``max_suffix`` tokens of its own context (pages of its own) and its
    new token; ``cascade`` is set."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shared = shared_pages * block_size
    ctxs = [shared + rng.randint(0, max_suffix) for _ in range(num_decodes)]
    own = [-(-(c + 1) // block_size) - shared_pages for c in ctxs]
    total = shared_pages + sum(own) + 3
    perm = torch.randperm(total, generator=gen).tolist()
    prefix, start, sched = perm[:shared_pages], shared_pages, []
    for c, n in zip(ctxs, own):
        sched.append(ScheduledSeq(prefix + perm[start:start + n], c, 1))
        start += n
    return _decode_batch(gen, sched, total, num_heads, num_kv_heads, head_size, block_size,
                         dtype, device, soft_cap)


def make_grouped_batch(seed: int, *, num_decodes: int, max_depth: int = 3, num_heads=4,
                       num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32,
                       device="cpu", soft_cap=None) -> PagedBatch:
    """``num_decodes`` decodes sharing leading pages like a random trie: the batch splits into
    1-4 groups, each adding 0-3 shared pages, recursively up to ``max_depth``; each decode then
    has 0 to 2 pages and a bit of its own context (cut mid-page) and its new token. Rows are
    shuffled, so groups are not contiguous; ``cascade`` is set."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    next_page = [0]

    def pages(n: int) -> list[int]:
        next_page[0] += n
        return list(range(next_page[0] - n, next_page[0]))

    rows: list[tuple[list[int], int]] = []  # (shared pages, own context tokens)

    def grow(n: int, prefix: list[int], depth: int) -> None:
        if n == 1 or depth == max_depth:
            rows.extend((prefix, rng.randint(0, 2 * block_size + 3)) for _ in range(n))
            return
        k = rng.randint(1, min(4, n))
        cuts = sorted(rng.sample(range(1, n), k - 1))
        for a, b in zip([0, *cuts], [*cuts, n]):
            grow(b - a, prefix + pages(rng.randint(0, 3)), depth + 1)

    grow(num_decodes, pages(rng.randint(0, 2)), 0)
    rng.shuffle(rows)
    sched = []
    for prefix, own in rows:
        ctx = len(prefix) * block_size + own
        sched.append(ScheduledSeq(prefix + pages(-(-(ctx + 1) // block_size) - len(prefix)),
                                  ctx, 1))
    perm = torch.randperm(next_page[0] + 3, generator=gen).tolist()  # scatter the pages
    sched = [ScheduledSeq([perm[p] for p in s.block_table], s.num_context, 1) for s in sched]
    return _decode_batch(gen, sched, next_page[0] + 3, num_heads, num_kv_heads, head_size,
                         block_size, dtype, device, soft_cap)


def with_prefills(batch: PagedBatch, seed: int, num_prefills: int = 3, max_new: int = 40
                  ) -> PagedBatch:
    """``batch`` (decodes) behind ``num_prefills`` prefill chunks of random sequences with pages
    of their own (a step that carries prefills and decodes)."""
    h, d = batch.spec.num_kv_heads, batch.spec.head_size
    p = make_paged_batch(seed, num_heads=batch.spec.num_heads, num_kv_heads=h, head_size=d,
                         block_size=batch.block_size, dtype=batch.q.dtype,
                         device=batch.q.device, num_prefills=num_prefills, num_decodes=0,
                         max_new=max_new, soft_cap=batch.spec.logits_soft_cap)
    off = batch.kv_cache.shape[0]
    prefills = [ScheduledSeq([b + off for b in s.block_table], s.num_context, s.num_new)
                for s in p.prefills]
    return PagedBatch(batch.spec, torch.cat([batch.kv_cache, p.kv_cache.to(batch.kv_cache)]),
                      torch.cat([p.q, batch.q]), torch.cat([p.k, batch.k]),
                      torch.cat([p.v, batch.v]), prefills, batch.decodes, batch.block_size,
                      cascade=batch.cascade)


def _decode_batch(gen: torch.Generator, sched: list[ScheduledSeq], num_pages: int,
                  num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                  dtype: torch.dtype, device, soft_cap: float | None) -> PagedBatch:
    """Decodes ``sched`` over a random cache of ``num_pages`` pages, with random q/k/v;
    ``cascade`` set."""
    kv = torch.randn(num_pages, 2, block_size, num_kv_heads, head_size, generator=gen)
    q, k, v = (torch.randn(len(sched), h, head_size, generator=gen).to(dtype).to(device)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    spec = LayerSpec(num_heads, num_kv_heads, head_size, head_size ** -0.5,
                     logits_soft_cap=soft_cap)
    return PagedBatch(spec, kv.to(dtype).to(device), q, k, v, [], sched, block_size,
                      cascade=True)


def backend_cache(backend: type[AttentionBackend], blocks: torch.Tensor) -> torch.Tensor:
    """A new cache in ``backend``'s layout holding ``blocks`` [num_blocks, 2, page, H, D]."""
    n, _, page, h, d = blocks.shape
    cache = torch.empty(backend.get_kv_cache_shape(n, page, h, d), dtype=blocks.dtype,
                        device=blocks.device)
    backend.blocks_view(cache).copy_(blocks)
    return cache


def run_backend(backend: type[AttentionBackend], batch: PagedBatch, state=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of ``backend`` over a copy of the batch's cache: (output, cache after writes,
    as [num_blocks, 2, page, H, D]). ``state``: an already built backend state."""
    state = state or backend.get_state_cls()(backend, [batch.spec], batch.block_size,
                                             batch.q.dtype, batch.kv_cache.dtype, batch.q.device)
    impl = backend.get_impl_cls()(batch.spec, state)
    impl.sinks = batch.sinks
    md = state.build(batch.metadata())
    cache = backend_cache(backend, batch.kv_cache)
    out = impl.forward(batch.q, batch.k, batch.v, cache, md)
    return out, backend.blocks_view(cache).contiguous()
