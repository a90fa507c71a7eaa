"""Gemma 4's images on the GPU (issue 96): the tiny Gemma 4 vision checkpoint with heads of 64
and 128 on CUDA, its image blocks attended again through triton's and FlashAttention's pages,
gives transformers' tokens and log-probabilities (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_gemma4_vision_checkpoint
from test_gemma4_images import CASES, check, reference, run

from pagedgen.attention import backend as attention_backend
from pagedgen.errors import PagedgenError

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma4_vision_checkpoint(tmp_path_factory.mktemp("gemma4_vl_64"), head_dim=64,
                                         global_head_dim=128)


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
    dtype = "float32" if backend == "sdpa" else "bfloat16"
    try:
        eng = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype=dtype, backend=backend,
                                  max_num_seqs=4, max_num_batched_tokens=80,
                                  kv_cache_memory="64MiB"))
    except PagedgenError as e:  # its kernels not installed on this machine
        pytest.skip(f"{backend}: {e}")
    seqs = run(eng, hf, cases)
    got = [[e[0] for e in s.logprobs] for s in seqs]
    worst = max(abs(a - b) for s, (_, w) in zip(got, want) for a, b in zip(s, w))
    print(backend, eng.backend_name, f"{len(calls)} block passes; worst log-probability "
          f"{worst:.2e} from transformers' float32")
    assert calls
    if backend == "sdpa":  # float32: transformers' tokens and log-probabilities
        for seq, w in zip(seqs, want):
            check(seq, w)
    else:  # bfloat16: the first tokens, log-probabilities near
        assert all(s.output_token_ids[:4] == w[0][:4] for s, w in zip(seqs, want))
        assert worst < 0.1
