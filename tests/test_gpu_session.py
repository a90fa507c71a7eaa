"""``.ci/gpu_session.sh``, the GPU machine's driver over ``.ci/gpu_steps.yaml``: every step is
well formed (what it measures, a limit a call can hold, a report the report module has), and
the driver runs steps under their limits, reports them, skips what needs more GPUs and names
an unknown step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import session_report

ROOT = Path(__file__).resolve().parents[1]
STEPS = yaml.safe_load((ROOT / ".ci" / "gpu_steps.yaml").read_text())


def test_every_step_says_what_it_measures_and_fits_one_call():
    for name, step in STEPS.items():
        assert {"about", "limit", "run"} <= set(step), name
        assert 0 < step["limit"] <= 580, name  # a call runs at most 600 s
        assert step.get("gpus", 1) in (1, 2), name
        assert ("report" in step) == ("reads" in step), name
        assert step.get("report", "peers") in session_report.REPORTS, name


def test_the_peers_report_prints_each_systems_runs_and_ratio(capsys):
    session_report.main(["peers", str(ROOT / "benchmarks/results/"
                                      "h100-t-fp8-kv-same-lease-vllm.json")])
    out = capsys.readouterr().out
    assert "runs tok/s [15049, 15037]" in out and "1.18" in out and "[12753, 12753]" in out


@pytest.mark.process
def test_the_driver_runs_reports_times_out_and_skips(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"backend": "triton", "kind": "decode", "ms": 0.5,
                                 "GB_s": 2000.0}]))
    steps = {"ok": {"about": "a", "limit": 20, "run": "echo hello; echo done",
                    "report": "attention", "reads": str(rows)},
             "plain": {"about": "b", "limit": 20, "run": "echo first; echo last"},
             "slow": {"about": "c", "limit": 1, "run": "sleep 5"},
             "two": {"about": "d", "limit": 20, "gpus": 2, "run": "echo never"}}
    (tmp_path / "steps.yaml").write_text(yaml.safe_dump(steps))
    env = dict(os.environ, GPU_STEPS=str(tmp_path / "steps.yaml"), GPUS="1",
               OUT=str(tmp_path / "out"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", str(ROOT / ".ci/gpu_session.sh"), "ok", "plain", "slow",
                          "two", "nope"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert "triton decode" in out and "2000 GB/s" in out  # ok's report
    assert "last" in out  # plain's log tail
    assert re.search(r"slow: \d+ s, exit 124 \(its limit, 1 s\)", out)
    assert "== two: skipped (needs 2 GPU(s), this machine has 1)" in out
    assert "unknown step 'nope'" in out
    assert (tmp_path / "out" / "session.tgz").exists()
    assert (tmp_path / "out" / "session" / "ok.log").read_text() == "hello\ndone\n"
