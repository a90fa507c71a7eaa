"""Images on the GPU (issue 96): the tiny Qwen3.5 vision checkpoint in float32 on CUDA gives
the CPU's greedy tokens (transformers' there: test_images.py) for prompts with images,
batched, through chunks that split an image and with decodes advanced on the device (pytest
-m gpu). The reference runs in pagedgen on the CPU, not in transformers: transformers before
5.2x (the GPU machine's 5.17) sends a CPU model's tensors to flash-linear-attention's Triton
kernels wherever that is installed, which fails."""

from __future__ import annotations

import pytest
import torch
from test_images import CASES, ckpt, engine, generate, image, msg  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_images_on_the_gpu_give_the_cpu_s_tokens(ckpt, hf, backend):  # noqa: F811
    from pagedgen.runtime.config import EngineConfig
    from pagedgen.runtime.engine.engine import Engine

    dtype = "float32" if backend == "sdpa" else "float16"
    prompts = [CASES["one image"], CASES["two images of other sizes"],
               ([msg(0, "u v")], [image(128, 128, 9)])]
    want = [s.output_token_ids for s in generate(engine(ckpt), hf, prompts)]
    eng = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype=dtype, backend=backend,
                              max_num_seqs=4, max_num_batched_tokens=16,
                              kv_cache_memory="64MiB"))
    got = [s.output_token_ids for s in generate(eng, hf, prompts)]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    summary = eng.summary(1.0, 0.0)
    print(backend, eng.backend_name, f"{same} of {sum(map(len, want))} tokens as on the CPU",
          summary["images_encoded"], "images encoded in",
          f"{summary['vision_encoder_s'] * 1e3:.1f} ms of the tower's kernels")
    assert 0 < summary["vision_encoder_s"] < 1.0
    if backend == "sdpa":  # float32: the same tokens
        assert got == want
    else:  # float16: the first tokens at least (rounding may part greedy paths later)
        assert all(g[:4] == w[:4] for g, w in zip(got, want))
