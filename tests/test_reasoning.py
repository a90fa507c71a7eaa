"""Reasoning output (``runtime/output/reasoning.py``): the parsers on token streams, and a run
whose samples think first: the reasoning in ``reasoning_content``, the answer in ``text``, a
grammar applied to the answer only, a sample cut while reasoning named so, and the OpenAI
batch body's fields."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from hf_models import make_checkpoint

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams, StructuredOutput
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.output.reasoning import ReasoningParser
from pagedgen.runtime.sampling.processors import LogitsProcessor

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

OPEN, CLOSE = 10, 11
THINK = ReasoningParser("think", OPEN, CLOSE)
# harmony: <|channel|> 100, <|message|> 101, <|end|> 102, <|start|> 103; channel names
NAMES = {200: "analysis", 201: "final", 202: "commentary"}
HARMONY = ReasoningParser("harmony", 100, 101, 102,
                          lambda ids: " ".join(NAMES.get(t, "assistant") for t in ids), 103)


def follow(parser: ReasoningParser, tokens: list[int], prompt: list[int] = (5, 6)):
    state = parser.state(list(prompt))
    for i, t in enumerate(tokens):
        state.token(t, i)
    return state, state.split(tokens)


def test_think_splits_the_reasoning_from_the_answer():
    state, (spans, answer) = follow(THINK, [OPEN, 1, 2, CLOSE, 3, 4])
    assert spans == [[1, 2]] and answer == [3, 4]
    assert not state.ended_in_reasoning(6)


def test_a_sample_that_does_not_think_is_all_answer():
    _, (spans, answer) = follow(THINK, [3, 4, OPEN, 5])  # a late tag is the answer's text
    assert spans == [] and answer == [3, 4, OPEN, 5]
    # Qwen3 with thinking off: its template closes an empty block in the prompt
    _, (spans, answer) = follow(THINK, [3], prompt=[5, OPEN, CLOSE])
    assert spans == [] and answer == [3]


def test_a_prompt_that_opens_the_reasoning_starts_the_output_in_it():
    """DeepSeek-R1's template ends the prompt with ``<think>``."""
    _, (spans, answer) = follow(THINK, [1, 2, CLOSE, 3], prompt=[5, OPEN])
    assert spans == [[1, 2]] and answer == [3]


def test_a_prompt_that_only_mentions_the_tag_opens_nothing():
    """A user's text about ``<think>`` (its tokenizer makes it the tag's token) used to start
    the output in reasoning: text empty, ``length_in_reasoning``. Only a prompt that ends in
    the open tag, whitespace after it at most (DeepSeek-R1's template), opens it."""
    blank = ReasoningParser("think", OPEN, CLOSE,
                            decode=lambda ids: "".join("\n" if t == 9 else "w" for t in ids))
    for parser in (THINK, blank):
        state, (spans, answer) = follow(parser, [1, 2], prompt=[5, OPEN, 6, 7, 8])
        assert spans == [] and answer == [1, 2] and not state.ended_in_reasoning(2)
    _, (spans, answer) = follow(blank, [1, CLOSE, 2], prompt=[5, OPEN, 9])  # "<think>\n"
    assert spans == [[1]] and answer == [2]
    _, (spans, answer) = follow(blank, [1], prompt=[5, OPEN, 9, CLOSE, 9])  # closed: no
    assert spans == [] and answer == [1]


def test_nested_tags_stay_inside_the_reasoning():
    _, (spans, answer) = follow(THINK, [OPEN, 1, OPEN, 2, CLOSE, 3, CLOSE])
    assert spans == [[1, OPEN, 2]] and answer == [3, CLOSE]


def test_reasoning_cut_by_max_tokens_has_no_answer():
    state, (spans, answer) = follow(THINK, [OPEN, 1, 2])
    assert spans == [[1, 2]] and answer is None and state.ended_in_reasoning(3)
    assert not THINK.state([5]).ended_in_reasoning(0)  # no token: it never reasoned


def test_harmony_takes_the_final_channel_as_the_answer():
    tokens = [100, 200, 101, 1, 2, 102, 103, 9, 100, 202, 101, 3, 102,
              103, 9, 100, 201, 101, 4, 5]
    state, (spans, answer) = follow(HARMONY, tokens)
    assert spans == [[1, 2], [3]] and answer == [4, 5] and not state.ended_in_reasoning(20)
    state, (spans, answer) = follow(HARMONY, tokens[:4])
    assert spans == [[1]] and answer is None and state.ended_in_reasoning(4)


def test_harmony_text_outside_any_message_is_the_answer():
    """A plain gpt-oss prompt (or a completions body) whose output has no channels used to
    give "": every token outside a final message was dropped."""
    state, (spans, answer) = follow(HARMONY, [1, 2, 3])
    assert spans == [] and answer == [1, 2, 3] and not state.ended_in_reasoning(3)
    tokens = [1, 2, 100, 200, 101, 3, 102, 103, 9, 100, 201, 101, 4, 5, 102, 6]
    _, (spans, answer) = follow(HARMONY, tokens)
    assert spans == [[3]] and answer == [1, 2, 4, 5, 6]
    _, (spans, answer) = follow(HARMONY, [103, 9, 101, 7, 8])  # a message with no channel
    assert spans == [] and answer == [7, 8]


# ---- a run ---------------------------------------------------------------------------------

def tagged_checkpoint(path, tags: list[str]):
    """A random checkpoint whose BPE tokenizer (SmolLM2's) has these tags as tokens."""
    pytest.importorskip("gguf", reason="pip install gguf (the README's test command does)")
    from pagedgen.runtime.models.loader import load_tokenizer, resolve_model

    # a copy: the loaded tokenizer is cached for the process, other tests' runs share it
    tok = copy.deepcopy(load_tokenizer(resolve_model("smollm2-135m")).tok)
    tok.add_tokens(tags)
    make_checkpoint("qwen3", path, vocab_size=len(tok), eos_token_id=2, bos_token_id=1)
    tok.save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """``<think>`` and ``</think>`` (Qwen3's)."""
    pytest.importorskip("xgrammar")
    return tagged_checkpoint(tmp_path_factory.mktemp("thinker"), ["<think>", "</think>"])


class Script(LogitsProcessor):
    """Forces the sample's first tokens to ``script`` (then leaves its logits alone)."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def __call__(self, output_token_ids, logits: torch.Tensor) -> None:
        i = len(output_token_ids)
        if i < len(self.script):
            keep = logits[self.script[i]].clone()
            logits.fill_(float("-inf"))
            logits[self.script[i]] = keep + 1.0


def run(path, script: list[int], params: SamplingParams, parser: str = "auto"):
    eng = Engine(EngineConfig(model=str(path), device="cpu", backend="sdpa", dtype="float32",
                              max_num_seqs=4, max_model_len=256, kv_cache_memory="64MiB",
                              reasoning_parser=parser),
                 processor_factory=lambda request, p, i: [Script(script)])
    seq = eng.add_request([1, 40, 41, 42], params, request=SimpleNamespace(id="r", metadata=None))
    eng.run()
    return eng.request_output(seq.samples or [seq]), eng


def test_a_grammar_constrains_the_answer_after_the_reasoning(thinker):
    """``<think>`` passes the grammar at the first token (a JSON schema would forbid it), the
    reasoning runs free, and the answer after ``</think>`` is what the schema allows."""
    path, tok = thinker
    words = tok.encode(" plan first", add_special_tokens=False)
    think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    schema = {"enum": ["alpha", "beta", "gamma"]}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(
        "json", json.dumps(schema, separators=(",", ":"))))
    out = run(path, [think[0], *words, think[1]], params)[0].outputs[0]
    assert out.reasoning_content.strip() == "plan first"
    assert json.loads(out.text) in schema["enum"] and out.finish_reason == "stop"
    assert out.token_ids[:len(words) + 2] == [think[0], *words, think[1]]


def test_samples_that_do_not_think_write_what_their_schema_allows(thinker):
    """A thinking tokenizer, samples at temperature 1 whose first token decides (with steps
    launched ahead): those that answer at once are constrained from their first token on."""
    path, _ = thinker
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, structured=StructuredOutput(
        "json", json.dumps(schema, separators=(",", ":"))))
    eng = Engine(EngineConfig(model=str(path), device="cpu", backend="sdpa", dtype="float32",
                              max_num_seqs=16, max_model_len=256, kv_cache_memory="64MiB"))
    seqs = [eng.add_request([1, 40 + i, 41, 42], params) for i in range(16)]
    eng.run()
    assert eng.stats.overlapped_steps > 0
    for seq in seqs:
        out = eng.request_output([seq]).outputs[0]
        if out.reasoning_content is None and out.finish_reason == "stop":
            assert 0 <= json.loads(out.text)["n"] <= 99, out.text
    assert sum(eng.request_output([s]).outputs[0].finish_reason == "stop" for s in seqs) >= 12


def test_a_sample_cut_while_reasoning_says_so(thinker):
    """Its finish reason says so (OpenAI's body: ``length`` with content null); its line is
    a complete record (``--resume`` keeps it)."""
    from pagedgen.cli.formats.openai_batch import _chat_choice
    from pagedgen.cli.formats.records import is_complete, record

    path, tok = thinker
    words = tok.encode(" plan first", add_special_tokens=False)
    script = [tok.convert_tokens_to_ids("<think>"), *words]
    ro = run(path, script, SamplingParams(max_tokens=len(script), temperature=0.0))[0]
    out = ro.outputs[0]
    assert out.finish_reason == "length_in_reasoning" and out.text == ""
    assert out.reasoning_content.strip() == "plan first"
    body = _chat_choice(out)
    assert body["finish_reason"] == "length" and body["message"]["content"] is None
    assert body["message"]["reasoning_content"] == out.reasoning_content
    line = record(ro)
    assert line["reasoning_content"] == out.reasoning_content and is_complete(line)


@pytest.fixture(scope="module")
def gemma4_thinker(tmp_path_factory):
    """Gemma 4's ``<|channel>`` and ``<channel|>``."""
    return tagged_checkpoint(tmp_path_factory.mktemp("gemma4_thinker"),
                             ["<|channel>", "<channel|>"])


def test_gemma4_reasoning_between_its_channel_tags_without_the_thought_label(gemma4_thinker,
                                                                            thinker):
    """``auto`` finds Gemma 4's tags; ``<|channel>thought\nplan<channel|>answer`` gives the
    reasoning "plan" (the label the model writes first dropped, as transformers'
    ``parse_thinking_output`` does) and the answer after the closing tag. A tokenizer
    without them refuses the parser in one line."""
    path, tok = gemma4_thinker
    open_, close = tok.convert_tokens_to_ids(["<|channel>", "<channel|>"])
    label = tok.encode("thought\n", add_special_tokens=False)
    plan = tok.encode("check the sum", add_special_tokens=False)
    answer = tok.encode(" 42", add_special_tokens=False)
    script = [open_, *label, *plan, close, *answer]
    for parser in ("auto", "gemma4"):
        out = run(path, script, SamplingParams(max_tokens=len(script), temperature=0.0,
                                               ignore_eos=True), parser)[0].outputs[0]
        assert out.reasoning_content == "check the sum" and out.text == " 42", parser
    with pytest.raises(PagedgenError, match=r"no <\|channel> and <channel\|> tokens"):
        run(thinker[0], [], SamplingParams(max_tokens=4), parser="gemma4")


def test_no_reasoning_without_its_tokens_and_none_turns_it_off(thinker, tmp_path):
    path, tok = thinker
    out = run(path, [], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              parser="none")[0].outputs[0]
    assert out.reasoning_content is None and len(out.token_ids) == 4
    plain = make_checkpoint("llama", tmp_path / "plain", with_tokenizer=True)
    out = run(plain, [], SamplingParams(max_tokens=4, temperature=0.0,
                                        ignore_eos=True))[0].outputs[0]
    assert out.reasoning_content is None  # auto: this vocabulary has no <think>
    with pytest.raises(PagedgenError, match="--reasoning-parser: .*no <think> and </think>"):
        run(plain, [], SamplingParams(max_tokens=4), parser="qwen3")
    with pytest.raises(PagedgenError, match="unknown parser 'o1'"):
        EngineConfig(reasoning_parser="o1").validate()


# ---- template variables: thinking on or off, reasoning effort -------------------------------

TEMPLATE = ("{% if reasoning_effort == 'high' %}h {% elif reasoning_effort == 'low' %}l "
            "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}n {% endif %}a")


def test_chat_template_variables_reach_the_template(tmp_path):
    """``chat_template_kwargs`` (vLLM's field: Qwen3's ``enable_thinking``) on pagedgen and
    OpenAI lines, and OpenAI's ``reasoning_effort`` (gpt-oss's template reads it), each line
    templated with its own; a bad effort and kwargs on a text prompt are one-line errors."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from pagedgen.cli.app import app
    path = make_checkpoint("llama", tmp_path / "m", with_tokenizer=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    hi = [{"role": "user", "content": "b c"}]
    lines = [{"messages": hi, "chat_template_kwargs": {"reasoning_effort": "high"}},
             {"messages": hi},
             {"messages": hi, "chat_template_kwargs": {"enable_thinking": False}},
             {"messages": hi, "chat_template_kwargs": {"reasoning_effort": "low"}}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = CliRunner().invoke
    common = ["--model", str(path), "--device", "cpu", "--max-tokens", "1"]
    res = run(app, ["generate", *STOP, str(src), *common, "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 0, res.output
    prompts = [json.loads(x)["prompt"] for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert prompts == ["h b c a", "b c a", "b c n a", "l b c a"]
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"custom_id": "r", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"messages": hi, "reasoning_effort": "high"}}) + "\n")
    res = run(app, ["generate", *STOP, str(batch), *common, "-o", str(tmp_path / "ob.jsonl")])
    assert res.exit_code == 0, res.output
    body = json.loads((tmp_path / "ob.jsonl").read_text())["response"]["body"]
    first = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
    assert body["usage"]["prompt_tokens"] == first["num_prompt_tokens"] == 4  # h b c a
    for bad, message in (({"prompt": "b", "chat_template_kwargs": {"x": 1}},
                          "applies to chat ('messages') prompts only"),
                         ({"messages": hi, "chat_template_kwargs": {"reasoning_effort": "max"}},
                          "reasoning_effort must be one of minimal, low, medium, high")):
        src.write_text(json.dumps(bad) + "\n")
        res = run(app, ["generate", *STOP, str(src), *common, "-o", str(tmp_path / "x.jsonl")])
        assert res.exit_code == 1 and message in res.output.replace("\n", ""), res.output


ROLES = ("{% for m in messages %}{{ 'u' if m['role'] == 'user' else 'r' }} {{ m['content'] }} "
         "e {% endfor %}{% if add_generation_prompt %}g{% endif %}")  # e: a turn's end


def test_a_chat_can_continue_its_last_message_or_leave_the_turn_closed(tmp_path):
    """vLLM's ``continue_final_message`` (a prefilled answer, continued) and
    ``add_generation_prompt`` on pagedgen and OpenAI lines, through a checkpoint's template and
    the presets' byte tokenizer; both at once, a text prompt or a non-bool: one line each."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from pagedgen.cli.app import app
    path = make_checkpoint("llama", tmp_path / "m", with_tokenizer=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ROLES
    tok.save_pretrained(path)
    chat = [{"role": "user", "content": "b c"}, {"role": "assistant", "content": "a b"}]
    lines = [{"messages": chat}, {"messages": chat, "continue_final_message": True},
             {"messages": chat, "add_generation_prompt": False},
             {"messages": chat, "continue_final_message": False}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = CliRunner().invoke
    common = ["--device", "cpu", "--max-tokens", "1"]
    res = run(app, ["generate", *STOP, str(src), "--model", str(path), *common,
                    "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 0, res.output
    prompts = [json.loads(x)["prompt"] for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert prompts == ["u b c e r a b e g", "u b c e r a b", "u b c e r a b e",
                       "u b c e r a b e g"]
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"custom_id": "r", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"messages": chat, "continue_final_message": True}})
                     + "\n")
    res = run(app, ["generate", *STOP, str(batch), "--model", str(path), *common,
                    "-o", str(tmp_path / "ob.jsonl")])
    assert res.exit_code == 0, res.output
    body = json.loads((tmp_path / "ob.jsonl").read_text())["response"]["body"]
    assert body["usage"]["prompt_tokens"] == 7  # u b c e r a b
    res = run(app, ["generate", *STOP, str(src), *common, "-o", str(tmp_path / "t.jsonl")])  # tiny
    assert res.exit_code == 0, res.output
    tiny = [json.loads(x)["prompt"] for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert tiny[1] == "<|user|>\nb c\n<|assistant|>\na b" and tiny[2] + "<|assistant|>\n" == tiny[0]
    for bad, says in [({"messages": chat, "continue_final_message": True,
                        "add_generation_prompt": True}, "give one"),
                      ({"prompt": "x", "continue_final_message": True},
                       "applies to chat ('messages') prompts only"),
                      ({"messages": chat, "add_generation_prompt": "no"}, "must be true or false")]:
        src.write_text(json.dumps(bad) + "\n")
        res = run(app, ["generate", *STOP, str(src), *common, "-o", str(tmp_path / "x.jsonl")])
        assert res.exit_code == 1 and says in " ".join(res.output.split()), res.output


def test_completions_bodies_get_no_parser_unless_the_run_names_one(thinker):
    """As vLLM: an OpenAI /v1/completions body's output is all text (its ``<think>`` kept);
    a chat body's is split; ``--reasoning-parser NAME`` splits both."""
    from pagedgen.cli.formats.openai_batch import parse_line
    from pagedgen.runtime.inputs.request import InputOptions

    def body(url, **b):
        return {"custom_id": "c", "url": url, "body": {"model": "m", **b}}

    completion = body("/v1/completions", prompt="Say")
    chat = body("/v1/chat/completions", messages=[{"role": "user", "content": "Say"}])
    defaults = SamplingParams()
    for line, options, split in ((completion, InputOptions(), False),
                                 (chat, InputOptions(), True),
                                 (completion, InputOptions(completions_reasoning=True), True)):
        req = parse_line(line, 0, 1, "line 1", options)
        assert req.sampling(defaults).reasoning is split
    path, tok = thinker
    words = tok.encode(" plan first", add_special_tokens=False)
    think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    params = SamplingParams(max_tokens=len(words) + 2, temperature=0.0, reasoning=False)
    out = run(path, [think[0], *words, think[1]], params)[0].outputs[0]
    assert out.reasoning_content is None and out.finish_reason == "length"
    assert out.token_ids[:len(words) + 2] == [think[0], *words, think[1]]
    assert "plan first" in out.text
