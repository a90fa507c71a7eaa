"""The Gated DeltaNet token mixer (Qwen3.5, Qwen3-Next): linear attention whose memory is a
recurrent state per sequence (``attention/recurrent``), not the paged KV cache.

Per token: one projection gives q, k, v (for the causal convolution) and the output gate z,
another the gates' inputs b and a; the layer's core (the convolution and the delta rule over
the sequence's state slot: ``GatedDeltaImpl``, bound by the model runner with the run's state)
gives o per value head; o is RMS-normed per head, scaled by ``silu(z)`` (``fused_ops``'
``gated_rms_norm``: one kernel on CUDA), and projected out. Checkpoints give the projections
fused per key-head group (Qwen3-Next's ``in_proj_qkvz``, ``in_proj_ba``: ``ungroup`` reorders
them) or apart (Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); both
load into the same two fused layers.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.recurrent.gated_delta import GatedDeltaImpl
from pagedgen.attention.recurrent.state import GatedDeltaSpec, LayerState
from pagedgen.profiling import scope
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment, copy_shard, full_shape, split
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.linear import (
    ColumnParallelLinear,
    MergedProjections,
    RowParallelLinear,
)
from pagedgen.runtime.quantization.config import QuantConfig, linear_method


def spec_of(config, tp_size: int = 1) -> GatedDeltaSpec:
    """The layer's state shape on one of ``tp_size`` ranks (each holds a share of the key heads
    and of the value heads they serve); the delta-rule matrix in the config's
    ``mamba_ssm_dtype`` where it names one (Qwen3.5's published configs: float32)."""
    ssm = getattr(config, "mamba_ssm_dtype", None)
    return GatedDeltaSpec(config.linear_num_key_heads // tp_size,
                          config.linear_num_value_heads // tp_size,
                          config.linear_key_head_dim, config.linear_value_head_dim,
                          config.linear_conv_kernel_dim,
                          SSM_DTYPES[ssm] if ssm is not None else None)


SSM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}


def ungroup(tensor: torch.Tensor, spec: GatedDeltaSpec, sizes: list[int]) -> list[torch.Tensor]:
    """A projection fused per key-head group (rows: for each of the ``Hk`` groups, its parts of
    ``sizes`` rows) → each part over every group, in order (Qwen3-Next's layout)."""
    grouped = tensor.reshape(spec.num_k_heads, sum(sizes), *tensor.shape[1:])
    return [p.reshape(-1, *tensor.shape[1:]) for p in grouped.split(sizes, 1)]


class CausalConv(nn.Module):
    """The depthwise convolution's weight, as checkpoints hold it: [C, 1, K] over the q, k and
    v channels; under ``-tp`` this rank's channels of each (``shards``), loaded from the whole
    tensor (three row ranges of one checkpoint tensor)."""

    def __init__(self, parts: list[Segment], taps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(sum(p.size for p in parts), 1, taps))
        self.shards = {"weight": (0, parts)}

    def checkpoint_units(self) -> dict[str, str]:
        return {"weight": "weight"}

    def load_checkpoint_tensor(self, rest: str, tensor) -> list[str]:
        if rest != "weight":
            raise KeyError(rest)
        whole, want = tensor[:], full_shape(self.weight, self.shards["weight"])
        if tuple(whole.shape) != tuple(want):
            raise ValueError(f"has shape {list(whole.shape)}; the config makes it {list(want)}")
        copy_shard(self.weight.data, self.shards["weight"], whole)
        return ["weight"]


class GatedDeltaNet(nn.Module):
    """x [T, hidden] → [T, hidden] through the layer's state slots; under ``-tp`` each rank
    holds a share of the key heads and of the value heads they serve (q, k, v, z, b, a, the
    convolution's channels, A and dt by head), ``out_proj`` row-parallel."""

    def __init__(self, config, tp: TensorParallel, quant: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.spec = s = spec_of(config, tp.size)
        full = spec_of(config)
        key, value = full.num_k_heads * full.head_k, full.num_v_heads * full.head_v
        q, v = split(key, tp, "linear-attention key features"), split(
            value, tp, "linear-attention value features")
        heads = split(full.num_v_heads, tp, "linear_num_value_heads")
        self.in_proj_qkvz = ColumnParallelLinear(
            config.hidden_size, [("q", q), ("k", q), ("v", v), ("z", v)], False,
            linear_method(quant, prefix, ["in_proj_qkv", "in_proj_z"]))
        # the gates' projections stay in the model's dtype (a few rows: nothing to gain)
        self.in_proj_ba = ColumnParallelLinear(
            config.hidden_size, [("b", heads), ("a", heads)], False)
        self.conv1d = CausalConv([Segment("q", key, q.start, q.size, 0),
                                  Segment("k", key, q.start, q.size, q.size),
                                  Segment("v", value, v.start, v.size, 2 * q.size)],
                                 s.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.shards = {"A_log": (0, [heads]), "dt_bias": (0, [heads])}
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(s.head_v))
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(value, config.hidden_size, False, tp,
                                          linear_method(quant, prefix, ["out_proj"]))
        self.impl: GatedDeltaImpl | None = None  # bound by the model runner, with the state
        self.state: LayerState | None = None
        self.fused = False  # the gated norm as one Triton kernel (``use_fused_kernels``)
        self.merged: MergedProjections | None = None  # ``merge_projections``

    def merge_projections(self) -> None:
        """After loading: both projections as one GEMM where both are unquantized."""
        self.merged = MergedProjections.of([self.in_proj_qkvz, self.in_proj_ba])

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        qkvz, ba = (self.merged(x) if self.merged is not None
                    else (self.in_proj_qkvz(x), self.in_proj_ba(x)))
        qkv, z = qkvz.split([s.conv_dim, s.num_v_heads * s.head_v], -1)
        b, a = ba.split([s.num_v_heads, s.num_v_heads], -1)
        with scope("linear_attention"):
            o = self.impl.forward(qkv, a, b, self.conv1d.weight[:, 0], None, self.A_log,
                                  self.dt_bias, self.state, metadata)
            norm = fused_ops.gated_rms_norm_fused if self.fused else \
                fused_ops.gated_rms_norm_ref
            o = norm(o, z.reshape(o.shape), self.norm.weight, self.eps)
        return self.out_proj(o.reshape(x.shape[0], -1))
