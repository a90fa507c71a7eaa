"""A MoE layer's router: softmax over each token's expert logits, then its ``top_k`` largest
(optionally renormalized). One Triton program a token on CUDA; torch's ops elsewhere (the
tests' reference)."""

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
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      RENORMALIZE: tl.constexpr):
        """One token: softmax over its experts' logits, then TOP_K rounds of arg-max."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < num_experts,
                    other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        rank = tl.arange(0, K_PAD)
        weights = tl.zeros((K_PAD,), dtype=tl.float32)
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 0)
            arg = tl.min(tl.where(p == best, offs, E_PAD), 0)  # the lowest index of the max
            weights = tl.where(rank == j, best, weights)
            ids = tl.where(rank == j, arg, ids)
            p = tl.where(offs == arg, -1.0, p)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, 0)
        tl.store(weights_ptr + t * TOP_K + rank, weights, mask=rank < TOP_K)
        tl.store(ids_ptr + t * TOP_K + rank, ids, mask=rank < TOP_K)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k),
                            E_PAD=triton.next_power_of_2(e), RENORMALIZE=renormalize)
    return weights, ids

