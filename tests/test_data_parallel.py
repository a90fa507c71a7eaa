"""``-dp N``: replicas in worker processes, the requests dealt by cost and prefix, one output."""

from __future__ import annotations

import json
from array import array

import pytest
import torch
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.drivers.data_parallel import PREFIX_TOKENS, deal
from pagedgen.runtime.inputs.request import Request

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

runner = CliRunner()


def write(path, n: int = 24):
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"prompt {i} " * (i % 4 + 1),
                                        "max_tokens": i % 5 + 1}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.process
def test_dp2_writes_the_dp1_file_and_resumes(tmp_path):
    src = write(tmp_path / "p.jsonl")
    common = ["generate", src, "--device", "cpu", "--temperature", "0", "--max-num-seqs", "4"]
    assert runner.invoke(app, [*common, "-o", str(tmp_path / "one.jsonl")]).exit_code == 0
    out = tmp_path / "dp.jsonl"
    res = runner.invoke(app, [*common, "-o", str(out), "-dp", "2", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["data_parallel_size"] == 2 and summary["requests"] == 24
    assert all(" 0 requests" not in summary[f"replica_{i}"] for i in range(2))
    want = (tmp_path / "one.jsonl").read_text()
    assert out.read_text() == want
    lines = want.splitlines()
    out.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # killed mid-line
    res = runner.invoke(app, [*common, "-o", str(out), "-dp", "2", "--resume", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped_resumed"] == 5
    assert out.read_text() == want


@pytest.mark.process
def test_a_failing_worker_is_a_one_line_error(tmp_path):
    src = write(tmp_path / "p.jsonl", 4)
    res = runner.invoke(app, ["generate", src, "--device", "cpu", "-dp", "2",
                              "--kv-cache-memory", "1KiB"])
    assert res.exit_code == 1
    assert "data parallel: worker" in res.output and "needs at least 2" in res.output
    assert "Traceback" not in res.output


@pytest.mark.process
def test_bad_dp_options(tmp_path):
    src = write(tmp_path / "p.jsonl", 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": 5}\n')
    res = runner.invoke(app, ["generate", *STOP, str(bad), "--device", "cpu", "-dp", "2"])
    assert res.exit_code == 1 and "bad.jsonl:2: 'prompt' must be a non-empty string" in \
        res.output.replace("\n", "")  # the workers, started early, are stopped
    for args, message in [(["-dp", "0"], "--data-parallel-size must be >= 1"),
                          (["-dp", "2", "--ray", "local"], "give one"),
                          (["-dp", "64", "--device", "cuda"], "-dp 64 needs 64 GPUs"
                           if torch.cuda.is_available() else "CUDA is not available here")]:
        res = runner.invoke(app, ["generate", *STOP, src, *args])
        assert res.exit_code == 1 and message in res.output.replace("\n", ""), res.output


def test_deal_balances_cost_and_keeps_prefixes_together():
    def req(i, ids, max_tokens=8):
        return Request(index=i, line=i + 1, id=i, prompt_token_ids=array("i", ids),
                       overrides={"max_tokens": max_tokens})

    shared = list(range(3, 3 + PREFIX_TOKENS))
    reqs = [req(i, shared + [1000 + i] * (PREFIX_TOKENS + 5)) for i in range(6)]  # one group
    reqs += [req(6 + i, [7] * (10 + 20 * i), max_tokens=4) for i in range(20)]  # singles
    parts = deal(reqs, 2, SamplingParams())
    assert sorted(r.index for p in parts for r in p) == list(range(26))  # each once
    assert all([r.index for r in p] == sorted(r.index for r in p) for p in parts)
    group_parts = {k for k, p in enumerate(parts) for r in p if r.index < 6}
    assert len(group_parts) == 1  # the shared-prefix group stayed on one replica

    def cost(p):
        return sum(len(r.prompt_token_ids) + r.overrides["max_tokens"] for r in p)

    a, b = cost(parts[0]), cost(parts[1])
    assert abs(a - b) <= max(len(r.prompt_token_ids) + 8 for r in reqs)
    # a group larger than a replica's share is cut, so every replica works
    big = [req(i, shared + [5] * (PREFIX_TOKENS + 5)) for i in range(8)]
    assert all(len(p) == 4 for p in deal(big, 2, SamplingParams()))
