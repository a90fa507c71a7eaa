"""Piecewise CUDA graphs for steps with prefills (runtime/worker/piecewise_graphs.py): on the
CPU, the pieces run inline through the same static buffers, padding and per-layer attention
calls as a replay does; the GPU test (test_gpu_backends.py) replays captured graphs."""

from __future__ import annotations

import pytest
import torch

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.layers.attention import PagedAttention
from pagedgen.runtime.worker.piecewise_graphs import MAX_TOKENS, PiecewiseGraphs, token_buckets
from tests.hf_models import make_checkpoint


def test_buckets_cover_every_count_up_to_the_largest():
    b = token_buckets(MAX_TOKENS)
    assert b[:3] == [64, 128, 192] and b[-1] == MAX_TOKENS == 1024 and len(b) == 16
    assert token_buckets(200) == [64, 128, 192, 200]
    pw = PiecewiseGraphs(torch.nn.Linear(1, 1), [], [], MAX_TOKENS, 0, torch.device("cpu"),
                         torch.float32)
    for n in (1, 63, 64, 65, 1000, 1023, 1024):
        tb = pw.bucket(n)
        assert tb >= n and tb in b and tb - n < 64


def with_pieces(engine: Engine, buckets: list[int]) -> PiecewiseGraphs:
    """Give ``engine`` piecewise graphs (on the CPU: run inline) over ``buckets``."""
    r = engine.runner
    layers = [m for m in r.model.modules() if isinstance(m, PagedAttention)]
    r.piecewise = PiecewiseGraphs(r.model, layers, r.kv_caches, buckets[-1],
                                  r.scratch_block * r.block_size, r.device, r.dtype,
                                  buckets=buckets)
    return r.piecewise


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, vocab, (20,), generator=g).tolist()  # cached context for some
    out = []
    for i in range(n):
        own = torch.randint(0, vocab, (int(torch.randint(3, 50, (1,), generator=g)),),
                            generator=g).tolist()
        out.append(shared + own if i % 2 else own)
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "qwen3_moe"])
def test_steps_through_the_pieces_equal_eager_steps(kind, tmp_path):
    """Admissions mid-decode (mixed steps), chunked prompts, cached prefixes, preemption: the
    same tokens and log-probabilities (of prompts too) as the plain forward, every step with
    prefills through the pieces, padded to buckets of several sizes."""
    path = make_checkpoint(kind, tmp_path / kind)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i % 3 == 0 else None) for i in range(10)]

    def run(pieces: bool):
        eng = Engine(EngineConfig(model=str(path), device="cpu", backend="sdpa",
                                  dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                                  block_size=8, num_blocks=16))
        pw = with_pieces(eng, [16, 40, 64]) if pieces else None
        ps = prompts(10, eng.runner.model.config.vocab_size)
        seqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
        eng.run()
        return eng, pw, seqs

    _, _, plain = run(False)
    eng, pw, seqs = run(True)
    st = eng.stats
    assert pw.steps == st.num_steps - st.decode_steps > 5
    assert sum(len(s.prompt_logprobs or []) for s in seqs) > 50
    assert st.num_preemptions > 0  # 16 blocks of 8 for 4 sequences of up to ~80 tokens
    for a, b in zip(seqs, plain):
        assert a.output_token_ids == b.output_token_ids
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for (ca, *_), (cb, *_) in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (ca is None and cb is None) or abs(ca - cb) < 1e-4
        for (ca, top_a, _), (cb, top_b, _) in zip(a.logprobs, b.logprobs):
            assert abs(ca - cb) < 1e-4
            assert [i for i, _ in top_a] == [i for i, _ in top_b]
            assert max(abs(x[1] - y[1]) for x, y in zip(top_a, top_b)) < 1e-4


@pytest.mark.parametrize("asked", [None, False, True])
def test_the_runner_makes_pieces_only_where_decode_steps_have_graphs(asked):
    eng = Engine(EngineConfig(device="cpu", backend="sdpa", load_format="dummy",
                              max_num_seqs=4, max_num_batched_tokens=64,
                              mixed_step_graphs=asked))
    assert eng.runner.graphs is None and eng.runner.piecewise is None
    summary = eng.summary(1.0, 0.0)
    assert "mixed_graph_steps" not in summary
    # asked for and not possible: the summary says why
    assert summary.get("mixed_step_graphs") == ("off: no CUDA graphs in this run" if asked
                                                else None)
