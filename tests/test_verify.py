"""`pagedgen verify` passes correct backends and fails a deliberately broken one."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from pagedgen.attention.registry import _BACKENDS, register_backend
from pagedgen.attention.sdpa import SdpaBackend, SdpaImpl
from pagedgen.cli.app import app

runner = CliRunner()
FAST = ["--device", "cpu", "--cases", "6", "--steps", "4"]


class OffByOneDecodeImpl(SdpaImpl):
    """Planted bug: decode ignores the sequence's newest cached token (an off-by-one length)."""

    def _decode(self, q, kv_cache, md):
        md.seq_lens = torch.clamp(md.seq_lens - 1, min=1)
        return super()._decode(q, kv_cache, md)


class OffByOneDecodeBackend(SdpaBackend):
    name = "broken-decode"

    @staticmethod
    def get_impl_cls():
        return OffByOneDecodeImpl


class WrongCausalOffsetImpl(SdpaImpl):
    """Planted bug: prefill masks as if the new tokens started at position 0 (no prior context)."""

    def _prefill(self, q, k_new, v_new, kv_cache, md, out):
        qsl = md.query_start_loc.tolist()
        for i, seq_len in enumerate(md.seq_lens_cpu):
            n = qsl[i + 1] - qsl[i]
            from pagedgen.attention.ops.kv_cache import gather_kv
            k, v = gather_kv(kv_cache, md.block_tables[i], seq_len)
            o = self._sdpa(q[qsl[i]:qsl[i + 1]].transpose(0, 1), k.transpose(0, 1),
                           v.transpose(0, 1), None, n > 1)  # top-left causal: wrong with context
            out[qsl[i]:qsl[i + 1]] = o.transpose(0, 1)


class WrongCausalOffsetBackend(SdpaBackend):
    name = "broken-causal"

    @staticmethod
    def get_impl_cls():
        return WrongCausalOffsetImpl


def invoke(*args):
    return runner.invoke(app, ["verify", *map(str, args)])


def test_verify_without_a_terminal_prints_a_line_as_each_check_is_in(tmp_path):
    """A log gets no progress bar: a line for each check's row says how it went and how many
    tasks are done, so a cold run's long kernel compiles show they are moving."""
    import re
    res = invoke("--backend", "sdpa", *FAST, "-o", tmp_path / "v.json")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("verifying sdpa: ")]
    (rep,) = json.loads((tmp_path / "v.json").read_text())["backends"]
    assert [ln.split(": ", 1)[1].rsplit(" pass (", 1)[0] for ln in lines] \
        == [r["group"] for r in rep["rows"]]
    counts = [tuple(map(int, re.search(r"\((\d+)/(\d+) tasks", ln).groups())) for ln in lines]
    done = [d for d, _ in counts]
    assert done == sorted(done) and len({n for _, n in counts}) == 1
    assert done[-1] == counts[0][1]


def test_verify_passes_sdpa_and_writes_json(tmp_path):
    res = invoke("--backend", "sdpa", *FAST, "-o", tmp_path / "v.json")
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["passed"] is True
    (rep,) = data["backends"]
    kinds = {r["kind"] for r in rep["rows"]}
    assert kinds == {"kernel", "model"}
    assert all(r["worst_abs"] <= r["tol"] for r in rep["rows"] if r["kind"] == "kernel")


def test_verify_model_only_runs_the_model_rows_of_a_moe_checkpoint(tmp_path):
    """--model-only: no kernel rows; a MoE checkpoint's model rows pass."""
    from hf_models import make_checkpoint
    path = make_checkpoint("mixtral", tmp_path / "mixtral")
    res = invoke("--backend", "sdpa", "--model", path, "--dtype", "float32", "--model-only",
                 "-o", tmp_path / "v.json")
    assert res.exit_code == 0, res.output
    (rep,) = json.loads((tmp_path / "v.json").read_text())["backends"]
    assert {r["kind"] for r in rep["rows"]} == {"model"} and len(rep["rows"]) >= 2


@pytest.mark.process
def test_verify_in_worker_processes_gives_the_same_rows(tmp_path, monkeypatch):
    """--jobs 2 splits kernel groups into tasks run by 2 processes; the rows (worst errors
    over the same cases) equal a run in this process."""
    import pagedgen.cli.verify.runner as verify_mod

    submitted = []

    class CountingPool(verify_mod.ProcessPoolExecutor):
        def submit(self, fn, *args):  # fn: the timing wrapper; args[0]: the task's function
            submitted.append(args[0].__name__)
            return super().submit(fn, *args)

    monkeypatch.setattr(verify_mod, "ProcessPoolExecutor", CountingPool)
    rows = {}
    for jobs in (1, 2):
        res = invoke("--backend", "sdpa", "--device", "cpu", "--cases", 8, "--steps", 2,
                     "--jobs", jobs, "-o", tmp_path / f"{jobs}.json")
        assert res.exit_code == 0, res.output
        rows[jobs] = json.loads((tmp_path / f"{jobs}.json").read_text())["backends"][0]["rows"]
        assert all(r.pop("seconds") > 0 for r in rows[jobs])  # each row's tasks, timed
    kernel_rows = [r for r in rows[2] if r["kind"] == "kernel"]
    assert kernel_rows == [r for r in rows[1] if r["kind"] == "kernel"]
    # model rows: the same checks; float32 CPU matmuls round differently with the workers'
    # share of the threads, so their errors agree only to rounding
    for a, b in zip(rows[1], rows[2], strict=True):
        assert (a["group"], a["cases"], a["passed"], a["detail"]) == \
            (b["group"], b["cases"], b["passed"], b["detail"])
        assert abs(a["worst_abs"] - b["worst_abs"]) < 1e-5
    assert kernel_rows and all(r["cases"] == 8 for r in kernel_rows)
    # every kernel group in two tasks (6 + 2 cases), plus the model-level checks
    assert submitted.count("kernel_cases") == 2 * len(kernel_rows)
    assert "check_model" in submitted


def test_verify_all_lists_gpu_only_backends_as_skipped_on_cpu(monkeypatch):
    """As a CPU user runs it (no Triton interpreter: the tests' conftest sets one, under which
    triton's checks took 90 s of CI even at one case a group; test_triton.py and
    test_gated_delta.py check its kernels there)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = invoke("--backend", "all", "--device", "cpu", "--cases", "1", "--steps", "2")
    assert res.exit_code == 0, res.output
    assert "flashinfer: skipped" in res.output or "flashinfer vs eager" in res.output
    assert "sdpa vs eager" in res.output and "PASS" in res.output


def verify_planted(name: str, target: str, *args):
    """Run verify on a backend registered only for this test."""
    register_backend(name, target)
    try:
        return invoke("--backend", name, *FAST, *args)
    finally:
        del _BACKENDS[name]


def test_verify_fails_an_off_by_one_decode():
    res = verify_planted("broken-decode", "test_verify:OffByOneDecodeBackend")
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output


def test_verify_fails_a_wrong_causal_offset():
    res = verify_planted("broken-causal", "test_verify:WrongCausalOffsetBackend")
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output


def test_prefix_cache_check_fails_a_prefill_that_ignores_cached_context(tmp_path):
    res = verify_planted("broken-causal", "test_verify:WrongCausalOffsetBackend",
                         "-o", tmp_path / "v.json")
    assert res.exit_code == 1, res.output
    rows = json.loads((tmp_path / "v.json").read_text())["backends"][0]["rows"]
    prefix = [r for r in rows if r["group"].startswith("prefix-cached prefill")]
    assert len(prefix) == 2 and not any(r["passed"] for r in prefix)
    good = invoke("--backend", "sdpa", *FAST, "-o", tmp_path / "s.json")
    assert good.exit_code == 0, good.output
    rows = json.loads((tmp_path / "s.json").read_text())["backends"][0]["rows"]
    assert [r["passed"] for r in rows if r["group"].startswith("prefix-cached")] == [True, True]


def test_verify_usage_error_exits_2():
    assert invoke("--backend", "nope", "--device", "cpu").exit_code == 2
    assert invoke("--cases", "0").exit_code == 2


def test_verify_workers_share_the_cores(monkeypatch):
    """Each of N workers gets cores/N build jobs (FlashInfer's ninja reads MAX_JOBS) and torch
    threads, so N workers compiling at once do not oversubscribe the machine."""
    import os

    import torch

    from pagedgen.cli.verify import runner

    # not in this process: a worker's tie to its parent would end pytest where the parent is
    # init (a run under nohup), with no summary
    monkeypatch.setattr(runner, "die_with_parent", lambda: None)
    threads = torch.get_num_threads()
    monkeypatch.setenv("MAX_JOBS", "16")
    try:
        runner._share_cores(5)
        assert os.environ["MAX_JOBS"] == "3" and torch.get_num_threads() == 3
        runner._share_cores(32)
        assert os.environ["MAX_JOBS"] == "1"
    finally:
        torch.set_num_threads(threads)


def noisy_checkpoint(path):
    """A 16-layer Llama whose bfloat16 weights (N(0, 0.2)) make its logits move ~25% under
    bfloat16 rounding alone: eager and sdpa differ by more than ``MODEL_TOL`` there."""
    from hf_models import make_checkpoint
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("llama", path, num_hidden_layers=16, initializer_range=0.2)
    f = path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f,
              metadata={"format": "pt"})
    return str(path)


def test_a_deep_models_own_rounding_passes_and_planted_bugs_still_fail(tmp_path):
    """In bfloat16 a backend passes when its error against the float32 run is within twice
    eager's own, though it differs from eager by more than the fixed tolerance; on the same
    model an off-by-one decode still fails, and so does a prefill that ignores cached
    context (judged against the uncached run and the float32 one)."""
    from pagedgen.cli.verify.model_checks import (
        MODEL_TOL,
        check_model,
        check_prefix_cache,
        difference,
        references,
    )

    model, cpu = noisy_checkpoint(tmp_path / "deep"), torch.device("cpu")
    base, ref32 = references(model, "bfloat16", "cpu", 8, 0)
    assert difference(base, ref32)[1] > 2 * MODEL_TOL[torch.bfloat16]  # the model's noise
    row = check_model("sdpa", model, "bfloat16", cpu, 8, 0, False)
    assert row.passed and row.worst_rel > MODEL_TOL[torch.bfloat16], row
    assert "within 2x" in row.detail
    assert check_prefix_cache("sdpa", model, "bfloat16", cpu, 8, 0, 16).passed
    register_backend("broken-decode", "test_verify:OffByOneDecodeBackend")
    register_backend("broken-causal", "test_verify:WrongCausalOffsetBackend")
    try:
        row = check_model("broken-decode", model, "bfloat16", cpu, 8, 0, False)
        assert not row.passed, row
        row = check_prefix_cache("broken-causal", model, "bfloat16", cpu, 8, 0, 16)
        assert not row.passed and "against float32" in row.detail, row
    finally:
        del _BACKENDS["broken-decode"], _BACKENDS["broken-causal"]


def test_trace_follows_forced_tokens_and_records_the_models_logits():
    """Teacher forcing: the outputs are the forced tokens, and the logits recorded at each
    position are the model's for that context (not the forced row)."""
    from pagedgen.cli.verify.model_checks import model_config, trace
    from pagedgen.runtime.engine.engine import Engine

    cfg = model_config("eager", "tiny", "float32", torch.device("cpu"), 0, False)
    prompt = [5, 17, 42, 99, 3]
    free = trace(Engine(cfg), [prompt], 4)
    forced = [[t + 1 for t in free[1][0]]]  # never the argmax
    got = trace(Engine(cfg), [prompt], 4, forced)
    assert got[1] == forced
    torch.testing.assert_close(got[0][(0, 0)], free[0][(0, 0)])
    for pos in range(1, 4):  # the context forced so far, run as a prompt
        alone = trace(Engine(cfg), [prompt + forced[0][:pos]], 1)
        torch.testing.assert_close(got[0][(0, pos)], alone[0][(0, 0)], atol=1e-4, rtol=1e-4)
        assert torch.isfinite(got[0][(0, pos)]).all()


def test_dummy_weights_are_the_same_in_every_dtype():
    """A preset's dummy weights are drawn as a bfloat16 checkpoint stores them, so its float32
    run holds exactly the bfloat16 run's weights (verify's float32 reference needs this)."""
    from pagedgen.runtime.models.loader import build_model, resolve_model

    src, cpu = resolve_model("tiny"), torch.device("cpu")
    fp32 = dict(build_model(src, "dummy", torch.float32, cpu, seed=3).named_parameters())
    bf16 = dict(build_model(src, "dummy", torch.bfloat16, cpu, seed=3).named_parameters())
    assert fp32.keys() == bf16.keys()
    for name, p in bf16.items():
        assert torch.equal(fp32[name], p.float()), name


def test_a_model_too_large_for_float32_is_judged_without_that_run(monkeypatch):
    """When the float32 reference runs out of device memory the checks still run: against
    eager in the model's dtype with the fixed tolerance, saying why."""
    import pagedgen.runtime.engine.engine as engine_mod
    from pagedgen.cli.verify import model_checks as mc

    real = engine_mod.Engine

    class NoFloat32(real):
        def __init__(self, config, *a, **kw):
            if config.dtype == "float32":
                raise torch.OutOfMemoryError("CUDA out of memory (planted)")
            super().__init__(config, *a, **kw)

    monkeypatch.setattr(engine_mod, "Engine", NoFloat32)
    mc.references.cache_clear()
    try:
        cpu = torch.device("cpu")
        row = mc.check_model("sdpa", "tiny", "bfloat16", cpu, 4, 0, False)
        assert row.passed and mc.NO_FLOAT32 in row.detail, row
        row = mc.check_prefix_cache("sdpa", "tiny", "bfloat16", cpu, 4, 0, 16)
        assert row.passed and mc.NO_FLOAT32 in row.detail, row
    finally:
        mc.references.cache_clear()


def test_a_named_backend_that_cannot_run_here_is_not_a_pass(tmp_path):
    """`verify --backend flashinfer --device cpu` checks nothing: it must not say PASS or exit 0."""
    res = invoke("--backend", "flashinfer", *FAST, "-o", tmp_path / "t.json")
    assert res.exit_code == 3, res.output
    assert "NOT CHECKED" in res.output and "PASS" not in res.output
    assert "flashinfer cannot run on cpu" in res.output
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["passed"] is False and report["not_checked"] == ["flashinfer"]


def test_fp8_checks_asked_for_on_a_cpu_are_not_a_pass():
    res = invoke("--backend", "eager", *FAST, "-q", "fp8")
    assert res.exit_code == 3, res.output
    assert "fp8-linear cannot run on cpu" in res.output


def test_verify_json_is_the_report_on_stdout_as_generate_json_is_the_summary(tmp_path):
    # `--json` is a flag in both commands (issue 99); the file is -o's
    res = invoke("--backend", "sdpa", *FAST, "--json", "-o", tmp_path / "v.json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)  # stdout holds the report alone
    assert report == json.loads((tmp_path / "v.json").read_text()) and report["passed"]
    assert "PASS" in res.stderr and "verifying sdpa" not in res.stdout


def test_batch_invariance_reports_its_checks_rows(monkeypatch):
    """``verify --batch-invariance``: one report with a row per check (the checks stand in
    here: tests/test_batch_invariant.py runs them), exit 1 when one differs."""
    from pagedgen.cli.verify import invariance_checks as ic
    from pagedgen.cli.verify.report import Row

    seen = []
    for i, name in enumerate(("check_batches", "check_prefix_cache", "check_chunks",
                              "check_preemption", "check_seeded_sampling")):
        monkeypatch.setattr(ic, name, lambda *a, i=i, **k: seen.append(k["options"]) or Row(
            "model", f"row {i}", 1, float(i == 3), float(i == 3), 0.0, i != 3, "detail"))
    res = runner.invoke(app, ["verify", "--batch-invariance", "--device", "cpu", "--json",
                              "--kv-cache-dtype", "fp8"])
    report = json.loads(res.stdout[res.stdout.index("{"):])
    rows = report["backends"][0]["rows"]
    assert report["backends"][0]["backend"] == "batch invariance"
    assert [r["group"] for r in rows] == [f"row {i}" for i in range(5)]
    assert res.exit_code == 1 and not report["passed"]
    assert seen == [{"quantization": None, "kv_cache_dtype": "fp8"}] * 5  # to every check
    res = runner.invoke(app, ["verify", "--device", "cpu", "--kv-cache-dtype", "fp8"])
    assert res.exit_code == 2 and "goes with --batch-invariance" in res.output


def test_batch_invariance_that_cannot_run_here_is_not_a_pass(monkeypatch):
    """Where the mode cannot run, ``verify --batch-invariance`` checked nothing: NOT CHECKED,
    the mode's reason, exit 3 (not PASS with 0 of 0)."""
    from pagedgen.errors import PagedgenError
    from pagedgen.runtime.worker import batch_invariant

    def refuse(config):
        raise PagedgenError("--batch-invariant runs on the triton backend, which cannot run "
                            "here: a planted reason")

    monkeypatch.setattr(batch_invariant, "prepared", refuse)
    res = runner.invoke(app, ["verify", "--batch-invariance", "--device", "cpu", "--json"])
    report = json.loads(res.stdout[res.stdout.index("{"):])
    assert res.exit_code == 3 and not report["passed"]
    assert report["not_checked"] == ["batch invariance"]
    assert "a planted reason" in report["backends"][0]["reason"]


def test_a_run_is_invariant_only_when_tokens_and_logprobs_are_bitwise_the_same():
    from pagedgen.cli.verify.invariance_checks import _row

    want = ([5, 6, 7], [-0.5, -1.25, -2.0])
    assert _row("g", want, [want, ([5, 6, 7], [-0.5, -1.25, -2.0])], "").passed
    one_ulp = ([5, 6, 7], [-0.5, float(torch.tensor(-1.25).nextafter(torch.tensor(0.0))), -2.0])
    row = _row("g", want, [want, one_ulp], "")
    assert not row.passed and 0 < row.worst_abs < 1e-6 and row.detail.startswith("1 of 2")
    row = _row("g", want, [([5, 9, 7], [-0.5, -1.25, -2.0])], "")
    assert not row.passed and row.worst_abs == float("inf")
