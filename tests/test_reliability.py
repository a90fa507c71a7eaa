"""Bad input and faults as a new user meets them: one short line, no traceback, the right exit
code, and every file that was there before left byte for byte as it was (issue 29)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "4"]
PROMPTS = [{"id": i, "prompt": f"p{i}"} for i in range(3)]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() or p.is_symlink() and p.exists()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama",
                           with_tokenizer=True)


@pytest.fixture(scope="module")
def previous_output(tmp_path_factory) -> tuple[Path, Path]:
    """An input and the output a finished run made of it (with its resume record)."""
    d = tmp_path_factory.mktemp("done")
    src = write(d / "p.jsonl", PROMPTS)
    res = runner.invoke(app, ["generate", str(src), *FAST, "-o", str(d / "out.jsonl")])
    assert res.exit_code == 0, res.output
    return src, d / "out.jsonl"


def _copy_ckpt(ckpt: Path, dst: Path, edit: Callable[[Path], None]) -> Path:
    dst.mkdir()
    for f in ckpt.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    edit(dst)
    return dst


def _config(**fields) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **fields}))
    return edit


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100_000])


def _garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 40)


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


# (case id, input lines (None: the plain prompts), extra arguments, expected message). "{out}"
# is an output that already holds a finished run's lines; "{ckpt:EDIT}" a copy of the test
# checkpoint with EDIT applied; "{yaml:TEXT}" a profile file with TEXT.
CASES = [
    # data loss: the output is an input, or a failing start-up over an existing output
    ("output-hard-link", None, ["-o", "{hardlink}"], r"is the prompts file"),
    ("output-symlink", None, ["-o", "{symlink}"], r"is the prompts file"),
    ("backend-unknown", None, ["-o", "{out}", "--overwrite", "--backend", "nope"],
     r"unknown backend 'nope'"),
    ("dtype-unknown", None, ["-o", "{out}", "--overwrite", "--dtype", "float17"],
     r"unknown dtype 'float17'"),
    ("num-blocks-0", None, ["-o", "{out}", "--overwrite", "--num-blocks", "0"],
     r"--num-blocks must be in 2\.\."),
    ("no-weights", None, ["-o", "{out}", "--overwrite", "--model", "{ckpt:no_weights}"],
     r"has no \*\.safetensors weights"),
    ("truncated-weights", None, ["-o", "{out}", "--overwrite", "--model", "{ckpt:truncate}"],
     r"model\.safetensors: cannot read the weights: .*truncated"),
    ("garbage-weights", None, ["-o", "{out}", "--overwrite", "--model", "{ckpt:garbage}"],
     r"model\.safetensors: cannot read the weights"),
    ("config-smaller-than-weights", None,
     ["-o", "{out}", "--overwrite", "--model", "{ckpt:small_ffn}"],
     r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \[\d+, "
     r"\d+\]; the config makes it"),
    ("config-hidden-size", None, ["-o", "{out}", "--overwrite", "--model", "{ckpt:hidden}"],
     r"model\.safetensors: tensor '[\w.]+' has shape"),
    ("output-exists", None, ["-o", "{out}"], r"already holds completions of this input; "
                                              r"--resume finishes it, --overwrite replaces it"),
    ("resume-foreign-input", [{"id": 0, "prompt": "other"}], ["-o", "{out}", "--resume"],
     r"was made from another input"),
    ("resume-other-settings", None, ["-o", "{out}", "--resume", "--temperature", "0.5"],
     r"was made with temperature = 0\.8, this run has 0\.5"),
    ("resume-and-overwrite", None, ["-o", "{out}", "--resume", "--overwrite"],
     r"--resume keeps .* give one"),
    # values checked at the edge
    ("json-nan", ['{"prompt": "a", "temperature": NaN}'], [], r"p\.jsonl:1: invalid JSON: NaN"),
    ("json-infinity", ['{"prompt": "a", "top_p": -Infinity}'], [], r"p\.jsonl:1: .*Infinity"),
    ("cli-nan", None, ["--temperature", "nan"], r"temperature must be a finite number"),
    ("cli-inf", None, ["--top-p", "inf"], r"top_p must be a finite number"),
    ("yaml-nan", None, ["--profile", "{yaml:sampling:\n  temperature: .nan\n}"],
     r"profile\.yaml:3: temperature must be a finite number"),
    ("stop-empty", [{"prompt": "a", "stop": ""}], [], r"p\.jsonl:1: stop strings must not be "
                                                     r"empty"),
    ("stop-empty-in-list", [{"prompt": "a", "stop": ["x", ""]}], [], r"stop strings must not"),
    ("top-k-huge", [{"prompt": "a", "top_k": 10**20}], [], r"p\.jsonl:1: top_k must be in 0\.\."),
    ("seed-huge", [{"prompt": "a", "seed": 2**70}], [], r"p\.jsonl:1: seed must fit in 64"),
    ("max-tokens-huge", [{"prompt": "a", "max_tokens": 2**40}], [], r"max_tokens must be at "),
    ("json-deep", ['{"prompt": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}"], [],
     r"p\.jsonl:1: invalid JSON: nested deeper than 64"),
    ("json-deeper-than-64", ['{"prompt": "a", "x": ' + "[" * 100 + "]" * 100 + "}"], [],
     r"p\.jsonl:1: invalid JSON: nested deeper than 64"),
    ("json-huge-number", ['{"prompt": "a", "seed": ' + "9" * 5000 + "}"], [],
     r"p\.jsonl:1: invalid JSON"),
    ("yaml-type", None, ["--profile", "{yaml:engine:\n  max_num_seqs: four\n}"],
     r"profile\.yaml:3: max_num_seqs must be an integer or null, not 'four'"),
    ("yaml-syntax", None, ["--profile", "{yaml:engine:\n  max_num_seqs: [1\n}"],
     r"profile\.yaml:\d: invalid YAML"),
    ("yaml-unknown-field", None, ["--profile", "{yaml:sampling:\n  temprature: 1\n}"],
     r"profile\.yaml:3: unknown field 'temprature'"),
    ("yaml-section-not-mapping", None, ["--profile", "{yaml:engine: 3\n}"],
     r"profile\.yaml:2: 'engine' must be a mapping"),
    ("invalid-utf8-line-1500", "utf8", [], r"p\.jsonl:1500: not UTF-8"),
    ("max-num-seqs-0", None, ["--max-num-seqs", "0"], r"--max-num-seqs must be in 1\.\."),
    ("gpu-memory-utilization", None, ["--gpu-memory-utilization", "1.5"],
     r"--gpu-memory-utilization must be in \(0, 1\]"),
    ("kv-cache-dtype-fp4", None, ["--kv-cache-dtype", "fp4"],
     r"unknown KV-cache dtype 'fp4'; use auto, fp8"),
    ("kv-cache-memory-nan", None, ["--kv-cache-memory", "nan"], r"cannot read a memory size"),
    ("mixed-formats", [{"prompt": "a"}, {"custom_id": "c", "method": "POST",
                                         "url": "/v1/completions", "body": {"prompt": "x"}}],
     [], r"p\.jsonl:2: an OpenAI batch line, but the input's first line .* one input holds one "
         r"format"),
    ("stdin-needs-output", "stdin", [], r"-: reading from a pipe or standard input: give "
                                        r"--output"),
    ("kv-cache-too-small", [{"prompt": "x" * 400}], ["--kv-cache-memory", "1MiB"],
     r"p\.jsonl:1: the prompt has 401 tokens; the KV cache holds 240 tokens .* give more "
     r"--kv-cache-memory"),
]


@pytest.mark.parametrize("case,lines,args,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_touches_nothing(tmp_path, previous_output, checkpoint, case,
                                                   lines, args, message):
    src = tmp_path / "p.jsonl"
    if lines == "stdin":
        src = Path("-")
    elif lines == "utf8":
        text = "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(1499))
        src.write_bytes(text.encode() + b'{"prompt": "caf\xe9"}\n')
    else:
        write(src, PROMPTS if lines is None else lines)
    prev_src, prev_out = previous_output
    edits = {"no_weights": _no_weights, "truncate": _truncate, "garbage": _garbage,
             "small_ffn": _config(intermediate_size=128), "hidden": _config(hidden_size=64)}
    argv = []
    for a in args:
        if a == "{out}":
            (tmp_path / "out.jsonl").write_bytes(prev_out.read_bytes())
            rec = prev_out.with_name(prev_out.name + ".resume.json")
            (tmp_path / rec.name).write_bytes(rec.read_bytes())
            if lines is None:
                src.write_bytes(prev_src.read_bytes())
            a = str(tmp_path / "out.jsonl")
        elif a == "{hardlink}":
            os.link(src, tmp_path / "link.jsonl")
            a = str(tmp_path / "link.jsonl")
        elif a == "{symlink}":
            (tmp_path / "sub").mkdir()
            (tmp_path / "sub" / "s.jsonl").symlink_to(src)
            a = str(tmp_path / "sub" / "s.jsonl")
        elif a.startswith("{ckpt:"):
            a = str(_copy_ckpt(checkpoint, tmp_path / "ck", edits[a[6:-1]]))
        elif a.startswith("{yaml:"):
            (tmp_path / "profile.yaml").write_text("model: tiny\n" + a[6:-1])
            a = str(tmp_path / "profile.yaml")
        argv.append(a)
    before = snapshot(tmp_path)
    res = runner.invoke(app, ["generate", *STOP, str(src), *FAST, *argv], input="")
    assert res.exit_code == 1, res.output
    text = res.output.strip()
    assert len(text.splitlines()) <= 3 and "Traceback" not in text, text
    assert text.startswith("error: ") and re.search(message, text.replace("\n", "")), text
    assert snapshot(tmp_path) == before  # nothing created, changed or removed


def invoke(*args) -> object:
    return runner.invoke(app, ["generate", *map(str, args)])


def test_overwrite_replaces_only_at_the_first_line(tmp_path, previous_output):
    prev_src, prev_out = previous_output
    src = write(tmp_path / "p.jsonl", [{"id": 0, "prompt": "new"}])
    out = tmp_path / "out.jsonl"
    out.write_bytes(prev_out.read_bytes())
    res = invoke(src, *FAST, "-o", out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert [json.loads(l)["prompt"] for l in out.read_text().splitlines()] == ["new"]
    assert json.loads((tmp_path / "out.jsonl.resume.json").read_text())["settings"]["max_tokens"] \
        == 4
    assert not (tmp_path / ".out.jsonl.lock").exists()  # released and removed


def test_stdin_is_an_input(tmp_path):
    out = tmp_path / "o.jsonl"
    text = "".join(json.dumps(p) + "\n" for p in PROMPTS)
    res = runner.invoke(app, ["generate", "-", *FAST, "-o", str(out)], input=text)
    assert res.exit_code == 0, res.output
    assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == [0, 1, 2]
    res = runner.invoke(app, ["generate", "-", *FAST, "-o", str(out), "--resume"], input=text)
    assert res.exit_code == 0, res.output  # the same content resumes, from a pipe too


def test_one_long_request_alone_fits_the_auto_sized_cache(tmp_path):
    """A 2,047-token prompt (the tiny preset's context is 2,048) runs alone in its file: the
    CPU cache is sized for one whole sequence besides the scratch block."""
    src = write(tmp_path / "p.jsonl", [{"prompt": "x" * 2046, "max_tokens": 1}])
    res = invoke(src, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    line = json.loads((tmp_path / "p.completions.jsonl").read_text())
    assert line["num_prompt_tokens"] == 2047 and line["num_output_tokens"] == 1


def test_resume_redoes_a_line_damaged_in_the_middle(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(6)])
    clean = tmp_path / "clean.jsonl"
    assert invoke(src, *FAST, "-o", clean).exit_code == 0
    out = tmp_path / "o.jsonl"
    assert invoke(src, *FAST, "-o", out).exit_code == 0
    lines = out.read_text().splitlines()
    lines[2] = lines[2][:-5] + "xx"  # not JSON any more
    lines[4] = json.dumps({**json.loads(lines[4]), "finish_reason": None})  # not a whole record
    out.write_text("\n".join(lines) + "\n")
    res = invoke(src, *FAST, "-o", out, "--resume", "--json")
    assert res.exit_code == 0, res.output
    assert "2 damaged or repeated line(s) are dropped" in res.output.replace("\n", " ")
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped_resumed"] == 4
    assert out.read_text() == clean.read_text()


def test_interrupts_in_process_keep_the_output_resumable(tmp_path, monkeypatch):
    """Ctrl-C while the model loads, and SIGTERM mid-run (as ``Terminated``): one line, exit
    codes 130 and 143, the output as it was or with whole lines only; --resume finishes it."""
    import pagedgen.runtime.drivers.driver as gen
    from pagedgen.errors import Terminated

    src = write(tmp_path / "p.jsonl", [{"id": i, "prompt": f"p{i}", "max_tokens": 2 + i % 5}
                                       for i in range(12)])
    clean = tmp_path / "clean.jsonl"
    assert invoke(src, *FAST, "-o", clean, "--max-num-seqs", "2").exit_code == 0
    out = tmp_path / "o.jsonl"
    real = gen.Replica

    class LoadInterrupted(real):
        def __init__(self, *a, **kw):
            raise KeyboardInterrupt

    monkeypatch.setattr(gen, "Replica", LoadInterrupted)
    res = invoke(src, *FAST, "-o", out, "--max-num-seqs", "2")
    assert res.exit_code == 130 and "interrupted: no completions were written" in res.output
    assert not out.exists() and not (tmp_path / ".o.jsonl.lock").exists()

    class TerminatedMidRun(real):
        def stream(self, requests):
            for i, step in enumerate(super().stream(requests)):
                if i == 6:
                    raise Terminated()
                yield step

    monkeypatch.setattr(gen, "Replica", TerminatedMidRun)
    res = invoke(src, *FAST, "-o", out, "--max-num-seqs", "2")
    assert res.exit_code == 143, res.output
    assert re.search(r"terminated \(SIGTERM\): \d+ of 12 requests are in .*--resume",
                     res.output.replace("\n", ""))
    kept = out.read_text().splitlines()
    assert 0 < len(kept) < 12 and all(json.loads(line)["finish_reason"] for line in kept)
    monkeypatch.setattr(gen, "Replica", real)
    assert invoke(src, *FAST, "-o", out, "--max-num-seqs", "2", "--resume").exit_code == 0
    assert out.read_text() == clean.read_text()


# ---- real processes: locks and signals ---------------------------------------------------------

def _start(*args: object) -> subprocess.Popen:
    """``pagedgen generate ARGS`` in a process of its own, with SIGINT's default action (a
    shell's background job, as CI may run us in, would pass it on ignored)."""
    return subprocess.Popen([sys.executable, "-m", "pagedgen.cli.main", "generate",
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_DFL))


def _wait_for(cond: Callable[[], bool], proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


SLOW = ["--device", "cpu", "--max-tokens", "24", "--max-num-seqs", "2"]


@pytest.fixture(scope="module")
def slow_input(tmp_path_factory) -> tuple[Path, Path]:
    """36 requests that take seconds on the CPU, and their finished output."""
    d = tmp_path_factory.mktemp("slow")
    src = write(d / "p.jsonl", [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(36)])
    clean = d / "clean.jsonl"
    res = invoke(src, *SLOW, "-o", clean)
    assert res.exit_code == 0, res.output
    return src, clean


@pytest.mark.process
def test_a_second_writer_stops_at_once_naming_the_first(tmp_path, slow_input):
    src, clean = slow_input
    out = tmp_path / "o.jsonl"
    first = _start(src, *SLOW, "-o", out)
    try:
        _wait_for(lambda: _lines(out) >= 2, first)
        for extra in ([], ["--resume"], ["--overwrite"]):
            res = invoke(src, *SLOW, "-o", out, *extra)
            assert res.exit_code == 1, res.output
            assert re.search(rf"another pagedgen run is writing it \(process {first.pid} on ",
                             res.output.replace("\n", "")), res.output
        assert first.wait(timeout=300) == 0, first.communicate()
    finally:
        first.kill()
    assert out.read_text() == clean.read_text()


@pytest.mark.parametrize("sig,code", [(signal.SIGKILL, -9), (signal.SIGTERM, 143),
                                      (signal.SIGINT, 130)])
@pytest.mark.process
def test_a_killed_run_resumes_to_each_id_once_in_order(tmp_path, slow_input, sig, code):
    src, clean = slow_input
    out = tmp_path / "o.jsonl"
    proc = _start(src, *SLOW, "-o", out)
    try:
        _wait_for(lambda: _lines(out) >= 3, proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    if sig != signal.SIGKILL:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "requests are in" in err and "--resume" in err
    res = invoke(src, *SLOW, "-o", out, "--resume")
    assert res.exit_code == 0, res.output
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(36)]
    assert out.read_text() == clean.read_text()


@pytest.mark.process
def test_ctrl_c_during_the_imports_is_one_line(tmp_path):
    src = write(tmp_path / "p.jsonl", PROMPTS)
    proc = _start(src, *FAST)
    time.sleep(0.5)  # the interpreter is up; torch takes seconds to import
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.completions.jsonl").exists()


def test_summary_is_grouped_and_fits_100_columns(tmp_path):
    from rich.console import Console

    from pagedgen.cli.summary import summary_table

    src = write(tmp_path / "p.jsonl", PROMPTS)
    res = invoke(src, *FAST, "--json")
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(summary_table(summary, full=True))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 100
    for group in ("run", "throughput (tokens/s)", "latency", "KV cache and prefix cache",
                  "memory", "start-up"):
        assert re.search(rf"│ {re.escape(group)} +│", text), group
    assert re.search(r"samples \(all n of each request\) +│ +3 │", text)
    assert "of which: model" in text  # the start-up breakdown, a row per phase


def test_help_shows_brackets_and_defaults():
    res = runner.invoke(app, ["generate", "--help"], terminal_width=100)
    text = " ".join(res.output.split())
    assert "[default: PROMPTS.completions.jsonl;" in text
    assert "[default: the profile's, else tiny]" in text
    assert "[default: the profile's, else vLLM's rule: 1024 on a GPU" in text  # --max-num-seqs


def test_a_request_that_ends_without_a_line_is_an_error_not_a_gap(tmp_path, monkeypatch):
    """If the engine ever ends a request without its line (as a scheduler bug once did: a
    sample that never ran), the run says so and fails; --resume then runs the missing one."""
    from pagedgen.runtime.drivers import replica

    src = write(tmp_path / "p.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(4)])
    out = tmp_path / "o.jsonl"
    args = ["generate", str(src), "-o", str(out), "--device", "cpu", "--max-tokens", "4"]
    real = replica.finished_requests

    def drop_request_2(finished):
        return [g for g in real(finished) if g[0].request.index != 2]

    monkeypatch.setattr(replica, "finished_requests", drop_request_2)
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "1 of 4 requests ended without an output line" in " ".join(res.output.split())
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [0, 1, 3]
    monkeypatch.setattr(replica, "finished_requests", real)
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [0, 1, 2, 3]


@pytest.mark.process
def test_a_model_larger_than_the_free_memory_is_one_line_before_it_loads(tmp_path, monkeypatch):
    """Checked on the meta device, before any allocation: otherwise a CPU run of a large preset
    is killed by the OOM killer minutes later (a GPU run: CUDA's out-of-memory traceback)."""
    from pagedgen.runtime import hardware

    src = write(tmp_path / "p.jsonl", PROMPTS)
    before = snapshot(tmp_path)
    monkeypatch.setattr(hardware, "available_memory", lambda device: 1 << 20)
    res = runner.invoke(app, ["generate", str(src), *FAST, "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 1, res.output
    assert re.fullmatch(r"error: tiny needs [\d.]+ MiB for its weights and this machine has "
                        r"1\.0 MiB free: run it on a GPU \(--device cuda\) or choose a smaller "
                        r"model", res.output.strip().replace("\n", " ")), res.output
    assert snapshot(tmp_path) == before
    monkeypatch.undo()
    free = hardware.available_memory(__import__("torch").device("cpu"))
    if free is None or free > 120 * 2**30:
        pytest.skip("this machine's memory is unknown or holds a 70B model")
    t0 = time.perf_counter()
    res = runner.invoke(app, ["generate", str(src), "--model", "llama-3-70b", *FAST, "-o",
                              str(tmp_path / "o.jsonl")])
    assert res.exit_code == 1, res.output  # its profile: 2 ranks, both on this machine
    assert "llama-3-70b needs 131.4 GiB for its weights (2 tensor-parallel ranks)" \
        in res.output.replace("\n", " "), res.output
    assert time.perf_counter() - t0 < 30 and snapshot(tmp_path) == before


def test_free_gpu_memory_counts_what_torch_holds_cached(monkeypatch):
    """A dropped engine's memory stays in torch's cache, free for the next one (verify and the
    benchmarks build engines one after another): counting only the driver's free memory
    would refuse a model that fits."""
    import torch

    from pagedgen.runtime import hardware

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 << 30)
    assert hardware.available_memory(torch.device("cuda", 0)) == 43 << 30


@pytest.mark.parametrize("with_lock_descriptor", [True, False])
def test_the_output_lock_keeps_a_second_holder_out(tmp_path, monkeypatch, with_lock_descriptor):
    """filelock's lock_descriptor, or flock where filelock is older than 3.30: a second lock
    on the same output fails naming the holder, and is taken once the first lets go."""
    import importlib

    import filelock

    from pagedgen.cli.formats import output_claim
    from pagedgen.errors import PagedgenError
    if not with_lock_descriptor:
        monkeypatch.delattr(filelock, "lock_descriptor")
    mod = importlib.reload(output_claim)
    try:
        out = tmp_path / "o.jsonl"
        first, second = mod.OutputLock(out), mod.OutputLock(out)
        first.acquire()
        with pytest.raises(PagedgenError, match=rf"another pagedgen run is writing it "
                                                rf"\(process {os.getpid()} on "):
            second.acquire()
        first.release()
        second.acquire()
        assert second.held
        second.release()
    finally:
        monkeypatch.undo()
        importlib.reload(output_claim)


@pytest.mark.parametrize("cls, name, value, why", [
    ("EngineConfig", "max_num_seqs", True, "must be an integer or null, not True"),
    ("EngineConfig", "max_model_len", "4096", "must be an integer or null, not '4096'"),
    ("EngineConfig", "gpu_memory_utilization", float("nan"), "must be a finite number, not nan"),
    ("EngineConfig", "kv_cache_memory", 4.5, "must be a string or an integer or null, not 4.5"),
    ("EngineConfig", "enforce_eager", 1, "must be true or false, not 1"),
    ("SamplingParams", "stop", ("a",), "must be a list of strings, not ('a',)"),
    ("SamplingParams", "stop_token_ids", [1, False], "must be a list of integers"),
    ("SamplingParams", "logit_bias", {1: float("inf")}, "must be an object of token id: bias"),
    ("SamplingParams", "temperature", 1, None),  # an integer is a number
    ("SamplingParams", "logit_bias", {5: -2}, None),
])
def test_a_setting_of_the_wrong_type_is_refused_as_it_is_not_coerced(cls, name, value, why):
    # profiles, options and request lines share these checks (pydantic, strict): nothing is
    # coerced (a quoted number, 1 for true, a tuple for a list) and no float is NaN or infinite
    from pagedgen.runtime import config

    got = config.type_error(getattr(config, cls), name, value)
    assert (got is None) if why is None else (why in (got or ""))
