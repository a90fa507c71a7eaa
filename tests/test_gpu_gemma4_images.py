"""Gemma 4's images on the GPU (issue 96): the tiny Gemma 4 vision checkpoint with heads of 64
and 128 on CUDA, its image blocks attended again through each backend's pages, gives
transformers' float32 tokens and log-probabilities (sdpa in float32), or, through triton's and
FlashAttention's kernels (half precision only), transformers' log-probabilities of its own
tokens fed back as the prompt (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_gemma4_vision_checkpoint
from test_gemma4_images import CASES, chat, check, reference, run

from pagedgen.attention import backend as attention_backend
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import SamplingParams

pytestmark = pytest.mark.gpu

# Greedy paths of this random tiny model part at near ties in half precision (bf16 or fp16:
# even the eager reference does, on a CPU), so the kernels are checked on transformers' own
# tokens: the mean |log-probability| error per prompt. Measured on a CPU (eager, float16):
# 0.002-0.005; with the image blocks not attended again (a planted bug) 0.014-0.041.
MEAN_LOGPROB_ERROR = 0.01


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma4_vision_checkpoint(tmp_path_factory.mktemp("gemma4_vl_64"), head_dim=64,
                                         global_head_dim=128)


def scored(eng, hf, cases, want) -> list[list[float]]:
    """The engine's log-probabilities of transformers' tokens ``want``, each prompt followed
    by its reference continuation and scored (``prompt_logprobs``)."""
    seqs = []
    for (messages, images), (tokens, _) in zip(cases, want):
        ids, mm = eng.prompt_images(chat(hf[1], messages), images)
        seqs.append(eng.add_request(ids + tokens, SamplingParams(max_tokens=0, prompt_logprobs=0),
                                    images=mm))
    eng.run()
    return [[e[0] for e in s.prompt_logprobs[-len(t):]] for s, (t, _) in zip(seqs, want)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["sdpa", "triton", "flash-attn"])
def test_image_blocks_on_the_gpu_give_transformers_tokens(ckpt, hf, backend, monkeypatch):
    from pagedgen.runtime.config import EngineConfig
    from pagedgen.runtime.engine.engine import Engine

    calls = []
    reattend = attention_backend.reattend
    monkeypatch.setattr(attention_backend, "reattend",
                        lambda *a: (calls.append(1), reattend(*a))[1])
    cases = [CASES["one image"], CASES["two images of other sizes"],
             CASES["an image in a multi-turn chat"]]
    want = [reference(hf, m, im) for m, im in cases]
    dtype = "float32" if backend == "sdpa" else "float16"
    try:
        eng = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype=dtype, backend=backend,
                                  max_num_seqs=4, max_num_batched_tokens=80,
                                  kv_cache_memory="64MiB"))
    except PagedgenError as e:  # its kernels not installed on this machine
        pytest.skip(f"{backend}: {e}")
    if backend == "sdpa":  # float32: transformers' tokens and log-probabilities
        for seq, w in zip(run(eng, hf, cases), want):
            check(seq, w)
        assert calls
        return
    errors = [sum(abs(a - b) for a, b in zip(got, w)) / len(w)
              for got, (_, w) in zip(scored(eng, hf, cases, want), want)]
    print(backend, eng.backend_name, f"{len(calls)} block passes; mean log-probability error "
          "per prompt " + ", ".join(f"{e:.4f}" for e in errors))
    assert calls
    assert max(errors) < MEAN_LOGPROB_ERROR
