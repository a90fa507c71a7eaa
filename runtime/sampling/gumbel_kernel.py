"""Temperature sampling (no top-k / top-p) as one Triton kernel: each row's tokens hashed into
Gumbel noise, added to the tempered logits and reduced to the argmax in one pass over the row.

The torch path (``sampler.sample``) makes the same noise from the same counter-based hash, as a
chain of int64 and float64 tensors the size of the logits: at 256 rows x 128k tokens each pass
is a quarter of a gigabyte, about 2.5 ms a decode step on an H100. Here the hash runs in
registers and the logits are read once. The noise is bit-identical (the same integer hash, the
same float64 rounding to a float32 uniform); the logarithms are the kernel's, so a row whose top
two candidates lie within float32 rounding may pick the other one.
"""

from __future__ import annotations

import importlib.util

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
BLOCK = 2048

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _hash32(x, m32):
        x = x & m32
        x = ((x >> 16) ^ x) * 0x45D9F3B & m32
        x = ((x >> 16) ^ x) * 0x45D9F3B & m32
        return (x >> 16) ^ x

    @triton.jit
    def gumbel_argmax_kernel(Logits, stride_l, Temps, RowHash, Out, V,
                             BLOCK_V: tl.constexpr):
        """Out[r] = argmax over tokens of Logits[r] / t + Gumbel(hash(RowHash[r], token)), or
        of Logits[r] where the temperature t is 0 (greedy); the first index on ties."""
        r = tl.program_id(0)
        t = tl.load(Temps + r)
        sampled = t > 0
        div = tl.where(sampled, t, 1.0)
        row = tl.load(RowHash + r)
        m32 = (tl.full((), 1, tl.int64) << 32) - 1
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int64)
        for start in range(0, V, BLOCK_V):
            col = start + tl.arange(0, BLOCK_V)
            ok = col < V
            x = tl.load(Logits + r * stride_l + col, mask=ok, other=float("-inf"))
            x = x.to(tl.float32)
            bits = _hash32(row * 0x27D4EB2F + col.to(tl.int64) * 0x165667B1 + 0x1B873593, m32)
            u = (bits.to(tl.float64) + 0.5) / 4294967296.0
            u = tl.minimum(u, 1.0 - 1.0 / 16777216.0).to(tl.float32)
            g = -tl.log(-tl.log(u))
            v = tl.where(sampled, x / div + g, x)
            v = tl.where(ok, v, float("-inf"))
            m = tl.max(v, 0)
            i = tl.argmax(v, 0).to(tl.int64) + start
            take = m > best
            best_i = tl.where(take, i, best_i)
            best = tl.where(take, m, best)
        tl.store(Out + r, best_i)


M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (int64 tensors holding values < 2**32; products stay < 2**63):
    the sampler's noise, in torch (the kernel's ``_hash32`` is the same)."""
    x = x & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    return (x >> 16) ^ x


def row_hashes(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's hash of (seed, step): the noise's row term."""
    return hash32(hash32(seeds) ^ hash32(steps * 0x9E3779B1 + 0x7F4A7C15))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor) -> torch.Tensor:
    """Token ids [B] for ``logits`` [B, V] (float32, or a 16-bit dtype read as float32): sampled
    at each row's temperature with its seed's noise at its step, greedy where the temperature
    is 0."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    gumbel_argmax_kernel[(b,)](logits, logits.stride(0), temperatures.float().contiguous(),
                               row_hashes(seeds, steps).contiguous(), out, v, BLOCK_V=BLOCK)
    return out
