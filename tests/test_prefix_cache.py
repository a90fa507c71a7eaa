"""KV reuse: automatic prefix caching and parallel sampling (``n``)."""

from __future__ import annotations

import json
import random

import pytest
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.runtime.sampling.sampler import derive_seed

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine(**kw) -> Engine:
    base = dict(device="cpu", dtype="float32", backend="sdpa", load_format="dummy",
                block_size=8, max_num_seqs=6, max_num_batched_tokens=48)
    base.update(kw)
    return Engine(EngineConfig(**base))


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Groups of prompts behind prefixes of 24 (3 blocks of 8), 29 and 13 tokens, plus a repeat
    of one prompt and a prompt that is exactly a cached prefix (capped: one token computed)."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    prompts = []
    for plen in (24, 29, 13):
        prefix = toks(plen)
        prompts += [prefix + toks(rng.randint(1, 20)) for _ in range(4)]
    prompts += [list(prompts[1]), prompts[0][:24]]
    return prompts


def assert_all_blocks_released(eng: Engine) -> None:
    bm = eng.block_manager
    assert all(r == 0 for r in bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks  # every block free or cached-evictable
    for key, block in bm.cached.items():
        assert bm.block_key[block] == key


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_greedy_outputs_with_caching_equal_without(tmp_path, model, async_scheduling):
    """fp32, chunked prefill (48-token budget), and an 18-block cache: preemption and eviction."""
    name = "tiny" if model == "tiny" else str(make_checkpoint("llama", tmp_path / "ckpt"))
    kw = dict(model=name, num_blocks=18, async_scheduling=async_scheduling)
    off = engine(prefix_caching=False, **kw)
    prompts = shared_prefix_prompts(off.src.hf_config.vocab_size)
    want = [s.output_token_ids for s in off.generate(prompts, GREEDY)]
    on = engine(**kw)
    got = [s.output_token_ids for s in on.generate(prompts, GREEDY)]
    assert got == want
    st = on.stats
    assert st.prefix_hit_tokens >= 8 * 9  # most of each group's prefix came from the cache
    assert st.num_preemptions > 0 and st.evicted_blocks > 0
    assert st.prefill_tokens < off.stats.prefill_tokens
    assert_all_blocks_released(on)


def test_a_block_is_reused_only_behind_the_same_prefix():
    """Block C cached behind block B must not serve C behind block A: keys chain."""
    rng = random.Random(3)
    a, b, c = ([rng.randrange(256) for _ in range(8)] for _ in range(3))
    runs = [b + c + [1, 2, 3], a + [4, 5], a + c + [6, 7]]  # one at a time, in this order
    on, off = engine(), engine(prefix_caching=False)
    for p in runs:
        want = off.generate([p], GREEDY)[0].output_token_ids
        assert on.generate([p], GREEDY)[0].output_token_ids == want
    assert on.stats.prefix_hit_tokens == 8  # only block A, for the last prompt


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompts_admitted_in_one_step_share_their_prefix(async_scheduling):
    rng = random.Random(4)
    prefix = [rng.randrange(256) for _ in range(27)]
    prompts = [prefix + [rng.randrange(256) for _ in range(5 + i)] for i in range(4)]
    on = engine(async_scheduling=async_scheduling, max_num_batched_tokens=256)
    got = on.generate(prompts, GREEDY)
    assert on.stats.prefix_hit_tokens == 3 * 24  # the first step: one computes, three share
    assert on.stats.prefill_tokens == sum(map(len, prompts)) - 3 * 24
    want = engine(prefix_caching=False).generate(prompts, GREEDY)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]


def test_preempted_sequence_recomputes_from_its_own_cached_blocks():
    eng = engine(num_blocks=14, max_num_seqs=4)
    ps = [[256] + [(7 * i + j) % 250 for j in range(30)] for i in range(4)]
    seqs = eng.generate(ps, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert eng.stats.num_preemptions > 0
    assert eng.stats.prefix_hit_tokens > 0  # only readmissions could hit: the prompts differ
    ref = engine(num_blocks=64, prefix_caching=False).generate(
        ps, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in ref]


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, tokens, SamplingParams(), 0)


def test_eviction_takes_the_least_recently_used_cached_block():
    bm = BlockManager(6, 4, prefix_caching=True)
    a, b = seq(0, list(range(8))), seq(1, list(range(100, 108)))
    for s in (a, b):
        bm.allocate(s, 8)
        bm.cache_blocks(s, 8)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.match_prefix(seq(2, list(range(9))), 8) == a_blocks  # both still cached
    c = seq(3, list(range(200, 216)))
    bm.allocate(c, 12)  # 3 blocks: the 2 never used, then a's last block (LRU, tail first)
    assert c.block_table[2] == a_blocks[1] and bm.num_evicted == 1
    assert bm.match_prefix(seq(4, list(range(9))), 8) == a_blocks[:1]
    assert bm.match_prefix(seq(5, list(range(100, 109))), 8) == b_blocks
    # a hit refreshes: b's blocks, taken and freed again, are now the most recently used
    d = seq(6, list(range(100, 109)))
    bm.take_prefix(d, bm.match_prefix(d, 8))
    bm.free(d)
    e = seq(7, list(range(300, 304)))
    bm.allocate(e, 4)
    assert e.block_table == a_blocks[:1]


def test_referenced_blocks_are_never_handed_out_twice():
    """Random admissions (with prefix hits), growth, forks and frees; after each operation the
    books balance: a block is referenced by exactly as many tables as its count, and is in the
    free queue exactly when the count is zero."""
    rng = random.Random(0)
    bm = BlockManager(40, 4, prefix_caching=True)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 14))] for _ in range(4)]
    for step in range(600):
        op = rng.random()
        if op < 0.4 or not live:
            s = seq(step, rng.choice(prefixes) + [rng.randrange(50) for _ in range(3)])
            hits = bm.match_prefix(s, len(s.token_ids) - 1)
            need = -(-len(s.token_ids) // 4) - len(hits) + bm.num_free_among(hits)
            if need <= bm.num_free_blocks:
                bm.take_prefix(s, hits)
                bm.allocate(s, len(s.token_ids))
                bm.cache_blocks(s, len(s.token_ids))
                live.append(s)
        elif op < 0.6 and bm.num_free_blocks:
            parent = rng.choice(live)
            child = seq(step, list(parent.token_ids))
            bm.fork(parent, child, len(parent.token_ids))
            live.append(child)
        elif op < 0.8:
            s = rng.choice(live)
            if bm.can_allocate(s, len(s.token_ids) + 4):
                s.token_ids += [rng.randrange(50) for _ in range(4)]
                bm.allocate(s, len(s.token_ids))
        else:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        counts = [0] * bm.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        assert counts == bm.ref_counts
        assert all((b in bm.free_blocks) == (counts[b] == 0) for b in range(bm.num_blocks))
        assert all(bm.block_key[b] == k for k, b in bm.cached.items())
    assert bm.num_evicted > 0


def test_parallel_samples_share_the_prompt_blocks_once():
    """n = 8 on a 2,000-token prompt: its 83 full blocks (of 24 tokens) are allocated once and
    held by all eight samples; each sample gets its own copy of the partly filled last one."""
    eng = engine(block_size=24, max_num_seqs=8, max_num_batched_tokens=2048, num_blocks=200)
    prompt = [256] + [random.Random(1).randrange(256) for _ in range(1999)]
    parent = eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=8))
    eng.step()  # the whole prompt: prefilled once, then forked
    bm = eng.block_manager
    full = 2000 // 24
    assert eng.stats.prefill_tokens == 2000
    assert len(parent.samples) == 8 and all(len(s.block_table) == full + 1
                                            for s in parent.samples)
    shared = parent.block_table[:full]
    assert all(s.block_table[:full] == shared for s in parent.samples)
    assert all(bm.ref_counts[b] == 8 for b in shared)
    assert len({s.block_table[full] for s in parent.samples}) == 8
    assert bm.num_blocks - bm.num_free_blocks == full + 8
    eng.run()
    assert_all_blocks_released(eng)


def test_sample_i_equals_the_single_run_with_its_derived_seed():
    prompt = [256] + list(range(40, 77))
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    eng = engine()
    parent = eng.add_request(prompt, SamplingParams(**{**params.__dict__, "n": 5}))
    eng.run()
    outs = [s.output_token_ids for s in parent.samples]
    assert len({tuple(o) for o in outs}) == 5  # five different samples
    for i, out in enumerate(outs):
        single = SamplingParams(**{**params.__dict__, "seed": derive_seed(11, i)})
        assert engine().generate([prompt], single)[0].output_token_ids == out


def test_generate_writes_choices_and_the_hit_rate(tmp_path):
    src = tmp_path / "p.jsonl"
    shared = "You are a careful assistant. Answer in one word. " * 2
    src.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "x", "prompt": shared + "Capital of France?", "n": 3, "temperature": 1},
        {"id": "y", "prompt": shared + "Capital of Peru?"},
        {"id": "z", "prompt": shared + "Capital of Chad?", "n": 2, "max_tokens": 3}]))
    res = CliRunner().invoke(app, ["generate", str(src), "--device", "cpu", "--max-tokens", "4",
                                   "--json", "--max-num-batched-tokens", "64"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["requests"] == 3 and summary["samples"] == 6
    assert summary["prefix_cache_hit_rate"] > 0.3 and summary["prefix_cache_hit_tokens"] >= 2 * 48
    lines = [json.loads(l) for l in (tmp_path / "p.completions.jsonl").read_text().splitlines()]
    assert [l["id"] for l in lines] == ["x", "y", "z"]
    assert set(lines[0]) == {"id", "prompt", "num_prompt_tokens", "choices"}
    assert [c["index"] for c in lines[0]["choices"]] == [0, 1, 2]
    for c in lines[0]["choices"] + lines[2]["choices"]:
        assert set(c) == {"index", "text", "token_ids", "num_output_tokens", "finish_reason"}
    assert all(c["num_output_tokens"] == 3 for c in lines[2]["choices"])
    assert "text" in lines[1] and "choices" not in lines[1]
