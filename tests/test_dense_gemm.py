"""The dense GEMM's device choice: float32 on an AMD CPU through oneDNN, equal to F.linear, and
a model whose large linears and LM head take it gives the tokens it gives without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_models import make_checkpoint

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.quantization import dense_gemm

ONEDNN = pytest.mark.skipif(not dense_gemm.onednn_available(),
                            reason="this torch has no oneDNN inner product")


@pytest.fixture
def calls(monkeypatch):
    """oneDNN taken as if on an AMD CPU; the (rows, weight shape) of each GEMM it ran."""
    seen: list[tuple[int, tuple[int, ...]]] = []
    real = dense_gemm.onednn_linear

    def spy(x, w, b):
        seen.append((x.shape[-2] if x.dim() > 1 else 1, tuple(w.shape)))
        return real(x, w, b)
    monkeypatch.setattr(dense_gemm, "onednn_pays", lambda: True)
    monkeypatch.setattr(dense_gemm, "onednn_linear", spy)
    return seen


@ONEDNN
def test_large_float32_gemms_go_to_onednn_and_equal_f_linear(calls):
    torch.manual_seed(0)
    w = torch.randn(2048, 256)  # 2 ** 19 elements
    b = torch.randn(2048)
    wide = torch.randn(4096, 256)[::2]  # a weight of every other row: strided
    with torch.inference_mode():
        for x, weight, bias in [(torch.randn(5, 256), w, b), (torch.randn(3, 4, 256), w, None),
                                (torch.randn(256, 7).t(), w, b), (torch.randn(1, 256), wide, b)]:
            got = dense_gemm.linear(x, weight, bias)
            assert got.shape == F.linear(x, weight, bias).shape
            torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert [c[1] for c in calls] == [(2048, 256)] * 4
    small = torch.randn(dense_gemm.MIN_WEIGHT // 256 - 1, 256)
    with torch.inference_mode():
        dense_gemm.linear(torch.randn(2, 256), small)  # below the size that pays
        dense_gemm.linear(torch.randn(2, 256, dtype=torch.bfloat16), w.bfloat16())
        dense_gemm.linear(torch.randn(0, 256), w)  # no rows
    x = torch.randn(2, 256, requires_grad=True)
    dense_gemm.linear(x, w).sum().backward()  # a gradient asked for: F.linear's
    assert x.grad is not None and len(calls) == 4


def test_only_an_amd_cpu_takes_onednn(monkeypatch):
    for vendor, taken in [("AuthenticAMD", dense_gemm.onednn_available()),
                          ("GenuineIntel", False), ("", False)]:
        monkeypatch.setattr(dense_gemm, "cpu_vendor", lambda v=vendor: v)
        dense_gemm.onednn_pays.cache_clear()
        assert dense_gemm.onednn_pays() == taken, vendor
    dense_gemm.onednn_pays.cache_clear()


@ONEDNN
def test_a_model_on_onednn_gives_the_tokens_it_gives_on_f_linear(tmp_path, monkeypatch, calls):
    # tied embeddings of 4,096 × 128 (2 ** 19 elements): the LM head, and the MLP's
    # projections, pay
    path = make_checkpoint("qwen2", tmp_path / "m", vocab_size=4096, intermediate_size=4096)
    prompts = [[5, 9, 3, 77], list(range(20, 57)), [7] * 9]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                  backend="eager", block_size=8, num_blocks=64))
        return [s.output_token_ids for s in eng.generate(prompts, params)]
    on = tokens()
    assert {(4096, 128), (8192, 128), (128, 4096)} <= {c[1] for c in calls}
    monkeypatch.setattr(dense_gemm, "onednn_pays", lambda: False)
    n = len(calls)
    assert tokens() == on and len(calls) == n
