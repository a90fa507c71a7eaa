"""A MoE layer's router: softmax over each token's expert logits, then its ``top_k`` largest
(optionally renormalized). On CUDA one Triton program a few tokens, each a warp's row, so
that the reductions stay in the warp; torch's ops elsewhere (the tests' reference)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: torch's ops
    HAVE_TRITON = False


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the ``top_k`` largest: (weights float32 [T, k],
    expert ids [T, k]); ``renormalize``: the chosen weights rescaled to sum to 1. One Triton
    kernel on CUDA (``route_reference`` elsewhere)."""
    if logits.is_cuda and HAVE_TRITON:
        return route_triton(logits, top_k, renormalize)
    return route_reference(logits, top_k, renormalize)


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


if HAVE_TRITON:
    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      BT: tl.constexpr, RENORMALIZE: tl.constexpr):
        """``BT`` tokens, a row each (a warp's, so every reduction stays in the warp): softmax
        over its experts' logits, then TOP_K rounds of arg-max."""
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        offs = tl.arange(0, E_PAD)
        token = (t < num_tokens)[:, None]
        x = tl.load(logits_ptr + t[:, None] * stride_t + offs[None, :],
                    mask=token & (offs[None, :] < num_experts), other=-float("inf"))
        x = tl.where(token, x.to(tl.float32), 0.0)  # rows past the last token: no NaN
        p = tl.exp(x - tl.max(x, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        rank = tl.arange(0, K_PAD)[None, :]
        weights = tl.zeros((BT, K_PAD), dtype=tl.float32)
        ids = tl.zeros((BT, K_PAD), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 1)[:, None]
            arg = tl.min(tl.where(p == best, offs[None, :], E_PAD), 1)[:, None]  # lowest index
            weights = tl.where(rank == j, best, weights)
            ids = tl.where(rank == j, arg, ids)
            p = tl.where(offs[None, :] == arg, -1.0, p)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, 1)[:, None]
        out = t[:, None] * TOP_K + rank
        tl.store(weights_ptr + out, weights, mask=token & (rank < TOP_K))
        tl.store(ids_ptr + out, ids, mask=token & (rank < TOP_K))


ROUTE_TOKENS = 8  # tokens a program of ``_route_kernel`` (two a warp)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(-(-t // ROUTE_TOKENS),)](
            logits, weights, ids, t, e, logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
            BT=ROUTE_TOKENS, RENORMALIZE=renormalize, num_warps=4)
    return weights, ids
