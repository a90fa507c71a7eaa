"""Input and output formats: OpenAI batch files, log-probabilities in output lines, users' own
fields (metadata), other prompt field names."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.inputs.request import near_miss

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "4"]


def write(path, lines) -> str:
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return str(path)


def run(*args):
    return runner.invoke(app, ["generate", *map(str, args)])


def read(path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


def chat(cid, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "my-model", "messages": [{"role": "user", "content": "Hi"}],
                     **body}}


def completion(cid, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "my-model", "prompt": "Once upon", **body}}


def test_openai_batch_file_round_trips_through_openai_types(tmp_path):
    # a test extra: present in CI; the GPU machine lacks it, and its `pytest -m gpu` collects this
    types = pytest.importorskip("openai.types")
    Completion, ChatCompletion = types.Completion, types.chat.ChatCompletion
    src = write(tmp_path / "batch.jsonl", [
        chat("c1", max_completion_tokens=3, logprobs=True, top_logprobs=2, n=2),
        completion("t1", max_tokens=5, logprobs=3, temperature=0, stop=["\n"]),
        chat("c2", messages=[{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
             temperature=0.5, seed=3, stream=False, user="u1"),
        completion("t2", prompt=[65, 66, 67], max_tokens=2),
    ])
    out = tmp_path / "out.jsonl"
    res = run(src, *FAST, "-o", out)
    assert res.exit_code == 0, res.output
    lines = read(out)
    assert [l["custom_id"] for l in lines] == ["c1", "t1", "c2", "t2"]
    for line, n, kind in zip(lines, (2, 1, 1, 1), (ChatCompletion, Completion) * 2):
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        body = line["response"]["body"]
        parsed = kind.model_validate(body)
        assert parsed.model_dump(exclude_unset=True) == body  # nothing lost or coerced
        assert len(parsed.choices) == n and [c.index for c in parsed.choices] == list(range(n))
        assert parsed.model == "my-model"
        assert parsed.usage.completion_tokens == sum(
            len(c.logprobs.content if kind is ChatCompletion else c.logprobs.tokens)
            if c.logprobs else 0 for c in parsed.choices) or not parsed.choices[0].logprobs
        usage = parsed.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    c1 = ChatCompletion.model_validate(lines[0]["response"]["body"])
    assert c1.usage.completion_tokens == 6
    for c in c1.choices:
        assert len(c.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    t1 = Completion.model_validate(lines[1]["response"]["body"]).choices[0]
    lp = t1.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert t1.logprobs.text_offset[0] == 0
    assert lines[3]["response"]["body"]["usage"]["prompt_tokens"] == 3


def test_openai_served_model_name_and_resume(tmp_path):
    src = write(tmp_path / "batch.jsonl", [chat(f"r{i}", temperature=0) for i in range(4)])
    out = tmp_path / "out.jsonl"
    res = run(src, *FAST, *STOP, "-o", out, "--served-model-name", "other")
    assert res.exit_code == 1 and "body 'model' is 'my-model'; this run serves 'other'" \
        in res.output.replace("\n", "")
    assert run(src, *FAST, *STOP, "-o", out, "--served-model-name", "my-model").exit_code == 0
    first = read(out)
    text = out.read_text().splitlines()
    out.write_text(text[0] + "\n" + text[1][:25])  # a crash after one line and a half
    res = run(src, *FAST, *STOP, "-o", out, "--resume", "--json")
    assert res.exit_code == 1 and "was made with served_model_name" in res.output
    res = run(src, *FAST, *STOP, "-o", out, "--resume", "--json", "--served-model-name", "my-model")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped_resumed"] == 1
    again = read(out)
    assert [l["custom_id"] for l in again] == ["r0", "r1", "r2", "r3"]
    for a, b in zip(first, again):
        assert a["response"]["body"]["choices"] == b["response"]["body"]["choices"]


@pytest.mark.parametrize("line,message", [
    (chat("x", tools=[]), "body 'tools' is not supported by pagedgen"),
    (chat("x", temperatur=1), "body 'temperatur' is unknown (did you mean 'temperature'?)"),
    (chat("x", top_logprobs=2), "body 'top_logprobs' needs 'logprobs': true"),
    (chat("x", max_tokens="5"), "body 'max_tokens' must be an integer"),
    (chat("x", max_tokens=3, max_completion_tokens=4),
     "body 'max_tokens' and 'max_completion_tokens' differ"),
    (chat("x", best_of=3), "body 'best_of' = 3 is not supported"),
    (chat("x", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "body 'messages'[0]: content part 0: an image_url part needs a URL or path"),
    (chat("x", messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
     "body 'messages'[0]: content part 0: only text and image parts"),
    (completion("x", messages=[]), "body 'messages' belongs to /v1/chat/completions"),
    (completion("x", prompt=["a", "b"]), "body 'prompt' holds 2 prompts"),
    ({**chat("x"), "url": "/v1/embeddings"}, "'url' must be one of"),
    ({**chat("x"), "custom_id": 5}, "'custom_id' must be a non-empty string"),
    (chat("x", guided_choice=["a"]), "body 'guided_choice' is vLLM's earlier field; write body "
                                     "\"structured_outputs\": {\"choice\": ...}"),
])
def test_bad_openai_line_is_a_one_line_error(tmp_path, line, message):
    src = write(tmp_path / "batch.jsonl", [chat("ok"), line])
    res = run(src, *FAST, *STOP)
    assert res.exit_code == 1
    assert f"batch.jsonl:2: {message}" in res.output.replace("\n", ""), res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "batch.completions.jsonl").exists()


def test_a_batch_line_without_its_custom_id_is_named_as_one(tmp_path):
    """First line or later, a line with OpenAI's url and body but no custom_id is a batch line
    missing its id, not a pagedgen line missing its prompt; a pagedgen line may carry url and
    body fields of its own (metadata)."""
    bare = {k: v for k, v in chat("x").items() if k != "custom_id"}
    for lines in ([bare], [chat("ok"), bare]):
        src = write(tmp_path / "batch.jsonl", lines)
        res = run(src, *FAST, *STOP)
        assert res.exit_code == 1
        assert f"batch.jsonl:{len(lines)}: 'custom_id' must be a non-empty string" in \
            res.output.replace("\n", ""), res.output
    for field, args in (("prompt", ()), ("text", ("--prompt-field", "text"))):
        own = write(tmp_path / "own.jsonl", [{field: "x", "url": "u", "body": {"a": 1}}])
        out = tmp_path / "own.out.jsonl"
        res = run(own, *FAST, *STOP, *args, "-o", out, "--overwrite")
        assert res.exit_code == 0, res.output
        assert read(out)[0]["metadata"] == {"url": "u", "body": {"a": 1}}


def test_own_fields_come_back_under_metadata(tmp_path):
    src = write(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "x", "answer": "B", "category": {"k": [1, 2]}},
        {"prompt": "y", "metadata": {"step": 3}},
        {"prompt": "z", "metadata": {"step": 4}, "idx": 9},
        {"prompt": "w", "seed": None, "logprobs": None},  # null: not set
    ])
    out = tmp_path / "o.jsonl"
    assert run(src, *FAST, *STOP, "-o", out).exit_code == 0
    lines = read(out)
    assert lines[0]["metadata"] == {"answer": "B", "category": {"k": [1, 2]}}
    assert lines[1]["metadata"] == {"step": 3}
    assert lines[2]["metadata"] == {"step": 4, "idx": 9}
    assert "metadata" not in lines[3] and "logprobs" not in lines[3]
    res = run(src, *FAST, *STOP, "-o", out, "--strict-fields")
    assert res.exit_code == 1 and "p.jsonl:1: unknown field 'answer' (--strict-fields)" \
        in res.output.replace("\n", "")
    bad = write(tmp_path / "b.jsonl", [{"prompt": "z", "metadata": {"idx": 1}, "idx": 9}])
    res = run(bad, *FAST, *STOP)
    assert res.exit_code == 1 and "field 'idx' is both on the line and in 'metadata'" in res.output


def test_prompt_and_messages_fields_and_logprobs_lines(tmp_path):
    src = write(tmp_path / "p.jsonl", [
        {"question": "What is it?", "prompt": "kept as metadata", "logprobs": 2},
        {"conversation": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
         "max_tokens": 0},
        {"question": "And this?", "n": 2, "logprobs": 0, "prompt_logprobs": 0},
    ])
    out = tmp_path / "o.jsonl"
    res = run(src, *FAST, "-o", out, "--prompt-field", "question",
              "--messages-field", "conversation")
    assert res.exit_code == 0, res.output
    a, b, c = read(out)
    assert a["prompt"] == "What is it?" and a["metadata"] == {"prompt": "kept as metadata"}
    assert [e["token_id"] for e in a["logprobs"]] == a["token_ids"]
    assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in a["logprobs"])
    assert b["num_output_tokens"] == 0 and b["token_ids"] == [] and b["finish_reason"] == "length"
    assert b["prompt_logprobs"][0] is None
    assert len(b["prompt_logprobs"]) == b["num_prompt_tokens"]
    assert all(len(e["top"]) == 1 for e in b["prompt_logprobs"][1:])
    assert len(c["prompt_logprobs"]) == c["num_prompt_tokens"] and len(c["choices"]) == 2
    assert all(len(ch["logprobs"]) == ch["num_output_tokens"] for ch in c["choices"])


@pytest.mark.parametrize("name,hint", [("max_token", "max_tokens"), ("temprature", "temperature"),
                                       ("Prompt", "prompt"), ("ingore_eos", "ignore_eos"),
                                       ("idx", None), ("answer", None), ("seeds", "seed")])
def test_near_miss(name, hint):
    known = {"prompt", "max_tokens", "temperature", "ignore_eos", "seed", "id", "n"}
    assert near_miss(name, known) == hint


def test_openai_logprob_tokens_carry_their_bytes(tmp_path):
    """A token holding part of a UTF-8 character keeps its own bytes ("bytes", OpenAI's
    field); the tokens' bytes put together are the completion's text."""
    src = write(tmp_path / "batch.jsonl", [
        completion("t", prompt="é ü —", max_tokens=12, logprobs=0, temperature=0,
                   ignore_eos=True),
        chat("c", max_tokens=12, logprobs=True, temperature=0, ignore_eos=True)])
    out = tmp_path / "out.jsonl"
    assert run(src, *FAST, "-o", out).exit_code == 0
    t, c = (json.loads(l)["response"]["body"]["choices"][0] for l in out.read_text().splitlines())
    got = bytes(b for item in c["logprobs"]["content"] for b in item["bytes"])
    assert got.decode("utf-8", errors="replace") == c["message"]["content"]
    assert "".join(t["logprobs"]["tokens"]).replace("\ufffd", "") == t["text"].replace("\ufffd", "")


def test_byte_level_bpe_token_bytes(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pagedgen.runtime.models.tokenizer import HFTokenizer

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["héllo wörld — naïve café"] * 50, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>",
                            eos_token="</s>").save_pretrained(tmp_path)
    tok = HFTokenizer(tmp_path, None)
    text = "naïve — café wörld"
    pieces = [tok.token_bytes(i) for i in tok.encode(text)]
    assert b"".join(pieces).decode() == text
    assert any(p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore")
               for p in pieces)  # some token does split a character
    assert tok.token_bytes(tok.tok.eos_token_id) == b""


def test_integer_fields_take_whole_floats_as_pandas_writes_them():
    """pandas writes an integer column with gaps as floats (100.0); vLLM takes those, so a
    whole float is its integer, and a fraction stays an error."""
    from pagedgen.errors import PagedgenError
    from pagedgen.runtime.inputs.parse import parse_line
    from pagedgen.runtime.inputs.request import InputOptions

    line = {"prompt": "x", "max_tokens": 100.0, "n": 2.0, "seed": 7.0, "top_k": None}
    req = parse_line(line, 0, 1, "p.jsonl:1", InputOptions())
    assert req.overrides == {"max_tokens": 100, "n": 2, "seed": 7}
    assert all(type(v) is int for v in req.overrides.values())
    with pytest.raises(PagedgenError, match="'max_tokens' must be an integer"):
        parse_line({"prompt": "x", "max_tokens": 100.5}, 0, 1, "p.jsonl:1", InputOptions())


def test_a_utf8_byte_order_mark_is_skipped(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark; it was "invalid JSON (column 1)".
    Skipped at the start of each input and of a --json-schema file; the lines otherwise run
    as they would without it."""
    plain = tmp_path / "plain"
    plain.mkdir()
    write(plain / "p.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / "p.jsonl").write_bytes(b"\xef\xbb\xbf" + (plain / "p.jsonl").read_bytes())
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    (tmp_path / "s.json").write_bytes(b"\xef\xbb\xbf" + schema.encode())
    outs = []
    for d in (plain, marked):
        res = run(d / "p.jsonl", "-o", d / "out.jsonl", *FAST, *STOP, "--json-schema",
                  tmp_path / "s.json")
        assert res.exit_code == 0, res.output
        outs.append([(r["prompt"], r["token_ids"]) for r in read(d / "out.jsonl")])
    assert outs[0] == outs[1] and [p for p, _ in outs[0]] == ["one", "two"]
    # a mark anywhere else is still an error, on its line
    (tmp_path / "late.jsonl").write_bytes(b'{"prompt": "one"}\n\xef\xbb\xbf{"prompt": "two"}\n')
    res = run(tmp_path / "late.jsonl", "-o", tmp_path / "late.out.jsonl", *FAST, *STOP)
    assert res.exit_code == 1 and "late.jsonl:2: invalid JSON" in res.output, res.output
