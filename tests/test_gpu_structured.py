"""Structured output on the GPU (pytest -m gpu): masks applied to CUDA logits equal the CPU
path's, and every backend runs constrained lines under CUDA graphs with steps launched ahead,
writing what each constraint allows beside unconstrained rows (that the masks leave other rows
alone is checked exactly on the CUDA logits; the CPU suite checks the engine's tokens)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from engine_checks import byte_prompts, engine
from test_gpu_kv_reuse import gpu_backends

from pagedgen.runtime.config import SamplingParams, StructuredOutput

pytestmark = pytest.mark.gpu
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"]}
CASES = [(StructuredOutput("json", json.dumps(SCHEMA)),
          lambda t: set(json.loads(t)) == {"id", "tag", "ok"}),
         (StructuredOutput("regex", r"[0-9]{2}-[a-f]{3}"),
          lambda t: re.fullmatch(r"[0-9]{2}-[a-f]{3}", t)),
         (StructuredOutput("choice", '["red", "green", "blue"]'),
          lambda t: t in ("red", "green", "blue"))]


def test_cuda_masks_equal_the_cpu_masks():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pagedgen.runtime.models.tokenizer import ByteTokenizer
    from pagedgen.runtime.sampling.structured import Grammars

    g = Grammars(ByteTokenizer(), 512)  # logits wider than the tokenizer's ids
    logits = torch.randn(6, 512)
    out = []
    for device in ("cpu", "cuda"):
        states = [g.state(c) for c, _ in CASES]
        x = logits.to(device)
        g.apply(x, [(1, states[0], [ord("{")]), (3, states[1], [ord("4")]),
                    (4, states[2], [])])
        out.append(x.cpu())
    assert torch.equal(out[0], out[1])
    assert torch.equal(out[1][[0, 2, 5]], logits[[0, 2, 5]])
    assert not torch.isfinite(out[1][1, 258:]).any()


@pytest.mark.parametrize("name", gpu_backends())
def test_constrained_lines_under_graphs_and_async(name):
    if name == "none":
        pytest.skip("needs a CUDA GPU")
    prompts = byte_prompts(12, seed=3)
    eng = engine(backend=name, num_blocks=256)
    free = [eng.add_request(p, SamplingParams(max_tokens=24, temperature=1.0))
            for p in prompts[:6]]
    constrained = [eng.add_request(p, SamplingParams(max_tokens=48, temperature=1.0, n=2,
                                                     structured=CASES[i % 3][0]))
                   for i, p in enumerate(prompts[6:])]
    eng.run()
    assert (eng.runner.graphs is not None) == eng.runner.backend.supports_cuda_graphs
    assert eng.stats.overlapped_steps > 0 and eng.grammars.prefetched_rows > 0
    assert all(s.num_output_tokens == 24 or s.finish_reason == "stop" for s in free)
    stopped = 0
    for i, seq in enumerate(constrained):
        for s in seq.samples:
            if s.finish_reason == "stop":
                stopped += 1
                assert CASES[i % 3][1](eng.output_text(s)), eng.output_text(s)
    assert stopped >= 10 and eng.grammars.rejected == 0
    print(f"{name}: {stopped} of 12 constrained samples stopped inside 48 tokens, "
          f"{eng.stats.overlapped_steps} steps launched ahead, mask fill "
          f"{1000 * eng.grammars.mask_time_s:.1f} ms in all")
