"""`pagedgen verify --quantization fp8`: the FP8 GEMMs against their dequantized reference
(random shapes, every M regime), and the model with FP8 weights against the same FP8 weights
dequantized (the reference's linear layers multiply in the model's dtype; the checked ones
quantize activations as they run)."""

from __future__ import annotations

import os
from unittest import mock

import torch

from pagedgen.cli.verify.report import BackendReport, Row, max_error
from pagedgen.cli.verify.runner import Check, single

# Max |difference| relative to the largest reference value. A GEMM: e4m3 activations (3
# mantissa bits) and a bf16 result; the model: the same error through every layer.
GEMM_TOL = 3e-2
MODEL_TOL = 0.15
NAME = "fp8-linear"


def fp8_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return ("FP8 GEMMs run on CUDA GPUs with FP8 tensor cores; the CPU multiplies "
                "dequantized weights (checked in the test suite)")
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "this GPU has no FP8 tensor cores (compute capability 8.9+ needed)"
    return None


def plan_fp8(device: torch.device, model: str, dtype: str, cases: int, steps: int,
             seed: int) -> tuple[BackendReport, list]:
    """The FP8 report: a row per GEMM kernel and the model row (runner.Check tasks)."""
    why = fp8_unavailable(device)
    if why:
        return BackendReport(NAME, "skipped", why), []
    checks = [Check([(gemm_row, (gemm, device, cases, seed))], single)
              for gemm in ("rowwise", "rowwise_fast", "triton_w8a16", "triton_w8a8",
                           "triton_tma")]
    checks.append(Check([(model_row, (model, dtype, device, steps, seed))], single))
    return BackendReport(NAME, "checked", reference="its dequantized reference"), checks


def gemm_row(gemm: str, device: torch.device, cases: int, seed: int) -> Row:
    """``cases`` random layers (M from 1 to 700, per-channel or 128-block scales as the
    kernel takes; ``triton_tma`` both, in turn) through ``gemm`` against ``scaled_gemm_ref``
    on the same FP8 operands."""
    from pagedgen.runtime.quantization.fp8 import kernels as k
    from pagedgen.runtime.quantization.fp8.gemm import run_gemm, standalone_layer

    g = torch.Generator().manual_seed(seed)
    worst_abs = worst_rel = 0.0
    for i in range(cases):
        block = 128 if gemm == "triton_w8a8" or (gemm == "triton_tma" and i % 2) else None
        m = [1, 3, 16, 64, 100, 256, 700][i % 7]
        n = 16 * int(torch.randint(1, 40, (1,), generator=g))
        kk = 128 * int(torch.randint(1, 12, (1,), generator=g)) + (0 if block else 16 * (i % 3))
        w = torch.randn(n, kk, generator=g).to(device)
        x = torch.randn(m, kk, generator=g).to(device, torch.bfloat16)
        layer = standalone_layer(w, block)
        got = run_gemm(gemm, layer, x, block).float()
        if gemm == "triton_w8a16":
            ref = k.scaled_gemm_ref(x, None, layer.weight, layer.weight_scale, torch.float32,
                                    block)
        else:
            xq, xs = k.quantize_activations_ref(x, block)
            ref = k.scaled_gemm_ref(xq, xs, layer.weight, layer.weight_scale, torch.float32,
                                    block)
        err, rel = max_error(got, ref)
        worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
    return Row("kernel", f"fp8 GEMM {gemm}", cases, worst_abs, worst_rel, GEMM_TOL,
               worst_rel <= GEMM_TOL, "vs float32 on the same FP8 operands")


def model_row(model: str, dtype: str, device: torch.device, steps: int, seed: int) -> Row:
    """The model with ``--quantization fp8`` (the GEMMs picked by measurement, CUDA graphs on)
    against the same FP8 weights dequantized, eager."""
    import dataclasses

    from pagedgen.cli.verify.model_checks import compare, model_config, model_prompts, trace
    from pagedgen.runtime.engine.engine import Engine
    from pagedgen.runtime.quantization.fp8.gemm import ENV_GEMM

    prompts = model_prompts(seed)
    cfg = dataclasses.replace(model_config("auto", model, dtype, device, seed, True),
                              quantization="fp8")
    got = trace(Engine(cfg), prompts, steps)
    with mock.patch.dict(os.environ, {ENV_GEMM: "dequantize"}):
        ref = trace(Engine(dataclasses.replace(cfg, enforce_eager=True)), prompts, steps)
    return compare(ref, got, MODEL_TOL, f"model {model} fp8 (GEMMs by measurement, CUDA graphs)"
                   " vs its weights dequantized")
