"""The KV cache's size on a GPU (pytest -m gpu): what is left after the weights and a forward
at the largest step, not shrunk by memory the model's build used and freed."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.worker import model_runner

pytestmark = pytest.mark.gpu


def kv_blocks() -> int:
    eng = Engine(EngineConfig(model="tiny", device="cuda", backend="triton",
                              enforce_eager=True))
    n = eng.runner.num_blocks
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return n


def test_the_kv_cache_is_sized_without_the_builds_freed_memory(monkeypatch):
    """A build's transients (dummy experts drawn whole, then quantized) are freed before the
    KV cache is sized: counted, they left gpt-oss-120b no KV blocks on an H100. A build that
    takes and frees half the free memory gets the same cache as one that does not."""
    plain = kv_blocks()
    build = model_runner.build_model

    def wasteful(*args, **kwargs):
        half = torch.empty(torch.cuda.mem_get_info()[0] // 2, dtype=torch.uint8, device="cuda")
        del half
        return build(*args, **kwargs)

    monkeypatch.setattr(model_runner, "build_model", wasteful)
    assert kv_blocks() >= 0.98 * plain
