"""FP8 weights: the kernels against their references (Triton interpreter on the CPU), FP8
checkpoints in every published format against the same weights dequantized, online
quantization's error, tensor parallelism, the command line, and one-line errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from fp8_checkpoints import FORMATS, write_fp8
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.cli.verify.model_checks import compare, trace
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.quantization.fp8 import kernels as k
from pagedgen.runtime.quantization.registry import check_device, quant_config

runner = CliRunner()
QUANTIZING = ("triton_w8a8", "triton_tma")  # the Triton kinds that quantize per token
PROMPTS = [[5, 9, 3], list(range(20, 57)), [7] * 16 + [8, 9]]
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not k.HAVE_TRITON,
                                 reason="Triton kernels run on CPU tensors only when interpreted")


def config(model: str, **kw) -> EngineConfig:
    base = dict(model=model, device="cpu", dtype="float32", load_format="auto", num_blocks=64,
                block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                async_scheduling=False)
    return EngineConfig(**{**base, **kw})


# ---- arithmetic ---------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [None, 32])
def test_weight_quantization_error_is_bounded_per_element(group):
    w = torch.randn(40, 100) * torch.logspace(-3, 1, 40)[:, None]  # rows of every magnitude
    q, s = k.quantize_weight(w, group)
    assert q.dtype == k.E4M3 and s.shape == (40, 1 if group is None else math.ceil(100 / group))
    err = (k.dequantize(q, s, torch.float32, group) - w).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value; below the normal range
    # the step is the group's scale x 2^-9
    s_el = s.repeat_interleave(group or 100, dim=1)[:, :100]
    assert (err <= w.abs() / 16 + s_el * 2 ** -10 + 1e-12).all()


@INTERPRETED
@pytest.mark.parametrize("group,static", [(None, False), (64, False), (None, True)])
@pytest.mark.kernels
def test_activation_quantization_kernel_equals_reference(group, static):
    x = torch.randn(7, 200) * 3
    scale = torch.tensor([0.02]) if static else None
    q, s = k.quantize_activations(x, group, scale)
    rq, rs = k.quantize_activations_ref(x, group, scale)
    torch.testing.assert_close(s, rs)
    assert torch.equal(q.float(), rq.float())


@INTERPRETED
@pytest.mark.parametrize("m,n,kk,group,a_quant", [
    (5, 48, 300, None, False),  # per-channel, partial K tile, W8A16
    (5, 48, 300, None, True),  # per-channel, per-token activations
    (20, 40, 256, 128, True),  # block scales, per-token-group activations
    (3, 40, 300, 128, True),  # partial last K group
    (70, 24, 192, 64, False),  # block scales, W8A16, the large-M tile
])
@pytest.mark.kernels
def test_scaled_gemm_kernel_equals_reference(m, n, kk, group, a_quant):
    x = torch.randn(m, kk)
    w = torch.randn(n, kk) * 0.1
    wq, ws = k.quantize_weight(w, group)
    if a_quant:
        a, a_s = k.quantize_activations_ref(x, group)
    else:
        a, a_s = x, None
    got = k.scaled_gemm(a, a_s, wq, ws, torch.float32, group)
    want = k.scaled_gemm_ref(a, a_s, wq, ws, torch.float32, group)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@INTERPRETED
@pytest.mark.parametrize("tile", list(k.TILES))
@pytest.mark.parametrize("group,a_quant", [(None, True), (None, False), (64, True)])
@pytest.mark.kernels
def test_every_tile_computes_the_same_gemm(tile, group, a_quant):
    x = torch.randn(19, 192)
    wq, ws = k.quantize_weight(torch.randn(40, 192) * 0.1, group)
    a, a_s = k.quantize_activations_ref(x, group) if a_quant else (x, None)
    got = k.scaled_gemm(a, a_s, wq, ws, torch.float32, group, tile)
    torch.testing.assert_close(got, k.scaled_gemm_ref(a, a_s, wq, ws, torch.float32, group),
                               rtol=1e-4, atol=1e-4)


@INTERPRETED
@pytest.mark.parametrize("tile", list(k.TMA_TILES))
@pytest.mark.parametrize("m,n,kk,group", [
    (70, 40, 192, None),  # partial M and N tiles, K short of one 256 tile
    (130, 72, 320, 64),  # block scales, per-token-group activations
    (9, 48, 272, 128),  # partial last K group
])
@pytest.mark.kernels
def test_tma_kernel_computes_the_same_gemm(tile, m, n, kk, group):
    """The TMA tiles (operands past the tensors' ends read as zeros) against the reference,
    with per-token activation scales and, for block weights, per-token-group ones."""
    x = torch.randn(m, kk)
    wq, ws = k.quantize_weight(torch.randn(n, kk) * 0.1, group)
    for a_group in {None, group}:
        a, a_s = k.quantize_activations_ref(x, a_group)
        got = k.scaled_gemm_tma(a, a_s, wq, ws, torch.float32, group, tile)
        torch.testing.assert_close(got, k.scaled_gemm_ref(a, a_s, wq, ws, torch.float32, group),
                                   rtol=1e-4, atol=1e-4)


@INTERPRETED
@pytest.mark.kernels
def test_tma_gemm_takes_misaligned_activations_through_the_plain_kernel():
    from pagedgen.runtime.quantization.fp8.gemm import run_quantized, standalone_layer

    layer = standalone_layer(torch.randn(40, 96) * 0.1, act_dtype=torch.float32)
    q, s = k.quantize_activations_ref(torch.randn(5, 96))
    shifted = torch.empty(5 * 96 + 8, dtype=q.dtype)[8:].view(5, 96)  # 8 bytes off
    shifted.copy_(q)
    assert k.tma_fits(q) and not k.tma_fits(shifted)
    with pytest.raises(ValueError, match="16-byte aligned"):
        k.scaled_gemm_tma(shifted, s, layer.weight, layer.weight_scale, torch.float32)
    want = k.scaled_gemm_ref(q, s, layer.weight, layer.weight_scale, torch.float32)
    for acts in (q, shifted):
        got = run_quantized("triton_tma/64x64x128", layer, k.QuantizedActivations(acts, s))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@INTERPRETED
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.kernels
def test_norm_and_swiglu_quantize_in_their_kernels_as_the_quant_kernel_would(residual):
    from pagedgen.runtime.layers import fused_ops as f

    x = torch.randn(6, 300, dtype=torch.bfloat16) * 4
    w = torch.randn(300, dtype=torch.bfloat16)
    r = torch.randn_like(x) if residual else None
    got = f.rms_norm_fused(x, w, 1e-6, r, quantize=True)
    plain = f.rms_norm_fused(x, w, 1e-6, r)
    if residual:
        (got, got_r), (plain, plain_r) = got, plain
        assert torch.equal(got_r, plain_r)
    # exactly what the unfused kernels write: the norm, then the quantization kernel
    q, s = k.quantize_activations(plain)
    assert torch.equal(got.q.float(), q.float()) and torch.equal(got.scale, s)
    deq = got.q.float() * got.scale  # within FP8's error of the values (test_fused_ops.py
    ref = plain.float()  # compares those with torch's)
    assert ((deq - ref).abs() <= ref.abs() / 16 + got.scale * 2 ** -9).all()
    gate_up = torch.randn(5, 2 * 2500, dtype=torch.bfloat16) * 3  # rows cross its 2048 block
    got = f.silu_and_mul_fused(gate_up, quantize=True)
    plain = f.silu_and_mul_fused(gate_up)
    q, s = k.quantize_activations(plain)
    assert torch.equal(got.q.float(), q.float()) and torch.equal(got.scale, s)
    ref = plain.float()
    deq = got.q.float() * got.scale
    assert ((deq - ref).abs() <= ref.abs() / 16 + got.scale * 2 ** -9).all()


@INTERPRETED
@pytest.mark.parametrize("gemm", ["triton_w8a8", "triton_tma", "triton_w8a16", "dequantize"])
@pytest.mark.kernels
def test_linear_layers_run_the_planned_kernel_on_plain_and_quantized_input(gemm):
    """What the GPU runs, on the CPU: a row- and a column-parallel FP8 layer with a plan, fed
    a tensor or (where the kernel quantizes per token) ``QuantizedActivations``."""
    from pagedgen.runtime.collectives.parallel import TensorParallel
    from pagedgen.runtime.collectives.sharding import Segment
    from pagedgen.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedgen.runtime.quantization.fp8.gemm import GemmPlan
    from pagedgen.runtime.quantization.fp8.scheme import Fp8

    w = torch.randn(48, 160) * 0.1
    x = torch.randn(5, 160)
    for layer in (RowParallelLinear(160, 48, False, TensorParallel(), Fp8()),
                  ColumnParallelLinear(160, [(None, Segment(None, 48, 0, 48, 0))], False,
                                       Fp8())):
        layer.act_dtype, layer.fused_input = torch.float32, True
        layer.quant_method.load(layer, "weight", None, w)
        layer.gemm_plan = GemmPlan([(math.inf, gemm)])
        want = k.scaled_gemm_ref(*k.quantize_activations_ref(x), layer.weight,
                                 layer.weight_scale, torch.float32) if gemm in QUANTIZING \
            else x @ k.dequantize(layer.weight, layer.weight_scale, torch.float32).t()
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
        takes = layer.quant_method.takes_quantized_input(layer, 5)
        assert takes == (gemm in QUANTIZING)
        if takes:
            q = k.QuantizedActivations(*k.quantize_activations_ref(x))
            torch.testing.assert_close(layer(q), want, rtol=1e-4, atol=1e-4)


def test_gemm_plans_pick_by_m_and_forced_names_are_checked(monkeypatch):
    from pagedgen.runtime.quantization.fp8.gemm import ENV_GEMM, GemmPlan, check_forced

    plan = GemmPlan([(1, "triton_w8a16/16x32x256"), (64, "rowwise"), (1024, "triton_w8a8")])
    assert [plan.choose(m) for m in (1, 2, 64, 65, 5000)] == [
        "triton_w8a16/16x32x256", "rowwise", "rowwise", "triton_w8a8", "triton_w8a8"]
    check_forced("triton_w8a8/64x64x128")
    check_forced("triton_tma/128x256x128")
    from pagedgen.runtime.quantization.fp8.gemm import _valid  # plans read back from disk
    assert _valid([[1, "triton_w8a16/16x32x256"], [64, "rowwise"]], ["rowwise"])
    assert not _valid([[1, "triton_w8a8/8x8x8"]], ["rowwise"])  # a tile this version lacks
    assert _valid([[256, "triton_tma/128x64x128"]], ["rowwise"])
    assert not _valid([[1, "rowwise"]], ["triton_w8a8/16x32x256"])  # block weights: no rowwise
    assert not _valid([[64, "rowwise"], [1, "rowwise"]], ["rowwise"]) and not _valid("x", [])
    for bad in ("cublas", "rowwise/16x32x256", "triton_w8a8/7x7x7", "triton_w8a8/128x256x128",
                "triton_tma/16x32x256"):  # each kind has its own tiles
        with pytest.raises(ValueError, match=ENV_GEMM):
            check_forced(bad)


# ---- checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A random Llama checkpoint whose every linear shape has partial 128 x 128 edge blocks."""
    base = tmp_path_factory.mktemp("fp8")
    return make_checkpoint("llama", base / "dense", hidden_size=200, intermediate_size=300)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_equals_its_weights_dequantized(dense, fmt):
    ckpt = write_fp8(dense, dense.with_name(fmt), fmt)
    eng = Engine(config(str(ckpt)))
    layer = eng.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn  # stored in FP8 with its scales
    got = trace(eng, PROMPTS, 6)
    ref = trace(Engine(config(str(ckpt) + "-dequantized")), PROMPTS, 6)
    row = compare(ref, got, 1e-5, fmt)
    assert row.worst_abs < 1e-4 and got[1] == ref[1], row
    assert eng.summary(1.0, 0.0)["quantization"] == "fp8"


def test_block_scales_follow_their_rows_through_fused_layers(dense, tmp_path):
    """q, k and v have their own block scales: a fused layer keeps each part's, row by row."""
    ckpt = write_fp8(dense, tmp_path / "b", "hf-block")
    layer = Engine(config(str(ckpt))).runner.model.model.layers[1].self_attn.qkv_proj
    from safetensors.torch import load_file
    t = load_file(str(ckpt / "model.safetensors"))
    for part, rows in (("q", slice(0, 128)), ("k", slice(128, 192)), ("v", slice(192, 256))):
        s = t[f"model.layers.1.self_attn.{part}_proj.weight_scale_inv"]
        want = s.repeat_interleave(128, 0)[:rows.stop - rows.start]
        assert torch.equal(layer.weight_scale[rows], want), part


def test_online_fp8_error_is_bounded_per_layer_and_logits_stay_close(dense):
    dense_eng = Engine(config(str(dense)))
    fp8_eng = Engine(config(str(dense), quantization="fp8"))
    ref = dict(dense_eng.runner.model.named_parameters())
    checked = 0
    for name, m in fp8_eng.runner.model.named_modules():
        if getattr(m, "weight_scale", None) is None:
            continue
        assert m.weight.dtype == torch.float8_e4m3fn
        w = ref[f"{name}.weight"].float()
        deq = k.dequantize(m.weight, m.weight_scale, torch.float32)  # per channel
        # per output channel: error at most 1/16 of each row's largest value
        assert ((deq - w).abs().amax(1) <= w.abs().amax(1) / 16).all(), name
        checked += 1
    assert checked == 2 * 4  # qkv, o, gate_up, down per layer
    assert fp8_eng.runner.model.lm_head.weight.dtype == torch.float32  # left dense
    row = compare(trace(dense_eng, PROMPTS, 6), trace(fp8_eng, PROMPTS, 6), 0.1, "online")
    assert row.passed, row


def test_dummy_fp8_weights_are_the_dense_dummy_weights_quantized():
    dense = Engine(config("tiny", load_format="dummy")).runner.model
    fp8 = Engine(config("tiny", load_format="dummy", quantization="fp8")).runner.model
    a, b = dense.model.layers[0].mlp.gate_up_proj, fp8.model.layers[0].mlp.gate_up_proj
    q, s = k.quantize_weight(a.weight.float())
    assert torch.equal(b.weight.float(), q.float()) and torch.equal(b.weight_scale, s)


def assert_tp2_trace_equals_tp1(ckpt: str, label: str, steps: int = 5) -> None:
    """The checkpoint's greedy trace over two gloo ranks equals one rank's."""
    from pagedgen.cli.verify.model_checks import trace_worker
    from pagedgen.runtime.drivers.launch import Workers

    with Workers(trace_worker, [(config(ckpt, tensor_parallel_size=2), PROMPTS, steps, None)],
                 [None], tp=2) as w:
        sharded = [msg for _, msg in w.messages()][0]
    ref = trace(Engine(config(ckpt)), PROMPTS, steps)
    row = compare(ref, sharded, 1e-5, label)
    assert row.worst_abs < 1e-4 and sharded[1] == ref[1], (label, row)


@pytest.mark.process
def test_tp2_fp8_checkpoint_equals_tp1(dense, tmp_path):
    even = make_checkpoint("llama", tmp_path / "even", hidden_size=256, intermediate_size=256)
    for fmt, block in (("ct-channel", (128, 128)), ("hf-block", (32, 32))):
        assert_tp2_trace_equals_tp1(str(write_fp8(even, tmp_path / fmt, fmt, block=block)), fmt)


# ---- command line and bad input -----------------------------------------------------------------

def test_generate_with_quantization_fp8_on_cpu(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(prompts), "-o", str(out), "--model", "tiny",
                              "--quantization", "fp8", "--max-tokens", "4", "--json",
                              "--device", "cpu"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["quantization"] == "fp8"
    assert "per-channel weights (quantized at load)" in summary["quantization_scheme"]
    assert len(out.read_text().splitlines()) == 3


def test_resume_refuses_another_quantization(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "o.jsonl"
    args = ["generate", str(prompts), "-o", str(out), "--model", "tiny", "--max-tokens", "2",
            "--device", "cpu"]
    assert runner.invoke(app, args + ["-q", "fp8"]).exit_code == 0
    before = out.read_bytes()
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code != 0 and "quantization" in res.output, res.output
    assert out.read_bytes() == before


def _fields(**q):
    from types import SimpleNamespace
    return SimpleNamespace(quantization_config=q) if q else SimpleNamespace()


@pytest.mark.parametrize("q,msg", [
    (dict(quant_method="awq"), "quant_method 'awq' is not supported"),
    (dict(quant_method="fp8", weight_block_size=[128]), "weight_block_size must be two"),
    (dict(quant_method="fp8", activation_scheme="sometimes"), "activation_scheme 'sometimes'"),
    (dict(quant_method="compressed-tensors", format="pack-quantized"), "format 'pack-quant"),
    (dict(quant_method="compressed-tensors", config_groups={"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}), "must be type float, num_bits 8"),
    (dict(quant_method="compressed-tensors", config_groups={"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "group"}}}), "strategy 'group' is not"),
])
def test_unsupported_quantization_configs_are_one_line_errors(q, msg):
    with pytest.raises(PagedgenError, match=msg):
        quant_config(_fields(**q), None, "config.json")


def test_quantization_flag_against_the_checkpoint():
    with pytest.raises(PagedgenError, match="unknown quantization 'int4'"):
        quant_config(_fields(), "int4", "x")
    assert quant_config(_fields(), None, "x") is None
    cfg = quant_config(_fields(quant_method="fp8", weight_block_size=[128, 128]), "fp8", "x")
    assert cfg.scheme.block == (128, 128) and cfg.scheme.scale_name == "weight_scale_inv"


def test_misfit_scales_name_the_tensor(dense, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = write_fp8(dense, tmp_path / "bad", "hf-block")
    t = load_file(str(ckpt / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(t, str(ckpt / "model.safetensors"))
    with pytest.raises(PagedgenError, match=r"down_proj.weight_scale_inv' has shape \[2, 2\]; "
                                            r"128x128 blocks of a \[200, 300\] weight make it "
                                            r"\[2, 3\]"):
        Engine(config(str(ckpt)))
    del t["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(t, str(ckpt / "model.safetensors"))
    with pytest.raises(PagedgenError, match="missing 1 tensor.*down_proj.weight_scale_inv"):
        Engine(config(str(ckpt)))


@pytest.mark.parametrize("how", ["no quantization_config", "layer left dense"])
def test_fp8_tensors_bound_for_a_dense_layer_are_refused(dense, tmp_path, how):
    """Copied into a dense parameter an e4m3 tensor loses its scale: a model that loads but
    computes nonsense. A config without quantization_config, or one that leaves the layer
    dense, is a one-line error naming the tensor."""
    ckpt = write_fp8(dense, tmp_path / "q", "ct-channel")
    cfg = json.loads((ckpt / "config.json").read_text())
    if how == "no quantization_config":
        del cfg["quantization_config"]
        name = "tensor 'model.layers.0."  # the file's first FP8 tensor
    else:
        cfg["quantization_config"]["ignore"].append("model.layers.1.mlp.down_proj")
        name = "model.layers.1.mlp.down_proj.weight"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedgenError, match="is FP8, but this model holds its layer dense") as e:
        Engine(config(str(ckpt)))
    assert name in str(e.value) and "\n" not in str(e.value)


def test_fp8_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    cfg = quant_config(_fields(), "fp8", "x")
    with pytest.raises(PagedgenError, match="FP8 tensor cores.*A100 is 8.0"):
        check_device(cfg, torch.device("cuda"))
    check_device(cfg, torch.device("cpu"))  # the CPU computes dequantized


def test_cli_refuses_an_unknown_quantization(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    res = runner.invoke(app, ["generate", str(prompts), "-o", str(tmp_path / "o.jsonl"),
                              "--quantization", "int3"])
    assert res.exit_code != 0 and "unknown quantization 'int3'" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "o.jsonl").exists()
