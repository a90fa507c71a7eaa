"""Kernel-level checks: random paged batches (mixed prefill and decode; decodes sharing pages
in nested groups for grouped cascade decode) through a backend's kernels, against the eager
reference over the same cache.

Tolerances live in ``KERNEL_TOL`` below; docs/VERIFY.md explains them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pagedgen.attention import cascade_layout
from pagedgen.attention.backend import AttentionBackend
from pagedgen.attention.cases import (
    make_grouped_batch,
    make_paged_batch,
    make_shared_prefix_batch,
    run_backend,
    with_prefills,
)
from pagedgen.attention.eager import EagerBackend
from pagedgen.attention.registry import get_backend
from pagedgen.cli.verify.report import Row, max_error

# Max absolute error of the attention output against eager (float32 math over the same cache),
# for q/k/v ~ N(0, 1). See docs/VERIFY.md for the reasoning.
KERNEL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


FP8_KV_TOL = 4e-2  # bf16 queries over an FP8 cache, compared with eager over the same FP8 cache


GQA_RATIOS = (1, 2, 4, 8)


HEAD_SIZES = (64, 128, 256, 512)  # 512: Gemma 4's global layers


PAGE_SIZES = (16, 32)


def kernel_groups(backend: type[AttentionBackend], device: torch.device
                  ) -> list[tuple[str, torch.dtype, dict]]:
    """(label, dtype, case options) for each group this backend supports."""
    groups = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if dtype not in backend.get_supported_dtypes():
            continue
        name = str(dtype).removeprefix("torch.")
        groups.append((f"{name}", dtype, {}))
        if backend.supports_sliding_window:
            groups.append((f"{name} sliding window", dtype, {"sliding_window": 19}))
        if backend.supports_soft_cap:
            groups.append((f"{name} soft-cap", dtype, {"soft_cap": 20.0}))
        if backend.supports_sinks:
            groups.append((f"{name} sinks", dtype, {"sinks": True}))
    query = next((d for d in (torch.bfloat16, torch.float16)
                  if d in backend.get_supported_dtypes()), None)
    if query is not None and backend.fp8_kv_reason(device) is None:
        name = str(query).removeprefix("torch.")
        groups.append((f"{name} fp8 KV cache", query, {"cache_dtype": torch.float8_e4m3fn}))
    return groups


def page_sizes(backend: type[AttentionBackend]) -> list[int]:
    """The pages to check: 16 and 32 where allowed, and the backend's default."""
    allowed = backend.get_supported_block_sizes()
    pages = {p for p in PAGE_SIZES if allowed is None or p in allowed}
    return sorted(pages | {backend.resolve_block_size(None)})


@dataclass
class Partial:
    """Worst errors over some of a kernel check group's cases (the group's row is the
    combination of its parts, which may run in different processes)."""

    cases: int = 0
    worst_abs: float = 0.0
    worst_rel: float = 0.0
    bad_cache: int = 0

    def add(self, out: torch.Tensor, ref: torch.Tensor, same_cache: bool = True) -> None:
        err, rel = max_error(out.float(), ref.float())
        self.cases += 1
        self.worst_abs = max(self.worst_abs, err)
        self.worst_rel = max(self.worst_rel, rel)
        self.bad_cache += not same_cache

    @staticmethod
    def combine(parts: list[Partial]) -> Partial:
        return Partial(sum(p.cases for p in parts), max(p.worst_abs for p in parts),
                       max(p.worst_rel for p in parts), sum(p.bad_cache for p in parts))


def _shapes(backend: type[AttentionBackend]) -> tuple[list[int], list[int]]:
    """The head sizes and page sizes checked for ``backend``."""
    return [h for h in HEAD_SIZES if h in backend.get_supported_head_sizes()], page_sizes(backend)


def kernel_cases(name: str, device: torch.device, dtype: torch.dtype, opts: dict,
                 case_ids: list[int], seed: int) -> Partial:
    """Cases ``case_ids`` of one kernel group: random mixed prefill/decode batches through
    backend ``name`` and through eager, outputs and written caches compared. Case ``i`` cycles
    through the GQA ratios, then head sizes, then page sizes."""
    backend = get_backend(name, device)
    sizes, pages = _shapes(backend)
    part = Partial()
    for i in case_ids:
        gqa = GQA_RATIOS[i % len(GQA_RATIOS)]
        head = sizes[(i // len(GQA_RATIOS)) % len(sizes)]
        page = pages[(i // (len(GQA_RATIOS) * len(sizes))) % len(pages)]
        b = make_paged_batch(seed * 100_003 + i, num_heads=2 * gqa, num_kv_heads=2,
                             head_size=head, block_size=page, dtype=dtype, device=device,
                             num_prefills=1 + i % 3, num_decodes=1 + (i * 7) % 6,
                             max_context=3 * page + 5, max_new=2 * page + 3, **opts)
        ref, ref_cache = run_backend(EagerBackend, b)
        out, cache = run_backend(backend, b)
        part.add(out, ref, torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)))
    return part


def kernel_row(label: str, dtype: torch.dtype, opts: dict, parts: list[Partial]) -> Row:
    p = Partial.combine(parts)
    tol = FP8_KV_TOL if "cache_dtype" in opts else KERNEL_TOL[dtype]
    detail = f"{p.bad_cache} case(s) wrote the KV cache differently" if p.bad_cache else ""
    return Row("kernel", label, p.cases, p.worst_abs, p.worst_rel, tol,
               p.worst_abs <= tol and p.bad_cache == 0, detail)


def cascade_dtype(backend: type[AttentionBackend]) -> torch.dtype:
    return next(d for d in (torch.bfloat16, torch.float16, torch.float32)
                if d in backend.get_supported_dtypes())


def cascade_cases(name: str, device: torch.device, case_ids: list[int], seed: int
                  ) -> Partial | None:
    """Cascade decode against eager attention: even cases, decodes sharing their first pages
    (one group: the prefix attended once for the batch); odd cases, random nested groups with
    every group the layout finder would keep at its least thresholds (up to three levels,
    groups of one, rows shuffled), every other one behind prefill chunks in the same step
    (grouped there too where the backend supports it). None when the backend's state has no
    cascade. One head size
    (128 where supported): the groups and the merge do not depend on it, and each shape is one
    more kernel variant to compile (FA4)."""
    backend = get_backend(name, device)
    sizes, pages = _shapes(backend)
    sizes = [128] if 128 in sizes else sizes
    dtype = cascade_dtype(backend)
    part = Partial()
    for i in case_ids:
        gqa = GQA_RATIOS[i % len(GQA_RATIOS)]
        page = pages[(i // len(GQA_RATIOS)) % len(pages)]
        shape = dict(num_heads=2 * gqa, num_kv_heads=2, head_size=sizes[i % len(sizes)],
                     block_size=page, dtype=dtype, device=device)
        if i % 2 == 0:
            b = make_shared_prefix_batch(
                seed * 100_003 + i, shared_pages=-(-cascade_layout.MIN_TOKENS // page) + i % 3,
                num_decodes=cascade_layout.MIN_SEQS + i % 5, max_suffix=2 * page + 5, **shape)
        else:
            b = make_grouped_batch(seed * 100_003 + i, num_decodes=(9, 33, 64, 17)[i // 2 % 4],
                                   **shape)
        state = backend.get_state_cls()(backend, [b.spec], page, dtype, dtype, device)
        if not state.supports_cascade:
            return None
        if i % 4 == 3:  # a step that also carries prefills
            b = with_prefills(b, seed * 100_003 + i, num_prefills=2)
            b.mixed_cascade = state.supports_mixed_cascade
        with _all_groups():
            ref, _ = run_backend(EagerBackend, b)
            out, _ = run_backend(backend, b, state)
        part.add(out, ref)
    return part


@contextlib.contextmanager
def _all_groups():
    """Keep every group of two or more decodes (the kernels' cases, not the run's economics)."""
    cl = cascade_layout
    saved = cl.MIN_TOKENS, cl.MIN_SEQS, cl.ROW_TOKENS
    cl.MIN_TOKENS, cl.MIN_SEQS, cl.ROW_TOKENS = 1, 1, 0
    try:
        yield
    finally:
        cl.MIN_TOKENS, cl.MIN_SEQS, cl.ROW_TOKENS = saved


def cascade_row(dtype: torch.dtype, parts: list[Partial | None]) -> Row | None:
    if any(p is None for p in parts):
        return None
    p = Partial.combine(parts)
    tol = KERNEL_TOL[dtype]
    return Row("kernel", f"{str(dtype).removeprefix('torch.')} cascade decode (grouped prefixes,"
               " also beside prefills)",
               p.cases, p.worst_abs, p.worst_rel, tol, p.worst_abs <= tol)
