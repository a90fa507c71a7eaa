"""``--batch-invariant`` (issue 97): every request's tokens and log-probabilities bit for bit
those it gets run alone, whatever the batch, its order, the prefill chunks or a preemption's
recompute.

A row's result may depend on nothing but that row. What the mode changes:
* the dense GEMMs (the model's projections and its LM head) run in tiles whose K order never
  changes (``quantization/invariant_gemm.py``), not cuBLAS's or MKL's per-shape choice;
* attention runs on the triton backend on a GPU with every token through its prefill kernel
  in short tiles (a decode is a tile of its own): its order over the keys follows neither the
  batch nor the chunk, and a recomputed token takes the path its first computation took; on a
  CPU on the eager backend, each query row alone over exactly the keys it sees
  (``attention/eager.py``);
* no cascade decode (a shared prefix's sums would follow the group); CUDA graphs as without
  the mode: the same kernels, a decode step's tiles in its graph's buffers, and the pieces of
  a step with prefills between its attention calls (their GEMMs over a bucket's padded rows:
  a row's bits follow no row count, above).
Norms, rotary and activations are per row already on a GPU (the fused Triton kernels); on a
CPU the gated activations run a row at a time (torch's CPU exp and tanh round by a value's
place in the tensor: SIMD lane or scalar tail; found by ``verify --batch-invariance``).
MoE experts run the grouped GEMM in one tile for every token count on a GPU (a token's row
sums its K in the same order wherever it sits; the plan's per-count tiles would move it) and a
token at a time on a CPU; a token's experts add in slot order. FP8 and MXFP4 experts convert
their weights to the activations' dtype in that tile's registers (no activation quantization,
whose scale would follow the batch's tokens; dequantized on a CPU). A log-probability's log-sum-exp
is one program's per row on a GPU in every run, and torch's a row at a time on a CPU
(``sampling/logprobs.py``). Linear-attention (Gated DeltaNet) layers run every token through
the scan, prompts too (a chunked prefill's sums would follow its chunks), their state kept in
float32 between steps (as a scan keeps it between a prompt's tokens); a token at a time on a
CPU (``recurrent_slots.bind_recurrent``). What it does not cover yet is refused in one line:
another expert format, more than two GPUs, MoE or FP8 weights under -tp. FP8
linear layers (``--quantization fp8`` or a checkpoint's) run bf16 activations times the e4m3
weight in one tile on a GPU (``fp8/scheme.py``'s ``invariant_fp8``).
-tp 2 gives -tp 1's bits: a row-parallel GEMM sums its K in halves on one GPU as two ranks
do, and no all-reduce is fused with the norm after it (``INVARIANT_TP``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedgen.attention.registry import unavailable_reason
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.layers.linear import MergedProjections, RowParallelLinear
from pagedgen.runtime.quantization.base import MoeMethod, QuantizationMethod
from pagedgen.runtime.quantization.fp8.moe import Fp8Moe
from pagedgen.runtime.quantization.fp8.scheme import Fp8
from pagedgen.runtime.quantization.mxfp4.moe import Mxfp4Moe
from pagedgen.runtime.quantization.unquantized import Unquantized, UnquantizedMoe

WHAT = "--batch-invariant"
# -tp 1 and -tp 2 give the same bits: a row-parallel GEMM (o_proj, down_proj) sums its K in the
# two halves two ranks hold, each half's product rounded, then added (``round(p0 + p1)``, what
# an all-reduce of two gives in any order); its bias after
INVARIANT_TP = 2
BACKENDS = ("triton", "eager")  # what keeps a token's attention invariant (auto: triton on a
# GPU, eager on a CPU, where triton's kernels run in its interpreter)


def summary(backend: str, graphs: bool, recurrent: bool = False) -> str:
    """What the summary says of a run in the mode on ``backend``: the kernels it ran, and
    whether it ran CUDA graphs (``recurrent``: the model has linear-attention layers)."""
    attention = ("each query row alone on eager's" if backend == "eager"
                 else f"every token through {backend}'s prefill kernel")
    if recurrent:
        attention += (", linear attention a token at a time" if backend == "eager"
                      else ", linear attention through the scan for every token")
    return (f"on: {attention}, dense GEMMs in invariant tiles (quantization/invariant_gemm.py), "
            f"MoE experts in one tile, row-parallel GEMMs in K halves (-tp 1 and 2 alike), "
            "no cascade decode, "
            f"{'CUDA graphs' if graphs else 'no CUDA graphs'}")


def prepared(config: EngineConfig) -> EngineConfig:
    """``config`` as the mode runs it (triton or eager, no cascade), or a
    PagedgenError for a setting it cannot keep invariant; unchanged without the mode."""
    if not config.batch_invariant:
        return config
    for bad, why in ((config.tensor_parallel_size > INVARIANT_TP,
                      f"runs on one GPU or {INVARIANT_TP} (-tp {INVARIANT_TP}: more ranks' "
                      "all-reduce would add their partial sums in an order of their own)"),
                     (config.quantization not in (None, "fp8"),
                      "runs unquantized or FP8 weights only"),
                     (config.quantization is not None and config.tensor_parallel_size > 1,
                      "runs FP8 weights on one GPU only"),
                     (config.backend not in ("auto", *BACKENDS),
                      f"runs on the triton or eager backend, not {config.backend}")):
        if bad:
            raise PagedgenError(f"{WHAT} {why}")
    device = config.torch_device()
    backend = config.backend if config.backend != "auto" else \
        "triton" if device.type == "cuda" else "eager"
    why = unavailable_reason(backend, device)
    if why:
        raise PagedgenError(f"{WHAT} runs on the {backend} backend, which cannot run here: "
                            f"{why}")
    return dataclasses.replace(config, backend=backend, cascade_attention=False,
                               cascade_mixed_steps=False)


def apply(runner: Any) -> None:
    """The mode on ``runner``'s model and attention states: invariant GEMMs, every token
    through the prefill kernel; a PagedgenError for a model it does not cover."""
    modules = list(runner.model.modules())
    methods = [m for mod in modules
               for m in (getattr(mod, "quant_method", None), getattr(mod, "method", None))
               if isinstance(m, QuantizationMethod | MoeMethod)]
    quantized = sorted({type(m).__name__ for m in methods
                        if not isinstance(m, Unquantized | UnquantizedMoe | Fp8 | Fp8Moe
                                          | Mxfp4Moe)})
    if quantized:  # a format whose kernels have not been checked in the mode's one tile
        raise PagedgenError(f"{WHAT} runs unquantized, FP8 and MXFP4 weights only (this "
                            f"checkpoint's are {', '.join(quantized)})")
    if runner.tp.size > 1 and any(isinstance(m, Fp8) for m in methods):
        raise PagedgenError(f"{WHAT} runs FP8 weights on one GPU only")
    if runner.tp.size > 1 and any(isinstance(m, MoeMethod) for m in methods):
        raise PagedgenError(f"{WHAT} runs MoE models on one GPU only (under -tp a token's "
                            "experts would add across ranks in another order)")
    for layer in modules:  # dense ones: FP8 weights run on one GPU only
        if isinstance(layer, RowParallelLinear) and isinstance(layer.quant_method, Unquantized):
            layer.quant_method.k_parts = INVARIANT_TP // runner.tp.size
    # what has a ``batch_invariant`` switch: dense linear methods, projections merged into one
    # GEMM (a MoE block's router and shared expert), the LM head, MoE experts, the gated
    # activations (a row at a time on a CPU), the attention states
    merged = [m.merged for m in modules
              if isinstance(getattr(m, "merged", None), MergedProjections)]
    for obj in [*modules, *methods, *merged, *runner.attn_states]:
        if hasattr(obj, "batch_invariant"):
            obj.batch_invariant = True
