"""Qwen2-MoE (issue 59): routed experts beside a shared expert scaled by its sigmoid gate,
against transformers' own model (fp32, CPU), sharded over two ranks, and with FP8 experts."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_checkpoint
from test_hf_equivalence import check_greedy_with_preemption, check_logits

from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe.shared import SharedExpertMoeBlock
from pagedgen.runtime.models.loader import build_model, resolve_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers(checkpoint, backend):
    """Prefill in one chunk and in chunks over cached pages."""
    check_logits(checkpoint, backend)


def test_greedy_generation_matches_transformers(checkpoint):
    check_greedy_with_preemption(checkpoint)


def test_the_sparse_layers_hold_a_gated_shared_expert(checkpoint):
    from safetensors.torch import load_file

    model = build_model(resolve_model(str(checkpoint)), "safetensors", torch.float32,
                        torch.device("cpu"))
    layers = model.model.layers
    assert isinstance(layers[0].mlp, SharedExpertMoeBlock)
    assert not isinstance(layers[1].mlp, SharedExpertMoeBlock)  # mlp_only_layers
    ckpt = load_file(str(checkpoint / "model.safetensors"))
    torch.testing.assert_close(layers[0].mlp.shared_expert_gate.weight,
                               ckpt["model.layers.0.mlp.shared_expert_gate.weight"])
    shared = layers[0].mlp.shared_expert
    torch.testing.assert_close(shared.down_proj.weight,
                               ckpt["model.layers.0.mlp.shared_expert.down_proj.weight"])


def test_one_gemm_reads_the_tokens_for_the_router_and_the_shared_expert(checkpoint):
    """After loading, the router, the shared expert's gate and its gate/up projection are one
    matrix (``MergedProjections``); where the gate/up projection is quantized only the first
    two merge. Each form gives the block's unmerged output."""
    from pagedgen.runtime.layers.linear import MergedProjections
    from pagedgen.runtime.quantization.unquantized import Unquantized

    model = build_model(resolve_model(str(checkpoint)), "safetensors", torch.float32,
                        torch.device("cpu"))
    block = model.model.layers[0].mlp
    gate_up = block.shared_expert.gate_up_proj
    assert len(block.merged.parts) == 3
    assert block.merged.weight.data_ptr() == block.gate.weight.data_ptr()
    x = torch.randn(5, block.gate.in_features, generator=torch.Generator().manual_seed(0))
    merged = block(x)
    block.merged = None
    unmerged = block(x)
    torch.testing.assert_close(merged, unmerged, atol=1e-6, rtol=1e-5)

    class Other(Unquantized):  # a method other than dense weights: not merged
        pass
    gate_up.quant_method = Other()
    block.merge_projections()
    assert len(block.merged.parts) == 2
    torch.testing.assert_close(block(x), unmerged, atol=1e-6, rtol=1e-5)
    assert MergedProjections.of([block.gate, gate_up]) is None


@pytest.mark.process
def test_tp2_equals_tp1(tmp_path_factory):
    """The shared expert sharded as a dense MLP, its partial sums reduced with the routed
    experts' (two ranks over gloo)."""
    from test_tensor_parallel import assert_tp2_equals_tp1

    assert_tp2_equals_tp1([str(make_checkpoint("qwen2_moe", tmp_path_factory.mktemp("tp")))])


def test_each_rank_holds_its_share_of_the_shared_expert(checkpoint):
    from safetensors.torch import load_file

    ckpt = load_file(str(checkpoint / "model.safetensors"))
    full = ckpt["model.layers.0.mlp.shared_expert.down_proj.weight"]
    src = resolve_model(str(checkpoint))
    for rank in range(2):
        model = build_model(src, "safetensors", torch.float32, torch.device("cpu"),
                            tp=TensorParallel(rank, 2))
        down = model.model.layers[0].mlp.shared_expert.down_proj.weight
        half = down.shape[1]
        assert torch.equal(down, full[:, rank * half:(rank + 1) * half])


def test_fp8_quantizes_routed_and_shared_experts_but_not_the_gates(checkpoint):
    from pagedgen.runtime.models.loader import model_quantization
    from pagedgen.runtime.quantization.fp8.kernels import E4M3
    from pagedgen.runtime.quantization.fp8.moe import Fp8Moe

    src = resolve_model(str(checkpoint))
    model = build_model(src, "safetensors", torch.float32, torch.device("cpu"),
                        quant=model_quantization(src, "fp8"))
    moe = model.model.layers[0].mlp
    assert isinstance(moe.experts.method, Fp8Moe)
    assert moe.shared_expert.down_proj.weight.dtype == E4M3
    assert moe.shared_expert_gate.weight.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.float32
    x = torch.randn(4, moe.gate.in_features)
    dense = build_model(src, "safetensors", torch.float32, torch.device("cpu"))
    want = dense.model.layers[0].mlp(x)
    got = moe(x)
    assert (got - want).norm() / want.norm() < 0.1  # e4m3 weights and activations
