"""Rotary position embedding: cos/sin tables (``RotaryEmbedding``, looked up once per step) and
the rotation of q and k (``ApplyRotary``: one fused Triton kernel on CUDA, with Qwen3's q/k
norm), neox-style.

The inverse frequencies of each rope type are computed the way transformers'
``modeling_rope_utils`` computes them when a model is built; written out rather than imported:
transformers' rope code takes its own config classes, whose import costs seconds of start-up
(see ``models/hf_config``). ``tests/test_hf_config.py`` checks every type here against
transformers' ``LlamaRotaryEmbedding``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.layers import fused_ops

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


def rotary_dim(rope: dict, head_dim: int) -> int:
    """The features each head rotates (all of them unless ``partial_rotary_factor``; Gemma 4's
    proportional rope turns the whole head, its last frequencies zero)."""
    if rope.get("rope_type") == "proportional":
        return head_dim
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def rope_frequencies(rope: dict, head_dim: int, max_position_embeddings: int,
                     long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[head_dim // 2]`` float32 on the CPU, attention scaling) for
    standardized rope parameters (``rope_type``, ``rope_theta`` and the type's own keys);
    ``long``: LongRoPE's frequencies past ``original_max_position_embeddings``."""
    kind, base, dim = rope["rope_type"], rope["rope_theta"], head_dim
    if kind == "longrope":
        return _longrope(rope, base, dim, max_position_embeddings, long)
    if kind == "dynamic":  # dynamic NTK at build time: sequence length = the model's maximum
        factor = rope["factor"]
        seq_len = max_position_embeddings
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2))
    if kind == "yarn":
        return _yarn(rope, base, dim, max_position_embeddings)
    if kind == "proportional":  # Gemma 4's global layers: the first frequencies of the whole
        # head's spectrum turn, the rest are zero (those features pass unturned)
        turned = int(rope.get("partial_rotary_factor", 1.0) * dim // 2)
        inv_freq = torch.zeros(dim // 2)
        inv_freq[:turned] = 1.0 / (base ** (torch.arange(0, 2 * turned, 2).float() / dim))
        return inv_freq / rope.get("factor", 1.0), 1.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv_freq /= rope["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(rope, inv_freq)
    return inv_freq, 1.0


def _llama3(rope: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's smooth interpolation between scaled low and unscaled high frequencies."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(rope: dict, base: float, dim: int, max_position_embeddings: int,
              long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5): each frequency divided by its own factor (the short
    list within the original length, the long one past it); cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original length)) unless ``attention_factor`` says."""
    old_len = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / old_len
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), \
        attention


def _yarn(rope: dict, base: float, dim: int,
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between, and an
    attention scaling of cos/sin."""
    factor = rope.get("factor")
    old_len = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all \
            else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(rope.get("beta_fast") or 32)
    high = correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # the share of each frequency kept as trained
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, attention


class RotaryEmbedding:
    """cos/sin tables of the config's rope type (Llama 3's, YaRN, ...) up to ``max_positions``.
    LongRoPE's table takes the short factors' rows within the original length and the long
    factors' past it (as vLLM does; transformers switches every position of a forward to the
    long factors once the sequence passes the original length)."""

    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device) -> None:
        rope = config.rope_parameters
        self.cos, self.sin = self._table(rope, head_dim, config.max_position_embeddings,
                                         max_positions, device, long=False)
        old_len = rope.get("original_max_position_embeddings", max_positions)
        if rope["rope_type"] == "longrope" and max_positions > old_len:
            cos, sin = self._table(rope, head_dim, config.max_position_embeddings,
                                   max_positions, device, long=True)
            self.cos[old_len:], self.sin[old_len:] = cos[old_len:], sin[old_len:]

    @staticmethod
    def _table(rope: dict, head_dim: int, max_position_embeddings: int, max_positions: int,
               device: torch.device, long: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = rope_frequencies(rope, head_dim, max_position_embeddings, long)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling  # [max_positions, head_dim]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for a step's positions (looked up once, used by every layer)."""
        with scope("rotary"):
            return self.cos[positions], self.sin[positions]

    def lookup_mrope(self, positions: torch.Tensor, sections: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for multimodal positions [3, T] (temporal, row, column):
        each column of the table takes the stream ``sections`` [head_dim] names for it."""
        with scope("rotary"):
            rows = positions[sections].T  # [T, head_dim]: each column's position
            cols = torch.arange(rows.shape[1], device=rows.device)
            return self.cos[rows, cols], self.sin[rows, cols]


def mrope_sections(mrope_section: list[int], dim: int, interleaved: bool = True
                   ) -> torch.Tensor:
    """Which position stream (0 temporal, 1 row, 2 column) turns each of a rotary table's
    ``dim`` columns: Qwen3.5's interleaved layout gives frequency ``j`` the row stream where
    ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the column's where ``j % 3 == 2`` and
    ``j < 3 * mrope_section[2]``, the temporal one elsewhere; the table's two halves alike."""
    if not interleaved:
        raise ValueError("only interleaved multimodal rotary (mrope_interleaved) is supported")
    half = torch.zeros(dim // 2, dtype=torch.long)
    for stream in (1, 2):
        half[stream:3 * mrope_section[stream]:3] = stream
    return torch.cat([half, half])


class ApplyRotary(nn.Module):
    """q [T, Hq, D], k [T, Hkv, D] rotated by a step's cos/sin; with ``norms`` (q weight, k
    weight, eps), each head RMS-normed first (Qwen3, Qwen3.5). Tables narrower than D (partial
    rotary) turn each head's first features only; the kernel writes the rest as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # ``use_fused_kernels``

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], norms: tuple = ()
                ) -> tuple[torch.Tensor, torch.Tensor]:
        op = fused_ops.rotary_fused if self.fused else fused_ops.rotary_ref
        with scope("rotary"):
            return op(q, k, *cos_sin, *norms)
