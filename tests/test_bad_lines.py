"""Lines that cannot run (issue 99): under ``--on-bad-line error`` (generate's default) each
gets an error record in its place and the rest run, as OpenAI's batch API and ``vllm
run-batch`` do; ``--resume`` keeps the records; ``--on-bad-line stop`` ends the run at the
first, before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pagedgen.cli.app import app

runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "4", "--temperature", "0"]
GOOD = ({"id": "a", "prompt": "Hello"}, {"id": "f", "prompt": "World"})


def lines(tmp_path: Path) -> Path:
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join([
        json.dumps(GOOD[0]),
        "not json",
        json.dumps({"id": "c", "prompt": "Hi", "max_tokens": -1}),
        json.dumps({"id": "a", "prompt": "a duplicate id"}),
        json.dumps({"id": "e", "prompt": "x", "tag": 1,
                    "structured_outputs": {"regex": "[^\\s\\S]"}}),
        json.dumps({"id": "g", "prompt": "y" * 9000}),  # longer than the preset's context
        json.dumps(GOOD[1])]) + "\n")
    return src


def test_each_bad_line_gets_an_error_record_in_its_place(tmp_path):
    src, out = lines(tmp_path), tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "-o", str(out), *FAST, "--json"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", 1, "c", 3, "e", "g", "f"]
    errors = {r["id"]: r["error"] for r in recs if "error" in r}
    assert errors[1].startswith(f"{src}:2: invalid JSON")
    assert errors["c"].startswith(f"{src}:3: max_tokens must be >= 1")
    assert errors[3] == f"{src}:4: duplicate id 'a' (first on line 1)"
    assert errors["e"].startswith(f"{src}:5: the regex matches no text")
    assert errors["g"].startswith(f"{src}:6: the prompt has 9,001 tokens")
    assert recs[4]["metadata"] == {"tag": 1}  # the line's own fields, as a record keeps them
    good = {r["id"]: r for r in recs if "error" not in r}
    alone = tmp_path / "good.jsonl"
    alone.write_text("".join(json.dumps(x) + "\n" for x in GOOD))
    runner.invoke(app, ["generate", str(alone), "-o", str(tmp_path / "g.jsonl"), *FAST])
    want = {r["id"]: r for r in map(json.loads, (tmp_path / "g.jsonl").read_text().splitlines())}
    assert {k: v["token_ids"] for k, v in good.items()} == \
        {k: v["token_ids"] for k, v in want.items()}
    summary = json.loads(res.output[res.output.index("{\n"):])
    assert summary["lines_with_errors"] == 5 and summary["requests"] == 2
    # --resume keeps every record, the error records too: nothing runs again
    res = runner.invoke(app, ["generate", str(src), "-o", str(out), *FAST, "--resume", "--json"])
    summary = json.loads(res.output[res.output.index("{\n"):])
    assert res.exit_code == 0 and summary["skipped_resumed"] == 7
    assert summary["lines_with_errors"] == 0 and "dropped" not in res.output


def test_stop_ends_the_run_at_the_first_bad_line(tmp_path):
    src, out = lines(tmp_path), tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "-o", str(out), *FAST,
                              "--on-bad-line", "stop"])
    assert res.exit_code == 1 and f"{src}:2: invalid JSON" in res.output.replace("\n", "")
    assert not out.exists()
    res = runner.invoke(app, ["generate", str(src), *FAST, "--on-bad-line", "skip"])
    assert res.exit_code == 1 and "--on-bad-line skip: choose error or stop" in res.output


def test_openai_batch_lines_that_cannot_run_get_openais_error_records(tmp_path):
    def line(cid: str, url: str, body: dict) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})

    src, out = tmp_path / "batch.jsonl", tmp_path / "o.jsonl"
    src.write_text("\n".join([
        line("r1", "/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 3}),
        line("r2", "/v1/embeddings", {"model": "m", "input": "x"}),
        line("r3", "/v1/chat/completions", {"model": "m", "tools": [{"type": "function"}],
                                            "messages": [{"role": "user", "content": "Hi"}]}),
        line("r4", "/v1/chat/completions", {"model": "m", "max_tokens": 3,
                                            "messages": [{"role": "user", "content": "Hi"}]}),
    ]) + "\n")
    res = runner.invoke(app, ["generate", str(src), "-o", str(out), *FAST])
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in recs] == ["r1", "r2", "r3", "r4"]
    for r in (recs[1], recs[2]):
        assert r["response"] is None and r["error"]["code"] == "invalid_request"
    assert recs[1]["error"]["message"].startswith(f"{src}:2: 'url' must be one of")
    assert "body 'tools' is not supported" in recs[2]["error"]["message"]
    assert recs[0]["error"] is None and recs[3]["response"]["status_code"] == 200


def test_an_error_of_the_whole_input_ends_the_run_in_either_mode(tmp_path):
    """--prompt-field on an OpenAI batch file is the options' mistake, found at the first
    line: never that line's record, and no line runs."""
    src, out = tmp_path / "batch.jsonl", tmp_path / "o.jsonl"
    src.write_text(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "Hello"}}) + "\n")
    for mode in ("error", "stop"):
        res = runner.invoke(app, ["generate", str(src), "-o", str(out), *FAST, "--prompt-field",
                                  "text", "--on-bad-line", mode])
        assert res.exit_code == 1 and "--prompt-field and --messages-field do not apply" in \
            res.output.replace("\n", ""), res.output
        assert not out.exists()
