"""Which FP8 GEMM kernel runs each layer at each M, chosen by measurement on this GPU.

Candidates (``kernels.py``): ``rowwise`` and ``rowwise_fast`` (torch._scaled_mm, with
fast accumulation; per-channel weights),
``triton_w8a8/<tile>`` (activations quantized, FP8 tensor cores), ``triton_tma/<tile>`` (the
same, its tiles loaded by TMA: Hopper and later) and ``triton_w8a16/<tile>``
(activations as they are, weights converted in registers; small M only), each Triton kernel in
the tiles that suit the M. At load, each distinct weight shape times every candidate at a few M
values from CUDA-graph replays (as the model runs them: small-M kernels would otherwise be timed
by their launches) and keeps the fastest per M. Plans are shipped for the GPUs we measure on
and cached per machine (``runtime/kernel_plans.py``: ``fp8-gemm-plans.json``): only the first
start on another GPU pays for the timing. ``$PAGEDGEN_FP8_GEMM`` forces one kernel
(``dequantize``: the weight dequantized, a dense GEMM: the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen import envs
from pagedgen.runtime import kernel_plans
from pagedgen.runtime.hardware import hopper_or_later
from pagedgen.runtime.kernel_plans import graph_time
from pagedgen.runtime.quantization.fp8 import kernels as k

ENV_GEMM = envs.FP8_GEMM.name
KINDS = ("rowwise", "rowwise_fast", "triton_w8a8", "triton_tma", "triton_w8a16", "dequantize")
# The M values each shape's kernels are timed at: decode's batches and prefill's chunks (a
# choice made at 1,024 ran a default 8,192-token chunk 9% slower on an H100)
M_BUCKETS = (1, 16, 64, 128, 256, 1024, 8192)
# the kinds that quantize per token (and so take a fused norm's or SwiGLU's quantized output)
QUANTIZED_INPUT = ("rowwise", "rowwise_fast", "triton_w8a8", "triton_tma")


@dataclass
class GemmPlan:
    """The kernel for each M: ``choices`` [(largest M, gemm)] in increasing M."""

    choices: list[tuple[float, str]]

    def choose(self, m: int) -> str:
        return next((g for bound, g in self.choices if m <= bound), self.choices[-1][1])


def candidates(layer: nn.Module, group_k: int | None, m: int) -> list[str]:
    """The GEMMs that can run this layer's weight on this device at M = ``m``."""
    n, kk = layer.weight.shape
    if layer.weight.device.type != "cuda":
        return ["dequantize"]
    out = []
    if group_k is None and n % 16 == 0 and kk % 16 == 0:
        out += ["rowwise", "rowwise_fast"]
    if k.HAVE_TRITON and (group_k is None or group_k % 16 == 0):
        for name, (bm, *_) in k.TILES.items():
            if bm <= max(16, m):  # no tile mostly padding rows
                out.append(f"triton_w8a8/{name}")
                if m <= 64:
                    out.append(f"triton_w8a16/{name}")
        if hopper_or_later(layer.weight.device) and k.tma_fits(layer.weight):
            out += [f"triton_tma/{name}" for name, (bm, *_) in k.TMA_TILES.items()
                    if bm <= max(64, m)]
    return out


def tiles(kind: str) -> dict[str, tuple]:
    """The tiles a Triton kind runs in (none for the others)."""
    return k.TMA_TILES if kind == "triton_tma" else k.TILES if kind.startswith("triton") else {}


def check_forced(name: str) -> None:
    kind, _, tile = name.partition("/")
    if kind not in KINDS or (tile and tile not in tiles(kind)):
        raise ValueError(f"${ENV_GEMM}={name}: use one of {', '.join(KINDS)} (the Triton ones "
                         f"optionally /TILE, TILE one of {', '.join(k.TILES)}; triton_tma's "
                         f"{', '.join(k.TMA_TILES)})")


def plan_gemm(layer: nn.Module, group_k: int | None) -> GemmPlan:
    """The kernel for each M on this layer's weight (timed once per shape and machine)."""
    forced = envs.FP8_GEMM.get()
    if forced is not None:
        check_forced(forced)
        if forced.startswith("rowwise") and group_k is not None:
            raise ValueError(f"${ENV_GEMM}=rowwise cannot run block-scaled weights")
        return GemmPlan([(math.inf, forced)])
    cands = candidates(layer, group_k, max(M_BUCKETS))
    return kernel_plans.cached(
        CACHE, kernel_plans.gpu_name(layer.weight.device), shape_key(layer),
        lambda saved: GemmPlan([(m, g) for m, g in saved]) if _valid(saved, cands) else None,
        lambda: _measure(layer, group_k), lambda plan: plan.choices)


def _measure(layer: nn.Module, group_k: int | None) -> GemmPlan:
    choices = []
    for m in M_BUCKETS:
        cands = candidates(layer, group_k, m)
        if not cands:
            raise ValueError("no FP8 GEMM can run here (Triton is not installed)")
        x = torch.randn(m, layer.weight.shape[1], device=layer.weight.device,
                        dtype=layer.act_dtype)
        times = {g: graph_time(lambda g=g: run_gemm(g, layer, x, group_k)) for g in cands}
        choices.append((m, min(times, key=times.get)))
    return GemmPlan(choices)


def _valid(saved, cands: list[str]) -> bool:
    """A plan read from disk names kernels this version has (and M bounds in order)."""
    try:
        ms = [float(m) for m, _ in saved]
        names = [g for _, g in saved]
    except (TypeError, ValueError):
        return False
    known = set(cands) | {f"{kind}/{t}" for kind in KINDS for t in tiles(kind)}
    return bool(ms) and ms == sorted(ms) and all(g in known for g in names)


PLAN_VERSION = 2  # part of the disk key: a change to the candidates or kernels bumps it
CACHE = "fp8-gemm-plans.json"


def shape_key(layer: nn.Module) -> str:
    """What a plan holds for: the weight's shape and scales, static input scale, act dtype."""
    return "|".join(map(str, (PLAN_VERSION, *layer.weight.shape, layer.weight_scale.shape[1],
                              layer.input_scale is not None, layer.act_dtype)))


def standalone_layer(weight: torch.Tensor, group_k: int | None = None,
                     act_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A bare module holding ``weight`` quantized (per channel, or per ``group_k`` columns) as
    an FP8 linear layer holds it: what ``run_gemm`` needs (verify's and the benchmark's)."""
    layer = nn.Module()
    layer.weight, layer.weight_scale = k.quantize_weight(weight, group_k)
    layer.input_scale, layer.act_dtype = None, act_dtype
    return layer


def run_quantized(gemm: str, layer: nn.Module, x: k.QuantizedActivations,
                  group_k: int | None = None) -> torch.Tensor:
    """``run_gemm`` on activations quantized already (per token, or per token and group)."""
    kind, _, tile = gemm.partition("/")
    if kind.startswith("rowwise"):
        return k.rowwise_gemm(x.q, x.scale, layer.weight, layer.weight_scale, layer.act_dtype,
                              kind == "rowwise_fast")
    if kind == "triton_tma":
        if k.tma_fits(x.q):
            return k.scaled_gemm_tma(x.q, x.scale, layer.weight, layer.weight_scale,
                                     layer.act_dtype, group_k, tile or None)
        tile = ""  # activations TMA cannot load (a view off 16 bytes): the same math
    return k.scaled_gemm(x.q, x.scale, layer.weight, layer.weight_scale, layer.act_dtype,
                         group_k, tile or None)


def run_gemm(gemm: str, layer: nn.Module, x: torch.Tensor, group_k: int | None) -> torch.Tensor:
    """``x W^T`` with FP8 ``layer.weight`` by the kernel named ``gemm`` (``candidates``), in
    ``layer.act_dtype`` (``x``'s)."""
    kind, _, tile = gemm.partition("/")
    if kind == "dequantize":
        return F.linear(x, k.dequantize(layer.weight, layer.weight_scale, x.dtype, group_k))
    if kind == "triton_w8a16":
        return k.scaled_gemm(x, None, layer.weight, layer.weight_scale, x.dtype, group_k,
                             tile or None)
    quantized = k.QuantizedActivations(*k.quantize_activations(x, group_k, layer.input_scale))
    return run_quantized(gemm, layer, quantized, group_k)
