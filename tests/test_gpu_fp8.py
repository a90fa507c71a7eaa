"""FP8 weights on the GPU (pytest -m gpu): each GEMM kernel against its reference, the
measured choice per M, FP8 checkpoints and online quantization through every backend with
CUDA graphs, the FP8 KV cache and prefix caching, and verify's FP8 rows."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import write_fp8
from hf_models import make_checkpoint

from pagedgen.attention.registry import backend_status
from pagedgen.cli.verify.fp8_checks import gemm_row, model_row
from pagedgen.cli.verify.model_checks import compare, trace
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores")]
PROMPTS = [[5, 9, 3], list(range(20, 57)), [7] * 16 + [8, 9], list(range(100, 300))]


def backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [s.name for s in backend_status(torch.device("cuda"))
            if s.available and s.name != "eager"]


def config(model: str, **kw) -> EngineConfig:
    base = dict(model=model, device="cuda", dtype="bfloat16", load_format="auto",
                num_blocks=256, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
                async_scheduling=False)
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("gemm", ["rowwise", "rowwise_fast", "triton_w8a16", "triton_w8a8",
                                  "triton_tma"])
def test_each_fp8_gemm_equals_its_reference(gemm):
    row = gemm_row(gemm, torch.device("cuda"), 21, seed=0)
    print(f"{gemm}: worst rel {row.worst_rel:.2e} over {row.cases} layers")
    assert row.passed, row


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8gpu")
    # head_dim 64: every GPU backend runs it
    dense = make_checkpoint("qwen3", base / "dense", hidden_size=256, intermediate_size=512)
    return dense, {fmt: write_fp8(dense, base / fmt, fmt)
                   for fmt in ("hf-block", "ct-channel", "ct-tensor-static")}


@pytest.mark.parametrize("fmt", ["hf-block", "ct-channel", "ct-tensor-static"])
def test_fp8_checkpoints_match_their_dequantized_weights_on_every_backend(checkpoints, fmt):
    _, ckpts = checkpoints
    ref = trace(Engine(config(str(ckpts[fmt]) + "-dequantized", backend="eager",
                              enforce_eager=True)), PROMPTS, 8)
    for backend in backends():
        eng = Engine(config(str(ckpts[fmt]), backend=backend))
        plan = eng.runner.model.model.layers[0].mlp.down_proj.gemm_plan
        row = compare(ref, trace(eng, PROMPTS, 8), 0.1, f"{fmt} {backend}")
        print(f"{fmt:18s} {backend:11s} rel {row.worst_rel:.2e} {row.detail}; "
              f"down_proj GEMMs {plan.choices}")
        assert row.passed, row


def test_online_fp8_with_fp8_kv_cache_prefix_caching_and_graphs(checkpoints):
    dense, _ = checkpoints
    for backend in backends():
        eng = Engine(config(str(dense), backend=backend, quantization="fp8"))
        if not eng.runner.backend.supports_fp8_kv_cache:
            continue
        kv8 = Engine(config(str(dense), backend=backend, quantization="fp8",
                            kv_cache_dtype="fp8"))
        first = trace(kv8, PROMPTS, 8)
        row = compare(trace(eng, PROMPTS, 8), first, 0.15, backend)
        assert row.passed, row
        hits = kv8.stats.prefix_hit_tokens
        again = trace(kv8, PROMPTS, 8)  # the prompts' full pages now come from the cache
        assert kv8.stats.prefix_hit_tokens > hits
        row = compare(first, again, 0.15, f"{backend} prefix-cached")
        assert row.passed, row


def test_graphs_and_eager_agree_with_fp8_weights(checkpoints):
    dense, _ = checkpoints
    g = trace(Engine(config(str(dense), quantization="fp8")), PROMPTS, 8)
    e = trace(Engine(config(str(dense), quantization="fp8", enforce_eager=True)), PROMPTS, 8)
    row = compare(e, g, 5e-2, "graphs vs eager")
    assert row.passed, row


def test_quantizing_in_the_norm_and_swiglu_kernels_changes_nothing(checkpoints, monkeypatch):
    from pagedgen.runtime.quantization.fp8.scheme import ENV_FUSED_INPUT

    dense, _ = checkpoints
    fused_eng = Engine(config(str(dense), quantization="fp8"))
    layer = fused_eng.runner.model.model.layers[0]
    assert any(layer.mlp.down_proj.quant_method.takes_quantized_input(layer.mlp.down_proj, m)
               for m in (1, 16, 64, 256))
    fused = trace(fused_eng, PROMPTS, 8)
    monkeypatch.setenv(ENV_FUSED_INPUT, "0")
    plain = trace(Engine(config(str(dense), quantization="fp8")), PROMPTS, 8)
    row = compare(plain, fused, 1e-3, "fused quantization")
    assert row.passed and fused[1] == plain[1], row


def test_verify_fp8_model_row_passes():
    row = model_row("tiny", "auto", torch.device("cuda"), 8, 0)
    print(row)
    assert row.passed, row


def test_preset_runs_with_fp8_and_says_so():
    eng = Engine(config("qwen3-0.6b", load_format="dummy", quantization="fp8",
                        max_model_len=256))
    seqs = eng.generate([list(range(1, 60))] * 4, SamplingParams(max_tokens=8, temperature=0))
    assert all(len(s.output_token_ids) == 8 for s in seqs)
    s = eng.summary(1.0, 0.0)
    assert s["quantization"] == "fp8" and s["cuda_graphs"]
    w = eng.runner.model.model.layers[0].self_attn.qkv_proj.weight
    assert w.dtype == torch.float8_e4m3fn
