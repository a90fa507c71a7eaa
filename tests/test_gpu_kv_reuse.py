"""Prefix caching and parallel sampling on every GPU backend: CUDA graphs, async scheduling,
preemption, FP8 caches (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from engine_checks import byte_prompts, engine
from pagedgen.attention.registry import backend_status, get_backend
from pagedgen.runtime.config import SamplingParams

pytestmark = pytest.mark.gpu


def gpu_backends() -> list[str]:
    if not torch.cuda.is_available():
        return ["none"]
    return [s.name for s in backend_status(torch.device("cuda"))
            if s.available and s.name != "eager"]


def shared_prefix_prompts(page: int) -> list[list[int]]:
    """Two groups of six behind prefixes of 2.5 and 4 pages, each prompt with its own tail."""
    g = torch.Generator().manual_seed(7)
    prefixes = [[256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()
                for n in (5 * page // 2, 4 * page)]
    tails = byte_prompts(12, seed=9, max_len=40)
    return [prefixes[i % 2] + t[1:] for i, t in enumerate(tails)]


def agreement(a, b) -> float:
    """Output tokens that agree up to each pair's first divergence, over all tokens."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        same, total = same + n, total + len(x)
    return same / total


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", gpu_backends())
def test_prefix_caching_and_samples_under_graphs(name, kv_cache_dtype):
    if name == "none":
        pytest.skip("needs a CUDA GPU")
    backend = get_backend(name, torch.device("cuda"))
    if kv_cache_dtype == "fp8" and not backend.supports_fp8_kv_cache:
        pytest.skip(f"{name} has no FP8 KV cache")
    page = backend.resolve_block_size(None)
    prompts = shared_prefix_prompts(page)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # room for three of the longest sequences: decodes preempt and recompute from the cache
    kw = dict(backend=name, kv_cache_dtype=kv_cache_dtype, max_num_seqs=8,
              num_blocks=3 * -(-(4 * page + 64) // page) + 1)
    on, off = engine(**kw), engine(prefix_caching=False, **kw)
    assert (on.runner.graphs is not None) == backend.supports_cuda_graphs
    got = [s.output_token_ids for s in on.generate(prompts, greedy)]
    want = [s.output_token_ids for s in off.generate(prompts, greedy)]
    rate = agreement(got, want)
    st = on.stats
    print(f"{name} {kv_cache_dtype}: hit {st.prefix_hit_tokens} tokens, preemptions "
          f"{st.num_preemptions}, greedy agreement with caching off {rate:.3f}")
    assert st.prefix_hit_tokens >= 4 * 2 * page and rate >= 0.75  # bf16: rare near-tie flips
    # parallel samples: forked from one prefill, each as the single run of its derived seed
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, n=4)
    parent = on.add_request(prompts[0], sampled)
    on.run()
    assert len(parent.samples) == 4 and all(s.num_output_tokens == 16 for s in parent.samples)
    assert len({tuple(s.output_token_ids) for s in parent.samples}) == 4
    bm = on.block_manager
    assert all(r == 0 for r in bm.ref_counts) and bm.num_free_blocks == bm.num_blocks
