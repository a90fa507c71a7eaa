"""`pagedgen generate` and `pagedgen backends` end to end, including bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "6"]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def read(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_generate_writes_every_field_in_input_order(tmp_path):
    src = write(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "hello", "max_tokens": 3},
        {"prompt_token_ids": [256, 65, 66]},
        "",
        {"id": 7, "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
        {"id": "s", "prompt": "x", "stop": ["\u0000"], "seed": 5, "top_k": 3, "top_p": 0.5},
    ])
    res = invoke("generate", src, *FAST, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["requests"] == 4 and summary["output_tokens"] > 0
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "total_tokens_per_s",
                "mean_ttft_s", "mean_tpot_s", "peak_memory_bytes", "wall_time_s"):
        assert key in summary
    out = read(tmp_path / "p.completions.jsonl")
    assert [r["id"] for r in out] == ["a", 1, 7, "s"]
    assert out[0]["num_output_tokens"] == 3 and out[0]["finish_reason"] == "length"
    assert out[1]["num_prompt_tokens"] == 3
    for r in out:
        assert set(r) == {"id", "prompt", "text", "token_ids", "num_prompt_tokens",
                          "num_output_tokens", "finish_reason"}
        assert r["finish_reason"] in ("stop", "length")
        assert len(r["token_ids"]) == r["num_output_tokens"]


def test_generate_is_reproducible_and_resume_skips_done_ids(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(4)])
    out = tmp_path / "o.jsonl"
    assert invoke("generate", src, *FAST, "-o", out).exit_code == 0
    first = read(out)
    # simulate a crash after two lines, the second cut short
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n" + lines[1][:10])
    res = invoke("generate", src, *FAST, "-o", out, "--resume", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped_resumed"] == 1
    assert read(out) == first


def test_profile_and_options_apply(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("model: tiny\nengine: {block_size: 8, load_format: dummy}\n"
                    "sampling: {max_tokens: 2, temperature: 0.0}\n")
    src = write(tmp_path / "p.jsonl", [{"prompt": "abc"}])
    res = invoke("generate", src, "--profile", prof, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    assert read(tmp_path / "p.completions.jsonl")[0]["num_output_tokens"] == 2


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "a"}', '{"prompt": '], r"p.jsonl:2: invalid JSON"),
    ([], r"p.jsonl: no requests \(the file is empty\)"),
    (["", "   ", "\t"], r"p.jsonl: no requests \(only blank lines\)"),
    ([{"prompt": "a", "temprature": 1}], r"p.jsonl:1: unknown field 'temprature' \(did you "
                                          r"mean 'temperature'\?"),
    ([{"prompt": "a", "logprobs": 21}], r"p.jsonl:1: logprobs must be in 0..20"),
    ([{"prompt": "a", "max_tokens": 0}], r"p.jsonl:1: max_tokens must be >= 1 \(0 only with "
                                         r"prompt_logprobs"),
    ([{"prompt": 5}], r"p.jsonl:1: 'prompt' must be a non-empty string"),
    ([{"prompt": "a", "max_tokens": "ten"}], r"p.jsonl:1: 'max_tokens' must be an integer"),
    ([{"prompt": "a", "top_p": 2}], r"p.jsonl:1: top_p must be in"),
    ([{"prompt": "a"}, {"prompt": "x" * 5000}], r"p.jsonl:2: the prompt has 5,001 tokens"),
    ([{"prompt": "a", "prompt_token_ids": [1]}], r"p.jsonl:1: need exactly one of"),
    (["[1, 2]"], r"p.jsonl:1: expected a JSON object"),
    ([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}], r"p.jsonl:2: duplicate id 1"),
    ([{"prompt": "a", "n": 0}], r"p.jsonl:1: n must be in 1..128"),
    ([{"prompt": "a"}, {"prompt": "a", "n": 129}], r"p.jsonl:2: n must be in 1..128"),
    ([{"prompt": "a", "n": 2.5}], r"p.jsonl:1: 'n' must be an integer"),
    ([{"prompt": "a", "n": True}], r"p.jsonl:1: 'n' must be an integer"),
    ([{"prompt": "a", "n": 100}], r"p.jsonl:1: n = 100 samples run as 100 sequences at once; "
                                  r"profile tiny:\d+: engine.max_num_seqs is 32"),
])
def test_bad_input_gives_one_line_error(tmp_path, lines, message):
    import re
    src = write(tmp_path / "p.jsonl", lines)
    res = invoke("generate", *STOP, src, *FAST)
    assert res.exit_code == 1
    assert re.search(message, res.output.replace("\n", "")), res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "p.completions.jsonl").exists()


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir"], "model directory /no/such/dir does not exist"),
    (["--model", "nosuchpreset"], "neither a checkpoint directory, a .gguf file nor a preset"),
    (["--backend", "nope"], "unknown backend 'nope'; choose auto or one of"),
    (["--dtype", "float8"], "unknown dtype"),
    (["--profile", "nope"], "profile 'nope' not found"),
])
def test_bad_options_give_one_line_error(tmp_path, args, message):
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    res = invoke("generate", src, *FAST, *args)
    assert res.exit_code == 1 and message in res.output.replace("\n", ""), res.output
    assert "Traceback" not in res.output


def test_a_weights_file_as_model_names_its_folder(tmp_path):
    """``--model dir/model.safetensors``: the message says to give the folder (and that it
    needs a config.json), not that a directory does not exist."""
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    for config, want in ((False, "which needs the checkpoint's config.json beside it"),
                         (True, f"takes its folder ({ckpt})")):
        if config:
            (ckpt / "config.json").write_text("{}")
        res = invoke("generate", src, *FAST, "--model", ckpt / "model.safetensors")
        text = res.output.replace("\n", "")
        assert res.exit_code == 1 and "is a weights file" in text and want in text, text
    res = invoke("generate", src, *FAST, "--model", ckpt / "other.bin")
    assert "other.bin: no such weights file" in res.output.replace("\n", ""), res.output


def test_finished_output_survives_a_later_bad_run(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    out = tmp_path / "o.jsonl"
    assert invoke("generate", src, *FAST, "-o", out).exit_code == 0
    before = out.read_text()
    write(src, [{"prompt": "a"}, "{oops"])
    assert invoke("generate", src, *FAST, "-o", out).exit_code == 1
    assert out.read_text() == before


def test_checkpoint_with_tokenizer_and_chat_template(tmp_path):
    ckpt = make_checkpoint("qwen3", tmp_path / "ckpt", with_tokenizer=True)
    src = write(tmp_path / "p.jsonl", [
        {"id": "chat", "messages": [{"role": "user", "content": "a b c"}]},
        {"id": "text", "prompt": "d e f", "temperature": 0}])
    res = invoke("generate", src, "--model", ckpt, *FAST, "--json")
    assert res.exit_code == 0, res.output
    out = read(tmp_path / "p.completions.jsonl")
    assert out[0]["num_prompt_tokens"] == 5  # "user a b c a" under the test template
    assert out[1]["prompt"] == "d e f"
    assert isinstance(out[1]["text"], str)


def test_backends_lists_every_backend_with_a_reason():
    res = invoke("backends", "--device", "cpu")
    assert res.exit_code == 0
    for name in ("eager", "sdpa", "flashinfer"):
        assert name in res.output
    assert "auto → sdpa" in res.output


@pytest.mark.process
def test_console_script_runs_as_a_subprocess(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}, '{"prompt": 1}'])
    res = subprocess.run([sys.executable, "-m", "pagedgen.cli.main", "generate", *STOP, str(src),
                          "--device", "cpu"], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.strip().startswith("error:") and "p.jsonl:2:" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_directory_or_glob_of_files_is_one_input_in_file_order(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "b.jsonl", [{"id": "b1", "prompt": "x"}, {"prompt": "y"}])
    write(d / "a.jsonl", [{"id": "a1", "prompt": "z"}])
    (d / "notes.txt").write_text("not an input\n")
    res = invoke("generate", *STOP, d, *FAST)
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in read(tmp_path / "in.completions.jsonl")] == ["a1", "b1", 2]
    res = invoke("generate", *STOP, f"{d}/*.jsonl", *FAST)
    assert res.exit_code == 1 and "give --output for a glob" in res.output
    out = tmp_path / "g.jsonl"
    assert invoke("generate", *STOP, f"{d}/b*.jsonl", *FAST, "-o", out).exit_code == 0
    assert [r["id"] for r in read(out)] == ["b1", 1]
    write(d / "c.jsonl", [{"id": "a1", "prompt": "again"}])
    res = invoke("generate", *STOP, d, *FAST)
    assert res.exit_code == 1
    assert "c.jsonl:1: duplicate id 'a1' (first on " in res.output.replace("\n", "")
    assert "a.jsonl:1)" in res.output.replace("\n", "")
    res = invoke("generate", *STOP, d, *FAST, "-o", f"{tmp_path}/shards/")
    assert res.exit_code == 1 and "needs --ray" in res.output


def test_a_gzip_input_reads_as_its_lines_and_other_compression_says_how_to_pipe_it(tmp_path):
    import gzip

    lines = [{"id": "g1", "prompt": "x"}, {"id": "g2", "prompt": "y"}]
    src = tmp_path / "p.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    res = invoke("generate", src, *FAST)
    assert res.exit_code == 0, res.output
    out = tmp_path / "p.completions.jsonl"  # named without the .gz
    assert [r["id"] for r in read(out)] == ["g1", "g2"]
    assert invoke("generate", src, *FAST, "--resume").exit_code == 0  # the same input
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl.gz").write_bytes(src.read_bytes())
    write(d / "b.jsonl", [{"id": "b1", "prompt": "z"}])
    assert invoke("generate", d, *FAST).exit_code == 0
    assert [r["id"] for r in read(tmp_path / "in.completions.jsonl")] == ["g1", "g2", "b1"]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(src.read_bytes()[:-12])  # its end-of-stream marker gone
    res = invoke("generate", cut, *FAST, "-o", tmp_path / "c.jsonl")
    assert res.exit_code == 1 and "cut.jsonl.gz: cannot read" in res.output
    assert "cut short or damaged" in " ".join(res.output.split())
    zst = tmp_path / "p.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(20))
    res = invoke("generate", zst, *FAST, "-o", tmp_path / "z.jsonl")
    assert res.exit_code == 1 and "zstd-compressed" in res.output
    assert "zstd -dc" in " ".join(res.output.split())


def test_paths_a_script_quoted_with_a_tilde_go_to_the_home_folder(tmp_path, monkeypatch):
    """``-o "~/out.jsonl"`` from a script (no shell to expand it) made a folder named "~"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "p.jsonl", [{"id": "t", "prompt": "x"}])
    res = invoke("generate", "~/p.jsonl", *FAST, "-o", "~/out.jsonl")
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["t"]
    assert not (tmp_path / "~").exists()


@pytest.mark.process
def test_summary_reports_startup_from_the_command(tmp_path):
    """``startup_s`` runs from the process start (interpreter and imports included) to the first
    step: more than the model load, less than the whole command."""
    import time

    src = write(tmp_path / "p.jsonl", [{"prompt": "abc"}])
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", "from pagedgen.cli.main import main; main()",
                          "generate", str(src), *FAST, "--json"], capture_output=True, text=True)
    whole = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["load_time_s"] < summary["startup_s"] < whole
    # the breakdown: what came before the engine, then the runner's phases; it adds up
    parts = summary["startup_breakdown_s"]
    assert list(parts) == ["imports_and_input", "model", "attention", "memory_profile",
                           "kv_cache"]  # no CUDA graphs on the CPU
    assert all(v >= 0 for v in parts.values()) and parts["imports_and_input"] > 0
    assert abs(sum(parts.values()) - summary["startup_s"]) < 1e-6


def test_engine_seats_fit_the_runs_sequences(tmp_path, monkeypatch):
    """max_num_seqs is cut to the run's sequences (n per request; after --resume, the ones
    left), so a short run captures no CUDA graphs for batches it cannot form."""
    import pagedgen.runtime.drivers.driver as gen

    seats = []

    class Recording(gen.Replica):
        def __init__(self, cfg, *args, **kw):
            seats.append(cfg.max_num_seqs)
            super().__init__(cfg, *args, **kw)

    monkeypatch.setattr(gen, "Replica", Recording)
    src = write(tmp_path / "p.jsonl", [{"id": 0, "prompt": "a", "n": 3}, {"id": 1, "prompt": "b"}])
    for extra in ([], ["--max-num-seqs", "3"]):
        res = invoke("generate", src, *FAST, "-o", tmp_path / f"o{len(extra)}.jsonl", *extra)
        assert res.exit_code == 0, res.output
    assert seats == [4, 3]  # 3 + 1 sequences of the profile's 32 seats; 3 seats stay 3
    out = tmp_path / "o0.jsonl"
    out.write_text(out.read_text().splitlines()[0] + "\n")  # request 0 done
    assert invoke("generate", src, *FAST, "-o", out, "--resume").exit_code == 0
    assert seats[-1] == 1
