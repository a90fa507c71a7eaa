"""vLLM's offline examples against pagedgen with only the import line changed (issue 99):
``SamplingParams`` with vLLM's defaults, ``generate``, ``chat``, logprobs in vLLM's form, ``n``
with a seed, and the output fields vLLM scripts read. The tiny preset on CPU stands in for the
examples' Hub models."""

from __future__ import annotations

import math

import pytest

from pagedgen import LLM, SamplingParams
from pagedgen.errors import PagedgenError

PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", device="cpu")


def test_the_basic_example_runs_with_vllms_defaults(llm):
    """vLLM's basic.py: an object's defaults (16 tokens, temperature 1, EOS honoured) replace
    the preset's own sampling defaults (64 tokens, greedy, EOS ignored)."""
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.request_id for o in outputs] == ["0", "1", "2", "3"]
    lens = [len(o.outputs[0].token_ids) for o in outputs]
    assert all(1 <= n <= 16 for n in lens) and 16 in lens, lens
    for o in outputs:
        c = o.outputs[0]
        assert isinstance(c.text, str) and o.finished
        assert c.cumulative_logprob is None and c.logprobs is None  # not asked for
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        assert (c.finish_reason == "length") == (len(c.token_ids) == 16)


def test_logprobs_come_in_vllms_form(llm):
    """Per output token a dict by token id: the token's ``Logprob`` (greedy: rank 1) and its
    top alternatives ranked 1..k; ``cumulative_logprob`` sums the tokens'; prompt logprobs
    start with None."""
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate("The capital of France is", params)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1
        assert 3 <= len(entry) <= 4  # the token and three alternatives, one of them itself
        ranks = sorted(lp.rank for t, lp in entry.items() if t != token)
        assert ranks in ([2, 3], [1, 2, 3])
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and isinstance(entry[token].decoded_token, str)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob
                                                     for t, e in zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(math.isfinite(lp.logprob) for e in out.prompt_logprobs[1:] for lp in e.values())


def test_n_samples_with_a_seed_repeat(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=12)
    a, b = (llm.generate(PROMPTS[:2], params) for _ in range(2))
    assert all(len(o.outputs) == 3 for o in a)
    assert [[c.token_ids for c in o.outputs] for o in a] == \
        [[c.token_ids for c in o.outputs] for o in b]
    assert len({tuple(c.token_ids) for c in a[0].outputs}) > 1


def test_chat_one_conversation_or_several(llm):
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"}]
    params = SamplingParams(temperature=0, max_tokens=8)
    one = llm.chat(conversation, params, use_tqdm=False)
    many = llm.chat([conversation] * 3, params, use_tqdm=True)
    assert len(one) == 1 and len(many) == 3
    assert all(o.outputs[0].token_ids == one[0].outputs[0].token_ids for o in many)
    with pytest.raises(PagedgenError, match="chat_template"):
        llm.chat(conversation, params, chat_template="{{ messages }}")


def test_stop_reason_names_the_token_or_string_that_stopped(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))[0].outputs[0]
    token = greedy.token_ids[4]
    first = greedy.token_ids.index(token)
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[token]))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == token
    assert c.token_ids == greedy.token_ids[:first + 1]
    stop = greedy.text[3:5]
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop=stop))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert greedy.text.startswith(c.text) and stop not in c.text
    assert greedy.stop_reason is None  # it ran to its length


def test_the_tokenizer_and_the_run_defaults(llm):
    tok = llm.get_tokenizer()
    assert tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"
    defaults = llm.get_default_sampling_params()
    assert isinstance(defaults, SamplingParams)
    assert defaults.max_tokens == llm.defaults.max_tokens


def test_vllms_defaults_and_fields_pagedgen_does_not_run():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n, p.ignore_eos) == \
        (16, 1.0, 1.0, 0, 1, False)
    assert SamplingParams(top_k=-1).request_fields(100)["top_k"] == 0
    assert SamplingParams(max_tokens=None).request_fields(100)["max_tokens"] == 100
    assert SamplingParams(stop="x").request_fields(100)["stop"] == ["x"]
    for field, value in (("best_of", 3), ("allowed_token_ids", [1]),
                         ("logits_processors", [print])):
        with pytest.raises(PagedgenError, match=f"SamplingParams.{field} is not run"):
            SamplingParams(**{field: value}).request_fields(100)
