"""Hostile inputs, round 2 (issue 57): every value that could reach the writer, the allocator or
a worker is checked before the model loads, errors name what the user wrote, constraints no
output can meet fail or say so, and damaged weights stop the load naming the tensor."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "4"]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def one_line_error(res, pattern: str) -> None:
    text = res.output.strip()
    assert res.exit_code == 1, res.output
    assert text.startswith("error: ") and "Traceback" not in text, text
    assert re.search(pattern, text.replace("\n", "")), text


# ---- every string that will be written is encodable --------------------------------------------

@pytest.mark.parametrize("line,field", [
    ('{"id": "a", "prompt": "x\\udc80"}', "field 'prompt'"),
    ('{"id": "a\\ud800", "prompt": "x"}', "field 'id'"),
    ('{"prompt": "x", "tag": ["ok \\ud83d\\ude00", {"k\\udfff": 1}]}', "a key 'tag\\[1\\].k"),
    ('{"custom_id": "c\\udc80", "method": "POST", "url": "/v1/completions", '
     '"body": {"prompt": "x"}}', "field 'custom_id'"),
])
def test_a_lone_surrogate_is_a_line_error_before_the_run(tmp_path, line, field):
    src = write(tmp_path / "p.jsonl", [line])
    res = runner.invoke(app, ["generate", *STOP, str(src), *FAST, "-o", str(tmp_path / "o.jsonl")])
    one_line_error(res, rf"p\.jsonl:1: {field}.* holds a lone surrogate")
    assert not (tmp_path / "o.jsonl").exists()


def test_a_surrogate_pair_is_text_and_runs(tmp_path):
    src = write(tmp_path / "p.jsonl", ['{"id": "\\ud83d\\ude00", "prompt": "x \\ud83d\\ude00"}'])
    res = runner.invoke(app, ["generate", str(src), *FAST, "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "o.jsonl").read_text())["id"] == "\U0001F600"


# ---- options bounded and named as given -------------------------------------------------------

PROFILE_BAD_BLOCKS = "model: tiny\nengine:\n  num_blocks: -5\n"
PROFILE_SEATS = "model: tiny\nengine:\n  max_num_seqs: 9000\n  max_num_batched_tokens: 100\n"


@pytest.mark.parametrize("args,pattern", [
    (["--device", "gpu0"], r"unknown device 'gpu0'; use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:7"], r"--device cuda:7: (CUDA is not available here|this machine has)"),
    (["--kv-cache-memory", "1TB"], r"--kv-cache-memory 1TB asks for 931\.3 GiB of KV cache; "
                                   r"this machine has .* free beside tiny's weights"),
    (["--num-blocks", "2000000000"], r"--num-blocks 2,000,000,000 asks for .* of KV cache"),
    (["--block-size", "1000000"], r"--block-size must be in 1\.\.1,024, not 1,000,000"),
    (["-dp", "64"], r"-dp 64 starts 64 worker processes on the CPU; this process has \d+ "),
    (["--max-num-seqs", "4000"], r"--max-num-seqs 4,000 is more than max_num_batched_tokens "
                                 r"\(2,048: profile tiny:\d+: engine\.max_num_batched_tokens\)"),
    (["--max-model-len", "100000"], r"--max-model-len 100,000 is more than tiny's context "
                                    r"\(2,048 tokens"),
    (["--replicas", "2"], r"--replicas counts Ray replicas: give --ray too"),
    (["--kv-cache-memory", "1GiB", "--num-blocks", "8"], r"both size the KV cache: give one"),
    (["--threads", "0"], r"--threads must be in 1\.\."),
    (["--model", ""], r"--model is empty: give a checkpoint directory"),
    (["--prompt-field", ""], r"--prompt-field must name a field of its own, not ''"),
    (["--messages-field", "max_tokens"], r"--messages-field must name a field of its own"),
    (["--prompt-field", "messages"], r"--prompt-field and --messages-field both name "
                                     r"'messages'"),
    (["--profile", "{prof:bad_blocks}"], r"prof\.yaml:3: engine\.num_blocks must be in 2\.\."),
    (["--profile", "{prof:seats}"], r"prof\.yaml:3: engine\.max_num_seqs 9,000 is more than "
                                    r"max_num_batched_tokens \(100: \S*prof\.yaml:4"),
])
def test_a_bad_option_is_one_line_naming_what_the_user_wrote(tmp_path, args, pattern):
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    argv = []
    for a in args:
        if a.startswith("{prof:"):
            text = {"bad_blocks": PROFILE_BAD_BLOCKS, "seats": PROFILE_SEATS}[a[6:-1]]
            (tmp_path / "prof.yaml").write_text(text)
            a = str(tmp_path / "prof.yaml")
        argv.append(a)
    t0 = time.monotonic()
    res = runner.invoke(app, ["generate", str(src), *FAST, "-o", str(tmp_path / "o.jsonl"),
                              *argv])
    one_line_error(res, pattern)
    assert not (tmp_path / "o.jsonl").exists() and time.monotonic() - t0 < 60


def test_backends_names_a_bad_device_in_one_line():
    res = runner.invoke(app, ["backends", "--device", "tpu"])
    one_line_error(res, r"unknown device 'tpu'")


def test_verify_checks_where_its_json_goes_before_any_check(tmp_path, monkeypatch):
    import pagedgen.cli.verify.runner as runner_module  # verify imports it when it runs

    def no_checks(*a, **k):
        raise AssertionError("checks ran")

    monkeypatch.setattr(runner_module, "run_plans", no_checks)
    (tmp_path / "f").write_text("")
    res = runner.invoke(app, ["verify", "--device", "cpu", "--backend", "eager",
                              "-o", str(tmp_path / "f" / "v.json")])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "--output" in text and "cannot be created" in text
    assert "Traceback" not in res.output
    for args, message in ((["--model", str(tmp_path / "none")], "does not exist"),
                          (["--dtype", "int8"], "unknown dtype 'int8'")):  # nor a bad model
        res = runner.invoke(app, ["verify", "--device", "cpu", "--backend", "eager", *args])
        assert res.exit_code == 2 and res.output.startswith("error: "), res.output
        assert message in res.output and len(res.output.strip().splitlines()) == 1


# ---- constraints no output can meet -----------------------------------------------------------

def test_a_constraint_that_matches_nothing_fails_before_the_run(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b", "structured_outputs": {
        "regex": "[^\\s\\S]"}}])
    res = runner.invoke(app, ["generate", *STOP, str(src), *FAST, "-o", str(tmp_path / "o.jsonl")])
    one_line_error(res, r"p\.jsonl:2: the regex matches no text this tokenizer can write")


@pytest.mark.parametrize("workers", ["0", "1"])
@pytest.mark.process
def test_a_sample_at_a_dead_end_of_its_grammar_ends_unsatisfiable(tmp_path, monkeypatch,
                                                                  workers):
    monkeypatch.setenv("PAGEDGEN_GRAMMAR_WORKERS", workers)
    src = write(tmp_path / "p.jsonl", [
        {"id": "dead", "prompt": "a", "structured_outputs": {"regex": "ab[^\\s\\S]c"}},
        {"id": "fine", "prompt": "b", "structured_outputs": {"choice": ["yes", "no"]}}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "8",
                              "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    lines = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert lines["dead"]["text"] == "ab" and lines["dead"]["finish_reason"] == "unsatisfiable"
    assert lines["dead"]["token_ids"] == [97, 98]
    assert lines["fine"]["text"] in ("yes", "no") and lines["fine"]["finish_reason"] == "stop"
    assert json.loads(res.stdout[res.stdout.index("{"):])["grammar_unsatisfiable_samples"] == 1
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "8",
                              "-o", str(out), "--resume", "--json"])  # a whole record
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped_resumed"] == 2


def test_choices_compile_as_a_trie_of_exactly_those_strings():
    import xgrammar as xgr

    from pagedgen.runtime.models.tokenizer import ByteTokenizer
    from pagedgen.runtime.sampling.structured import choice_grammar, tokenizer_info

    choices = ["app", "apple", "apply", "banana", "band", "", "b"]
    g = xgr.GrammarCompiler(tokenizer_info(ByteTokenizer(), 258)).compile_grammar(
        choice_grammar(choices))
    for text in ["app", "apple", "apply", "banana", "band", "", "b", "ap", "appl", "bandx",
                 "c", "applee", "bananaband"]:
        m = xgr.GrammarMatcher(g)
        ok = all(m.accept_token(b) for b in text.encode()) and m.accept_token(257)
        assert ok == (text in choices), text


def test_sigterm_while_a_constraint_compiles_ends_the_run_at_once(tmp_path, monkeypatch):
    from pagedgen.errors import Terminated
    from pagedgen.runtime.sampling import structured

    monkeypatch.setattr(structured.Grammars, "compile",
                        lambda self, c: time.sleep(120))  # a compile of minutes
    src = write(tmp_path / "p.jsonl", [{"prompt": "a", "structured_outputs": {"regex": "a+"}}])

    def terminate(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGALRM, terminate)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    t0 = time.monotonic()
    try:
        res = runner.invoke(app, ["generate", str(src), *FAST, "-o", str(tmp_path / "o.jsonl")])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert res.exit_code == 143 and "no completions were written" in res.output
    assert time.monotonic() - t0 < 10  # not the compile's 120 s


# ---- damaged weights --------------------------------------------------------------------------

def test_text_settings_on_a_checkpoint_without_a_tokenizer_are_line_errors(tmp_path):
    """Token-id prompts run on a checkpoint without tokenizer files (their text empty, which
    the summary says); a stop string would never match there, bad words cannot be tokenized and
    a grammar cannot be compiled, so each is a line error before the model loads."""
    ckpt = make_checkpoint("llama", tmp_path / "ck")
    out = tmp_path / "o.jsonl"
    ids = {"prompt_token_ids": [1, 2, 3]}
    res = runner.invoke(app, ["generate", *STOP, str(write(tmp_path / "ok.jsonl", [ids])), *FAST,
                              "--model", str(ckpt), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "empty: no tokenizer files" in res.output
    assert json.loads(out.read_text())["num_output_tokens"] == 4
    out.unlink()
    for extra, pattern in [
            ({"stop": "a"}, r"'stop' strings match text: use 'stop_token_ids'"),
            ({"bad_words": ["a"]}, r"'bad_words' are text: use 'logit_bias'"),
            ({"response_format": {"type": "json_object"}},
             r"structured output constrains text")]:
        src = write(tmp_path / "p.jsonl", [ids, {**ids, **extra}])
        res = runner.invoke(app, ["generate", *STOP, str(src), *FAST, "--model", str(ckpt),
                                  "-o", str(out)])
        one_line_error(res, r"p\.jsonl:2: .*ck has no tokenizer; " + pattern)
        assert not out.exists()
    from pagedgen import LLM
    from pagedgen.errors import PagedgenError

    with pytest.raises(PagedgenError, match="prompt 0: .*ck has no tokenizer; 'stop'"):
        LLM(str(ckpt), device="cpu").generate([ids], stop=["a"])


def test_a_non_finite_weight_stops_the_load_naming_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = make_checkpoint("llama", tmp_path / "ck", with_tokenizer=True)
    weights = load_file(ckpt / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][7, 3] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    src = write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    res = runner.invoke(app, ["generate", str(src), *FAST, "--model", str(ckpt),
                              "-o", str(tmp_path / "o.jsonl")])
    one_line_error(res, r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                        r"holds a non-finite value \(nan\) at \[7, 3\]")


def test_damaged_gguf_bytes_stop_the_load_naming_the_tensor(tmp_path):
    from gguf_models import write_gguf

    ckpt = make_checkpoint("llama", tmp_path / "ck", with_tokenizer=True)
    path = write_gguf(ckpt, tmp_path / "m.gguf", qtype="Q8_0")
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = b"\xff" * 4096  # 0xffff as an f16 block scale is NaN
    path.write_bytes(bytes(data))
    src = write(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 5, 9]}])
    res = runner.invoke(app, ["generate", str(src), *FAST, "--model", str(path),
                              "-o", str(tmp_path / "o.jsonl")])
    one_line_error(res, r"m\.gguf: tensor '[\w.]+' holds a non-finite value")


def test_the_finite_check_reads_every_dtype():
    from pagedgen.runtime.models.weights import first_nonfinite

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        t = torch.randn(64, 32).to(dtype)
        assert first_nonfinite(t) is None, dtype
        t[40, 17] = float("nan")
        assert first_nonfinite(t)[0] == (40, 17), dtype
    t = torch.zeros(5)
    t[4] = -float("inf")
    assert first_nonfinite(t) == ((4,), "inf")


def test_a_librarys_message_is_cut_to_its_first_said_line():
    from pagedgen.errors import first_line
    assert first_line(ValueError("\n  bad header\nTraceback-like detail\n")) == "bad header"
    assert first_line(KeyError()) == "KeyError" and first_line(OSError(), "") == ""
