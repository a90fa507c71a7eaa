"""Log-probabilities on every GPU backend, under CUDA graphs, async scheduling and chunked
prefill (pytest -m gpu): the decode steps' figures against the same tokens scored by prefill."""

from __future__ import annotations

import pytest
from engine_checks import byte_prompts, engine
from test_gpu_kv_reuse import gpu_backends

from pagedgen.runtime.config import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", gpu_backends())
def test_decode_logprobs_equal_prefill_scoring(name):
    if name == "none":
        pytest.skip("needs a CUDA GPU")
    # prompts of up to 120 tokens: chunked; blocks set (the default takes 90% of the GPU, which
    # the engines of earlier parameters may still hold)
    eng = engine(backend=name, max_num_batched_tokens=64, num_blocks=256)
    prompts = byte_prompts(8, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    seqs = eng.generate(prompts, params)
    assert eng.stats.overlapped_steps > 0  # async scheduling was on
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=3)
    scored = eng.generate([p + s.output_token_ids for p, s in zip(prompts, seqs)], scoring)
    worst_prompt = worst_out = 0.0
    for p, s, sc in zip(prompts, seqs, scored):
        assert len(s.logprobs) == s.num_output_tokens == 16
        assert len(s.prompt_logprobs) == len(p) - 1 and len(sc.prompt_logprobs) == len(p) + 15
        assert all(lp == top[0][1] and len(top) == 3 for lp, top, _ in s.logprobs)  # greedy
        for (a, *_), (b, *_) in zip(s.prompt_logprobs, sc.prompt_logprobs):
            worst_prompt = max(worst_prompt, abs(a - b))  # prefill both times, other chunks
        for (a, *_), (b, *_) in zip(s.logprobs, sc.prompt_logprobs[len(p) - 1:]):
            worst_out = max(worst_out, abs(a - b))
    print(f"{name}: logprobs against prefill scoring, worst difference: prompt tokens "
          f"{worst_prompt:.4f}, generated tokens {worst_out:.4f}")
    # bf16: chunks cut elsewhere and decode kernels sum in other orders (a logprob near -5.5)
    assert worst_prompt < 0.05 and worst_out < 0.05
