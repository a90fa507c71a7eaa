"""Piecewise CUDA graphs of steps with prefills, replayed on the GPU (pytest -m gpu): stepped in
lockstep with the same engine running those steps eagerly, per backend and on a MoE model."""

from __future__ import annotations

import pytest
import torch

from pagedgen.attention.registry import backend_status
from pagedgen.runtime.config import SamplingParams
from tests.engine_checks import byte_prompts, engine, lockstep_logits
from tests.hf_models import make_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def backends() -> list[str]:
    if not torch.cuda.is_available():
        return ["none"]
    names = {s.name for s in backend_status(torch.device("cuda")) if s.available}
    return [b for b in ("flash-attn", "flashinfer", "triton") if b in names] or ["none"]


def check(model: str, backend: str, prompts: list[list[int]]) -> None:
    kw = dict(model=model, backend=backend, async_scheduling=False,
              advance_decode_on_device=False, num_blocks=512, max_model_len=1024)
    a, ref = engine(mixed_step_graphs=True, **kw), engine(mixed_step_graphs=False, **kw)
    pw = a.runner.piecewise
    assert pw is not None and ref.runner.piecewise is None
    worst, agree, total = lockstep_logits(a, ref, prompts, GREEDY)
    steps = a.stats.num_steps - a.stats.decode_steps
    print(f"{backend} {model.rsplit('/', 1)[-1]}: {pw.steps} of {steps} steps with prefills "
          f"through the pieces, buckets {sorted(pw.pieces)}, capture "
          f"{pw.capture_time_s:.2f} s; logits vs eager: worst rel {worst:.4f}, argmax "
          f"{agree}/{total}")
    assert not pw.failed, pw.failed
    assert pw.steps == steps > 5 and len(pw.pieces) >= 2
    assert worst < 0.02 and agree >= 0.97 * total


@pytest.mark.parametrize("backend", backends())
def test_mixed_steps_replay_as_eager(backend):
    if backend == "none":
        pytest.skip("no GPU backend with CUDA graphs")
    check("tiny", backend, byte_prompts(40, seed=3, max_len=200))


def test_mixed_steps_replay_as_eager_on_a_moe_model(tmp_path):
    backend = backends()[0]
    if backend == "none":
        pytest.skip("no GPU backend with CUDA graphs")
    path = make_checkpoint("qwen3_moe", tmp_path / "moe")
    check(str(path), backend, byte_prompts(40, seed=4, max_len=200))
