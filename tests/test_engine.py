"""The engine: continuous batching, limits, preemption, chunked prefill, stops (the scheduler
alone: test_scheduler.py)."""

from __future__ import annotations

import random

import pytest

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine


def tiny(**kw) -> Engine:
    base = dict(device="cpu", backend="sdpa", load_format="dummy", max_num_seqs=8,
                max_num_batched_tokens=256)
    base.update(kw)
    return Engine(EngineConfig(**base))


def prompts(n, lo=5, hi=60):
    rng = random.Random(0)
    return [[256] + [rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_batched_results_do_not_depend_on_batching():
    ps = prompts(6)
    alone = [tiny(max_num_seqs=1, max_num_batched_tokens=64).generate([p], GREEDY)[0]
             for p in ps[:2]]
    together = tiny().generate(ps, GREEDY)
    for a, b in zip(alone, together):
        assert a.output_token_ids == b.output_token_ids


def test_sampled_results_are_reproducible():
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50)
    a = [s.output_token_ids for s in tiny(seed=3).generate(prompts(4), params)]
    b = [s.output_token_ids for s in tiny(seed=3).generate(prompts(4), params)]
    c = [s.output_token_ids for s in tiny(seed=4).generate(prompts(4), params)]
    assert a == b and a != c


def test_preemption_recomputes_and_gives_the_same_tokens():
    ps = prompts(6, 20, 40)
    roomy = tiny().generate(ps, GREEDY)
    eng = tiny(num_blocks=12, block_size=8)  # far too small for 6 x ~50 tokens at once
    cramped = eng.generate(ps, GREEDY)
    assert eng.stats.num_preemptions > 0
    assert [s.output_token_ids for s in cramped] == [s.output_token_ids for s in roomy]
    assert eng.block_manager.num_free_blocks == 11  # one is the scratch block


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_samples_fork_when_a_cramped_cache_leaves_the_prompts_last_token(async_scheduling):
    """n = 2 under a small cache with samples stopping early: a prompt whose block copies do
    not fit leaves its last token for a later step, which must still fork the samples (it
    ran as a decode instead: the parent sampled alone, its samples forked later from its
    output and the run hung with 'an empty step')."""
    ps = prompts(12, 20, 40)
    params = SamplingParams(max_tokens=40, temperature=1.0, n=2,
                            stop_token_ids=list(range(300, 340)))
    roomy = tiny(max_num_seqs=32).generate(ps, params)
    eng = tiny(max_num_seqs=32, num_blocks=9, block_size=16, async_scheduling=async_scheduling)
    cramped = eng.generate(ps, params)
    assert eng.stats.num_preemptions > 0
    assert all(x.finish_reason is not None for s in cramped for x in s.samples)
    assert [[x.output_token_ids for x in s.samples] for s in cramped] == \
        [[x.output_token_ids for x in s.samples] for s in roomy]


def test_chunked_prefill_gives_the_same_tokens():
    ps = prompts(3, 100, 200)
    whole = tiny().generate(ps, GREEDY)
    chunked = tiny(max_num_batched_tokens=32).generate(ps, GREEDY)
    assert [s.output_token_ids for s in chunked] == [s.output_token_ids for s in whole]


def test_stops_on_eos_max_tokens_and_context():
    eng = tiny(max_model_len=40)
    s1 = eng.add_request(prompts(1)[0][:30], SamplingParams(max_tokens=100, ignore_eos=True))
    s2 = eng.add_request([256, 1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.run()
    assert (s1.finish_reason, s1.num_tokens) == ("length", 40)
    assert (s2.finish_reason, s2.num_output_tokens) == ("length", 3)
    eng.tokenizer.eos_token_ids = set(range(384))  # every token is EOS now
    s3 = eng.add_request([256, 5], SamplingParams(max_tokens=5))
    eng.run()
    assert (s3.finish_reason, s3.num_output_tokens) == ("stop", 1)


def test_stop_strings_cut_the_text():
    eng = tiny()
    eng.tokenizer.decode = lambda ids, *options: "".join(chr(97 + i % 26) for i in ids)
    s = eng.add_request([256, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    eng.run()
    full = eng.output_text(s)
    stop = full[3:5]
    s2 = eng.add_request([256, 9], SamplingParams(max_tokens=30, temperature=0.0,
                                                  ignore_eos=True, stop=[stop]))
    eng.run()
    assert s2.finish_reason == "stop"
    assert eng.output_text(s2) == full[:full.find(stop)]


def test_bad_prompts_are_rejected():
    eng = tiny(max_model_len=20)
    with pytest.raises(ValueError, match="context is 20"):
        eng.add_request(list(range(25)), GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([5, 99999], GREEDY)


def test_decode_metadata_advanced_on_device_gives_the_same_tokens():
    ps = prompts(5, 3, 30)
    params = SamplingParams(max_tokens=40, temperature=0.7, ignore_eos=True)
    rebuilt = tiny(block_size=4, advance_decode_on_device=False).generate(ps, params)
    eng = tiny(block_size=4)
    advanced = eng.generate(ps, params)
    assert eng.runner.advancer.num_advanced > 20
    assert [s.output_token_ids for s in advanced] == [s.output_token_ids for s in rebuilt]


@pytest.mark.parametrize("num_blocks", [None, 24])  # 24: preemptions mid-decode
def test_steps_with_prefills_launch_ahead_with_the_same_results(num_blocks):
    """Steps that carry prefill chunks launch before the last step's tokens are on the host:
    its tokens reach the decodes' rows on the device, with exactly the outputs of launching
    them after it (preempted samples included)."""
    ps = prompts(12, 3, 40)
    params = [SamplingParams(max_tokens=6 + 5 * (i % 4), temperature=1.0, seed=i,
                             n=2 if i % 3 == 0 else 1, stop=["z"] if i % 4 == 1 else [])
              for i in range(12)]

    def run(**kw):
        eng = tiny(block_size=4, num_blocks=num_blocks, max_num_seqs=6,
                   max_num_batched_tokens=48, **kw)
        rows = {"decode": 0}
        fill = eng.runner._fill_pending

        def counted(ids, pending):
            rows["decode"] += len(pending)
            return fill(ids, pending)

        eng.runner._fill_pending = counted
        reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
        eng.run()
        return eng, [[s.output_token_ids for s in r.samples or [r]] for r in reqs], rows

    before, before_out, _ = run(mixed_steps_ahead=False)
    eng, out, rows = run()
    assert out == before_out
    assert eng.stats.overlapped_steps > before.stats.overlapped_steps
    assert rows["decode"] > 0  # decodes beside prefills took the step in flight's tokens
    assert (eng.stats.num_preemptions > 0) == bool(num_blocks)


@pytest.mark.parametrize("num_blocks", [None, 24])  # 24: preemptions mid-decode
def test_async_scheduling_gives_the_same_results_as_sync(num_blocks):
    """Stops found a step late (EOS, stop strings) and length limits known at launch must give
    exactly the synchronous engine's outputs, with no placeholder left behind."""
    ps = prompts(10, 3, 40)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=1.0, seed=i,
                             stop=["z"] if i % 3 == 0 else []) for i in range(10)]

    def run(**kw):
        eng = tiny(block_size=4, num_blocks=num_blocks, max_num_seqs=6, **kw)
        seqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
        done = []
        eng.run(on_finish=done.append)
        return eng, seqs, done

    sync_eng, sync_seqs, _ = run(async_scheduling=False)
    eng, seqs, done = run()
    assert eng.stats.overlapped_steps > 10
    assert sorted(s.seq_id for s in done) == [s.seq_id for s in seqs]
    reasons = {s.finish_reason for s in seqs}
    assert "stop" in reasons and "length" in reasons  # both kinds of stop were exercised
    for a, b in zip(seqs, sync_seqs):
        assert a.output_token_ids == b.output_token_ids
        assert (a.finish_reason, a.stop_text_end) == (b.finish_reason, b.stop_text_end)
        assert a.token_ids == a.prompt_token_ids + a.output_token_ids
    if num_blocks:
        assert eng.stats.num_preemptions > 0


def test_lockstep_logits_sdpa_vs_eager():
    """The GPU backends' model-level check (tests/engine_checks.py), here with sdpa on CPU."""
    from engine_checks import byte_prompts, engine, lockstep_logits

    kw = dict(device="cpu", dtype="float32", num_blocks=128)
    a = engine(backend="sdpa", advance_decode_on_device=False, **kw)
    ref = engine(backend="eager", async_scheduling=False, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    worst, agree, total = lockstep_logits(a, ref, byte_prompts(4), params)
    assert total == 4 * 6 and agree == total and worst < 1e-4
