"""gpt-oss (``runtime/models/families/gpt_oss.py``): random tiny checkpoints written with
transformers' ``GptOssConfig`` (biases everywhere, attention sinks, alternating windows, a
clamped SwiGLU in biased experts, YaRN rope) give transformers' logits and greedy tokens in
float32 with no options but the device and dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import make_checkpoint, pack_mxfp4
from test_hf_equivalence import check_greedy_with_preemption, check_logits

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.layers.moe.act import clamped_swiglu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers(checkpoint, backend):
    """Prefill whole and in chunks of 11 (past the 12-token window, over cached pages)."""
    check_logits(checkpoint, backend)


def test_greedy_generation_matches_transformers_through_preemption(checkpoint):
    check_greedy_with_preemption(checkpoint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.kernels
def test_grouped_gemm_kernels_take_biases_and_the_clamped_swiglu(dtype):
    """The first GEMM writes gate and up, the biases and the clamp run between, the down
    bias joins each slot weighted: the per-expert loop's result (Triton's interpreter)."""
    from test_moe import INTERPRETED_ONLY, _experts

    from pagedgen.runtime.layers.moe import kernels as mk
    if INTERPRETED_ONLY.args[0]:
        pytest.skip(INTERPRETED_ONLY.kwargs["reason"])
    x, w13, w2, weights, chosen = _experts(37, 8, 3, 40, 24, dtype)
    g = torch.Generator().manual_seed(1)
    b13, b2 = torch.randn(8, 48, generator=g), torch.randn(8, 40, generator=g)
    act = clamped_swiglu(1.702, 0.3)
    ref = mk.reference(x.float(), w13.float(), w2.float(), weights, chosen, act, b13, b2)
    tiles = mk.Tiles(32, 32, 32)
    got = mk.fused_experts(x, w13, w2, weights, chosen, (tiles, tiles), None, act=act,
                           b13=b13, b2=b2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.kernels
def test_the_model_in_the_grouped_gemm_kernels_matches_transformers(checkpoint):
    """gpt-oss's experts through the kernels a GPU runs (Triton's interpreter)."""
    from test_moe import INTERPRETED_ONLY, _moe_kernels
    if INTERPRETED_ONLY.args[0]:
        pytest.skip(INTERPRETED_ONLY.kwargs["reason"])
    check_logits(checkpoint, "eager", chunks=(11,), setup=_moe_kernels)


def test_sinks_and_layout_are_loaded_as_transformers_holds_them(checkpoint):
    """The sinks land in the attention layers; the experts' interleaved gate/up columns are
    split as transformers splits them (gate at even columns)."""
    from safetensors.torch import load_file
    eng = Engine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32",
                              backend="eager", num_blocks=16))
    model = eng.runner.model
    tensors = load_file(str(checkpoint / "model.safetensors"))
    attn = model.model.layers[1].self_attn.attn
    assert attn.spec.sinks and torch.equal(attn.sinks, tensors["model.layers.1.self_attn.sinks"])
    assert attn.impl.sinks is attn.sinks
    experts = model.model.layers[0].mlp.experts
    gate_up = tensors["model.layers.0.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    width = gate_up.shape[2] // 2
    assert torch.equal(experts.w13_weight[2, :width], gate_up[2, :, 0::2].t())
    assert torch.equal(experts.w13_weight[2, width:], gate_up[2, :, 1::2].t())
    assert [s.sliding_window for s in model.layer_specs(model.config)] == [12, None, 12]


def test_auto_takes_a_backend_that_runs_sinks(checkpoint):
    """``auto`` passes over backends without sinks (FlashInfer's and FA4's, on a GPU): the
    reason ``pagedgen backends`` gives."""
    from pagedgen.attention.flashinfer import FlashInferBackend
    from pagedgen.attention.registry import backend_for_model
    from pagedgen.runtime.models import registry
    from pagedgen.runtime.models.loader import resolve_model

    cfg = resolve_model(str(checkpoint)).hf_config
    specs = registry.model_class(cfg).layer_specs(cfg)
    cpu = torch.device("cpu")
    assert backend_for_model("auto", cpu, specs, torch.float32, torch.float32, "m").supports_sinks
    spec = dataclasses.replace(specs[0], head_size=64)  # the published head size
    assert FlashInferBackend.check_layer(spec, torch.bfloat16) == "attention sinks not supported"


def test_mxfp4_dequantizes_as_transformers_does():
    """Our e2m1 + e8m0 decoding against transformers' (random codes and exponents), and
    ``quantize`` its inverse on values it can hold."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, rows, 64]
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, 64, rows]
    assert torch.equal(ours, want.transpose(1, 2))
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(ours), torch.float32), ours)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory):
    """(the tiny checkpoint with its experts packed to MXFP4, the same values dequantized:
    transformers' reference) (``hf_models.pack_mxfp4``)."""
    return pack_mxfp4(checkpoint, tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _mxfp4_logits(mxfp4_checkpoint, setup=None) -> None:
    from test_hf_equivalence import engine, hf_model, ids, prefill_logits
    path, ref = mxfp4_checkpoint
    prompt = ids(20)
    with torch.no_grad():
        want = hf_model(ref)(torch.tensor([prompt])).logits[0]
    eng = engine(path, "eager")
    experts = eng.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.uint8  # kept 4-bit: two codes a byte
    assert experts.w13_weight.shape[2] * 2 == eng.runner.model.config.hidden_size
    if setup is not None:
        setup(eng)
    got = prefill_logits(eng, prompt, 20)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_an_mxfp4_checkpoint_equals_transformers_dequantized(mxfp4_checkpoint):
    """Loaded as it is, the experts stay 4-bit; the CPU's loop dequantizes them: transformers'
    logits of the same values."""
    _mxfp4_logits(mxfp4_checkpoint)


@pytest.mark.kernels
def test_an_mxfp4_checkpoint_in_the_grouped_gemm_kernels_equals_transformers(mxfp4_checkpoint):
    """The 4-bit experts through the kernels a GPU runs (Triton's interpreter)."""
    from test_moe import INTERPRETED_ONLY, _moe_kernels
    if INTERPRETED_ONLY.args[0]:
        pytest.skip(INTERPRETED_ONLY.kwargs["reason"])
    _mxfp4_logits(mxfp4_checkpoint, _moe_kernels)


@pytest.mark.process
def test_tp2_equals_tp1_dense_and_mxfp4(checkpoint, mxfp4_checkpoint):
    """Two gloo ranks: each holds its query heads' sinks, its rows of gate/up (and of their
    biases), its columns of down (MXFP4: in whole scale groups); rank 0 alone adds the down
    bias. The greedy trace equals one rank's."""
    from test_fp8 import assert_tp2_trace_equals_tp1
    assert_tp2_trace_equals_tp1(str(checkpoint), "gpt_oss", steps=4)
    assert_tp2_trace_equals_tp1(str(mxfp4_checkpoint[0]), "gpt_oss mxfp4", steps=4)


def test_tp_that_splits_an_mxfp4_group_is_refused_with_the_reason(mxfp4_checkpoint):
    from pagedgen.runtime.models import registry
    from pagedgen.runtime.models.loader import resolve_model

    cfg = resolve_model(str(mxfp4_checkpoint[0])).hf_config  # intermediate_size 64
    assert registry.model_class(cfg).tensor_parallel_error(cfg, 2) is None
    assert "in whole MXFP4 groups of 32" in registry.model_class(cfg).tensor_parallel_error(
        cfg, 4)


def test_an_unpaired_mxfp4_tensor_is_a_one_line_error(mxfp4_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / "unpaired"
    shutil.copytree(mxfp4_checkpoint[0], path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(PagedgenError, match="down_proj_blocks' has no MXFP4 partner"):
        Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                            num_blocks=16))


@pytest.mark.parametrize("preset,layers,experts", [("gpt-oss-20b", 24, 32),
                                                    ("gpt-oss-120b", 36, 128)])
def test_the_presets_read_as_transformers_would(preset, layers, experts):
    """transformers' defaults (those of 120b; 20b with 24 layers and 32 experts), experts in
    MXFP4."""
    import transformers as tf

    from pagedgen.runtime.models.loader import resolve_model
    ours = resolve_model(preset).hf_config
    assert ours.quantization_config == {"quant_method": "mxfp4"}
    ref = tf.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                  "num_key_value_heads", "sliding_window", "num_experts_per_tok",
                  "swiglu_limit", "swiglu_alpha", "layer_types", "rope_parameters",
                  "attention_bias", "vocab_size"):
        assert getattr(ours, field) == getattr(ref, field), field


def test_dummy_mxfp4_experts_are_the_dense_dummy_experts_quantized(mxfp4_checkpoint):
    """Dummy weights for an MXFP4 config (the presets): each expert drawn as the dense model
    draws it, then stored as a checkpoint's MXFP4 would be; the biases zero."""
    from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4
    path, ref = mxfp4_checkpoint

    def experts(model):
        eng = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                  backend="eager", num_blocks=16, load_format="dummy"))
        return eng.runner.model.model.layers[1].mlp.experts

    dense, packed = experts(ref), experts(path)
    for w, codes, exps in ((dense.w13_weight, packed.w13_weight, packed.w13_weight_scale),
                           (dense.w2_weight, packed.w2_weight, packed.w2_weight_scale)):
        blocks, scales = mxfp4.quantize(w)
        assert torch.equal(codes, mxfp4.kernel_codes(blocks.flatten(-2)))
        assert torch.equal(exps, scales.transpose(-1, -2))
    assert not packed.w13_bias.any() and not packed.w2_bias.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.kernels
def test_bias_and_clamped_swiglu_kernel_equals_the_torch_ops(dtype):
    """One program per slot: its expert's gate and up biases added, the clamp and the
    activation in float32 (Triton's interpreter), against torch's ops in float32; a width
    past one block. Gemma 4's GeGLU by the same kernel."""
    from test_moe import INTERPRETED_ONLY

    from pagedgen.runtime.layers.moe import act as moe_act
    if INTERPRETED_ONLY.args[0]:
        pytest.skip(INTERPRETED_ONLY.kwargs["reason"])
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(9, 2 * 1500, generator=g).to(dtype)
    bias = torch.randn(4, 2 * 1500, generator=g)
    expert = torch.randint(0, 4, (9,), generator=g)
    act = clamped_swiglu(1.702, 0.7)
    want = act(*(gate_up.float() + bias[expert]).chunk(2, -1))
    got = moe_act.bias_and_act(gate_up, act, bias, expert)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    no_bias = moe_act.bias_and_act(gate_up, act, None, expert)
    torch.testing.assert_close(no_bias.float(), act(*gate_up.float().chunk(2, -1)), atol=tol,
                               rtol=tol)
    geglu = moe_act.bias_and_act(gate_up, moe_act.geglu, None, expert)  # Gemma 4's experts'
    torch.testing.assert_close(geglu.float(), moe_act.geglu(*gate_up.float().chunk(2, -1)),
                               atol=tol, rtol=tol)
    with_bias = moe_act.bias_and_act(gate_up, moe_act.geglu, bias, expert)
    torch.testing.assert_close(with_bias.float(), moe_act.geglu(
        *(gate_up.float() + bias[expert]).chunk(2, -1)), atol=tol, rtol=tol)
