"""Token sampling: greedy, temperature, min-p, top-k, top-p, with a per-request seed.

Randomness is a counter-based hash of (request seed, output position, token id), turned into
Gumbel noise, so a request's tokens do not depend on which other requests share its batch, on
the batch order or on the device's random state: a run is reproducible. The samples of a
request with ``n`` > 1 each take a seed derived from the request's (``derive_seed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedgen.runtime.sampling import gumbel_kernel
from pagedgen.transfer import to_device


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0, 1) noise [B, V] as a pure function of (seed, step, token id), strictly inside
    (0, 1) in float32: the largest values are held at 1 - 2**-24, which would otherwise round
    to 1.0 and make an infinite Gumbel draw (a uniformly random token, or NaN on a -inf
    logit: a masked token)."""
    row = gumbel_kernel.row_hashes(seeds, steps)
    col = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = gumbel_kernel.hash32(row[:, None] * 0x27D4EB2F + col[None, :] * 0x165667B1 + 0x1B873593)
    return (bits.to(torch.float64) + 0.5).div_(2.0 ** 32).clamp_(max=1 - 2.0 ** -24).to(
        torch.float32)


def derive_seed(seed: int, sample_index: int) -> int:
    """Sample ``i``'s seed for a request of seed ``seed`` (sample 0 keeps the request's): a
    splitmix64 step over both, so seeds of neighbouring requests and samples look unrelated."""
    if sample_index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + sample_index) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 33  # 31 bits: a seed a JSONL line can carry


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ks: torch.Tensor  # [B] int64, 0 = off
    top_ps: torch.Tensor  # [B] float32, 1 = off
    min_ps: torch.Tensor | None  # [B] float32, 0 = off (None: off for every row)
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: output position being sampled
    all_greedy: bool
    any_top_k_or_p: bool

    @classmethod
    def build(cls, temperatures: list[float], top_ks: list[int], top_ps: list[float],
              seeds: list[int], steps: list[int], device: torch.device,
              min_ps: list[float] | None = None) -> SamplingBatch:
        def up(x: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(x, dtype, device)

        return cls(
            temperatures=up(temperatures, torch.float32), top_ks=up(top_ks, torch.int64),
            top_ps=up(top_ps, torch.float32),
            min_ps=up(min_ps, torch.float32) if min_ps and any(min_ps) else None,
            seeds=up([s & gumbel_kernel.M32 for s in seeds], torch.int64),
            steps=up(steps, torch.int64),
            all_greedy=all(t == 0 for t in temperatures),
            any_top_k_or_p=any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps))


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """-inf for the tokens whose probability is below ``min_ps`` [B] x the row's top one."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def sample(logits: torch.Tensor, sb: SamplingBatch, fused: bool | None = None) -> torch.Tensor:
    """logits [B, V] → token ids [B]. The logits may be in float32 or the model's dtype:
    greedy rows and the fused kernel read them as they are (their float32 values are exact),
    every other path upcasts them first. ``fused``: temperature sampling without top-k or
    top-p in one Triton kernel (gumbel_kernel.py; default: on CUDA with Triton)."""
    if fused is None:
        fused = logits.is_cuda and gumbel_kernel.HAVE_TRITON
    if sb.all_greedy:
        return logits.argmax(dim=-1)
    if fused and not sb.any_top_k_or_p:
        if sb.min_ps is not None:  # min-p judges the tempered distribution
            logits = logits.float()
            temps = torch.where(sb.temperatures > 0, sb.temperatures, 1.0)
            kept = apply_min_p(logits / temps[:, None], sb.min_ps)
            logits = logits.masked_fill(kept.isneginf() & (sb.temperatures[:, None] > 0),
                                        float("-inf"))
        return gumbel_kernel.gumbel_argmax(logits, sb.temperatures, sb.seeds, sb.steps)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    temps = torch.where(sb.temperatures > 0, sb.temperatures, 1.0)
    logits = logits / temps[:, None]
    if sb.min_ps is not None:
        logits = apply_min_p(logits, sb.min_ps)
    gumbel = -torch.log(-torch.log(uniform_noise(sb.seeds, sb.steps, logits.shape[-1])))
    if sb.any_top_k_or_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = (sb.top_ks[:, None] > 0) & (ranks >= sb.top_ks[:, None])
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = (probs.cumsum(dim=-1) - probs) >= sb.top_ps[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        pick = (sorted_logits + gumbel.gather(1, order)).argmax(dim=-1, keepdim=True)
        sampled = order.gather(1, pick)[:, 0]
    else:
        sampled = (logits + gumbel).argmax(dim=-1)
    return torch.where(sb.temperatures > 0, sampled, greedy)
