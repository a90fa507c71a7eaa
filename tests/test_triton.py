"""Our Triton kernels against the eager reference. On CPU they run in Triton's interpreter
(conftest sets TRITON_INTERPRET=1 when there is no GPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import make_paged_batch, padded_decodes, run_backend

from pagedgen.attention.eager import EagerBackend

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed on this machine")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytestmark = [pytest.mark.kernels,
                  pytest.mark.skip(reason="no GPU and TRITON_INTERPRET is not set")]
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


@pytest.mark.parametrize("head_size", [64, 128, 256, 512])
def test_head_sizes(head_size):
    check(make_paged_batch(3, head_size=head_size, dtype=DTYPES[-1], device=DEVICE))


def test_heads_of_512_in_groups_of_8():
    """Gemma-4-31B's global layers: 8 query heads to a KV head of 512 (a prefill tile holds
    2 of them, so the group runs as 4 tiles of heads), mixed prefills and decodes."""
    check(make_paged_batch(5, num_heads=16, num_kv_heads=2, head_size=512, dtype=DTYPES[-1],
                           device=DEVICE))


def split_heads(monkeypatch, dv: int) -> None:
    """Every Triton state's prefill programs make ``dv`` of a head's output columns."""
    from pagedgen.attention.triton_attn import TritonState
    init = TritonState.__init__

    def split(self, *args, **kw):
        init(self, *args, **kw)
        self.prefill_dv = dv
    monkeypatch.setattr(TritonState, "__init__", split)


@pytest.mark.parametrize("dv,window", [(256, None), (128, 23)])
def test_a_head_of_512_split_over_prefill_programs(monkeypatch, dv, window):
    """A head's output columns split over prefill programs (each computes all of Q K^T and
    its share of P V): eager's output, with a window too, and cascade's prefix levels (the
    log-sum-exp each split writes)."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_shared_prefix_batch
    split_heads(monkeypatch, dv)
    check(make_paged_batch(5, num_heads=16, num_kv_heads=2, head_size=512, dtype=DTYPES[-1],
                           device=DEVICE, sliding_window=window, max_context=60, max_new=40))
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    check(make_shared_prefix_batch(1, shared_pages=3, num_decodes=5, num_heads=8,
                                   num_kv_heads=2, head_size=512, block_size=16,
                                   dtype=DTYPES[-1], device=DEVICE))


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
def test_cascade_decode_matches_eager(monkeypatch, block_size, heads):
    """Decodes sharing their first pages: the prefix attended once for the batch (one group),
    merged with each suffix (the decode kernel's splits), equals plain attention."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_shared_prefix_batch
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    for seed in range(2):
        b = make_shared_prefix_batch(seed, shared_pages=256 // block_size + seed, num_decodes=9,
                                     num_heads=heads[0], num_kv_heads=heads[1],
                                     block_size=block_size, dtype=DTYPES[-1], device=DEVICE)
        md = b.metadata()
        assert md.cascade_levels == 1 and md.cascade.levels[0][0].rows == 9
        st = backend().get_state_cls()(backend(), [b.spec], block_size, b.q.dtype, b.q.dtype,
                                       b.q.device)
        md = st.build(md)
        assert md.plan.cascade.kv_lens[0].tolist()[:1] == [(256 // block_size + seed)
                                                           * block_size]
        check(b)


@pytest.mark.parametrize("seed", range(6))
def test_grouped_cascade_decode_matches_eager(monkeypatch, seed):
    """Random nested groups (1 to dozens of groups, up to three levels, groups of one, pages
    cut mid-block, rows shuffled): each level's groups by the prefill kernel over the sorted
    queries, merged with the suffixes, equal plain attention; on the CUDA-graph path (static
    buffers, a fixed tile count) too."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_grouped_batch
    from pagedgen.runtime.worker.cuda_graphs import cascade_segments
    monkeypatch.setattr(cl, "MIN_TOKENS", 1)
    monkeypatch.setattr(cl, "MIN_SEQS", 1)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    n = [2, 7, 16, 33, 64, 24][seed]
    b = make_grouped_batch(seed, num_decodes=n, num_heads=8, num_kv_heads=2, block_size=16,
                           dtype=DTYPES[-1], device=DEVICE, soft_cap=30.0 if seed % 2 else None)
    md = b.metadata()
    assert md.cascade is not None, "the case shares pages"
    check(b)
    # the graph path: static buffers of a bigger batch, the layout copied in
    st = backend().get_state_cls()(backend(), [b.spec], 16, b.q.dtype, b.q.dtype, b.q.device)
    bs, width = n + 3, md.block_tables.shape[1]
    segs = cascade_segments(md.cascade, bs)  # as the graph runner holds them
    assert md.cascade.segments() <= segs <= bs + 1
    st.make_graph_plan(bs, bs * width, md.cascade_levels, segs)
    padded = padded_decodes(md, bs, b.kv_cache.shape[0], segs)
    gmd = st.build(padded, graph_batch_size=bs)
    assert gmd.plan.cascade is st.cascade_buffers.by_graph[bs, md.cascade_levels, segs]
    impl = backend().get_impl_cls()(b.spec, st)
    from pagedgen.attention.cases import backend_cache
    cache = backend_cache(backend(), b.kv_cache)
    q = torch.cat([b.q, torch.zeros(bs - n, *b.q.shape[1:], dtype=b.q.dtype, device=DEVICE)])
    k = torch.cat([b.k, torch.zeros(bs - n, *b.k.shape[1:], dtype=b.k.dtype, device=DEVICE)])
    v = torch.cat([b.v, torch.zeros(bs - n, *b.v.shape[1:], dtype=b.v.dtype, device=DEVICE)])
    out = impl.forward(q, k, v, cache, gmd)[:n]
    ref, _ = run_backend(EagerBackend, b)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[b.q.dtype]


def test_engine_cascade_decode_matches_plain(monkeypatch, one_layer):
    """Prompts behind two shared prefixes, each sampled twice (n = 2), in a cache small enough
    to preempt: with grouped cascade decode on, decode steps attend groups (the prefixes, and
    each request's samples) and the greedy tokens equal cascade off (fp32). The thresholds
    are lowered to keep the interpreter's work small (nesting: test_cascade.py)."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.ops import paged_decode
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine
    monkeypatch.setattr(cl, "MIN_TOKENS", 16)
    monkeypatch.setattr(cl, "MIN_SEQS", 2)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    monkeypatch.setattr(paged_decode, "MAX_SPLITS", 1)  # fewer programs for the interpreter
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 33)]
    prompts = [prefixes[i % 2] + torch.randint(3, 256, (n,), generator=g).tolist()
               for i, n in enumerate((1, 5, 16, 17))]
    outs, steps, preempted, levels = [], [], [], []
    for on in (True, False):
        eng = Engine(EngineConfig(model=one_layer, backend="triton", device=DEVICE,
                                  block_size=16,
                                  dtype="float32" if DEVICE == "cpu" else "float16",
                                  num_blocks=7, max_num_seqs=12, max_num_batched_tokens=256,
                                  cascade_attention=on))
        outs.append([[s.output_token_ids for s in r.samples]
                     for r in eng.generate(prompts, params)])
        summary = eng.runner.decode_reads.summary()
        steps.append(summary["cascade_decode_steps"])
        levels.append(summary["cascade_most_levels"])
        preempted.append(eng.stats.num_preemptions)
        assert summary["decode_kv_read_gb_per_step"] <= summary["decode_kv_plain_gb_per_step"]
    assert outs[0] == outs[1]
    assert steps[0] >= 3 and steps[1] == 0 and levels[0] >= 1
    assert preempted[0] > 0


@pytest.mark.parametrize("seed", range(3))
def test_grouped_cascade_in_a_step_with_prefills_matches_eager(monkeypatch, seed):
    """A step that carries prefill chunks in front of grouped decodes: the prefills by the
    prefill kernel, the decodes' groups once each and their own pages apart, equal plain
    attention; without ``mixed`` the builder leaves such a step plain."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_grouped_batch, with_prefills
    monkeypatch.setattr(cl, "MIN_TOKENS", 1)
    monkeypatch.setattr(cl, "MIN_SEQS", 1)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    b = with_prefills(make_grouped_batch(seed, num_decodes=(5, 12, 20)[seed], num_heads=8,
                                         num_kv_heads=2, block_size=16, dtype=DTYPES[-1],
                                         device=DEVICE), seed, num_prefills=1 + seed)
    assert b.metadata().cascade is None  # mixed steps plain unless asked
    b.mixed_cascade = True
    md = b.metadata()
    assert md.num_prefills == 1 + seed and md.cascade is not None
    assert len(md.cascade.order) == md.num_decodes
    check(b)


def test_engine_cascade_in_steps_with_prefills_matches_plain(monkeypatch, one_layer):
    """Long prompts behind a shared prefix, admitted in chunks while the first ones' samples
    decode: the steps that carry prefills group those decodes too, and the greedy tokens
    equal cascade there off and cascade off altogether (fp32)."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.ops import paged_decode
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine
    monkeypatch.setattr(cl, "MIN_TOKENS", 16)
    monkeypatch.setattr(cl, "MIN_SEQS", 2)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    monkeypatch.setattr(paged_decode, "MAX_SPLITS", 1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 256, (48,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 60)]
    outs, mixed = [], []
    for cascade, in_mixed in ((True, True), (True, False), (False, False)):
        eng = Engine(EngineConfig(model=one_layer, backend="triton", device=DEVICE,
                                  block_size=16,
                                  dtype="float32" if DEVICE == "cpu" else "float16",
                                  num_blocks=48, max_num_seqs=8, max_num_batched_tokens=32,
                                  cascade_attention=cascade, cascade_mixed_steps=in_mixed))
        outs.append([[s.output_token_ids for s in r.samples]
                     for r in eng.generate(prompts, params)])
        mixed.append(eng.runner.decode_reads.summary()["cascade_steps_with_prefills"])
    assert outs[0] == outs[1] == outs[2]
    assert mixed[0] >= 2 and mixed[1] == mixed[2] == 0


def test_verify_cascade_cases_cover_steps_with_prefills(monkeypatch):
    """``pagedgen verify``'s cascade cases on the triton backend (the interpreter): the grouped
    layouts behind prefill chunks among them, every case equal to eager."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.ops import paged_decode
    from pagedgen.cli.verify import kernel_checks as kc
    seen, floors = [], (cl.MIN_TOKENS, cl.MIN_SEQS, cl.ROW_TOKENS)
    real = kc.run_backend

    def spy(backend, batch, state=None):
        if state is not None:
            seen.append((batch.mixed_cascade, batch.metadata().cascade is not None))
        return real(backend, batch, state)

    monkeypatch.setattr(kc, "run_backend", spy)
    monkeypatch.setattr(paged_decode, "MAX_SPLITS", 1)
    part = kc.cascade_cases("triton", torch.device(DEVICE), [3, 1], 0)
    assert (cl.MIN_TOKENS, cl.MIN_SEQS, cl.ROW_TOKENS) == floors  # restored after the cases
    assert part.cases == 2 and part.worst_abs <= TOL[kc.cascade_dtype(backend())]
    assert (True, True) in seen


@pytest.mark.parametrize("window", [None, 19])
def test_sinks_match_eager(window):
    """Each head's sink joins the prefill kernel's softmax and the decode kernel's (in its
    first split only: long contexts split the keys, and the merge must count it once)."""
    from pagedgen.attention.cases import with_sinks
    for seed in range(2):
        check(make_paged_batch(seed, num_heads=8, num_kv_heads=2, sliding_window=window,
                               device=DEVICE, max_context=60, max_new=40, sinks=True))
    b = make_paged_batch(5, num_prefills=0, num_decodes=3, max_context=700, device=DEVICE)
    for s in b.decodes:  # long contexts: split-KV decode
        extra = 600 - s.num_context
        s.num_context = 600
        s.block_table.extend(s.block_table[-1:] * (-(-extra // b.block_size) + 1))
    check(with_sinks(b, 5))


def test_sinks_enter_grouped_cascade_decode_once(monkeypatch):
    """Grouped cascade decode: the suffixes' split 0 takes the sink, the groups' parts do
    not."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_grouped_batch, with_sinks
    monkeypatch.setattr(cl, "MIN_TOKENS", 1)
    monkeypatch.setattr(cl, "MIN_SEQS", 1)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    b = with_sinks(make_grouped_batch(3, num_decodes=16, num_heads=8, num_kv_heads=2,
                                      block_size=16, dtype=DTYPES[-1], device=DEVICE), 3)
    assert b.metadata().cascade is not None, "the case shares pages"
    check(b)


def fp8_states(batch, k_scale: float, v_scale: float) -> tuple:
    """Eager's and the triton backend's states for ``batch`` (an FP8 cache) with these
    scales."""
    states = []
    for cls in (EagerBackend, backend()):
        st = cls.get_state_cls()(cls, [batch.spec], batch.block_size, batch.q.dtype,
                                 batch.kv_cache.dtype, batch.q.device)
        st.k_scale, st.v_scale = k_scale, v_scale
        states.append(st)
    return states


@pytest.mark.parametrize("scales", [(1.0, 1.0), (2.0, 0.25)])
@pytest.mark.parametrize("window", [None, 19])
def test_fp8_kv_cache_reads_and_writes_as_eager(scales, window):
    """An FP8 cache: new tokens stored as x / scale rounded to e4m3 (the same bytes as eager's
    write), prefill and decode (split-KV over long contexts too) reading K and V back times
    their scales, within the query dtype's tolerance of eager over the same cache."""
    fp8 = torch.float8_e4m3fn
    batches = [make_paged_batch(seed, num_heads=8, num_kv_heads=2, dtype=DTYPES[-1],
                                cache_dtype=fp8, sliding_window=window, device=DEVICE,
                                max_context=60, max_new=40) for seed in range(2)]
    long = make_paged_batch(5, num_prefills=0, num_decodes=3, max_context=700,
                            dtype=DTYPES[-1], cache_dtype=fp8, device=DEVICE)
    for s in long.decodes:  # long contexts: split-KV decode
        extra = 600 - s.num_context
        s.num_context = 600
        s.block_table.extend(s.block_table[-1:] * (-(-extra // long.block_size) + 1))
    for b in [*batches, long]:
        eager, triton_state = fp8_states(b, *scales)
        ref, ref_cache = run_backend(EagerBackend, b, eager)
        out, cache = run_backend(backend(), b, triton_state)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= TOL[b.q.dtype], err
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


@pytest.mark.parametrize("share", [0, 1])
def test_a_layer_on_its_share_of_a_flash_attn_slab(share):
    """Gemma 4's global layers on a GPU: triton attends through a view of its share of a slab
    laid out as flash-attn lays a cache (K and V apart, pages twice as wide): the same output
    and written K/V as eager on a cache of its own, and the other share untouched."""
    from pagedgen.attention.flash_attn.backend import FlashAttnBackend
    from pagedgen.runtime.engine.kv_groups import plan_layout
    from pagedgen.runtime.worker.kv_memory import KVMemory

    b = make_paged_batch(3, num_heads=4, num_kv_heads=1, head_size=128, block_size=16,
                         dtype=DTYPES[-1], device=DEVICE, max_context=40, max_new=20)
    pages = b.kv_cache.shape[0]
    wide = b.spec.__class__(4, 2, 128, b.spec.scale, 64)  # a window layer: 2 KV heads of 128
    specs = [wide, wide, b.spec, b.spec]  # the two narrow ones share the slab's pages
    layout = plan_layout(specs)
    triton = backend()
    kv = KVMemory(FlashAttnBackend, specs, layout, 16, b.kv_cache.dtype, torch.device(DEVICE),
                  [triton if g.window is None else FlashAttnBackend for g in layout.groups])
    caches = kv.allocate(pages)
    mine = caches[2 + share]
    assert layout.share(2 + share) == (share, 2) and not mine.is_contiguous()
    other = caches[3 - share]
    other_before = triton.blocks_view(other).clone()
    triton.blocks_view(mine).copy_(b.kv_cache)
    ref, ref_cache = run_backend(EagerBackend, b)
    state = triton.get_state_cls()(triton, [b.spec], 16, b.q.dtype, mine.dtype, b.q.device)
    impl = triton.get_impl_cls()(b.spec, state)
    out = impl.forward(b.q, b.k, b.v, mine, state.build(b.metadata()))
    assert (out.float() - ref.float()).abs().max().item() <= TOL[b.q.dtype]
    assert torch.equal(triton.blocks_view(mine), ref_cache)
    assert torch.equal(triton.blocks_view(other), other_before)
