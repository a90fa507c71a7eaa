"""MoE on the GPU (pytest -m gpu): every candidate tile of the grouped GEMMs against the
per-expert loop in bf16, the measured plan, the layer inside a CUDA graph, and MoE checkpoints
through each backend with graphs against transformers' greedy tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_models import make_checkpoint

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe.act import clamped_swiglu
from pagedgen.runtime.layers.moe.plan import CANDIDATES, fits, plan_moe, random_routing

pytestmark = pytest.mark.gpu


def _layer(e: int, k: int, h: int, i: int, t: int, seed: int = 0):
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * 0.05
    weights, ids = random_routing(t, e, k, dev)
    return x, w13, w2, weights, ids


def _gpt_oss_layer(t: int, magnitude: float = 1.0) -> SimpleNamespace:
    """gpt-oss-20b's experts (32, 4 per token, 2880 -> 2880) for ``t`` tokens in MXFP4
    (``q13``, ``q2``, ``scales``: small exponents unless ``magnitude`` scales the weights
    past them), biased and clamped, and the loop's float32 result on the dequantized
    weights (``ref``)."""
    from test_mxfp4_moe import packed

    from pagedgen.runtime.quantization.fp8.moe import ExpertScales
    from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4
    x, w13, w2, weights, ids = _layer(32, 4, 2880, 2880, t)
    (q13, s13, d13), (q2, s2, d2) = packed(w13 * magnitude), packed(w2)
    act = clamped_swiglu(1.702, 7.0)
    bias13 = torch.randn(32, 5760, device="cuda") * 0.1
    bias2 = torch.randn(32, 2880, device="cuda") * 0.1
    ref = mk.reference(x.float(), d13, d2, weights, ids, act, bias13, bias2)
    scales = ExpertScales(s13, s2, mxfp4.GROUP, mxfp4.small_exponents(s13, s2))
    return SimpleNamespace(x=x, q13=q13, q2=q2, scales=scales,
                           weights=weights, ids=ids, act=act, bias13=bias13, bias2=bias2,
                           ref=ref)


def _candidates(elem: int, up_k: int):
    """(name, (gate/up tiles, down tiles)) of every candidate that fits shared memory at
    ``elem`` bytes an operand: as down's tile, and as gate/up's where it fits there too (else
    a narrow tile of its height, K ``up_k``)."""
    for name, tiles in CANDIDATES.items():
        if fits(tiles, elem, gated=False):
            up = tiles if fits(tiles, elem, gated=True) else mk.Tiles(tiles.block_m, 64, up_k)
            yield name, (up, tiles)


@pytest.mark.parametrize("t", [1, 5, 64, 300])
def test_every_candidate_tile_equals_the_per_expert_loop(t):
    """Qwen3-30B-A3B's expert shape (128 experts, 8 per token, 2048 → 768)."""
    x, w13, w2, weights, ids = _layer(128, 8, 2048, 768, t)
    ref = mk.reference(x.float(), w13.float(), w2.float(), weights, ids)
    scale = ref.abs().max().item()
    for name, tiles in _candidates(2, 64):  # FP8's own tiles: the test below
        got = mk.fused_experts(x, w13, w2, weights, ids, tiles)
        err = (got.float() - ref).abs().max().item()
        assert err < 2e-2 * scale, (name, err, scale)


@pytest.mark.parametrize("t", [1, 300, 2048])
def test_every_candidate_tile_in_fp8_equals_the_dequantized_loop(t):
    """Mixtral's expert shape scaled down (8 experts, 2 per token, 1024 → 1792) in per-channel
    FP8 with the activations quantized per token: every candidate that fits FP8's shared
    memory, as gate/up's tile where it fits and as down's."""
    x, w13, w2, weights, ids = _layer(8, 2, 1024, 1792, t)
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, None)
    ref = mk.reference(x.float(), *scales.dequantize(q13, q2, torch.float32), weights, ids)
    scale = ref.abs().max().item()
    for name, tiles in _candidates(1, 128):
        got = mk.fused_experts(x, q13, q2, weights, ids, tiles, scales=scales, native=True)
        err = (got.float() - ref).abs().max().item()
        assert err < 6e-2 * scale, (name, err, scale)


@pytest.mark.parametrize("layout", ["strided", "rows-not-16-bytes"])
def test_a_tma_tile_on_experts_tma_cannot_load_runs_them_by_pointers(layout):
    """A TMA tile meeting experts a descriptor cannot view (every second expert of a larger
    tensor; rows of 1,004 bf16 values, not a multiple of 16 bytes) gives the loop's result."""
    h = 1004 if layout == "rows-not-16-bytes" else 1024
    x, w13, w2, weights, ids = _layer(8, 2, h, 512, 300)
    if layout == "strided":
        w13 = torch.stack([w13, torch.zeros_like(w13)], 1).flatten(0, 1)[::2]
        assert not w13.is_contiguous()
    ref = mk.reference(x.float(), w13.float(), w2.float(), weights, ids)
    tiles = mk.Tiles(64, 128, 64, tma=True)
    got = mk.fused_experts(x, w13, w2, weights, ids, (tiles, tiles))
    err = (got.float() - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item(), err


def test_one_variant_of_each_moe_kernel_serves_every_token_count():
    """A run's prefill chunks hit token counts a plan's measurement did not: the sort's and
    the GEMMs' step-sized arguments are not specialized, so nothing compiles inside a run."""
    from pagedgen.runtime.worker import jit_monitor

    tiles = mk.Tiles(32, 32, 32, 2, 2, 2)  # a launch shape no other test takes
    jit_monitor.install()
    # slot counts divisible by 16 and not, by each way of the sort (by expert, by chunks)
    for t in (64, 2500, 37, 50, 333, 3001):
        x, w13, w2, weights, ids = _layer(24, 4, 256, 128, t, seed=t)
        mk.fused_experts(x, w13, w2, weights, ids, (tiles, tiles))
        if t == 2500:
            first = jit_monitor.MONITOR.mark()
    made = [(c.kernel, c.variant) for c in jit_monitor.MONITOR.compiles[first:]]
    assert not [m for m in made if m[0] in ("_align_kernel", "_grouped_gemm_kernel")
                or m[0].startswith("_chunk_")], made


@pytest.mark.parametrize("way", ["align_by_expert", "align_by_chunks"])
@pytest.mark.parametrize("t,e,k,block_m", [(1, 256, 8, 16), (256, 256, 8, 16),
                                           (300, 128, 8, 32), (512, 8, 2, 64),
                                           (4096, 256, 8, 64), (16384, 256, 8, 128),
                                           (40000, 128, 8, 64)])
def test_the_slot_sort_by_expert_equals_torchs_in_slot_order(t, e, k, block_m, way):
    """Sorts on the GPU, decode-sized to a long prefill chunk's: a program per expert, and
    the chunked way (past 256 chunks too), lay out exactly torch's sort (each run in slot
    order)."""
    from pagedgen.runtime.layers.moe import align as moe_align
    from pagedgen.runtime.layers.moe import route as moe_route

    if way == "align_by_expert" and t * k > 32768:
        pytest.skip("every program of the sort by expert reads every slot: not used so large")
    _, ids = moe_route.route(torch.randn(t, e, device="cuda"), k, True)
    want, want_blocks = moe_align.align_reference(ids, e, block_m)
    got, blocks = getattr(moe_align, way)(ids, e, block_m)
    assert torch.equal(blocks, want_blocks) and torch.equal(got, want)


def test_measured_plan_runs_inside_a_cuda_graph():
    x, w13, w2, weights, ids = _layer(64, 6, 1024, 512, 48)
    plan = plan_moe(w13, w2, 6)
    tiles = plan.choose(48)
    out = torch.empty_like(x)
    mk.fused_experts(x, w13, w2, weights, ids, tiles, out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk.fused_experts(x, w13, w2, weights, ids, tiles, out)
    for seed in (1, 2):  # new inputs and routing, replayed
        x2, _, _, w_new, ids_new = _layer(64, 6, 1024, 512, 48, seed)
        x.copy_(x2)
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        ref = mk.fused_experts(x, w13, w2, weights, ids, tiles)
        assert torch.equal(out, ref)
    print("plan:", [(m, a.name, b.name) for m, a, b, _ in plan.choices])


def test_layer_runs_torch_grouped_gemm_where_planned_but_not_inside_a_graph():
    """A layer whose plan sends these counts to torch's grouped GEMM: eager calls run it and
    equal the per-expert loop; a call under CUDA-graph capture runs the Triton tiles."""
    from pagedgen.runtime.collectives.parallel import TensorParallel
    from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm
    from pagedgen.runtime.layers.moe.layer import FusedMoE
    from pagedgen.runtime.layers.moe.plan import MoePlan

    x, w13, w2, weights, ids = _layer(8, 2, 1024, 1792, 600)
    if not moe_grouped_mm.available(w13):
        pytest.skip("torch's grouped GEMM needs bf16 on Hopper or later")
    layer = FusedMoE(8, 2, 1024, 1792, TensorParallel()).cuda()
    layer.w13_weight.data, layer.w2_weight.data = w13, w2
    tiles = plan_moe(w13, w2, 2).choose(600)
    layer._plan = MoePlan([(float("inf"), *tiles, False)], grouped_mm_from=512)
    calls = []
    real = moe_grouped_mm.experts
    moe_grouped_mm.experts = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        got = layer(x, weights, ids)
        assert calls == [1]
        ref = mk.reference(x.float(), w13.float(), w2.float(), weights, ids)
        assert (got.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
        out = torch.empty_like(x)
        layer(x, weights, ids, out)  # warm, then captured
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, weights, ids, out)
        assert calls == [1, 1]  # the capture ran the tiles
        graph.replay()
        torch.testing.assert_close(out, mk.fused_experts(x, w13, w2, weights, ids, tiles))
    finally:
        moe_grouped_mm.experts = real


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {k: make_checkpoint(k, tmp_path_factory.mktemp(k)) for k in ("qwen3_moe", "mixtral")}


PROMPTS = [[5 + i, 9, 3, 17 + i] * (3 + i) for i in range(5)]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(path, backend: str, dtype: str, eager: bool) -> list[list[int]]:
    eng = Engine(EngineConfig(model=str(path), device="cuda", dtype=dtype, backend=backend,
                              block_size=16, num_blocks=128, max_num_seqs=8,
                              max_num_batched_tokens=128, enforce_eager=eager))
    assert eager or eng.runner.graphs is not None
    return [s.output_token_ids for s in eng.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fp32_on_the_gpu_gives_transformers_greedy_tokens(checkpoints, kind):
    """The MoE kernels in IEEE fp32 (sdpa attention: the GPU backend that runs fp32)."""
    from transformers import AutoModelForCausalLM
    got = _tokens(checkpoints[kind], "sdpa", "float32", True)
    model = AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert out == ref


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("backend", ["triton", "flash-attn", "flashinfer"])
def test_cuda_graphs_give_the_eager_tokens(checkpoints, kind, backend):
    """bf16 with the MoE layers captured in CUDA graphs, prefix caching on."""
    from pagedgen.attention.registry import backend_status
    status = {s.name: s for s in backend_status(torch.device("cuda"))}
    if not status[backend].available:
        pytest.skip(status[backend].reason)
    path = checkpoints[kind]
    assert _tokens(path, backend, "bfloat16", False) == _tokens(path, backend, "bfloat16", True)


@pytest.mark.parametrize("group_k", [None, 128])
def test_fp8_experts_equal_the_dequantized_loop_inside_a_cuda_graph(group_k):
    """Qwen3-30B-A3B's expert shape in FP8 (per-channel and 128-column groups): the measured
    plan's kernels, weights converted in registers and activations quantized, against the loop
    on the dequantized weights; the plan's choices captured and replayed."""
    x, w13, w2, weights, ids = _layer(128, 8, 2048, 768, 48)
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, group_k)
    ref = mk.reference(x.float(), *scales.dequantize(q13, q2, torch.float32), weights, ids)
    scale = ref.abs().max().item()
    for fp8_input in (False, True):
        got = mk.fused_experts(x, q13, q2, weights, ids, (mk.Tiles(16, 64, 128),) * 2,
                               scales=scales, native=fp8_input)
        err = (got.float() - ref).abs().max().item()
        assert err < (6e-2 if fp8_input else 2e-2) * scale, (fp8_input, err, scale)
    plan = plan_moe(q13, q2, 8, scales, torch.bfloat16)
    print("fp8 plan:", [(m, a.name, b.name, a8) for m, a, b, a8 in plan.choices])
    for t in (1, 48, 300):
        x, _, _, weights, ids = _layer(128, 8, 2048, 768, t, seed=t)
        tiles, a8 = plan.choose(t), plan.native(t)
        out = torch.empty_like(x)
        mk.fused_experts(x, q13, q2, weights, ids, tiles, out, scales, a8)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mk.fused_experts(x, q13, q2, weights, ids, tiles, out, scales, a8)
        out.zero_()
        graph.replay()
        want = mk.fused_experts(x, q13, q2, weights, ids, tiles, None, scales, a8)
        assert torch.equal(out, want), t


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fp8_moe_checkpoint_in_graphs_as_eager_and_near_its_dequantized_weights(
        checkpoints, kind, tmp_path):
    """A block-scaled FP8 checkpoint (partial 128-column groups): CUDA graphs give the eager
    tokens; along the dequantized checkpoint's greedy tokens its logits stay within 10% (bf16
    and the activations' per-token quantization apart)."""
    from fp8_checkpoints import write_fp8

    from pagedgen.cli.verify.model_checks import difference, trace

    ckpt = write_fp8(checkpoints[kind], tmp_path / "q", "hf-block")
    assert _tokens(ckpt, "triton", "bfloat16", False) == _tokens(ckpt, "triton", "bfloat16", True)

    def engine(path):
        return Engine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                   backend="triton", block_size=16, num_blocks=128,
                                   max_num_seqs=8, max_num_batched_tokens=128))
    ref = trace(engine(str(ckpt) + "-dequantized"), PROMPTS, 8)
    got = trace(engine(ckpt), PROMPTS, 8, forced=ref[1])
    _, rel, agree = difference(got, ref)
    print(f"{kind} fp8 vs dequantized: rel {rel:.4f}, argmax agree {agree}/{len(ref[0])}")
    # measured on the H200: 5.0-5.4% and 37-39 of 40 (bf16 rounding and FP8 activations)
    assert rel < 0.1 and agree >= 0.85 * len(ref[0])


def test_fp8_experts_on_torch_scaled_grouped_gemm_equal_the_loop():
    """Prefill-sized counts of per-channel FP8 experts through torch's FP8 grouped GEMM (the
    contract tests/test_moe_fp8.py holds its stand-in to) against the loop on the dequantized
    weights, no further from it than twice our kernels with FP8 inputs."""
    from pagedgen.runtime.layers import fused_ops
    from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm

    x, w13, w2, weights, ids = _layer(128, 8, 2048, 768, 600)
    q13, q2, scales = mk.ExpertScales.quantize(w13, w2, None)
    if not moe_grouped_mm.available(q13, scales):
        pytest.skip("torch's FP8 grouped GEMM needs Hopper or later")
    got = moe_grouped_mm.experts(x, q13, q2, weights, ids,
                                 silu_and_mul=fused_ops.silu_and_mul_fused, scales=scales)
    ref = mk.reference(x.float(), *scales.dequantize(q13, q2, torch.float32), weights, ids)
    ours = mk.fused_experts(x, q13, q2, weights, ids, (mk.Tiles(64, 64, 64),) * 2,
                            scales=scales, native=True)
    err, ours_err = ((y.float() - ref).abs().max().item() for y in (got, ours))
    print(f"FP8 grouped GEMM error {err:.3f}, our kernels' {ours_err:.3f}, "
          f"of {ref.abs().max().item():.2f}")
    # each rounds the intermediate to bf16 at another point before its e4m3 rounding: the
    # two differ by 2.4% of the largest output on the H200; against float32 both are close
    assert err < 6e-2 * ref.abs().max().item() and err < 2 * ours_err


@pytest.mark.parametrize("t", [1, 64, 300])
def test_mxfp4_experts_in_every_candidate_tile_equal_the_dequantized_loop(t):
    """gpt-oss-20b's expert shape (32 experts, 4 per token, 2880 → 2880) in MXFP4, biased and
    clamped: each tile, converted in registers and through ``tl.dot_scaled`` (where this
    Triton builds it for the GPU), and the measured plan inside a CUDA graph."""
    o = _gpt_oss_layer(t)

    def experts(tiles, native, out=None):
        return mk.fused_experts(o.x, o.q13, o.q2, o.weights, o.ids, tiles, out, o.scales,
                                native, act=o.act, b13=o.bias13, b2=o.bias2)
    scale = o.ref.abs().max().item()
    for native in (False, True):
        for name, tiles in CANDIDATES.items():
            if tiles.tma:  # MXFP4's codes are read by pointers
                continue
            try:
                got = experts((tiles, tiles), native)
            except Exception as e:  # noqa: BLE001 - a scaled dot this Triton cannot lower
                if not native:
                    raise
                print("tl.dot_scaled:", name, type(e).__name__)
                continue
            err = (got.float() - o.ref).abs().max().item()
            assert err < 2e-2 * scale, (name, native, err, scale)
    plan = plan_moe(o.q13, o.q2, 4, o.scales, torch.bfloat16)
    out = torch.empty_like(o.x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts(plan.choose(t), plan.native(t), out)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - o.ref).abs().max().item() < 2e-2 * scale


def test_mxfp4_experts_with_exponents_past_the_folded_range_equal_the_dequantized_loop():
    """Gate/up weights 2^12 times larger (exponents past 128): the swapped tiles convert them
    with the two multiplies, and the layer still equals the loop; at the usual size the same
    tiles take the folded conversion (one multiply)."""
    for magnitude, small in ((4096.0, False), (1.0, True)):
        o = _gpt_oss_layer(64, magnitude)
        assert o.scales.small_exponents is small
        scale = o.ref.abs().max().item()
        for name, tiles in CANDIDATES.items():
            if tiles.swap:
                got = mk.fused_experts(o.x, o.q13, o.q2, o.weights, o.ids, (tiles, tiles),
                                       None, o.scales, act=o.act, b13=o.bias13, b2=o.bias2)
                err = (got.float() - o.ref).abs().max().item()
                assert err < 2e-2 * scale, (name, magnitude, err, scale)


def test_mxfp4_experts_written_out_dense_equal_the_dequantized_loop():
    """The prefill way at gpt-oss-20b's shape, 2,048 tokens, biased and clamped, in each dense
    tile and torch's grouped GEMM, with the default scratch (every expert in one run) and one
    of half that (two)."""
    from pagedgen.runtime.layers.moe import dequantized as moe_dequantized
    from pagedgen.runtime.layers.moe.plan import DENSE
    o = _gpt_oss_layer(2048)
    half = moe_dequantized.experts_per_run(o.q13, o.q2, o.x.dtype) // 2
    for tiles in [*((t, t) for t in DENSE), moe_dequantized.GROUPED_MM]:
        for scratch in (moe_dequantized.SCRATCH_BYTES, half * 2 * 2880 * 2880 * 3):
            got = moe_dequantized.experts(o.x, o.q13, o.q2, o.weights, o.ids, tiles,
                                          None, o.scales, o.act, o.bias13, o.bias2,
                                          scratch_bytes=scratch)
            err = (got.float() - o.ref).abs().max().item()
            assert err < 2e-2 * o.ref.abs().max().item(), (tiles, scratch, err)
