"""Log-probabilities of generated and prompt tokens against transformers' own logits."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_checkpoint

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.sampling import logprobs as logprobs_mod

K = 5


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return path, hf


def engine(path, **kw) -> Engine:
    base = dict(model=str(path), device="cpu", dtype="float32", backend="sdpa", block_size=8,
                num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16)  # 16: chunked prefill
    base.update(kw)
    return Engine(EngineConfig(**base))


def reference(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the float32 logits, one row per position."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_entries(entries, ref_rows: torch.Tensor, targets: list[int], k: int) -> None:
    assert len(entries) == len(targets) == ref_rows.shape[0]
    for (lp, top, rank), row, t in zip(entries, ref_rows, targets):
        assert lp == pytest.approx(row[t].item(), abs=1e-4)
        # the token's rank: 1 + the tokens above it (those within 1e-3 of it may go either way)
        above, near = (row > row[t] + 1e-3).sum().item(), (row > row[t] - 1e-3).sum().item()
        assert above + 1 <= rank <= near, (rank, above, near)
        vals, ids = row.topk(k)
        assert len(top) == k
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
        for (i, v) in top:  # ids may tie-swap only among equal values
            assert v == pytest.approx(row[i].item(), abs=1e-4)


def prompts(n: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 320, (length,), generator=gen).tolist() for length in (30, 9, 21)][:n]


def test_generated_and_prompt_logprobs_match_transformers(checkpoint):
    path, hf = checkpoint
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=K,
                            prompt_logprobs=K)
    for prompt, seq in zip(prompts(), engine(path).generate(prompts(), params)):
        ref = reference(hf, prompt + seq.output_token_ids)
        P = len(prompt)
        assert_entries(seq.prompt_logprobs, ref[:P - 1], prompt[1:], K)
        assert_entries(seq.logprobs, ref[P - 1:P - 1 + 6], seq.output_token_ids, K)
        # greedy: each chosen token is its row's best
        assert all(lp == pytest.approx(top[0][1]) and rank == 1
                   for lp, top, rank in seq.logprobs)


def test_parallel_samples_have_their_own_logprobs(checkpoint):
    path, hf = checkpoint
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True, n=3, seed=11,
                            logprobs=2, prompt_logprobs=1)
    prompt = prompts(1)[0]
    seq = engine(path).generate([prompt], params)[0]
    assert len({tuple(s.output_token_ids) for s in seq.samples}) > 1
    for s in seq.samples:
        ref = reference(hf, prompt + s.output_token_ids)
        assert_entries(s.logprobs, ref[len(prompt) - 1:-1], s.output_token_ids, 2)
        assert (s.prompt_logprobs is None) == (s.sample_index > 0)  # the request's, once
    assert_entries(seq.prompt_logprobs, reference(hf, prompt)[:-1], prompt[1:], 1)


def test_scoring_only_and_prefix_cache_and_preemption(checkpoint):
    """max_tokens 0 scores the prompt and samples nothing; a prompt whose blocks are cached
    still gets every prompt log-probability (those positions are computed again); sequences
    preempted and recomputed keep one entry per token."""
    path, hf = checkpoint
    prompt = prompts(1)[0]
    eng = engine(path)
    eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # caches its blocks
    seq = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert seq.output_token_ids == [] and seq.finish_reason == "length"
    assert_entries(seq.prompt_logprobs, reference(hf, prompt)[:-1], prompt[1:], 3)
    assert eng.stats.prefix_hit_tokens == 0  # the first run's own prompt had nothing to hit

    small = engine(path, num_blocks=9, max_num_seqs=4)  # 8 usable blocks: decodes preempt
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    seqs = small.generate(prompts(), params)
    assert small.stats.num_preemptions > 0
    for p, s in zip(prompts(), seqs):
        ref = reference(hf, p + s.output_token_ids)
        assert_entries(s.prompt_logprobs, ref[:len(p) - 1], p[1:], 1)
        assert_entries(s.logprobs, ref[len(p) - 1:-1], s.output_token_ids, 1)


def test_runs_without_logprobs_compute_none(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("log-probabilities computed though no request asked")

    monkeypatch.setattr(logprobs_mod, "compute", boom)
    eng = Engine(EngineConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32))
    seqs = eng.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4))
    assert all(s.logprobs is None and s.prompt_logprobs is None for s in seqs)
    with pytest.raises(AssertionError, match="no request asked"):
        eng.generate([[5, 6]], SamplingParams(max_tokens=2, logprobs=0))


@pytest.mark.parametrize("bad", [dict(logprobs=21), dict(prompt_logprobs=-1),
                                 dict(max_tokens=0), dict(max_tokens=0, prompt_logprobs=0, n=2)])
def test_bad_logprobs_settings(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


@pytest.mark.kernels
def test_the_row_kernel_gives_torchs_logsumexp_and_masked_rows_their_own():
    """The CUDA path's one-program-a-row log-sum-exp (interpreted) against torch's, with
    masked (-inf) tokens, a row of a single allowed token and a row of none."""
    from pagedgen.runtime.sampling.logprobs import row_logsumexp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3000, generator=g) * 4
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    x[2, 2999] = 1.5
    x[3] = float("-inf")
    got = row_logsumexp(x, kernel=True)
    want = torch.logsumexp(x, dim=-1, keepdim=True)
    assert got[3, 0] == float("-inf") and got[2, 0] == 1.5
    assert torch.allclose(got[[0, 1, 4]], want[[0, 1, 4]], rtol=0, atol=1e-5)
