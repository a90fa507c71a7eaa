"""The weight-format seam of MoE layers (issue 58): a format is a ``MoeMethod``, chosen as a
linear layer's method is; a new one plugs into the experts' loading and kernels without a
change to the layer."""

from __future__ import annotations

import torch
from hf_models import make_checkpoint
from torch import nn

from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe.layer import SparseMoeBlock
from pagedgen.runtime.models.loader import build_model, resolve_model
from pagedgen.runtime.quantization.base import MoeMethod
from pagedgen.runtime.quantization.fp8.moe import Fp8Moe
from pagedgen.runtime.quantization.registry import quant_config
from pagedgen.runtime.quantization.unquantized import UnquantizedMoe


class HalfMoe(MoeMethod):
    """A test format: experts kept in float16 with one float32 scale a row (as a 4-bit format
    would keep its blocks and scales), loaded through the layer's checkpoint path."""

    name = "half"
    quantized = True

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       width: int) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * width, hidden,
                                                    dtype=torch.float16), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, width,
                                                   dtype=torch.float16), requires_grad=False)
        layer.row_scale = nn.Parameter(torch.ones(num_experts, 2 * width + hidden),
                                       requires_grad=False)

    def load(self, layer, e, part, kind, tensor, shard, key) -> None:
        full = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        rows = full.abs().amax(-1, keepdim=True).clamp(min=1e-8)  # kept beside the weights
        super().load(layer, e, part, kind, (full / rows).half(), shard, key)
        w13 = layer.w13_weight.shape[1]
        at = {"gate": slice(0, w13 // 2), "up": slice(w13 // 2, w13),
              "down": slice(w13, w13 + layer.w2_weight.shape[1])}[part]
        layer.row_scale.data[e, at] = rows[:, 0].float()

    def dense(self, layer, dtype):
        w13 = layer.w13_weight.shape[1]
        s = layer.row_scale
        return ((layer.w13_weight.float() * s[:, :w13, None]).to(dtype),
                (layer.w2_weight.float() * s[:, w13:, None]).to(dtype))


def test_the_experts_method_is_chosen_as_a_linear_layers_is():
    assert quant_config(type("C", (), {})(), None, "x") is None  # dense: UnquantizedMoe
    cfg = quant_config(type("C", (), {})(), "fp8", "x")
    names = ["model.layers.0.mlp.experts.0.gate_proj"]
    assert isinstance(cfg.moe_method_for(names), Fp8Moe)
    kept = quant_config(type("C", (), {"quantization_config": {
        "quant_method": "fp8", "modules_to_not_convert": ["re:.*\\.experts\\..*"]}})(), None, "x")
    assert kept.moe_method_for(names) is None
    block = SparseMoeBlock(8, 4, 2, 16, True, TensorParallel())
    assert isinstance(block.experts.method, UnquantizedMoe)


def test_a_new_format_plugs_in_through_the_checkpoint_path(tmp_path):
    """The test format above loads a Qwen3-MoE checkpoint's experts one by one (the layer
    parses the names and shards; the method stores) and runs the same MLP as dense experts."""
    path = make_checkpoint("qwen3_moe", tmp_path / "ck")
    src = resolve_model(str(path))
    dense = build_model(src, "safetensors", torch.float32, torch.device("cpu"))
    moe = dense.model.layers[0].mlp
    x = torch.randn(5, moe.experts.w13_weight.shape[2])
    want = moe(x)
    half = SparseMoeBlock(x.shape[1], moe.experts.num_experts, moe.top_k,
                          moe.experts.w2_weight.shape[2], moe.renormalize, TensorParallel(),
                          method=HalfMoe())
    half.gate.weight.data.copy_(moe.gate.weight)
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        units = set()
        for name in f.keys():
            if name.startswith("model.layers.0.mlp.experts."):
                units |= set(half.experts.load_checkpoint_tensor(
                    name[len("model.layers.0.mlp.experts."):], f.get_tensor(name)))
    assert units == set(half.experts.checkpoint_units())
    assert half.experts.w13_weight.dtype == torch.float16
    torch.testing.assert_close(half(x), want, rtol=2e-3, atol=2e-3)
