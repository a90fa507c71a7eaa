"""Engine-level checks shared by the backend tests: a backend's logits stepped in lockstep with
a reference engine, and CUDA-graph replay against eager stepping."""

from __future__ import annotations

import torch

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine


def engine(**kw) -> Engine:
    """The tiny preset with dummy weights; ``kw`` overrides EngineConfig fields."""
    base = dict(device="cuda", load_format="dummy", max_num_seqs=16, max_num_batched_tokens=512,
                dtype="bfloat16")
    base.update(kw)
    return Engine(EngineConfig(**base))


def byte_prompts(n: int, seed: int = 0, max_len: int = 120) -> list[list[int]]:
    """``n`` prompts of BOS + 5..max_len random bytes."""
    g = torch.Generator().manual_seed(seed)
    return [[256] + torch.randint(0, 256, (int(l),), generator=g).tolist()
            for l in torch.randint(5, max_len, (n,), generator=g)]


def lockstep_logits(a: Engine, ref: Engine, prompts: list[list[int]], params: SamplingParams
                    ) -> tuple[float, int, int]:
    """Step ``a`` and ``ref`` together on the same prompts, giving ``a`` the reference's tokens
    after each step so that later steps stay comparable. Both must step synchronously (``a``
    without device-side advance, since its tokens are patched on the host). Returns the worst
    relative logit difference, the rows whose argmax agrees, and the rows compared."""
    pairs = [(a.add_request(p, params), ref.add_request(p, params)) for p in prompts]
    worst, agree, total = 0.0, 0, 0
    while a.has_unfinished():
        a.runner.last_logits = ref.runner.last_logits = None
        a.step()
        ref.step()
        la, lb = a.runner.last_logits, ref.runner.last_logits
        if la is None or lb is None:  # a step that sampled nothing (a prefill chunk)
            assert la is lb
            continue
        la, lb = la.float(), lb.float()  # as sampled: the model's dtype where nothing upcast
        worst = max(worst, (la - lb).abs().max().item() / lb.abs().max().item())
        agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
        total += la.shape[0]
        for sa, sb in pairs:
            if sb.output_token_ids:
                sa.token_ids[-1] = sb.token_ids[-1]
                sa.output_token_ids[-1] = sb.output_token_ids[-1]
    return worst, agree, total


def graphs_vs_eager(g: Engine, e: Engine, prompts: list[list[int]], params: SamplingParams
                    ) -> float:
    """Step the CUDA-graph engine ``g`` and the eager engine ``e`` together; asserts they
    produce the same tokens and returns the worst logit difference of any step."""
    assert g.runner.graphs is not None and e.runner.graphs is None
    pairs = [(g.add_request(p, params), e.add_request(p, params)) for p in prompts]
    worst = 0.0
    while g.has_unfinished():
        g.step()
        e.step()
        diff = g.runner.last_logits.float() - e.runner.last_logits.float()
        worst = max(worst, diff.abs().max().item())
    assert g.runner.host_steps["decode"] > 10
    for sg, se in pairs:
        assert sg.output_token_ids == se.output_token_ids
    return worst
