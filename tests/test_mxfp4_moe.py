"""MXFP4 experts kept 4-bit (``runtime/quantization/mxfp4/moe.py``): the grouped GEMM kernels
convert the e2m1 codes and e8m0 scales in registers and give the per-expert loop's result on
the dequantized weights (Triton's interpreter), plain SwiGLU experts and gpt-oss's biased,
clamped ones alike, K tiles that split a scale group or run past K included."""

from __future__ import annotations

import pytest
import torch
from test_moe import INTERPRETED_ONLY, _experts

from pagedgen.runtime.layers.moe import align as moe_align
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe.act import clamped_swiglu
from pagedgen.runtime.quantization.fp8.moe import ExpertScales
from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4


def packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [E, rows, K / 2], exponents [E, K / 32, rows] in the kernel layout, the values
    they hold)."""
    blocks, scales = mxfp4.quantize(w)
    return (*mxfp4.to_kernel_layout(blocks.flatten(-2), scales),
            mxfp4.dequantize(blocks, scales, torch.float32))


@INTERPRETED_ONLY
@pytest.mark.parametrize("h,i,block_k", [(64, 32, 32), (96, 64, 64), (64, 96, 128)])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter: no bf16 dot
@pytest.mark.parametrize("swap", [False, True], ids=["a-left", "weights-left"])
@pytest.mark.kernels
def test_mxfp4_grouped_gemms_equal_the_loop_on_the_dequantized_weights(h, i, block_k, biased,
                                                                        dtype, swap):
    x, w13, w2, weights, chosen = _experts(29, 8, 3, h, i)
    x = x.to(dtype)
    q13, s13, d13 = packed(w13)
    q2, s2, d2 = packed(w2)
    if biased:
        g = torch.Generator().manual_seed(2)
        act = clamped_swiglu(1.702, 0.5)
        b13, b2 = torch.randn(8, 2 * i, generator=g), torch.randn(8, h, generator=g)
    else:
        act, b13, b2 = mk.swiglu, None, None
    ref = mk.reference(x.float(), d13, d2, weights, chosen, act, b13, b2)
    # a K step's exponents of 128 rows at k = 128: 512 bytes, loaded as bytes; else as words
    tiles = mk.Tiles(16, 128 if block_k == 128 else 32, block_k, swap=swap)
    got = mk.fused_experts(x, q13, q2, weights, chosen, (tiles, tiles), None,
                           ExpertScales(s13, s2, mxfp4.GROUP), act=act, b13=b13, b2=b2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max(), rtol=tol)


@INTERPRETED_ONLY
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.kernels
def test_mxfp4_experts_through_tl_dot_scaled_equal_the_loop_on_the_dequantized_weights(biased):
    """The plan's other MXFP4 way (``native``: codes and scales as they are into
    ``tl.dot_scaled``, bf16 activations) gives the loop's result to bf16's precision, K tiles
    past K included (Triton's interpreter multiplies no bf16 ``tl.dot``, so the reference is
    float32's), with the weights on either side of the product; float32 activations are a
    one-line refusal."""
    x, w13, w2, weights, chosen = _experts(29, 8, 3, 96, 64)
    q13, s13, d13 = packed(w13)
    q2, s2, d2 = packed(w2)
    scales = ExpertScales(s13, s2, mxfp4.GROUP)
    g = torch.Generator().manual_seed(2)
    extra = dict(act=clamped_swiglu(1.702, 0.5), b13=torch.randn(8, 128, generator=g),
                 b2=torch.randn(8, 96, generator=g)) if biased else {}
    xb = x.bfloat16()
    ref = mk.reference(xb.float(), d13, d2, weights, chosen, extra.get("act", mk.swiglu),
                       extra.get("b13"), extra.get("b2"))
    for block_k, swap in ((64, False), (128, False), (64, True), (128, True)):
        tiles = (mk.Tiles(16, 32, block_k, swap=swap),) * 2
        got = mk.fused_experts(xb, q13, q2, weights, chosen, tiles, None, scales, native=True,
                               **extra)
        assert (got.float() - ref).abs().max() < 3e-2 * ref.abs().max()
    slots, experts = moe_align.align_reference(chosen, 8, 16)
    with pytest.raises(ValueError, match="bf16 or fp16 activations"):
        mk.grouped_gemm(x, q13, x.new_empty(87, 128), slots, experts, 87,
                        mk.Tiles(16, 32, 64), 3, gated=True, w_scale=s13, scaled_dot=True)


def test_mxfp4_plans_time_tl_dot_scaled_only_for_half_precision_activations():
    from pagedgen.runtime.layers.moe.plan import natives
    assert natives(None, 32, True, torch.bfloat16) == (False, True)
    assert natives(None, 32, True, torch.float32) == (False,)
    assert natives(object(), None, False, torch.bfloat16) == (False, True)  # FP8 per channel
    assert natives(None, None, False, torch.bfloat16) == (False,)  # dense experts


def test_mxfp4_experts_refuse_scales_that_do_not_pair():
    x, w13, _, weights, chosen = _experts(3, 4, 2, 64, 32)
    q13, s13, _ = packed(w13)
    slots, experts = moe_align.align_reference(chosen, 4, 16)
    with pytest.raises(ValueError, match="one per 32 columns"):
        mk.grouped_gemm(x, q13, x.new_empty(6, 64), slots, experts, 6, mk.Tiles(16, 32, 32),
                        2, gated=True, w_scale=s13[..., :1], group_k=32)


@pytest.mark.parametrize("lowers", [True, False])
def test_mxfp4_plans_time_the_scaled_dot_only_in_the_converted_ways_best_tiles(monkeypatch,
                                                                              lowers):
    """A MXFP4 plan times ``tl.dot_scaled`` in the tiles that won converted (at most two a
    block height: the start-up's timing stays bounded) and takes it where it is faster; where
    Triton cannot lower it for the GPU, the plan keeps the conversion in registers."""
    from pagedgen.runtime import kernel_plans
    from pagedgen.runtime.layers.moe import plan as moe_plan
    calls = []

    def gemm(a, w, out, slots, experts, n, tiles, a_row_div, gated, weights=None,
             w_scale=None, a_scale=None, group_k=None, scaled_dot=False, bias=None,
             small_exps=False):
        calls.append((tiles, scaled_dot))
        if scaled_dot and not lowers:
            raise RuntimeError("no lowering of tt.dot_scaled here")

    order = list(moe_plan.CANDIDATES.values())

    def graph_time(fn):  # the scaled dot twice as fast; earlier candidates faster
        before = len(calls)
        fn()
        if len(calls) == before:
            return 1e-6  # the sort
        tiles, dot = calls[-1]
        return (1 + order.index(tiles) / 100) / (2 if dot else 1)

    monkeypatch.setattr(mk, "grouped_gemm", gemm)
    monkeypatch.setattr(moe_align, "align", lambda ids, experts, block_m: (None, None))
    monkeypatch.setattr(kernel_plans, "graph_time", graph_time)
    w13, w2 = (torch.zeros(8, rows, cols, dtype=torch.uint8) for rows, cols in ((64, 32),
                                                                                 (64, 16)))
    scales = ExpertScales(torch.zeros(8, 64, 2, dtype=torch.uint8),
                          torch.zeros(8, 64, 1, dtype=torch.uint8), mxfp4.GROUP)
    plan = moe_plan._measure(w13, w2, 2, scales, torch.bfloat16)
    converted, scaled = {}, {}
    for tiles, dot in calls:
        (scaled if dot else converted).setdefault(tiles.block_m, set()).add(tiles)
    assert scaled and all(len(ts) <= 2 for ts in scaled.values())
    for block_m, ts in scaled.items():  # the first fitting candidates are the converted best
        assert ts <= set(sorted(converted[block_m], key=order.index)[:2])
    assert all(plan.native(t) == lowers for t in moe_plan.TOKEN_BUCKETS)


def test_a_biased_clamped_layers_plan_times_its_gemms_as_the_run_has_them(monkeypatch):
    """gpt-oss's experts (biases, clamped SwiGLU) run gate/up ungated, the activation kernel,
    then down with its bias (``fused_experts``): their plan times exactly that, under a key
    of its own, with the conversion the run takes (one multiply where every exponent is
    small); plain experts keep theirs (gate/up gated, no activation kernel)."""
    from pagedgen.runtime import kernel_plans
    from pagedgen.runtime.layers.moe import plan as moe_plan
    gemms, acts, folded = [], [], set()

    def gemm(a, w, out, slots, experts, n, tiles, a_row_div, gated, weights=None,
             w_scale=None, a_scale=None, group_k=None, scaled_dot=False, bias=None,
             small_exps=False):
        gemms.append((w, out.shape[1], gated, bias))
        folded.add(small_exps)

    monkeypatch.setattr(mk, "grouped_gemm", gemm)
    monkeypatch.setattr(moe_plan, "bias_and_act", lambda gu, act, b, e: acts.append(
        (gu.shape[1], act, b)))
    monkeypatch.setattr(moe_align, "align", lambda ids, experts, block_m: (None, None))
    monkeypatch.setattr(kernel_plans, "graph_time", lambda fn: (fn(), 1e-6)[1])
    monkeypatch.setattr(moe_plan, "TOKEN_BUCKETS", (1, 64))
    w13, w2 = (torch.zeros(8, rows, cols, dtype=torch.uint8) for rows, cols in ((64, 32),
                                                                                 (64, 16)))
    scales = ExpertScales(torch.zeros(8, 2, 64, dtype=torch.uint8),
                          torch.zeros(8, 1, 64, dtype=torch.uint8), mxfp4.GROUP, True)
    act, b13, b2 = clamped_swiglu(1.702, 7.0), torch.zeros(8, 64), torch.zeros(8, 64)
    moe_plan._measure(w13, w2, 2, scales, torch.float32, act, b13, b2)
    ups = [g[1:] for g in gemms if g[0] is w13]
    downs = [g[1:] for g in gemms if g[0] is w2]
    assert ups and downs and len(ups) + len(downs) == len(gemms)
    assert set(ups) == {(64, False, None)}  # gate and up both written, no bias in the GEMM
    assert set(downs) == {(64, False, b2)}
    assert len(acts) == len(ups) and all(a == (64, act, b13) for a in acts)
    assert folded == {True}
    gemms.clear(), acts.clear()
    moe_plan._measure(w13, w2, 2, scales, torch.float32)
    assert not acts and {g[1:] for g in gemms if g[0] is w13} == {(32, True, None)}
    assert {g[1:] for g in gemms if g[0] is w2} == {(64, False, None)}
    plain = moe_plan.shape_key(w13, 2, scales, torch.bfloat16)
    assert moe_plan.shape_key(w13, 2, scales, torch.bfloat16, gated=False) == plain + "|ungated"
    assert mk.gated_up(mk.swiglu, None, None) and not mk.gated_up(act, b13, b2)


@INTERPRETED_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.kernels
def test_mxfp4_rows_written_out_dense_equal_the_dequantized_values(dtype):
    from pagedgen.runtime.quantization.mxfp4.kernels import dequantize
    w = torch.randn(3, 40, 160) * torch.logspace(-3, 3, 160)  # scales far apart
    q, s, values = packed(w)
    got = dequantize(q, s, torch.empty(3, 40, 160, dtype=dtype))
    assert torch.equal(got, values.to(dtype))


@INTERPRETED_ONLY
# skipped slots' gate/up rows are never written: their activation reads whatever memory held
# (an overflow in exp or multiply, or a NaN sum, the interpreter reports, as that memory
# happens to hold) and nothing reads it
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("ep", [False, True], ids=["all-experts", "expert-parallel"])
@pytest.mark.parametrize("way", ["tiles", "grouped_mm"])
@pytest.mark.kernels
def test_mxfp4_experts_written_out_dense_a_run_at_a_time_equal_the_loop(ep, way, monkeypatch):
    """The prefill way (``moe.dequantized``): a scratch of three experts' dense weights, so
    eight experts take three runs, each skipping the others' slots; gpt-oss's biased, clamped
    experts; under expert parallelism the marker's slots add nothing. In our tiles and in
    torch's grouped GEMM (whose rows past the last expert hold whatever memory held)."""
    from pagedgen.runtime.layers.moe import dequantized as moe_dequantized
    x, w13, w2, weights, chosen = _experts(29, 8, 3, 64, 32)
    q13, s13, d13 = packed(w13)
    q2, s2, d2 = packed(w2)
    g = torch.Generator().manual_seed(3)
    act = clamped_swiglu(1.702, 0.5)
    b13, b2 = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    if ep:  # another rank's slots: the marker 8, weight 0
        other = torch.rand(chosen.shape, generator=g) < 0.3
        chosen, weights = torch.where(other, 8, chosen), weights * ~other
    run = 3 * (64 * 32 + 64 * 16) * 2 * 4  # three experts' dense float32 bytes
    assert moe_dequantized.experts_per_run(q13, q2, torch.float32, run) == 3
    tiles = (mk.Tiles(16, 32, 32),) * 2 if way == "tiles" else moe_dequantized.GROUPED_MM
    real = torch._grouped_mm

    def unwritten_nan(a, b, offs):  # rows past the last offset: NaN, as memory may hold
        out = real(a, b, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out
    monkeypatch.setattr(torch, "_grouped_mm", unwritten_nan)
    got = moe_dequantized.experts(x, q13, q2, weights, chosen, tiles, None,
                                  ExpertScales(s13, s2, mxfp4.GROUP), act, b13, b2,
                                  dropped=ep, scratch_bytes=run)
    mine = chosen < 8
    ref = mk.reference(x, d13, d2, weights * mine, torch.where(mine, chosen, 0), act, b13, b2)
    torch.testing.assert_close(got, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_mxfp4_plans_keep_the_dense_way_from_its_count_and_read_plans_from_before_it():
    from pagedgen.runtime.layers.moe import dequantized as moe_dequantized
    from pagedgen.runtime.layers.moe import plan as moe_plan
    t = moe_plan.CANDIDATES
    small, big = t["m16n64k128g1w4s4x"], t["m128n256k64g8w8s3"]
    plan = moe_plan.MoePlan([(64, small, small, False), (8192, small, small, False)],
                            dequantize_from=2048, dense=[(2048, big), (8192, big)])
    assert plan.dequantizes(512) is None and plan.dequantizes(4096) == (big, big)
    saved = moe_plan.to_json(plan)
    assert moe_plan._from_json(saved) == plan
    grouped = moe_plan.MoePlan(plan.choices, dequantize_from=2048,
                               dense=[(2048, big), (8192, moe_dequantized.GROUPED_MM)])
    assert grouped.dequantizes(2048) == (big, big)
    assert grouped.dequantizes(4096) == grouped.dequantizes(1 << 20) == "grouped_mm"
    assert moe_plan._from_json(moe_plan.to_json(grouped)) == grouped
    before = {k: v for k, v in saved.items() if k in ("choices", "grouped_mm_from")}
    assert moe_plan._from_json(before).dequantizes(1 << 20) is None


def test_a_way_runs_from_the_count_at_which_it_wins_at_every_larger_one():
    from pagedgen.runtime.layers.moe.plan import _wins_from
    assert _wins_from([(512, False), (2048, True), (8192, True)]) == 2048
    assert _wins_from([(512, True), (2048, False), (8192, True)]) == 8192
    assert _wins_from([(512, True), (2048, True), (8192, False)]) == float("inf")


@pytest.mark.skipif(not mk.HAVE_TRITON, reason="the PTX's constants live beside Triton kernels")
def test_the_packed_conversions_bits_read_every_code_pair_times_two_to_the_minus_126():
    """``e2m1_bf16``'s integer steps (the same constants its PTX is built from: the
    interpreter runs no PTX, the GPU tests run it) turn every byte, in either half of a word,
    into the bf16 bits of its two codes' values times 2^-126, so the bf16 multiplies by
    ``UNBIAS`` and by the group's scale 2^(e - 127) give the value exactly."""
    from pagedgen.runtime.quantization.mxfp4 import kernels as fk
    byte = torch.arange(256, dtype=torch.int64)
    other = byte.flip(0)  # the other half's byte, to catch bits leaking across halves
    words = byte | (other << 16)
    lo, hi = fk.e2m1_bf16_bits(words)
    table = torch.tensor(mxfp4.E2M1, dtype=torch.float32)

    def halves(w: torch.Tensor) -> torch.Tensor:  # [256, 2] of the bits' float values
        h = torch.stack([w & 0xFFFF, w >> 16], -1).to(torch.int16)
        return h.view(torch.bfloat16).float() * 2.0 ** 126
    unbias = torch.tensor([fk.UNBIAS & 0xFFFF], dtype=torch.int16).view(torch.bfloat16)
    assert unbias.float().item() == 2.0 ** 126 and fk.UNBIAS >> 16 == fk.UNBIAS & 0xFFFF
    for got, nibble in ((lo, lambda b: b & 15), (hi, lambda b: b >> 4)):
        want = torch.stack([table[nibble(byte)], table[nibble(other)]], -1)
        assert torch.equal(halves(got), want)


@pytest.mark.skipif(not mk.HAVE_TRITON, reason="the PTX's constants live beside Triton kernels")
def test_the_folded_conversion_scales_and_unbiases_every_code_with_one_multiply():
    """With every exponent at most 128, the FOLDED PTX makes each exponent e the bf16 2^(e - 1)
    (``folded_scale_bits``), and one bf16 multiply of the codes' bits (2^-126 times their
    values) by it gives the value times 2^(e - 127) exactly; at 129 it would overflow, which
    is why larger exponents keep the two multiplies."""
    from pagedgen.runtime.quantization.mxfp4 import kernels as fk
    byte = torch.arange(256, dtype=torch.int64)
    lo, hi = fk.e2m1_bf16_bits(byte | (byte.flip(0) << 16))
    table = torch.tensor(mxfp4.E2M1, dtype=torch.float32)

    def bf16(bits: torch.Tensor) -> torch.Tensor:  # the low half's bf16
        return (bits & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    for e in range(1, mxfp4.FOLD_MAX_EXPONENT + 1):
        scale = fk.folded_scale_bits(torch.tensor([e | (e << 16)]))
        assert scale >> 16 == scale & 0xFFFF  # both halves, no carry between them
        for bits, nibble in ((lo, byte & 15), (hi, byte >> 4)):
            got = (bf16(bits) * bf16(scale)).float()
            assert torch.equal(got, table[nibble] * 2.0 ** (e - 127)), e
    over = bf16(fk.folded_scale_bits(torch.tensor([mxfp4.FOLD_MAX_EXPONENT + 1])))
    assert torch.isinf(over.float()).all()


def test_mxfp4_experts_say_whether_every_exponent_is_small_as_loaded():
    """``scales`` says the experts take the one-multiply conversion while every exponent is at
    most 128, and asks again after a load: one expert loaded with a larger one turns it off."""
    from pagedgen.runtime.collectives.parallel import TensorParallel
    from pagedgen.runtime.layers.moe.layer import FusedMoE
    from pagedgen.runtime.quantization.mxfp4.moe import Mxfp4Moe
    assert mxfp4.small_exponents(torch.tensor([3, mxfp4.FOLD_MAX_EXPONENT], dtype=torch.uint8))
    assert not mxfp4.small_exponents(torch.tensor([mxfp4.FOLD_MAX_EXPONENT + 1],
                                                  dtype=torch.uint8))
    moe = FusedMoE(4, 2, 64, 32, TensorParallel(), method=Mxfp4Moe())
    g = torch.Generator().manual_seed(0)
    for name in FusedMoE.DRAWN:
        moe.load_drawn(name, torch.randn(moe.drawn_shape(name), generator=g) * 0.02)
    assert moe.method.scales(moe).small_exponents
    big = torch.full((64, 32), 6.0 * 2.0 ** (mxfp4.FOLD_MAX_EXPONENT + 1 - 127))
    moe.load_checkpoint_tensor("1.down_proj.weight", big)  # as a checkpoint's expert 1
    assert int(moe.w2_weight_scale[1].max()) == mxfp4.FOLD_MAX_EXPONENT + 1
    assert not moe.method.scales(moe).small_exponents
