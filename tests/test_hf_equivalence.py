"""pagedgen's models against transformers' own forward and generate (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hf_models import make_checkpoint

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.scheduler import ScheduledBatch
from pagedgen.runtime.layers import fused_ops

KINDS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    kind = request.param
    return kind, make_checkpoint(kind, tmp_path_factory.mktemp(kind))


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def engine(path, backend="eager", **kw):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", backend=backend,
                       block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, **kw)
    return Engine(cfg)


def prefill_logits(eng: Engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits for every position, computed in chunks (later chunks attend to cached ones)."""
    seq = eng.add_request(ids, SamplingParams(max_tokens=1))
    eng.scheduler.waiting.clear()
    out = []
    runner = eng.runner
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        eng.block_manager.allocate(seq, start + n)
        ids_t, pos_t, md = runner.prepare(ScheduledBatch(prefills=[(seq, n)]))
        md = runner.plan(md)
        with torch.inference_mode():
            h = runner.model(ids_t, pos_t, runner.kv_caches, md)
            out.append(runner.model.compute_logits(h))
        seq.num_computed_tokens += n
    return torch.cat(out)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_logits(path, backend: str, length: int = 30, chunks: tuple[int, ...] = (30, 11),
                 setup: Callable[[Engine], None] = lambda eng: None) -> None:
    """Prefill of ``length`` tokens in each chunk size of ``chunks`` (later chunks over cached
    pages) gives transformers' logits; ``setup`` readies each engine first (fused kernels,
    say). The families' own test files use it too."""
    prompt = ids(length)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0]
    for chunk in chunks:
        eng = engine(path, backend)
        setup(eng)
        torch.testing.assert_close(prefill_logits(eng, prompt, chunk), ref, atol=2e-4, rtol=1e-4)


def check_greedy_with_preemption(path, num_blocks: int = 8) -> None:
    """Greedy continuations equal transformers' generate, with prefix caching on and a cache
    of ``num_blocks`` pages of 8, small enough to preempt (the families' own test files)."""
    prompts = [ids(n, seed) for seed, n in enumerate((5, 17, 9, 26))]
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                              block_size=8, num_blocks=num_blocks, max_num_seqs=8,
                              max_num_batched_tokens=64))
    seqs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert eng.stats.num_preemptions > 0
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_token_ids == ref


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers(checkpoint, backend):
    """Prefill whole, and chunked: 30 tokens as 11 + 11 + 8."""
    check_logits(checkpoint[1], backend)


def fused_kernels(eng: Engine) -> None:
    """``check_logits`` setup: norms, rotary and SwiGLU as the fused Triton kernels."""
    eng.runner.model.use_fused_kernels(True)
    assert all(m.fused for m in eng.runner.model.modules() if hasattr(m, "fused"))


@pytest.mark.skipif(not fused_ops.HAVE_TRITON, reason="triton is not installed")
@pytest.mark.kernels
def test_fused_kernels_match_transformers(checkpoint):
    """The model with its norms, rotary (and Qwen3's q/k norm) and SwiGLU as the fused Triton
    kernels (on CPU: in Triton's interpreter) gives Hugging Face's logits."""
    check_logits(checkpoint[1], "eager", chunks=(11,), setup=fused_kernels)


def test_greedy_generation_matches_transformers(checkpoint):
    kind, path = checkpoint
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    model = hf_model(path)
    model.generation_config.eos_token_id = None  # generate exactly 12 tokens, EOS included
    eng = engine(path, "sdpa")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seqs = eng.generate(prompts, params)
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                 do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_token_ids == ref, kind
