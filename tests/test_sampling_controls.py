"""Sampling controls (presence / frequency / repetition penalties, min_p, logit_bias,
min_tokens, stop_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens): the
batched device code against transformers' logits processors on the same logits, then through
the engine and the input formats."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest
import torch
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.sampling import controls
from pagedgen.runtime.sampling.sampler import apply_min_p

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

V = 50
EOS = 7
runner = CliRunner()


@dataclass
class Row:
    """What the controls read of a sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    bad_words_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def controlled(self) -> bool:
        return self.params.has_controls()


def rows(**params) -> list[Row]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        prompt = torch.randint(0, V, (5 + i,), generator=g).tolist()
        output = torch.randint(0, V, (i * 3,), generator=g).tolist()
        out.append(Row(SamplingParams(**params), prompt, output))
    return out


def logits_for(n: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(1)) * 3


def hf(processor, r: Row, scores: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return processor(torch.tensor([ids]), scores[None].clone())[0]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    rs = rows(repetition_penalty=penalty)
    x = logits_for(len(rs))
    want = torch.stack([hf(RepetitionPenaltyLogitsProcessor(penalty), r, x[i],
                           r.prompt_token_ids + r.output_token_ids) for i, r in enumerate(rs)])
    controls.apply(x, rs, {EOS})
    torch.testing.assert_close(x, want)


def test_presence_and_frequency_penalties_follow_openai():
    rs = rows(presence_penalty=0.5, frequency_penalty=-0.25)
    x = logits_for(len(rs))
    want = x.clone()
    for i, r in enumerate(rs):  # logit - count * frequency - (count > 0) * presence
        for t in set(r.output_token_ids):
            c = r.output_token_ids.count(t)
            want[i, t] -= c * -0.25 + 0.5
    controls.apply(x, rs, {EOS})
    torch.testing.assert_close(x, want)


def test_min_p_equals_transformers():
    from transformers import MinPLogitsWarper

    x = logits_for(4)
    got = apply_min_p(x.clone(), torch.tensor([0.0, 0.05, 0.2, 0.9]))
    for i, p in enumerate([0.0, 0.05, 0.2, 0.9]):
        want = MinPLogitsWarper(p)(None, x[i:i + 1].clone())[0] if p else x[i]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), p
        assert torch.equal(got[i][~torch.isinf(got[i])], want[~torch.isinf(want)])


def test_logit_bias_equals_transformers_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor

    bias = {3: 5.0, 11: -100.0, 49: 0.5}
    rs = rows(logit_bias=bias)
    x = logits_for(len(rs))
    proc = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    want = torch.stack([hf(proc, r, x[i], r.output_token_ids or [0]) for i, r in enumerate(rs)])
    controls.apply(x, rs, {EOS})
    torch.testing.assert_close(x, want)


def test_min_tokens_equals_transformers_and_holds_stop_tokens_too():
    from transformers import MinNewTokensLengthLogitsProcessor

    rs = rows(min_tokens=4, max_tokens=8, stop_token_ids=[12])
    x = logits_for(len(rs))
    want = x.clone()
    for i, r in enumerate(rs):
        ids = r.prompt_token_ids + r.output_token_ids
        proc = MinNewTokensLengthLogitsProcessor(len(r.prompt_token_ids), 4, EOS)
        want[i] = hf(proc, r, x[i], ids)
        if r.num_output_tokens < 4:  # vLLM also holds back stop_token_ids
            want[i, 12] = float("-inf")
    controls.apply(x, rs, {EOS})
    torch.testing.assert_close(x, want)


def test_bad_words_equal_transformers_on_the_output():
    from transformers import NoBadWordsLogitsProcessor

    rs = rows()
    for r in rs:
        r.params = SamplingParams(bad_words=["x"])
        r.bad_words_ids = [[5], [r.output_token_ids[-1] if r.output_token_ids else 8, 9],
                           [1, 2, 3]]
    x = logits_for(len(rs))
    want = torch.stack([hf(NoBadWordsLogitsProcessor(r.bad_words_ids, EOS), r, x[i],
                           r.output_token_ids or [0]) for i, r in enumerate(rs)])
    controls.apply(x, rs, {EOS})
    torch.testing.assert_close(x, want)


def test_rows_without_controls_are_untouched():
    rs = rows()
    rs[1].params = SamplingParams(repetition_penalty=2.0, logit_bias={4: 1.0})
    x = logits_for(len(rs))
    before = x.clone()
    controls.apply(x, rs, {EOS})
    for i in (0, 2, 3):
        assert torch.equal(x[i], before[i])
    assert not torch.equal(x[1], before[1])


# ---- through the engine (the tiny preset: byte tokens, EOS = 257) -------------------------------

def engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64,
                               max_num_seqs=8, **kw))


def test_engine_controls_shape_the_output():
    eng = engine()
    a = ord("A")
    runs = {
        "bias": SamplingParams(max_tokens=6, temperature=0, logit_bias={a: 100.0}),
        "min_tokens": SamplingParams(max_tokens=9, temperature=0, min_tokens=5,
                                     logit_bias={257: 100.0}),
        "stop_token": SamplingParams(max_tokens=9, temperature=0,
                                     logit_bias={a: 99.0, ord("B"): 100.0},
                                     stop_token_ids=[ord("B")], min_tokens=2),
        "stop_token_kept": SamplingParams(max_tokens=9, temperature=0,
                                          logit_bias={a: 99.0, ord("B"): 100.0},
                                          stop_token_ids=[ord("B")], min_tokens=2,
                                          include_stop_str_in_output=True),
        "stop_str_kept": SamplingParams(max_tokens=9, temperature=0, logit_bias={a: 100.0},
                                        stop=["AA"], include_stop_str_in_output=True),
        "bad_word": SamplingParams(max_tokens=6, temperature=0, logit_bias={a: 100.0},
                                   bad_words=["A"]),
        "penalty": SamplingParams(max_tokens=6, temperature=0, logit_bias={a: 5.0},
                                  frequency_penalty=2.0),
    }
    seqs = {k: eng.add_request([65, 66, 67], p) for k, p in runs.items()}
    eng.run()
    out = {k: s.output_token_ids for k, s in seqs.items()}
    assert out["bias"] == [a] * 6
    # EOS (biased +100) is held back while fewer than 5 tokens are out; it is the 6th
    assert len(out["min_tokens"]) == 6 and out["min_tokens"][-1] == 257
    assert seqs["min_tokens"].finish_reason == "stop"
    assert all(t != 257 for t in out["min_tokens"][:5])
    # "B" is the stop token: held back by min_tokens, then it ends the output
    assert out["stop_token"] == [a, a, ord("B")] and eng.output_text(seqs["stop_token"]) == "AA"
    assert eng.output_text(seqs["stop_token_kept"]) == "AAB"
    assert eng.output_text(seqs["stop_str_kept"]) == "AA"
    assert a not in out["bad_word"]
    assert out["penalty"].count(a) < 6  # its count pays 2.0 each time


def test_penalties_read_tokens_while_launching_ahead_and_agree_with_async_off():
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, repetition_penalty=1.5,
                             presence_penalty=0.5) for i in range(5)]
    outs = []
    for async_on in (True, False):
        eng = engine(async_scheduling=async_on)
        seqs = [eng.add_request(list(range(60 + i, 70 + i)), p) for i, p in enumerate(params)]
        eng.run()
        outs.append([s.output_token_ids for s in seqs])
        assert (eng.stats.overlapped_steps > 0) == async_on
    assert outs[0] == outs[1]


def test_lines_carry_the_controls_and_bad_values_are_one_line_errors(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi", "logit_bias": {"65": 100},
                                   "max_tokens": 3, "temperature": 0}) + "\n")
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", *STOP, str(prompts), "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["text"] == "AAA"
    for line, msg in [({"prompt": "x", "logit_bias": {"a": 1}}, "keys must be token ids"),
                      ({"prompt": "x", "logit_bias": {"5": 101}}, r"in \[-100, 100\]"),
                      ({"prompt": "x", "logit_bias": {"999": 1}}, "outside the vocabulary"),
                      ({"prompt": "x", "min_p": 1.5}, r"min_p must be in \[0, 1\]"),
                      ({"prompt": "x", "min_tokens": 99, "max_tokens": 5}, "min_tokens must"),
                      ({"prompt": "x", "bad_words": [""]}, "bad_words must not be empty"),
                      ({"prompt": "x", "stop_token_ids": ["a"]}, "a list of integers"),
                      ({"prompt": "x", "presence_penalty": 3}, r"in \[-2, 2\]")]:
        prompts.write_text(json.dumps(line) + "\n")
        bad = tmp_path / "bad.jsonl"
        res = runner.invoke(app, ["generate", *STOP, str(prompts), "-o", str(bad), "--device",
                                  "cpu"])
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        flat = " ".join(res.output.split())
        assert "p.jsonl:1" in flat and re.search(msg, flat), (line, res.output)
        assert not bad.exists()


def test_openai_batch_bodies_take_penalties_and_logit_bias(tmp_path):
    prompts = tmp_path / "b.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.5,
            "logit_bias": {"66": 100}, "min_p": 0.1, "repetition_penalty": 1.1}
    prompts.write_text(json.dumps({"custom_id": "r1", "method": "POST",
                                   "url": "/v1/chat/completions", "body": body}) + "\n")
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["generate", str(prompts), "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    msg = json.loads(out.read_text())["response"]["body"]["choices"][0]["message"]["content"]
    assert msg == "BB"


def test_special_tokens_in_the_text(tmp_path):
    from hf_models import save_tokenizer

    from pagedgen.runtime.models.tokenizer import HFTokenizer

    save_tokenizer(tmp_path, 64)
    tok = HFTokenizer(tmp_path, 2)
    ids = [1, 4, 5, 2]  # <s> a b </s>
    assert tok.decode(ids) == "a b"
    assert tok.decode(ids, skip_special_tokens=False) == "<s> a b </s>"
    assert tok.decode(ids, False, False) == tok.tok.decode(ids, skip_special_tokens=False)


def test_a_resume_record_with_logit_bias_matches_itself():
    from pagedgen.cli.formats.output_claim import RECORD_VERSION, _difference

    settings = {"logit_bias": {65: 1.0}, "stop_token_ids": [3]}
    new = {"version": RECORD_VERSION, "inputs_sha256": "x", "settings": settings}
    assert _difference(json.loads(json.dumps(new)), new) is None
    other = {**new, "settings": {**settings, "logit_bias": {65: 2.0}}}
    assert "logit_bias" in _difference(json.loads(json.dumps(new)), other)


def test_controls_and_processors_change_model_dtype_logits_in_float32():
    """Sampling takes logits in the model's dtype; where controls or processors will change
    them it upcasts first, so a penalty or bias is not rounded to bf16: the planned logits are
    those of the float32 path, bit for bit, and processors see float32."""
    from types import SimpleNamespace

    from pagedgen.runtime.sampling.step import plan_sampling
    seen = []

    def processor(output_token_ids, row):
        seen.append(row.dtype)
        row[3] += 0.3

    rs = rows(repetition_penalty=1.3, presence_penalty=0.45, logit_bias={5: 0.3}, min_tokens=4)
    seqs = [SimpleNamespace(**vars(r), controlled=r.controlled, seed=i, num_output_tokens=len(
        r.output_token_ids), logits_processors=[processor] if i % 2 else [], grammar=None,
        is_finished=False) for i, r in enumerate(rs)]
    x = logits_for(len(rs)).to(torch.bfloat16)
    plan = plan_sampling(x, seqs, torch.device("cpu"), True, {EOS})
    ref = x.float()
    controls.apply(ref, seqs, {EOS})
    ref[1, 3] += 0.3
    ref[3, 3] += 0.3
    assert plan.logits.dtype == torch.float32 and torch.equal(plan.logits, ref)
    assert seen == [torch.float32, torch.float32]
    plain = plan_sampling(x, [SimpleNamespace(**{**vars(s), "controlled": False,
                                                 "logits_processors": []}) for s in seqs],
                          torch.device("cpu"), True, {EOS})
    assert plain.logits is x  # nothing to change: no float32 copy
