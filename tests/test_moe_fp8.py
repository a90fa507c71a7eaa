"""FP8 experts: the grouped GEMM kernels on e4m3 weights (converted in registers, or with
activations quantized per token) against the per-expert loop on the same weights dequantized
(Triton interpreter on the CPU); MoE checkpoints in every FP8 format against their weights
dequantized; online and dummy quantization; -tp 2; bad scales named."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoints import write_fp8
from hf_models import make_checkpoint
from test_fp8 import PROMPTS, assert_tp2_trace_equals_tp1, config
from test_moe import INTERPRETED_ONLY, KINDS, _experts

from pagedgen.cli.verify.model_checks import compare, trace
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe.layer import FusedMoE
from pagedgen.runtime.quantization.fp8 import kernels as k


def fp8_input_reference(x, w13, w2, scales, weights, ids) -> torch.Tensor:
    """Each GEMM's input quantized per token (and K group), then the per-slot loop on the
    dequantized weights, in float32."""
    d13, d2 = scales.dequantize(w13, w2, torch.float32)
    g = scales.group_k

    def through_fp8(v: torch.Tensor) -> torch.Tensor:
        q, s = k.quantize_activations_ref(v, g)
        return k.dequantize(q, s, torch.float32, g if s.shape[1] > 1 else None)

    xd = through_fp8(x.float())
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t, j in ids.new_ones(ids.shape).nonzero().tolist():
        e = int(ids[t, j])
        gate, up = (xd[t:t + 1] @ d13[e].t()).chunk(2, dim=-1)
        inter = (F.silu(gate) * up).to(x.dtype).float()
        out[t] += weights[t, j] * (through_fp8(inter) @ d2[e].t())[0]
    return out


@INTERPRETED_ONLY
@pytest.mark.parametrize("fp8_input", [False, True])
@pytest.mark.parametrize("group_k,swap,tma", [(None, False, False), (None, True, False),
                                              (32, False, False), (32, False, True)],
                         ids=["per-row", "per-row-weights-left", "k-groups", "k-groups-tma"])
@pytest.mark.parametrize("t,e,top_k,h,i,block_m", [
    (1, 8, 2, 64, 96, 16),    # one token, most experts without one; I not a multiple of 64
    (37, 8, 3, 96, 64, 32),   # full and partial blocks, H three K groups
    (20, 16, 16, 64, 32, 16)])  # every token to every expert
@pytest.mark.kernels
def test_fp8_grouped_gemm_kernels_equal_the_dequantized_loop(t, e, top_k, h, i, block_m,
                                                              group_k, swap, tma, fp8_input):
    x, w13, w2, weights, ids = _experts(t, e, top_k, h, i)
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, group_k)
    tiles = mk.Tiles(block_m, 32, 32, swap=swap, tma=tma)
    got = mk.fused_experts(x, q13, q2, weights, ids, (tiles, tiles), scales=scales,
                           native=fp8_input)
    if fp8_input:
        ref = fp8_input_reference(x, q13, q2, scales, weights, ids)
        tol = 2e-3  # an activation on an e4m3 rounding tie may round the other way
    else:
        ref = mk.reference(x, *scales.dequantize(q13, q2, torch.float32), weights, ids)
        tol = 1e-5
    assert (got - ref).abs().max() <= tol * ref.abs().max()


@INTERPRETED_ONLY
@pytest.mark.kernels
def test_fp8_kernels_take_fp16_activations():
    x, w13, w2, weights, ids = _experts(9, 8, 2, 64, 64, torch.float16)
    q13, q2, scales = mk.ExpertScales.quantize(w13.float(), w2.float(), 32)
    tiles = mk.Tiles(16, 32, 32)
    got = mk.fused_experts(x, q13, q2, weights, ids, (tiles, tiles), scales=scales)
    ref = mk.reference(x.float(), *scales.dequantize(q13, q2, torch.float32), weights, ids)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@INTERPRETED_ONLY
@pytest.mark.parametrize("group_k,fp8_input", [(16, False), (32, False), (32, True)])
@pytest.mark.kernels
def test_a_k_tile_wider_than_the_scale_groups_narrows_to_them(group_k, fp8_input):
    """Block scales of 16 or 32 columns (the config allows them) under 64-wide K tiles: each K
    tile must lie in one group, so the tile narrows to the group."""
    x, w13, w2, weights, ids = _experts(9, 4, 2, 64, 64)
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, group_k)
    t = mk.Tiles(16, 32, 64)
    got = mk.fused_experts(x, q13, q2, weights, ids, (t, t), scales=scales, native=fp8_input)
    ref = fp8_input_reference(x, q13, q2, scales, weights, ids) if fp8_input else \
        mk.reference(x, *scales.dequantize(q13, q2, torch.float32), weights, ids)
    assert (got - ref).abs().max() <= 2e-3 * ref.abs().max()


@INTERPRETED_ONLY
@pytest.mark.kernels
def test_swapped_tiles_refuse_k_group_scales_in_one_line():
    x, w13, w2, weights, ids = _experts(9, 4, 2, 64, 64)
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, 32)
    t = mk.Tiles(16, 32, 32, swap=True)
    with pytest.raises(ValueError, match="one scale per weight row"):
        mk.fused_experts(x, q13, q2, weights, ids, (t, t), scales=scales)


# ---- checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=KINDS)
def moe_dense(request, tmp_path_factory):
    return request.param, make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _experts_of(eng: Engine) -> list[FusedMoE]:
    return [m for m in eng.runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("fmt,block", [("hf-block", (32, 32)), ("hf-block", (128, 128)),
                                       ("ct-channel", None), ("hf-tensor-static", None),
                                       ("ct-tensor-static", None)])
def test_fp8_moe_checkpoint_equals_its_weights_dequantized(moe_dense, fmt, block, tmp_path):
    """Every FP8 format, block scales with partial edge blocks (128 over 48- and 64-wide
    experts), the experts' static input scales read and left unused."""
    kind, dense = moe_dense
    ckpt = write_fp8(dense, tmp_path / fmt, fmt, block=block or (128, 128))
    eng = Engine(config(str(ckpt)))
    layers = _experts_of(eng)
    assert layers and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in layers)
    assert all(m.gate.weight.dtype == torch.float32  # the router stays dense
               for m in eng.runner.model.modules() if hasattr(m, "experts"))
    got = trace(eng, PROMPTS, 6)
    ref = trace(Engine(config(str(ckpt) + "-dequantized")), PROMPTS, 6)
    row = compare(ref, got, 1e-5, fmt)
    assert row.worst_abs < 1e-4 and got[1] == ref[1], row


@INTERPRETED_ONLY
@pytest.mark.kernels
def test_fp8_moe_checkpoint_through_the_kernels(moe_dense, tmp_path):
    """The same, with the MoE layers in the grouped GEMM kernels (Triton's interpreter)."""
    kind, dense = moe_dense
    ckpt = write_fp8(dense, tmp_path / "b", "hf-block", block=(32, 32))
    eng = Engine(config(str(ckpt)))
    for m in _experts_of(eng):
        m.use_triton = True
    got = trace(eng, PROMPTS[:2], 3)
    ref = trace(Engine(config(str(ckpt) + "-dequantized")), PROMPTS[:2], 3)
    row = compare(ref, got, 1e-5, "kernels")
    assert row.worst_abs < 1e-4 and got[1] == ref[1], row


def test_online_fp8_experts_error_is_bounded_per_row(moe_dense):
    kind, dense = moe_dense
    dense_eng = Engine(config(str(dense)))
    fp8_eng = Engine(config(str(dense), quantization="fp8"))
    for ref, got in zip(_experts_of(dense_eng), _experts_of(fp8_eng)):
        assert got.w13_weight.dtype == torch.float8_e4m3fn
        for w, q, s in ((ref.w13_weight, got.w13_weight, got.w13_weight_scale),
                        (ref.w2_weight, got.w2_weight, got.w2_weight_scale)):
            w = w.float()
            deq = q.float() * s  # one scale per row
            # per output row: error at most 1/16 of the row's largest value
            assert ((deq - w).abs().amax(-1) <= w.abs().amax(-1) / 16).all()
    row = compare(trace(dense_eng, PROMPTS, 6), trace(fp8_eng, PROMPTS, 6), 0.1, "online")
    assert row.passed, row


def test_dummy_fp8_experts_are_the_dense_dummy_experts_quantized(moe_dense):
    model = str(moe_dense[1])  # its config; the weights drawn
    dense = _experts_of(Engine(config(model, load_format="dummy")))[0]
    fp8 = _experts_of(Engine(config(model, load_format="dummy", quantization="fp8")))[0]
    for w, q, s in ((dense.w13_weight, fp8.w13_weight, fp8.w13_weight_scale),
                    (dense.w2_weight, fp8.w2_weight, fp8.w2_weight_scale)):
        want_q, want_s = k.quantize_weight(w.float().reshape(-1, w.shape[2]))
        assert torch.equal(q.reshape(-1, w.shape[2]).float(), want_q.float())
        assert torch.equal(s.reshape(-1, 1), want_s)


@pytest.mark.process
def test_tp2_fp8_moe_checkpoint_equals_tp1(tmp_path):
    # per-channel scales; 16 x 16 blocks (Mixtral's 64-wide experts: 32 columns a rank)
    for kind, fmt in (("qwen3_moe", "ct-channel"), ("mixtral", "hf-block")):
        dense = make_checkpoint(kind, tmp_path / kind)
        ckpt = write_fp8(dense, tmp_path / f"{kind}-q", fmt, block=(16, 16))
        assert_tp2_trace_equals_tp1(str(ckpt), kind, steps=4)


def test_misfit_and_missing_expert_scales_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from pagedgen.errors import PagedgenError
    dense = make_checkpoint("qwen3_moe", tmp_path / "dense")
    ckpt = write_fp8(dense, tmp_path / "q", "hf-block", block=(32, 32))
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    for change, message in ((lambda t: t.update({name: t[name][:1]}), "has shape"),
                            (lambda t: t.pop(name), "missing")):
        bad = dict(tensors)
        change(bad)
        save_file(bad, str(ckpt / "model.safetensors"))
        with pytest.raises(PagedgenError, match=message) as e:
            Engine(config(str(ckpt)))
        assert name in str(e.value) and "\n" not in str(e.value)



def test_an_fp8_router_or_dense_experts_given_fp8_tensors_are_refused(tmp_path):
    """The router stays dense (an FP8 one would load without its scale), and so do experts the
    config leaves dense."""
    from safetensors.torch import load_file, save_file

    from pagedgen.errors import PagedgenError
    dense = make_checkpoint("qwen3_moe", tmp_path / "dense")
    ckpt = write_fp8(dense, tmp_path / "q", "ct-channel")
    tensors = load_file(str(ckpt / "model.safetensors"))
    router = "model.layers.0.mlp.gate.weight"
    bad = {**tensors, router: tensors[router].to(torch.float8_e4m3fn)}
    save_file(bad, str(ckpt / "model.safetensors"))
    with pytest.raises(PagedgenError, match=f"'{router}' is FP8, but this model holds"):
        Engine(config(str(ckpt)))
    save_file(tensors, str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:model\\.layers\\.2\\.mlp\\.experts\\..*")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedgenError, match="layers.2.mlp.experts.*is FP8, but this model"):
        Engine(config(str(ckpt)))


def scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs, out_dtype):
    """``torch._scaled_grouped_mm``'s contract (its CUDA kernel runs on Hopper only): rows
    ``[offs[g-1], offs[g])`` of ``a`` times ``b[g]`` ([K, N]), each product scaled by its
    row's ``scale_a`` and its column's ``scale_b[g]``."""
    out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        prod = a[start:end].float() @ b[g].float()
        out[start:end] = (prod * scale_a[start:end, None] * scale_b[g][None, :]).to(out_dtype)
        start = end
    return out


@INTERPRETED_ONLY
@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.kernels
def test_fp8_experts_on_torch_scaled_grouped_gemm_equal_the_fp8_input_loop(monkeypatch, top_k):
    """Prefill-sized counts of per-channel FP8 experts may run on torch's FP8 grouped GEMM:
    each GEMM's rows quantized per token (the second's by the SiLU-and-mul kernel), the
    scales handed as its contract reads them."""
    from pagedgen.runtime.layers import fused_ops
    from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_reference, raising=False)
    x, w13, w2, weights, ids = _experts(37, 8, top_k, 64, 48)
    ids[:, 0] = 3  # most slots to one expert
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, None)
    got = moe_grouped_mm.experts(x, q13, q2, weights, ids,
                                 silu_and_mul=fused_ops.silu_and_mul_fused, scales=scales)
    ref = fp8_input_reference(x, q13, q2, scales, weights, ids)
    assert (got - ref).abs().max() <= 2e-3 * ref.abs().max()
