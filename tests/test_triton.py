"""Our Triton kernels against the eager reference. On CPU they run in Triton's interpreter
(conftest sets TRITON_INTERPRET=1 when there is no GPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from conftest import make_paged_batch, run_backend
from pagedgen.attention.eager import EagerBackend

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed on this machine")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytestmark = pytest.mark.skip(reason="no GPU and TRITON_INTERPRET is not set")
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def backend():
    from pagedgen.attention.triton_attn import TritonBackend
    return TritonBackend


def check(batch):
    ref, ref_cache = run_backend(EagerBackend, batch)
    out, cache = run_backend(backend(), batch)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[batch.q.dtype], err
    assert torch.equal(cache, ref_cache)


DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 2), (6, 2)])  # GQA 1,2,4,8,3
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batches_match_eager(heads, block_size, dtype):
    for seed in range(2):
        check(make_paged_batch(seed, num_heads=heads[0], num_kv_heads=heads[1],
                               block_size=block_size, dtype=dtype, device=DEVICE,
                               max_context=2 * block_size + 7, max_new=block_size + 9))


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_head_sizes(head_size):
    check(make_paged_batch(3, head_size=head_size, dtype=DTYPES[-1], device=DEVICE))


@pytest.mark.parametrize("window,cap", [(19, None), (None, 20.0), (7, 5.0)])
def test_sliding_window_and_soft_cap(window, cap):
    for seed in range(2):
        check(make_paged_batch(seed, sliding_window=window, soft_cap=cap, device=DEVICE,
                               max_context=60, max_new=40))


def test_split_kv_decode_over_long_contexts():
    from pagedgen.attention.triton_attn import TritonState
    b = make_paged_batch(5, num_prefills=0, num_decodes=3, max_context=700, device=DEVICE)
    for s in b.decodes:  # make every context long
        extra = 600 - s.num_context
        s.num_context = 600
        s.block_table.extend(s.block_table[-1:] * (-(-extra // b.block_size) + 1))
    st = TritonState(backend(), [b.spec], b.block_size, b.q.dtype, b.kv_cache.dtype, b.q.device)
    md = st.build(b.metadata())
    assert md.plan.num_splits > 2
    check(b)


def test_engine_with_triton_matches_sdpa():
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[256, 1, 2, 3], list(range(40)), [256] * 17]
    outs = []
    for name in ("triton", "sdpa"):
        eng = Engine(EngineConfig(backend=name, device=DEVICE, dtype="float32" if DEVICE == "cpu"
                                  else "float16", num_blocks=64, max_num_seqs=4,
                                  max_num_batched_tokens=128))
        outs.append([s.output_token_ids for s in eng.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 2)])
def test_cascade_decode_matches_eager(block_size, heads):
    """Decodes sharing their first pages: the prefix attended once for the batch (as one more
    split), merged with each suffix, equals plain attention."""
    from pagedgen.attention.cases import make_shared_prefix_batch
    for seed in range(2):
        b = make_shared_prefix_batch(seed, shared_pages=256 // block_size + seed, num_decodes=9,
                                     num_heads=heads[0], num_kv_heads=heads[1],
                                     block_size=block_size, dtype=DTYPES[-1], device=DEVICE)
        md = b.metadata()
        assert md.cascade_blocks == 256 // block_size + seed
        st = backend().get_state_cls()(backend(), [b.spec], block_size, b.q.dtype, b.q.dtype,
                                       b.q.device)
        md = st.build(md)
        assert int(md.plan.cascade.prefix_lens[0]) == md.cascade_blocks * block_size
        check(b)


def test_engine_cascade_decode_matches_plain(monkeypatch):
    """Prompts behind one shared prefix: with cascade decode on, the decode steps cascade, and
    the greedy tokens equal cascade off (fp32). The thresholds are lowered to keep the
    interpreter's work small."""
    from pagedgen.attention import metadata
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine
    monkeypatch.setattr(metadata, "MIN_TOKENS", 32)
    monkeypatch.setattr(metadata, "MIN_SEQS", 4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 256, (40,), generator=g).tolist()  # 2.5 pages: 2 shared
    prompts = [prefix + torch.randint(3, 256, (n,), generator=g).tolist()
               for n in (1, 5, 16, 17, 9)]
    outs, steps = [], []
    for on in (True, False):
        eng = Engine(EngineConfig(backend="triton", device=DEVICE, block_size=16,
                                  dtype="float32" if DEVICE == "cpu" else "float16",
                                  num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
                                  cascade_attention=on))
        outs.append([s.output_token_ids for s in eng.generate(prompts, params)])
        steps.append(eng.runner.cascade_steps)
    assert outs[0] == outs[1]
    assert steps[0] >= 3 and steps[1] == 0
