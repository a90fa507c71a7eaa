"""The dense GEMM ``x W^T (+ b)`` whose every output row is the same bits whatever the other
rows (``--batch-invariant``, issue 97).

cuBLAS (and MKL) choose tiles, split-K and even the algorithm by the problem's shape, so a
row's sums take another order when the batch has more or fewer rows. On a GPU every program
makes one output tile, its K loop in steps of ``BLOCK_K`` in the same order for any row count,
no split-K: an element's sum is the same chain of tensor-core products whatever the tile's
height or width. So the tile may change with the row count (narrow tiles for a decode's few
rows, so that many programs stream the weight; wide ones for a prefill's many, for reuse),
which is invariant only where the tensor cores sum an element alike in every tile shape:
``kept_tiles`` checks that on the device once (each candidate against the first, bitwise, on
a probe product) and keeps only those that agree. Each weight shape's plan (``shape_plan``:
the fastest kept tile per row count) is timed once per machine as the FP8 GEMM's is
(``kernel_plans``: cached on disk, shipped per GPU); under CUDA-graph capture, where nothing
is timed, a shape not planned yet takes ``PLAN``. On a CPU each
row is its own product (a BLAS's rounding also follows where a row sits in its register
block, so tiles would not do). Hand-written: torch has no GEMM with a fixed reduction order
(vLLM's and SGLang's batch-invariant modes carry their own Triton GEMMs for the same reason).
``benchmarks/invariant_gemm.py`` measures the tiles against cuBLAS.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pagedgen import envs
from pagedgen.errors import PagedgenError

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - a torch without Triton
    HAVE_TRITON = False

BLOCK_K = 64  # the K step: an element's sum adds its products in this order for any tile
BAND_M = 8  # row tiles next to each other share a weight tile (tile_order.py)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False  # tiles loaded by TMA (Hopper on; the same products in the same order)


# (the largest row count a tile serves, the tile), by row count; the last serves the rest: a
# shape's plan before it is timed (under CUDA-graph capture). Measured on an H100 over
# Llama-3-8B's five GEMMs (benchmarks/invariant_gemm.py,
# results/h100-invariant-gemm.json; their summed time): up to 64 rows 64 x 64 is level with
# cuBLAS (636-654 us against 638-681) and with 64 x 128; at 256 rows 128 x 128 takes 907 us,
# 64 x 128 1,032, 64 x 64 1,312 (cuBLAS 701); at 512 1,446, 1,852, 2,654 (cuBLAS 1,159)
PLAN: tuple[tuple[int, Tiles], ...] = ((64, Tiles(64, 64, 4, 4)),
                                       (1 << 62, Tiles(128, 128, 8, 4)))
# the tiles a shape's plan chooses between (the first is the one every other must agree with).
# On an H100 (results/h100-invariant-gemm-candidates.json, Llama-3-8B's shapes, TFLOP/s):
# 64 x 64 or 64 x 128 up to 256 rows; past 2,048 rows 128 x 128 loaded by TMA (627-677
# against 556-577 by pointers) or 256 x 128 (564-626); every one gave the first's bits
CANDIDATES = ("64x64x4x4", "64x128x4x4", "128x128x8x4", "128x256x8x3", "128x256x8x3xtma",
              "256x128x8x3", "128x128x8x4xtma")
# the row counts a shape's plan times (the last's choice serves every larger count), while a
# timing's activations and output take at most TIMING_BYTES (a forward may be running)
M_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048)
TIMING_BYTES = 1 << 27
CACHE = "invariant-gemm-plans"


def tile_name(t: Tiles) -> str:
    return f"{t.block_m}x{t.block_n}x{t.warps}x{t.stages}" + ("xtma" if t.tma else "")


def parse_tiles(text: str) -> Tiles:
    """"128x256x8x3" as Tiles (rows, columns, warps, stages); "128x256x8x3xtma" loads them
    by TMA."""
    tma = text.endswith("xtma")
    return Tiles(*map(int, text.removesuffix("xtma").split("x")), tma=tma)


def configured_plan() -> tuple[tuple[int, Tiles], ...]:
    """``PLAN``, or ``PAGEDGEN_INVARIANT_GEMM_PLAN``'s ("64:64x64x4x4,128x256x8x3": the rows
    each tile serves up to, the last serving the rest)."""
    text = envs.INVARIANT_GEMM_PLAN.get()
    if text is None:
        return PLAN
    try:
        parts = [p.split(":") for p in text.split(",")]
        plan = tuple((int(p[0]) if len(p) == 2 else 1 << 62, parse_tiles(p[-1])) for p in parts)
        ok = all(len(p) == 2 for p in parts[:-1]) and len(parts[-1]) == 1
    except (ValueError, TypeError):  # not numbers, or not four of them
        ok = False
    if not ok:
        raise PagedgenError(f"{envs.INVARIANT_GEMM_PLAN.name}={text}: ROWS:MxNxWARPSxSTAGES,... "
                            "with the last tile alone (64:64x64x4x4,128x256x8x3)")
    return plan


if HAVE_TRITON:
    from pagedgen.runtime.quantization.tile_order import banded_tile, tma_fits

    @triton.jit
    def _gemm_kernel(X, W, B, Out, M, N, K, stride_xm, stride_wn, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BAND_M: tl.constexpr, PRECISION: tl.constexpr):
        pm, pn = banded_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, BAND_M)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(W + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rm[:, None] * stride_om + rn[None, :], acc.to(Out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _gemm_tma_kernel(x_desc, w_desc, B, Out, M, N, K, stride_om, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BAND_M: tl.constexpr, PRECISION: tl.constexpr):
        """``_gemm_kernel`` with both operands' tiles loaded by TMA (zeros past the ends)."""
        pm, pn = banded_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, BAND_M)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = x_desc.load([pm * BLOCK_M, k0])
            w = w_desc.load([pn * BLOCK_N, k0])
            acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rm[:, None] * stride_om + rn[None, :], acc.to(Out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def by_rows(op, x: torch.Tensor, *args):
    """``op`` a row at a time, a row's result its own: on a CPU a BLAS rounds a row by its place
    in the register block, and torch's exp and tanh by a value's place in the tensor (SIMD lane
    or scalar tail), so a row's bits would follow the rows around it."""
    return torch.cat([op(row, *args) for row in x.split(1)]) if len(x) else op(x, *args)


def tiled_linear(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """``x2 W^T (+ b)`` into ``out`` in ``tiles`` (``x2``: [M, K] rows contiguous)."""
    m, k = x2.shape
    n = w.shape[0]
    precision = "ieee" if x2.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    if m and tiles.tma and x2.is_cuda and tma_fits(x2, w):
        from triton.tools.tensor_descriptor import TensorDescriptor
        _gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x2, [tiles.block_m, BLOCK_K]),
            TensorDescriptor.from_tensor(w, [tiles.block_n, BLOCK_K]),
            bias if bias is not None else w, out, m, n, k, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=BLOCK_K, BAND_M=BAND_M, PRECISION=precision, num_warps=tiles.warps,
            num_stages=tiles.stages)
    elif m:
        _gemm_kernel[grid](x2, w, bias if bias is not None else w, out, m, n, k,
                           x2.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                           BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K,
                           BAND_M=BAND_M, PRECISION=precision,
                           num_warps=tiles.warps, num_stages=tiles.stages)
    return out


@functools.cache
def kept_tiles(device: torch.device, dtype: torch.dtype, more: tuple[Tiles, ...] = ()
               ) -> tuple[Tiles, ...]:
    """``CANDIDATES`` (and ``more``) whose product of a probe on ``device`` (``dtype``) has
    the first's bits; the first alone on a CPU."""
    tiles = tuple(dict.fromkeys([*map(parse_tiles, CANDIDATES), *more]))
    if device.type != "cuda":
        return tiles[:1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 1000, generator=g).to(device, dtype)
    w = torch.randn(700, 1000, generator=g).to(device, dtype)
    products = [tiled_linear(x, w, None, torch.empty(300, 700, dtype=dtype, device=device), t)
                for t in tiles]
    return tuple(t for t, p in zip(tiles, products) if torch.equal(products[0], p))


def usable_plan(plan: tuple[tuple[int, Tiles], ...], kept: tuple[Tiles, ...]
                ) -> tuple[tuple[int, Tiles], ...]:
    """``plan`` where every tile of it is ``kept``, else the first kept tile for every row
    count."""
    return plan if all(t in kept for _, t in plan) else ((1 << 62, kept[0]),)


# the plans ``shape_plan`` settled, by (weight shape, dtype, device, the configured plan): a
# GEMM's call looks its plan up once resolved (it runs for every linear layer of every step)
_SETTLED: dict[tuple, tuple[tuple[int, Tiles], ...]] = {}


def shape_plan(w: torch.Tensor, dtype: torch.dtype) -> tuple[tuple[int, Tiles], ...]:
    """The plan of weight ``w``'s shape for activations of ``dtype``: the configured one
    (``PAGEDGEN_INVARIANT_GEMM_PLAN``), else the shape's timed plan, else (under CUDA-graph
    capture, before it is timed) ``PLAN``; each only where its tiles are kept."""
    key = (*w.shape, dtype, w.device, envs.INVARIANT_GEMM_PLAN.get())
    plan = _SETTLED.get(key)
    if plan is None:
        plan, settled = _resolve(w, dtype)
        if settled:
            _SETTLED[key] = plan
    return plan


def _resolve(w: torch.Tensor, dtype: torch.dtype) -> tuple[tuple[tuple[int, Tiles], ...], bool]:
    """``shape_plan``'s plan, and whether it is settled (not the stand-in of a capture)."""
    from pagedgen.runtime import kernel_plans

    configured = configured_plan()
    if configured is not PLAN:
        return usable_plan(configured, kept_tiles(w.device, dtype,
                                                  tuple(t for _, t in configured))), True
    kept = kept_tiles(w.device, dtype)
    if w.device.type != "cuda":  # Triton's interpreter (tests): nothing to time
        return usable_plan(PLAN, kept), True
    gpu, key = kernel_plans.gpu_name(w.device), _key(w, dtype)
    if torch.cuda.is_current_stream_capturing():
        return usable_plan(kernel_plans.planned(CACHE, gpu, key) or PLAN, kept), False
    return kernel_plans.cached(
        CACHE, gpu, key, lambda saved: _read(saved, {tile_name(t): t for t in kept}),
        lambda: _measure(w, dtype, kept), lambda plan: [[m, tile_name(t)] for m, t in plan]), True


def _key(w: torch.Tensor, dtype: torch.dtype) -> str:
    return f"{w.shape[0]}x{w.shape[1]}/{str(dtype).removeprefix('torch.')}"


def _read(saved, names: dict[str, Tiles]) -> tuple[tuple[int, Tiles], ...] | None:
    """A plan read from disk or a shipped file, or None where it names a tile not kept here
    (or is malformed)."""
    try:
        plan = tuple((int(m), names[t]) for m, t in saved)
    except (KeyError, TypeError, ValueError):
        return None
    return plan if plan and [m for m, _ in plan] == sorted(m for m, _ in plan) else None


def _measure(w: torch.Tensor, dtype: torch.dtype, kept: tuple[Tiles, ...]
             ) -> tuple[tuple[int, Tiles], ...]:
    """The fastest kept tile at each of ``M_BUCKETS`` rows on weight ``w`` (CUDA-graph
    replays, as the model runs them)."""
    from pagedgen.runtime.kernel_plans import graph_time

    n, k = w.shape
    choices: list[tuple[int, Tiles]] = []
    for m in M_BUCKETS:
        if choices and m * (n + k) * w.element_size() > TIMING_BYTES:
            break
        x = torch.randn(m, k, device=w.device, dtype=dtype)
        out = torch.empty(m, n, device=w.device, dtype=dtype)
        times = {t: graph_time(lambda t=t: tiled_linear(x, w, None, out, t)) for t in kept}
        choices.append((m, min(times, key=times.get)))
    return (*choices[:-1], (1 << 62, choices[-1][1]))


def tiles_for(m: int, w: torch.Tensor, dtype: torch.dtype) -> Tiles:
    """The tile for ``m`` rows of ``dtype`` activations times weight ``w`` on its GPU."""
    return next(t for most, t in shape_plan(w, dtype) if m <= most)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, tiles: bool | None = None,
                     k_parts: int = 1) -> torch.Tensor:
    """``x W^T (+ b)`` in invariant tiles on a GPU, a row at a time on a CPU (``x``: [..., K],
    ``weight``: [N, K]); into ``out`` ([rows, N]) when given. ``tiles`` forces the tiled
    kernel (Triton's interpreter on a CPU: the tests). ``k_parts`` 2: the products of K's two
    halves, each rounded to ``x``'s dtype, then added: the bits two tensor-parallel ranks'
    partial sums give once all-reduced (``round(p0 + p1)`` in any order)."""
    if k_parts == 2:
        half = x.shape[-1] // 2
        y = invariant_linear(x[..., :half], weight[:, :half], None, None, tiles)
        y += invariant_linear(x[..., half:], weight[:, half:], None, None, tiles)
        if bias is not None:
            y += bias
        if out is not None:
            out.copy_(y.reshape(out.shape))
            return out.view(y.shape)
        return y
    if k_parts != 1:
        raise ValueError(f"k_parts is 1 or 2, not {k_parts}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not (x.is_cuda if tiles is None else tiles):
        got = by_rows(torch.nn.functional.linear, x2, weight, bias)
        if out is not None:
            out.copy_(got)
            got = out
        return got.reshape(*shape[:-1], weight.shape[0])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = w.shape[0]
    if out is None:
        out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    tiled_linear(x2, w, bias, out, tiles_for(x2.shape[0], w, x.dtype))
    return out.reshape(*shape[:-1], n)
