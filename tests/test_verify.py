"""`pagedgen verify` passes correct backends and fails a deliberately broken one."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from pagedgen.attention.registry import _BACKENDS, register_backend
from pagedgen.attention.sdpa import SdpaBackend, SdpaImpl
from pagedgen.cli.main import app

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
            from pagedgen.attention.kv_cache import gather_kv
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


def test_verify_passes_sdpa_and_writes_json(tmp_path):
    res = invoke("--backend", "sdpa", *FAST, "--json", tmp_path / "v.json")
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["passed"] is True
    (rep,) = data["backends"]
    kinds = {r["kind"] for r in rep["rows"]}
    assert kinds == {"kernel", "model"}
    assert all(r["worst_abs"] <= r["tol"] for r in rep["rows"] if r["kind"] == "kernel")


def test_verify_in_worker_processes_gives_the_same_rows(tmp_path, monkeypatch):
    """--jobs 2 splits kernel groups into tasks run by 2 processes; the rows (worst errors
    over the same cases) equal a run in this process."""
    import pagedgen.cli.verify as verify_mod

    submitted = []

    class CountingPool(verify_mod.ProcessPoolExecutor):
        def submit(self, fn, *args):  # fn: the timing wrapper; args[0]: the task's function
            submitted.append(args[0].__name__)
            return super().submit(fn, *args)

    monkeypatch.setattr(verify_mod, "ProcessPoolExecutor", CountingPool)
    rows = {}
    for jobs in (1, 2):
        res = invoke("--backend", "sdpa", "--device", "cpu", "--cases", 8, "--steps", 2,
                     "--jobs", jobs, "--json", tmp_path / f"{jobs}.json")
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


def test_verify_all_lists_gpu_only_backends_as_skipped_on_cpu():
    res = invoke("--backend", "all", *FAST)
    assert res.exit_code == 0, res.output
    assert "flashinfer: skipped" in res.output or "flashinfer vs eager" in res.output


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
                         "--json", tmp_path / "v.json")
    assert res.exit_code == 1, res.output
    rows = json.loads((tmp_path / "v.json").read_text())["backends"][0]["rows"]
    prefix = [r for r in rows if r["group"].startswith("prefix-cached prefill")]
    assert len(prefix) == 2 and not any(r["passed"] for r in prefix)
    good = invoke("--backend", "sdpa", *FAST, "--json", tmp_path / "s.json")
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

    from pagedgen.cli.verify import _share_cores

    threads = torch.get_num_threads()
    monkeypatch.setenv("MAX_JOBS", "16")
    try:
        _share_cores(5)
        assert os.environ["MAX_JOBS"] == "3" and torch.get_num_threads() == 3
        _share_cores(32)
        assert os.environ["MAX_JOBS"] == "1"
    finally:
        torch.set_num_threads(threads)


class PrecompilingBackend(SdpaBackend):
    """SDPA that records what it is asked to compile ahead, and when (against its forwards)."""

    name = "precompiling"
    events: list = []

    @classmethod
    def precompile(cls, variants, device):
        cls.events.append(("precompile", variants))

    @staticmethod
    def get_impl_cls():
        class RecordingImpl(SdpaImpl):
            def forward(self, *args):
                PrecompilingBackend.events.append(("forward", None))
                return super().forward(*args)
        return RecordingImpl


def test_verify_compiles_every_variant_ahead_before_the_checks(tmp_path):
    PrecompilingBackend.events.clear()
    res = verify_planted("precompiling", "test_verify:PrecompilingBackend", "--jobs", 1,
                         "--json", tmp_path / "v.json")
    assert res.exit_code == 0, res.output
    events = PrecompilingBackend.events
    assert events[0][0] == "precompile" and [e for e, _ in events].count("precompile") == 1
    assert any(e == "forward" for e, _ in events[1:])
    got = {(s.head_size, s.sliding_window, s.logits_soft_cap, dt, kv) for s, dt, kv in events[0][1]}
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    for head in (64, 128, 256):  # every kernel group at every checked head size
        for dt in (f32, f16, bf16):
            assert {(head, None, None, dt, dt), (head, 19, None, dt, dt)} <= got
    assert (64, None, None, f32, f32) in got  # the tiny model's layers, float32 on the CPU
    rep = json.loads((tmp_path / "v.json").read_text())["backends"][0]
    assert rep["precompile_s"] > 0 and rep["precompile_error"] == ""


def test_verify_reports_a_failed_precompile_and_still_checks(monkeypatch):
    def broken(cls, variants, device):
        raise RuntimeError("nvcc exploded\nsecond line")

    monkeypatch.setattr(PrecompilingBackend, "precompile", classmethod(broken))
    res = verify_planted("precompiling", "test_verify:PrecompilingBackend", "--jobs", 1)
    assert res.exit_code == 0, res.output
    assert "compiling ahead failed (RuntimeError: nvcc exploded)" in res.output


def test_worker_tasks_of_a_precompiled_plan_start_after_its_build(tmp_path):
    """With worker processes, a plan's tasks are queued once its precompile is done, and the
    workers start at once on plans without one (here the precompile waits for such a task)."""
    import os
    import time
    from pathlib import Path

    from pagedgen.cli.verify import BackendReport, Check, Plan, Row, run_plans

    other, built = tmp_path / "other-ran", tmp_path / "built"

    def build(other: Path, built: Path) -> None:
        t = time.monotonic()
        while not other.exists():  # a worker ran the other plan's task meanwhile
            assert time.monotonic() - t < 120, "no worker started while compiling"
            time.sleep(0.05)
        built.touch()

    def row(results):
        return Row("kernel", "g", len(results), 0.0, 0.0, 0.0, all(results))

    plans = [Plan(BackendReport("compiled", "checked"),
                  [Check([(os.path.exists, (str(built),))] * 3, row)], (build, (other, built))),
             Plan(BackendReport("plain", "checked"),
                  [Check([(Path.touch, (other,))], lambda r: None)])]
    compiled, plain = run_plans(plans, jobs=2)
    assert [r.passed for r in compiled.rows] == [True]  # every task saw the build's output
    assert compiled.precompile_s > 0 and plain.precompile_s == 0
