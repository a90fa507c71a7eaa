"""Which tiles the MoE grouped GEMMs run with at each token count, chosen by measurement on
this GPU.

At load, a MoE layer shape (experts, hidden, this rank's intermediate, top-k, dtype) times the
candidate tiles at a few token counts, on uniformly random routing, from CUDA-graph replays (as
the model runs them; the activations or, swapped, the weights as the MMA's left operand;
gpt-oss's biased, clamped experts with gate/up ungated and the activation kernel after it, as
``fused_experts`` runs them, under a key of their own), and keeps per count the block height
and the gate/up and down tiles whose sum (sorting included) is least (FP8 experts: with or
without their GEMMs' inputs quantized per token, that quantization timed with them; MXFP4
experts: converted in registers, and through ``tl.dot_scaled`` in the tiles that won
converted, which bounds the added timing; on Hopper, each GEMM's winning prefill tile also
with its weights loaded by TMA), and from which count torch's grouped GEMM
(``moe.grouped_mm``, where it runs) is faster than those (prefill chunks), and from which
MXFP4 experts are better written out dense first (``moe.dequantized``; then in a tile or by
torch's grouped GEMM, whichever is faster). Plans are shipped for the GPUs we measure on and
cached per machine (``runtime/kernel_plans.py``: ``moe-plans.json``).
``$PAGEDGEN_MOE_TILES`` forces one tile (``Tiles.name``) for both GEMMs at every count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from pagedgen import envs
from pagedgen.runtime import kernel_plans
from pagedgen.runtime.hardware import hopper_or_later
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.moe import align as moe_align
from pagedgen.runtime.layers.moe import dequantized as moe_dequantized
from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe.act import bias_and_act
from pagedgen.runtime.layers.moe.kernels import Tiles

ENV_TILES = envs.MOE_TILES.name
CACHE = "moe-plans.json"
# part of the disk key: a change to the kernel or to what a tile's name means bumps it (a
# candidate added leaves earlier plans valid, as measured without it: re-measure where it counts)
PLAN_VERSION = 5
TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
GROUPED_MM_FROM = 512  # the smallest count torch's grouped GEMM is timed at (prefill sizes)
CANDIDATES = {t.name: t for t in (
    Tiles(16, 32, 128, 1, 4, 4), Tiles(16, 64, 128, 1, 4, 3), Tiles(16, 128, 64, 1, 4, 4),
    Tiles(16, 64, 256, 1, 4, 2), Tiles(32, 64, 128, 4, 4, 3), Tiles(32, 128, 64, 4, 4, 4),
    Tiles(64, 64, 64, 8, 4, 4), Tiles(64, 128, 64, 8, 4, 3), Tiles(64, 128, 64, 8, 8, 4),
    Tiles(128, 128, 64, 8, 8, 3), Tiles(128, 64, 64, 8, 4, 4), Tiles(128, 128, 64, 8, 8, 4),
    Tiles(128, 256, 64, 8, 8, 3), Tiles(64, 256, 64, 8, 8, 3),
    Tiles(16, 64, 256, 1, 4, 4), Tiles(32, 64, 256, 4, 4, 3),  # deeper: FP8 operands
    # FP8 operands at prefill heights: K steps of 128 bytes a row, as bf16's K of 64 take
    # (most fit shared memory only in FP8: ``fits`` keeps each plan to those that do)
    Tiles(64, 128, 128, 8, 4, 4), Tiles(128, 128, 128, 8, 8, 4), Tiles(128, 256, 128, 8, 8, 3),
    # the weights on the left (Tiles.swap): few rows a block fill the MMA's narrow side
    Tiles(16, 64, 128, 1, 4, 4, True), Tiles(16, 128, 128, 1, 4, 3, True),
    Tiles(32, 64, 128, 4, 4, 3, True), Tiles(32, 128, 128, 4, 8, 3, True),
    Tiles(64, 128, 64, 8, 4, 3, True), Tiles(64, 128, 128, 8, 8, 3, True),
    Tiles(128, 128, 64, 8, 8, 3, True), Tiles(128, 256, 64, 8, 8, 3, True),
    Tiles(16, 128, 128, 1, 8, 3, True), Tiles(64, 128, 64, 8, 8, 4, True),
    Tiles(64, 128, 128, 8, 4, 3, True))}
# each prefill tile of A on the left also with its weights loaded by TMA
CANDIDATES.update((t.name, t) for t in [replace(t, tma=True) for t in CANDIDATES.values()
                                        if t.block_m >= 64 and not t.swap])
INTERPRETED = Tiles(16, 32, 32)  # CPU tensors in Triton's interpreter (tests)
# --batch-invariant on a GPU: one tile for every token count (no split of K, the same K order
# wherever a token's row sits), bf16 at any expert shape
INVARIANT = Tiles(64, 64, 64)
DENSE = (Tiles(64, 128, 64, 8, 4, 3), Tiles(64, 256, 64, 8, 8, 3), Tiles(128, 128, 64, 8, 8, 4),
         Tiles(128, 256, 64, 8, 8, 3))  # MXFP4 experts written out dense: prefill tiles


@dataclass
class MoePlan:
    """``choices``: [(largest token count, gate/up tiles, down tiles, native)], increasing
    counts (native: the weights' own format meets the tensor cores: FP8 experts' GEMMs take
    their inputs quantized per token, MXFP4 experts run ``tl.dot_scaled``);
    ``grouped_mm_from``: the token count from which torch's grouped GEMM runs instead (outside
    CUDA-graph capture); ``dequantize_from``: the token count from which MXFP4 experts are
    written out dense a run at a time (``moe.dequantized``, also outside capture), with
    ``dense`` [(largest token count, tiles or ``moe_dequantized.GROUPED_MM``)] for their
    GEMMs."""

    choices: list[tuple[float, Tiles, Tiles, bool]]
    grouped_mm_from: float = math.inf
    dequantize_from: float = math.inf
    dense: list[tuple[float, Tiles | str]] = field(default_factory=list)

    def uses_grouped_mm(self, tokens: int) -> bool:
        """Whether ``tokens`` run on torch's grouped GEMM (never while a graph is captured)."""
        return tokens >= self.grouped_mm_from and not _capturing()

    def dequantizes(self, tokens: int) -> tuple[Tiles, Tiles] | str | None:
        """The tiles (or ``GROUPED_MM``) of the dense way where ``tokens`` run it (never while
        capturing)."""
        if tokens < self.dequantize_from or not self.dense or _capturing():
            return None
        way = next((t for m, t in self.dense if tokens <= m), self.dense[-1][1])
        return way if way == moe_dequantized.GROUPED_MM else (way, way)

    def choose(self, tokens: int) -> tuple[Tiles, Tiles]:
        return self._choice(tokens)[1:3]

    def native(self, tokens: int) -> bool:
        """Whether the experts' GEMMs take their weights' own format at ``tokens`` tokens."""
        return self._choice(tokens)[3]

    def _choice(self, tokens: int) -> tuple[float, Tiles, Tiles, bool]:
        return next((c for c in self.choices if tokens <= c[0]), self.choices[-1])


def _capturing() -> bool:
    """Whether a CUDA graph is being captured (prefill-only ways then stand aside)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def to_json(plan: MoePlan) -> dict:
    """A plan as the plan files hold it (tiles by name)."""
    return {"choices": [(m, up.name, down.name, a8) for m, up, down, a8 in plan.choices],
            "grouped_mm_from": plan.grouped_mm_from, "dequantize_from": plan.dequantize_from,
            "dense": [(m, t if isinstance(t, str) else t.name) for m, t in plan.dense]}


def plan_moe(w13: torch.Tensor, w2: torch.Tensor, top_k: int,
             scales: mk.ExpertScales | None = None,
             act_dtype: torch.dtype = torch.bfloat16, act=mk.swiglu,
             b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> MoePlan:
    """The tiles at each token count for experts ``w13`` / ``w2`` (FP8 with ``scales``, taking
    ``act_dtype`` activations; timed once per shape and machine). ``act`` and the biases
    ``b13`` / ``b2`` (gpt-oss's): timed as ``fused_experts`` runs them, gate/up ungated."""
    forced = envs.MOE_TILES.get()
    if forced is not None:
        if forced not in CANDIDATES:
            raise ValueError(f"${ENV_TILES}={forced}: use one of {', '.join(CANDIDATES)}")
        return MoePlan([(math.inf, CANDIDATES[forced], CANDIDATES[forced], False)])
    if w13.device.type != "cuda":
        return MoePlan([(math.inf, INTERPRETED, INTERPRETED, False)])
    if scales is None:
        act_dtype = w13.dtype
    return kernel_plans.cached(
        CACHE, kernel_plans.gpu_name(w13.device), plan_key(w13, top_k, scales, act_dtype, act,
                                                           b13, b2), _from_json,
        lambda: _measure(w13, w2, top_k, scales, act_dtype, act, b13, b2), to_json)


def plan_key(w13: torch.Tensor, top_k: int, scales: mk.ExpertScales | None,
             act_dtype: torch.dtype, act=mk.swiglu, b13: torch.Tensor | None = None,
             b2: torch.Tensor | None = None) -> str:
    """The key ``plan_moe`` keeps these experts' plan under (shipped files, the machine's
    cache): unquantized experts take activations of their own dtype."""
    act_dtype = act_dtype if scales is not None else w13.dtype
    return shape_key(w13, top_k, scales, act_dtype, mk.gated_up(act, b13, b2))


def shape_key(w13: torch.Tensor, top_k: int, scales: mk.ExpertScales | None,
              act_dtype: torch.dtype, gated: bool = True) -> str:
    """What a plan holds for: the experts' shape, top-k, weight and activation dtypes (and
    ``ungated`` where gate/up's GEMM writes both halves for the activation after it)."""
    return "|".join(map(str, (PLAN_VERSION, *w13.shape, top_k, w13.dtype, act_dtype,
                              scales and scales.group_k, *(() if gated else ("ungated",)))))


def _from_json(saved) -> MoePlan | None:
    """A plan read from disk, or None when it names tiles this version does not have."""
    try:
        choices = [(float(m), CANDIDATES[up], CANDIDATES[down], bool(a8))
                   for m, up, down, a8 in saved["choices"]]
        grouped_from = float(saved["grouped_mm_from"])
        dense_from = float(saved.get("dequantize_from", math.inf))  # a plan before the way
        dense = [(float(m), t if t == moe_dequantized.GROUPED_MM else CANDIDATES[t])
                 for m, t in saved.get("dense", [])]
    except (TypeError, ValueError, KeyError):
        return None
    ok = choices and [m for m, *_ in choices] == sorted(m for m, *_ in choices)
    return MoePlan(choices, grouped_from, dense_from, dense) if ok else None


SHARED_MEMORY = 200 << 10  # bytes a program may stage (Hopper has 227 KiB; Ampere 163)


def fits(tiles: Tiles, elem: int, gated: bool, b_elem: int | None = None) -> bool:
    """Whether the kernel's pipeline stages (an A tile and one B tile each, two when
    ``gated``) fit in shared memory at ``elem`` bytes an element of A and ``b_elem`` (default
    ``elem``) of B (float32 doubles bf16's; FP8 halves it)."""
    b_tiles = 2 if gated else 1
    per_stage = (tiles.block_m * elem + b_tiles * tiles.block_n * (b_elem or elem)) \
        * tiles.block_k
    return tiles.num_stages * per_stage <= SHARED_MEMORY


def mostly_padding(block_m: int, tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether blocks of ``block_m`` rows would be mostly padding at ``tokens`` tokens: past
    twice an expert's share of the slots under uniform routing (blocks of 16 always run)."""
    return block_m > max(16, 2 * tokens * top_k / num_experts)


def random_routing(tokens: int, num_experts: int, top_k: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, uniformly at random, and softmax-like weights."""
    ids = torch.rand(tokens, num_experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device)
    return weights / weights.sum(-1, keepdim=True), ids


def natives(scales: mk.ExpertScales | None, group_k: int | None, fp4: bool,
            act_dtype: torch.dtype) -> tuple[bool, ...]:
    """The ways the experts' weights may meet the tensor cores that a plan times: converted to
    the activations' dtype (False), and their own format (True) where it can: FP8 inputs take
    K tiles of 32 or more; ``tl.dot_scaled`` takes bf16 or fp16 activations."""
    if fp4:
        return (False, True) if act_dtype in mk.SCALED_DOT_FORMATS else (False,)
    return (False, True) if scales is not None and (group_k or 32) >= 32 else (False,)


def _or_never(fn) -> float:
    """``graph_time(fn)``, or infinity where its kernel does not build (a Triton that lowers
    no ``tl.dot_scaled`` for this GPU, a tile past its registers): never chosen, and the GPU
    tests build every candidate."""
    try:
        return kernel_plans.graph_time(fn)
    except Exception:  # noqa: BLE001 - a compiler's refusal: that way is not timed
        return math.inf


def _measure(w13: torch.Tensor, w2: torch.Tensor, top_k: int,
             scales: mk.ExpertScales | None, act_dtype: torch.dtype, act=mk.swiglu,
             b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> MoePlan:
    from pagedgen.runtime.hardware import time_cuda

    graph_time = kernel_plans.graph_time
    fp4 = w13.dtype == torch.uint8  # MXFP4: two values a byte, activations as they are
    num_experts, hidden = w13.shape[0], w13.shape[2] * (2 if fp4 else 1)
    s13, s2, group_k = (scales.w13, scales.w2, scales.group_k) if scales else (None,) * 3
    gated = mk.gated_up(act, b13, b2)
    small = scales is not None and scales.small_exponents  # MXFP4's one-multiply conversion
    tma = hopper_or_later(w13.device)  # before it the TMA twins only lengthen the plan
    choices, grouped_wins, dense_wins, dense_tiles = [], [], [], []
    for tokens in TOKEN_BUCKETS:
        x = torch.randn(tokens, hidden, device=w13.device, dtype=act_dtype)
        weights, ids = random_routing(tokens, num_experts, top_k, w13.device)
        n = tokens * top_k
        inter = x.new_empty(n, w13.shape[1] // 2)
        gate_up = None if gated else x.new_empty(n, w13.shape[1])
        out = x.new_empty(n, hidden)
        slot_experts = ids.reshape(-1).long()

        def up_gemm(t: Tiles, native: bool) -> None:
            a8 = native and not fp4
            a, a_scale = mk.quantize_activations(x, group_k) if a8 else (x, None)
            mk.grouped_gemm(a, w13, inter if gated else gate_up, slots, experts, n, t, top_k,
                            gated=gated, w_scale=s13, a_scale=a_scale, group_k=group_k,
                            scaled_dot=native and fp4, small_exps=small)
            if not gated:  # the activation between the GEMMs, as the run has it
                bias_and_act(gate_up, act, b13, slot_experts)

        def down_gemm(t: Tiles, native: bool) -> None:
            a8 = native and not fp4
            a, a_scale = mk.quantize_activations(inter, group_k) if a8 else (inter, None)
            mk.grouped_gemm(a, w2, out, slots, experts, n, t, 1, gated=False,
                            weights=weights.reshape(-1), w_scale=s2, a_scale=a_scale,
                            group_k=group_k, scaled_dot=native and fp4, bias=b2,
                            small_exps=small)

        best = None
        shortlist: dict[int, set[Tiles]] = {}  # per block height: the converted way's best
        for native in natives(scales, group_k, fp4, act_dtype):
            elem = 1 if native and not fp4 else x.element_size()
            b_elem = w13.element_size()
            for block_m in sorted({t.block_m for t in CANDIDATES.values()}):
                if mostly_padding(block_m, tokens, top_k, num_experts):
                    continue
                slots, experts = moe_align.align(ids, num_experts, block_m)
                sort_t = graph_time(lambda: moe_align.align(ids, num_experts, block_m))
                tiles = [t for t in CANDIDATES.values() if t.block_m == block_m]
                if group_k is not None and any(t.block_k <= group_k for t in tiles):
                    tiles = [t for t in tiles if t.block_k <= group_k]  # others narrow to K
                if group_k is not None and not fp4:  # K-group scales: no swapped tiles
                    tiles = [t for t in tiles if not t.swap]
                tiles = [t for t in tiles if not t.tma]  # twins: of the winners, below
                if native and fp4:  # the scaled dot in the converted way's best tiles only
                    tiles = [t for t in tiles if t in shortlist.get(block_m, ())]
                # a tile or scaled dot this GPU or Triton cannot build: never chosen
                up = {t: _or_never(lambda t=t: up_gemm(t, native))
                      for t in tiles if fits(t, elem, gated, b_elem)}
                down = {t: _or_never(lambda t=t: down_gemm(t, native))
                        for t in tiles if fits(t, elem, False, b_elem)}
                up = {t: v for t, v in up.items() if v < math.inf}
                down = {t: v for t, v in down.items() if v < math.inf}
                if not up or not down:
                    continue
                t_up, t_down = min(up, key=up.get), min(down, key=down.get)
                if tma and not fp4:  # each GEMM's TMA twin of its winner, where it has one
                    for times, gemm, won in ((up, up_gemm, t_up), (down, down_gemm, t_down)):
                        twin = CANDIDATES.get(replace(won, tma=True).name)
                        if twin is not None:
                            times[twin] = _or_never(lambda: gemm(twin, native))
                    t_up, t_down = min(up, key=up.get), min(down, key=down.get)
                shortlist[block_m] = {t_up, t_down}
                total = sort_t + up[t_up] + down[t_down]
                if best is None or total < best[0]:
                    best = (total, t_up, t_down, native)
        choices.append((tokens, best[1], best[2], best[3]))
        if gated and tokens >= GROUPED_MM_FROM and moe_grouped_mm.available(w13, scales):
            # eager, as prefill steps run: at these sizes launches are a small part
            try:
                grouped = time_cuda(lambda: moe_grouped_mm.experts(
                    x, w13, w2, weights, ids, silu_and_mul=fused_ops.silu_and_mul_fused,
                    scales=scales), 5)
            except RuntimeError:  # a shape or build torch's kernel does not take: the tiles
                grouped = math.inf
            grouped_wins.append((tokens, grouped < best[0]))
        if fp4 and tokens >= GROUPED_MM_FROM and act_dtype in mk.SCALED_DOT_FORMATS:
            ways = [(t, (t, t)) for t in DENSE if fits(t, x.element_size(), True)]
            if act_dtype == torch.bfloat16 and moe_grouped_mm.available(
                    w13, dense=torch.Size([num_experts, w13.shape[1], hidden])):
                ways.append((moe_dequantized.GROUPED_MM, moe_dequantized.GROUPED_MM))
            dense = {t: _eager_or_never(lambda way=way: moe_dequantized.experts(
                x, w13, w2, weights, ids, way, None, scales, act, b13, b2)) for t, way in ways}
            t_dense = min(dense, key=dense.get)
            dense_wins.append((tokens, dense[t_dense] < best[0]))
            dense_tiles.append((tokens, t_dense))
    dense_from = _wins_from(dense_wins)
    return MoePlan(choices, _wins_from(grouped_wins), dense_from,
                   [(m, t) for m, t in dense_tiles if m >= dense_from])


def _wins_from(wins: list[tuple[int, bool]]) -> float:
    """The first token count from which a way wins at every larger count measured."""
    start = math.inf
    for tokens, won in reversed(wins):
        if not won:
            break
        start = tokens
    return start


def _eager_or_never(fn) -> float:
    """Eager seconds of ``fn`` (as prefill steps run), or infinity where it does not build."""
    from pagedgen.runtime.hardware import time_cuda

    try:
        return time_cuda(fn, 5)
    except Exception:  # noqa: BLE001 - a compiler's or allocator's refusal: never chosen
        return math.inf
