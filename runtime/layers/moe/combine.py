"""The last step of a MoE layer: each token's ``top_k`` expert outputs summed into its hidden
state. The outputs are slot rows (slot ``t * top_k + j``, ``moe.kernels``), in slot order or,
with ``rows``, wherever a sorted layout left them, and weighted already or, with ``weights``,
here; with ``bias`` [E, H] and ``experts`` (each slot's expert, slot order), each row plus its
expert's bias before the weighting (gpt-oss's down bias); with ``gated`` (x, logit), a shared
expert's output ``x`` scaled by ``sigmoid(logit)`` and added after (Qwen2-MoE's and
Qwen3.5-MoE's shared expert, each op rounded to the activation dtype as transformers' torch ops
round it). One Triton kernel where Triton runs: a program per token and column block reads the
token's rows once and adds them in float32, where torch would scale, scatter back to slot order,
reduce over the middle dimension of [T, top_k, H] and add the shared expert in a kernel each;
torch's ops otherwise (the tests' reference)."""

from __future__ import annotations

import torch

from pagedgen.runtime.quantization.fp8.kernels import INTERPRETED
from pagedgen.runtime.quantization.invariant_gemm import by_rows

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def slot_sum_reference(src: torch.Tensor, top_k: int, out: torch.Tensor | None = None,
                       rows: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None,
                       experts: torch.Tensor | None = None,
                       gated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    slots = src if rows is None else src.index_select(0, rows.long())
    if bias is not None:
        slots = (slots.float() + bias.index_select(0, experts.reshape(-1).long()).float()
                 ).to(src.dtype)
    if weights is not None:
        slots = (slots.float() * weights.reshape(-1, 1).float()).to(src.dtype)
    out = torch.sum(slots.view(-1, top_k, src.shape[1]), dim=1, out=out)
    return out if gated is None else add_gated(out, *gated)


def add_gated(out: torch.Tensor, x: torch.Tensor, logit: torch.Tensor,
              rowwise: bool = False) -> torch.Tensor:
    """``out += sigmoid(logit) * x`` in place (``out``, ``x`` [T, H], ``logit`` [T, 1]), each
    op rounded to the activation dtype (transformers' ``Qwen2MoeSparseMoeBlock``);
    ``rowwise``: a token's sigmoid on its own (torch's CPU exp rounds by a value's place)."""
    gate = by_rows(torch.sigmoid, logit) if rowwise else torch.sigmoid(logit)
    return out.add_(gate * x)


if HAVE_TRITON:
    @triton.jit
    def _slot_sum_kernel(Src, Rows, Weights, Bias, Experts, Out, X, Logit, width, stride_src,
                         stride_out, stride_x, stride_logit, TOP_K: tl.constexpr,
                         GATHER: tl.constexpr, WEIGHTED: tl.constexpr, BIASED: tl.constexpr,
                         GATED: tl.constexpr, BLOCK: tl.constexpr):
        """Token ``pid 0``, columns block ``pid 1``: the sum of its slots' rows (then, GATED,
        plus ``sigmoid(logit) * x``, rounded where ``add_gated`` rounds)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            row = t * TOP_K + j
            if GATHER:
                row = tl.load(Rows + row).to(tl.int64)
            v = tl.load(Src + row * stride_src + cols, mask=ok, other=0.0).to(tl.float32)
            if BIASED:  # rounded to the rows' dtype, as a GEMM epilogue would write it
                e = tl.load(Experts + t * TOP_K + j).to(tl.int64)
                v += tl.load(Bias + e * width + cols, mask=ok, other=0.0).to(tl.float32)
                v = v.to(Src.dtype.element_ty).to(tl.float32)
            if WEIGHTED:
                v = v * tl.load(Weights + t * TOP_K + j)
            acc += v
        if GATED:
            dtype = Out.dtype.element_ty
            g = tl.load(Logit + t * stride_logit).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            x = tl.load(X + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
            acc = acc.to(dtype).to(tl.float32) + (gate * x).to(dtype).to(tl.float32)
        tl.store(Out + t * stride_out + cols, acc.to(Out.dtype.element_ty), mask=ok)


def slot_sum(src: torch.Tensor, top_k: int, out: torch.Tensor | None = None,
             rows: torch.Tensor | None = None, weights: torch.Tensor | None = None,
             bias: torch.Tensor | None = None,
             experts: torch.Tensor | None = None,
             gated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * (src[rows[t * top_k + j]] + bias[experts[t, j]])``
    ([T, H], ``src``'s dtype; ``rows`` default: slot order; ``weights`` default: 1;
    ``bias`` [E, H] contiguous, default none), summed in float32; ``gated`` (x [T, H],
    logit [T, 1]): plus ``sigmoid(logit[t]) * x[t]`` (``add_gated``)."""
    tokens, width = src.shape[0] // top_k, src.shape[1]
    out = src.new_empty(tokens, width) if out is None else out
    kernel = (HAVE_TRITON and (src.is_cuda or INTERPRETED) and src.stride(1) == 1
              and out.stride(1) == 1 and (gated is None or gated[0].stride(1) == 1))
    if not kernel:
        return slot_sum_reference(src, top_k, out, rows, weights, bias, experts, gated)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        weights = weights.reshape(-1).float() if weights is not None else None
        x, logit = gated if gated is not None else (src, src)
        _slot_sum_kernel[(tokens, triton.cdiv(width, block))](
            src, rows if rows is not None else src, weights if weights is not None else src,
            bias if bias is not None else src, experts if experts is not None else src,
            out, x, logit, width, src.stride(0), out.stride(0), x.stride(0), logit.stride(0),
            TOP_K=top_k, GATHER=rows is not None, WEIGHTED=weights is not None,
            BIASED=bias is not None, GATED=gated is not None, BLOCK=block)
    return out
