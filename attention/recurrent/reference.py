"""The gated delta rule and its causal convolution in torch: the reference every kernel is
checked against, and the path on a CPU.

Per value head, with state S [key dim, value dim], decay ``g`` (log space, <= 0) and step
size ``beta`` in (0, 1), a token (q, k L2-normalized, q scaled by key dim ** -0.5) does::

    S = exp(g) * S;   S = S + k (beta * (v - S^T k))^T;   o = S^T q

A prefill runs it a chunk of tokens at a time (``gated_delta_chunked``): inside a chunk the
corrections ``delta`` solve one unit lower-triangular system (the WY form), and the state is
carried from chunk to chunk. The causal convolution (depthwise, ``K`` taps, SiLU after) reads
the ``K - 1`` inputs before a sequence's first new token from its conv state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in float32 from the projections ``a`` and ``b`` [T, Hv]: the decay
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [T, Hk, Dk] → [T, Hv, Dk] float32, normalized (q scaled): each key head serves
    ``Hv / Hk`` consecutive value heads."""
    rep = num_v_heads // q.shape[1]
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float())
    return q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k [L, H, Dk] (normalized, per value head), v [L, H, Dv],
    g, beta [L, H], state [H, Dk, Dv] (float32) → (o [L, H, Dv], the state after them)."""
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, L, D]
    g, beta = g.float().t(), beta.float().t()  # [H, L]
    out = torch.empty_like(v)
    s = state.float()
    for c0 in range(0, q.shape[1], chunk):
        c1 = min(c0 + chunk, q.shape[1])
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        cum = g[:, c0:c1].cumsum(-1)  # [H, C]: log decay from the chunk's start, inclusive
        n = c1 - c0
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        # (I + A) delta = beta v - beta exp(cum) K S0, A = beta_i exp(cum_i - cum_j) k_i.k_j, j < i
        a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        rhs = torch.cat([bc[..., None] * vc, (bc * cum.exp())[..., None] * kc], -1)
        solved = torch.linalg.solve_triangular(a + torch.eye(n, device=q.device), rhs,
                                               upper=False, unitriangular=True)
        u, w = solved.split([vc.shape[-1], kc.shape[-1]], -1)
        delta = u - w @ s
        out[:, c0:c1] = (cum.exp()[..., None] * qc) @ s + ((qc @ kc.transpose(1, 2)) * decay
                                                            ) @ delta
        tail = (cum[:, -1:] - cum).exp()  # [H, C]: decay from each token to the chunk's end
        s = cum[:, -1, None, None].exp() * s + (tail[..., None] * kc).transpose(1, 2) @ delta
    return out.transpose(0, 1), s


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """One token for each of N sequences: q, k [N, H, Dk] (normalized), v [N, H, Dv], g, beta
    [N, H], state [N, H, Dk, Dv] (float32) → (o [N, H, Dv], the new states)."""
    s = state.float() * g.float().exp()[..., None, None]
    k, q = k.float(), q.float()
    delta = beta.float()[..., None] * (v.float() - (s * k[..., None]).sum(-2))
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def _runs(query_lens: Sequence[int]):
    """(first, end, one token each) of the step's runs of sequences: one-token runs
    (decodes) go as one batched operation, the others one sequence at a time."""
    i = 0
    while i < len(query_lens):
        j = i + 1
        if query_lens[i] == 1:
            while j < len(query_lens) and query_lens[j] == 1:
                j += 1
        yield i, j, query_lens[i] == 1
        i = j


def gated_delta(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor, ssm: torch.Tensor, slots: Sequence[int],
                query_lens: Sequence[int], has_state: Sequence[bool], num_k_heads: int,
                head_k: int, head_v: int) -> torch.Tensor:
    """A step's gated delta rule over its sequences in order (each ``query_lens`` tokens of
    ``qkv`` [T, 2 * Hk * Dk + Hv * Dv], after the convolution): reads and writes the states
    ``ssm[slots]`` [Hv, Dv, Dk] (the slots' layout, ``state.py``; the math here runs on their
    transposes; a sequence without ``has_state`` starts from zero). → o [T, Hv, Dv] in
    ``qkv``'s dtype."""
    key = num_k_heads * head_k
    q, k, v = qkv.split([key, key, qkv.shape[-1] - 2 * key], -1)
    hv = v.shape[-1] // head_v
    q, k = _heads(q.reshape(-1, num_k_heads, head_k), k.reshape(-1, num_k_heads, head_k), hv)
    v = v.reshape(-1, hv, head_v)
    g, beta = gates(a, b, a_log, dt_bias)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    start = 0
    for i, j, single in _runs(query_lens):
        n = j - i if single else query_lens[i]
        t = slice(start, start + n)
        if single:  # one batched step
            idx = torch.tensor(list(slots[i:j]), device=ssm.device)
            s0 = ssm[idx].float() * _mask(has_state[i:j], ssm.device)[:, None, None, None]
            out[t], s1 = gated_delta_step(q[t], k[t], v[t], g[t], beta[t], s0.mT)
            ssm[idx] = s1.mT.to(ssm.dtype)
        else:
            s0 = (ssm[slots[i]].float() if has_state[i] else torch.zeros(
                ssm.shape[1:], dtype=torch.float32, device=ssm.device)).mT
            out[t], s1 = gated_delta_chunked(q[t], k[t], v[t], g[t], beta[t], s0)
            ssm[slots[i]] = s1.mT.to(ssm.dtype)
        start += n
    return out.to(qkv.dtype)


def _mask(has_state: Sequence[bool], device: torch.device) -> torch.Tensor:
    return torch.tensor([float(h) for h in has_state], device=device)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: torch.Tensor, slots: Sequence[int], query_lens: Sequence[int],
                has_state: Sequence[bool]) -> torch.Tensor:
    """The depthwise causal convolution (SiLU after) of a step's sequences in order: x [T, C],
    weight [C, K]; each sequence's ``K - 1`` earlier inputs come from ``conv[slot]`` [K - 1, C]
    (zeros without ``has_state``), which then holds its last ``K - 1`` inputs. → [T, C]."""
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    w, b = weight.float(), None if bias is None else bias.float()
    start = 0
    for i, j, single in _runs(query_lens):
        n = j - i if single else query_lens[i]
        if single:  # [N, C, K]: each decode's window
            idx = torch.tensor(list(slots[i:j]), device=conv.device)
            past = conv[idx].float().transpose(1, 2) * _mask(has_state[i:j],
                                                             conv.device)[:, None, None]
            window = torch.cat([past, x[start:start + n, :, None].float()], 2)
            y = (window * w).sum(-1) + (0 if b is None else b)
            out[start:start + n] = F.silu(y).to(x.dtype)
            conv[idx] = window[:, :, 1:].transpose(1, 2).to(conv.dtype)
        else:
            past = conv[slots[i]].float().t() if has_state[i] else x.new_zeros(
                x.shape[1], width, dtype=torch.float32)
            window = torch.cat([past, x[start:start + n].t().float()], 1)  # [C, K - 1 + n]
            y = F.conv1d(window[None], w[:, None, :], b, groups=x.shape[1])[0]
            out[start:start + n] = F.silu(y).t().to(x.dtype)
            conv[slots[i]] = window[:, window.shape[1] - width:].t().to(conv.dtype)
        start += n
    return out


def token_by_token(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, a_log: torch.Tensor, dt_bias: torch.Tensor,
                   conv: torch.Tensor, ssm: torch.Tensor, slots: Sequence[int],
                   query_lens: Sequence[int], has_state: Sequence[bool], num_k_heads: int,
                   head_k: int, head_v: int) -> torch.Tensor:
    """``causal_conv`` then ``gated_delta`` for each token alone, in order (each a one-token
    step of its sequence's slot): a token's bits are those it gets as a decode, whatever
    the step's other tokens, its prompt's chunks or a recompute (``--batch-invariant``)."""
    out, start = [], 0
    for slot, n, has in zip(slots, query_lens, has_state):
        for i in range(start, start + n):
            first = has or i > start
            row = slice(i, i + 1)
            mixed = causal_conv(qkv[row], weight, bias, conv, [slot], [1], [first])
            out.append(gated_delta(mixed, a[row], b[row], a_log, dt_bias, ssm, [slot], [1],
                                   [first], num_k_heads, head_k, head_v))
        start += n
    return torch.cat(out) if out else qkv.new_empty(0, ssm.shape[1], head_v)
