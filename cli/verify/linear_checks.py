"""`pagedgen verify` on a GPU: the linear-attention (Gated DeltaNet) kernels against the torch
reference (attention/recurrent/reference.py), whatever the attention backend: our Triton
convolution and scan, and the chunked prefills of flash-linear-attention and FlashInfer (heads of
128 on Hopper) where they run. Each
case is two steps over random layer shapes and sequences (new prompts, chunks that continue a
state, decodes), outputs and the slots' states compared."""

from __future__ import annotations

import torch

from pagedgen.cli.verify.report import BackendReport, Row, max_error
from pagedgen.cli.verify.runner import Check, single

NAME = "gated-delta"
# Max |difference| relative to the largest reference value: bf16 inputs and states, float32
# arithmetic (fla's chunks: tensor-core products)
TOL = 4e-2


def plan_linear(device: torch.device, cases: int, seed: int) -> tuple[BackendReport, list]:
    """The gated-delta report (only on CUDA: the CPU runs the reference itself)."""
    from pagedgen.attention.recurrent.gated_delta import HAVE_TRITON, chunked_unavailable

    if not HAVE_TRITON:
        return BackendReport(NAME, "skipped", "Triton is not installed"), []
    runs = [("triton", ()), ("fla", ()), ("flashinfer", (300, (128,)))]  # its heads: 128
    checks = [Check([(kernel_row, (prefill, device, cases, seed, *more))], single)
              for prefill, more in runs
              if prefill == "triton" or not chunked_unavailable(prefill, device, (),
                                                                 torch.bfloat16)]
    return BackendReport(NAME, "checked", reference="the torch reference"), checks


def _case(g: torch.Generator, device: torch.device, dtype: torch.dtype, kernels,
          longest: int, dims: tuple[int, ...]):
    """One random layer (head dims from ``dims``) over two steps, prompts of up to
    ``longest`` tokens; (outputs, ssm state, conv state)."""
    from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
    from pagedgen.attention.recurrent.gated_delta import GatedDeltaImpl
    from pagedgen.attention.recurrent.state import GatedDeltaSpec, RecurrentStates

    def pick(*values: int) -> int:
        return values[int(torch.randint(len(values), (1,), generator=g))]

    hk = pick(1, 2, 4)
    spec = GatedDeltaSpec(hk, hk * pick(1, 2), pick(*dims), pick(*dims), 4)
    n = 6
    lens = [int(torch.randint(1, longest, (1,), generator=g)) for _ in range(n)]
    # step 1: every sequence's first chunk; step 2: half continue a chunk, half decode
    first = [(slot, 0, length) for slot, length in enumerate(lens)]
    more = [(slot, length, int(torch.randint(2, max(3, longest // 3), (1,), generator=g)))
            for slot, length in enumerate(lens[:n // 2])]
    decodes = [(slot, length) for slot, length in enumerate(lens) if slot >= n // 2]
    states = RecurrentStates([spec], n + 1, dtype, device)
    c, hv = spec.conv_dim, spec.num_v_heads
    weight = (torch.randn(c, 4, generator=g) * 0.5).to(device, dtype)
    a_log = torch.rand(hv, generator=g).log().to(device)
    dt_bias = torch.randn(hv, generator=g).to(device)
    builder = AttentionMetadataBuilder(16, device)
    table = list(range(64))
    impl = GatedDeltaImpl(spec, kernels)
    outs = []
    for prefills, decs in ((first, []), (more, decodes)):
        md = builder.build([ScheduledSeq(table, ctx, k, slot) for slot, ctx, k in prefills],
                           [ScheduledSeq(table, ctx, 1, slot) for slot, ctx in decs])
        qkv = torch.randn(md.num_tokens, c, generator=g).to(device, dtype)
        ab = torch.randn(md.num_tokens, 2 * hv, generator=g).to(device, dtype)
        outs.append(impl.forward(qkv, ab[:, :hv], ab[:, hv:], weight, None, a_log, dt_bias,
                                 states.layers[0], md).float())
    layer = states.layers[0]
    return torch.cat([o.flatten() for o in outs]), layer.ssm[:n].float(), layer.conv[:n].float()


def kernel_row(prefill: str, device: torch.device, cases: int, seed: int, longest: int = 300,
               dims: tuple[int, ...] = (32, 64, 128)) -> Row:
    """``cases`` random layers through the Triton kernels (prefill tokens through ``prefill``:
    our scan or fla's chunks) against the reference on the same inputs, in bfloat16."""
    from pagedgen.attention.recurrent.gated_delta import GatedDeltaKernels

    worst_abs = worst_rel = 0.0
    for i in range(cases):
        got, ref = (_case(torch.Generator().manual_seed(seed + i), device, torch.bfloat16,
                          GatedDeltaKernels(*kinds), longest, dims)
                    for kinds in (("triton", prefill), ("torch", "torch")))
        for a, b in zip(got, ref):
            err, rel = max_error(a, b)
            worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
    what = {"triton": "our scan", "fla": "flash-linear-attention's chunks",
            "flashinfer": "FlashInfer's chunks"}[prefill]
    return Row("kernel", f"gated delta, prefill by {what}", cases, worst_abs, worst_rel, TOL,
               worst_rel <= TOL, "conv + delta rule; outputs and states vs the torch reference")
