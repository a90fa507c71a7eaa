"""`pagedgen profile`: JSON fields, kernel grouping, graph-kernel attribution, files written."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime import kernel_stats as ks

runner = CliRunner()


@pytest.mark.kernels
def test_profile_on_cpu_writes_trace_json_and_charts(tmp_path, one_layer):
    res = runner.invoke(app, ["profile", "--model", one_layer, "--device", "cpu",
                              "--backend", "all",
                              "--batch-sizes", "1,3", "--prompt-len", "20",
                              "--measured-steps", "3", "--warmup-steps", "1",
                              "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["workload"]["batch_sizes"] == [1, 3]
    backends = [r["backend"] for r in data["results"]]
    assert backends[-1] == "sdpa" and "eager" not in backends  # triton too, if interpreting
    for r in data["results"]:
        assert [b["batch"] for b in r["batches"]] == [1, 3]
        for b in r["batches"]:
            assert b["prefill_tok_s"] > 0 and b["decode_tok_s"] > 0
            assert b["step_ms_p50"] <= b["step_ms_p90"] <= b["step_ms_p99"]
        for phase in ("prefill", "decode"):
            groups = r["phases"][phase]["groups_us"]
            assert set(groups) == set(ks.GROUPS)
            assert groups["GEMM"] > 0 and groups["attention"] > 0
        assert "not_measured" in r
        assert (tmp_path / f"trace-{r['backend']}.json").stat().st_size > 1000
    for png in ("kernel_groups.png", "decode_step_vs_batch.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    if len(backends) > 1:
        assert "backends side by side" in res.output


def test_known_kernel_names_fall_in_their_groups():
    cases = {
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>": "attention",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>": "attention",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
        "nvjet_sm90_tst_256x48_64x5_4x1_v_bz_TNT": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>": "GEMM",
        "void at::native::vectorized_elementwise_kernel<4, silu_kernel>": "activation",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward": "other",
        "Memcpy HtoD (Pinned -> Device)": "memory copy",
        "void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>": "sampling",
        "void vllm::reshape_and_cache_flash_kernel<bf16>": "KV-cache write",
        "void at::native::index_copy_kernel_impl": "KV-cache write",
        "rms_norm_kernel": "normalization",
        "apply_rotary_embedding_kernel": "rotary",
        "kernel_cutlass_flashinfergdn_kernelsdelta_rule_sm90_kernel": "linear attention",
        "void causal_conv1d_update_kernel<bf16>": "linear attention",
        "fused_recurrent_gated_delta_rule_fwd_kernel": "linear attention",
        "prefill_kernel": "attention",  # the triton backend's, unscoped in CUDA graphs
        "cascade_merge_kernel": "attention",
        "write_kv_kernel": "KV-cache write",
    }
    for name, group in cases.items():
        assert ks.group_from_name(name) == group, name


def _ev(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
         "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_scopes_phases_and_graph_replays_are_attributed():
    ev = [
        # eager reference forward: two scoped kernels and a GEMM
        _ev("user_annotation", "pagedgen.reference", 0, 100),
        _ev("user_annotation", "pg:forward", 1, 90),
        _ev("user_annotation", "pg:normalization", 2, 10),
        _ev("cuda_runtime", "cudaLaunchKernel", 3, 1, corr=1),
        _ev("user_annotation", "pg:activation", 20, 10),
        _ev("cuda_runtime", "cudaLaunchKernel", 21, 1, corr=2),
        _ev("cuda_runtime", "cudaLaunchKernel", 40, 1, corr=3),
        _ev("kernel", "elementwise_kernel<mul>", 5, 4, tid=7, corr=1),
        _ev("kernel", "elementwise_kernel<mul>", 25, 6, tid=7, corr=2),
        _ev("kernel", "nvjet_gemm", 45, 30, tid=7, corr=3),
        # a decode step replayed from a CUDA graph: same kernels, no scopes
        _ev("user_annotation", "pagedgen.decode", 200, 100),
        _ev("cuda_runtime", "cudaGraphLaunch", 201, 2, corr=9),
        _ev("kernel", "elementwise_kernel<mul>", 210, 4, tid=7, corr=9),
        _ev("kernel", "elementwise_kernel<mul>", 220, 6, tid=7, corr=9),
        _ev("kernel", "nvjet_gemm", 230, 30, tid=7, corr=9),
        _ev("gpu_memcpy", "Memcpy HtoD", 280, 2, tid=7, corr=10),
        _ev("cuda_runtime", "cudaMemcpyAsync", 270, 1, corr=10),
    ]
    kernels = ks.load_kernels({"traceEvents": ev})
    ref = [k for k in kernels if k.phase == "reference" and k.in_forward]
    assert [k.group for k in ref] == ["normalization", "activation", "GEMM"]
    decode = [k for k in kernels if k.phase == "decode"]
    assert [k.group for k in decode] == ["other", "other", "GEMM", "memory copy"]
    assert ks.attribute_graph_kernels(kernels, ref) == 1
    assert [k.group for k in decode] == ["normalization", "activation", "GEMM", "memory copy"]
    summary = ks.summarize(kernels)
    assert summary["decode"]["gpu_time_us"] == 42
    assert summary["decode"]["graph_kernels"] == 3
    assert summary["decode"]["groups_us"]["activation"] == 6


def test_short_names_drop_templates():
    assert ks.short_name("void a::b<c<d>, e>(int)") == "a::b<…>"


def test_profile_survives_chunked_prefill(tmp_path):
    """8 x 300 prompt tokens exceed the tiny profile's 2048-token step: prefill is chunked, and
    early sequences decode meanwhile; the measured decode steps must still all run."""
    res = runner.invoke(app, ["profile", "--device", "cpu", "--backend", "sdpa",
                              "--batch-sizes", "8", "--prompt-len", "300", "--measured-steps",
                              "3", "--warmup-steps", "1", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (r,) = json.loads((tmp_path / "profile.json").read_text())["results"]
    assert r["batches"][0]["prefill_tokens"] == 8 * 300


def test_profile_measures_prefill_steps_as_they_launch():
    """``profile`` times eager prefill steps unless the profile asks for piecewise graphs (the
    default would capture a bucket inside a timed prefill); steps stay synchronous."""
    from pagedgen.cli.profile.measure import measured_config
    from pagedgen.cli.profile.workload import Workload
    from pagedgen.runtime.config import EngineConfig

    wl = Workload(batch_sizes=[1, 8])
    for asked, measured in ((None, False), (False, False), (True, True)):
        cfg = measured_config(EngineConfig(mixed_step_graphs=asked), wl)
        assert cfg.mixed_step_graphs is measured
        assert cfg.async_scheduling is False and cfg.max_num_seqs == 8


def test_a_batch_past_the_step_budget_raises_the_budget_and_past_the_seats_is_refused():
    """``--batch-sizes`` past the step's token budget gets a budget that decodes the batch in
    one step (it named options the user never gave before); past the seats a step can hold,
    one line naming the batch size."""
    import pytest

    from pagedgen.cli.profile.measure import measured_config
    from pagedgen.cli.profile.workload import Workload, workload_from
    from pagedgen.errors import PagedgenError
    from pagedgen.runtime.config import EngineConfig

    cfg = measured_config(EngineConfig(device="cpu", max_num_batched_tokens=64),
                          Workload(batch_sizes=[8, 300]))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (300, 300)
    cfg = measured_config(EngineConfig(device="cpu"), Workload(batch_sizes=[8]))
    assert cfg.max_num_batched_tokens == EngineConfig(device="cpu").with_step_limits(
        ).max_num_batched_tokens
    with pytest.raises(PagedgenError, match="batch size 70,000: a step runs at most 65,536"):
        workload_from({}, {"batch_sizes": "1,70000"})


def test_an_output_dir_that_cannot_be_made_is_a_one_line_error(tmp_path, monkeypatch):
    """A file where the directory should go: one line before the model loads, not a
    traceback (FileExistsError) and not after the profiling ran."""
    (tmp_path / "taken").write_text("a file\n")
    loaded = []
    monkeypatch.setattr("pagedgen.cli.profile.measure.run_backend",
                        lambda *a, **k: loaded.append(a))
    for where in ("taken", "taken/sub"):
        res = runner.invoke(app, ["profile", "--device", "cpu", "--backend", "eager",
                                  "--output-dir", str(tmp_path / where)])
        assert res.exit_code == 1, res.output
        assert res.output.startswith("error: --output-dir") and "Traceback" not in res.output
        assert len(res.output.strip().splitlines()) == 1
    assert not loaded and (tmp_path / "taken").read_text() == "a file\n"


def test_a_workload_the_model_cannot_take_is_a_one_line_error(tmp_path, monkeypatch):
    """A shared prefix longer than the prompt (was silently cut), a bad prompt file (was read
    only after the model loaded) and a prompt longer than the context (was a ValueError
    traceback): one line each, exit 1."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": 5}\n')
    loads = []
    from pagedgen.runtime.engine import engine as engine_module

    real_engine = engine_module.Engine
    monkeypatch.setattr(engine_module, "Engine",
                        lambda *a, **k: loads.append(1) or real_engine(*a, **k))
    cases = [(["--prompt-len", "20", "--shared-prefix-len", "21"],
              "--shared-prefix-len must be in 0..20 (the prompt length), not 21", 0),
             (["--prompt-len", "0"], "--prompt-len must be >= 1, not 0", 0),
             (["--output-len", "2"], "--output-len must be >= 3, not 2", 0),
             (["--prompts", str(tmp_path / "bad.jsonl")], "bad.jsonl:1:", 0),
             (["--prompt-len", "5000"], "the prompt has 5,000 tokens", 1)]
    for args, says, loaded in cases:
        loads.clear()
        res = runner.invoke(app, ["profile", "--device", "cpu", "--backend", "sdpa",
                                  "--batch-sizes", "1", "--output-dir", str(tmp_path), *args])
        assert res.exit_code == 1, res.output
        err = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and says in err[0] and "Traceback" not in res.output, res.output
        assert len(loads) == loaded, args


def test_prefill_moe_is_measured_against_the_peak_its_experts_meet():
    """FP8 experts' prefill GEMMs against FP8's peak, bf16's against bf16's; MXFP4's packed
    bytes count two weight values each."""
    from types import SimpleNamespace

    import torch

    from pagedgen.cli.profile.measure import _moe_roofline
    from pagedgen.runtime.collectives.parallel import TensorParallel
    from pagedgen.runtime.layers.moe.layer import FusedMoE
    from pagedgen.runtime.worker.measurement import Measurement

    layer = FusedMoE(4, 2, 64, 32, TensorParallel())
    measured = Measurement(SimpleNamespace(model=torch.nn.ModuleList([layer])), 0, None)
    values = 3 * 64 * 32
    limits = {"matmul": 1e12, "matmul_fp8": 2e12, "copy_bw": 1e12}
    dec, pre = {"groups_us": {"MoE": 0.0}}, {"groups_us": {"MoE": 1e6}}  # one second

    def peak_fraction() -> float:
        moe = measured.moe_figures(1, 1000)
        return _moe_roofline(moe, dec, pre, 1, limits)["prefill_moe_peak_fraction"]
    flops = 2 * 1000 * 2 * values
    assert peak_fraction() == flops / 1e12
    layer.w13_weight.data = layer.w13_weight.data.to(torch.float8_e4m3fn)
    layer.w2_weight.data = layer.w2_weight.data.to(torch.float8_e4m3fn)
    assert peak_fraction() == flops / 2e12
    layer.w13_weight.data = torch.zeros(4, 64, 32, dtype=torch.uint8)  # MXFP4: K / 2 bytes
    layer.w2_weight.data = torch.zeros(4, 64, 16, dtype=torch.uint8)
    assert peak_fraction() == flops / 1e12


@pytest.mark.kernels
def test_profile_at_auto_takes_the_backend_that_runs_the_models_layers(tmp_path):
    """Gemma 2's soft cap is beyond SDPA, the CPU's first choice: ``auto`` profiles the backend
    the engine picks for the model (not the device's first, which then refused the model), and
    ``all`` passes over SDPA with a line saying why."""
    from hf_models import make_checkpoint
    ckpt = make_checkpoint("gemma2", tmp_path / "gemma2")
    args = ["profile", "--device", "cpu", "--model", str(ckpt), "--batch-sizes", "1",
            "--prompt-len", "12", "--measured-steps", "2", "--warmup-steps", "1",
            "--no-cuda-graphs"]
    res = runner.invoke(app, [*args, "--output-dir", str(tmp_path / "auto")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "auto" / "profile.json").read_text())
    assert [r["backend"] for r in data["results"]] == ["eager"]
    res = runner.invoke(app, [*args, "--backend", "all", "--output-dir", str(tmp_path / "all")])
    assert "skipped: backend 'sdpa' cannot run" in " ".join(res.output.split())
    if res.exit_code == 0:  # Triton's interpreter runs soft caps
        data = json.loads((tmp_path / "all" / "profile.json").read_text())
        assert "sdpa" not in [r["backend"] for r in data["results"]]
    else:
        assert "no available backend runs" in res.output and res.exit_code == 2
