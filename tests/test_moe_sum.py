"""The sum over each token's expert slots (``moe.combine``): the Triton kernel (interpreted on a
CPU, compiled on a GPU) against torch's scale, scatter and reduce, in slot order and gathered from a
sorted layout with routing weights."""

from __future__ import annotations

import os

import pytest
import torch

from pagedgen.runtime.layers.moe import combine as moe_sum

pytestmark = pytest.mark.skipif(not moe_sum.HAVE_TRITON, reason="triton is not installed")

CASES = [pytest.param("cpu", dt, marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors run only interpreted"))
    for dt in (torch.float32, torch.float16)] + [
    pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.bfloat16)]


def _slots(tokens: int, top_k: int, width: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(tokens * 31 + top_k)
    src = torch.randn(tokens * top_k, width, generator=g).to(device, dtype)
    order = torch.randperm(tokens * top_k, generator=g)  # a sorted layout: row r holds slot
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    weights = torch.rand(tokens, top_k, generator=g).to(device)
    return src, order.to(device), rows.to(device), weights


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,top_k,width", [
    (1, 1, 48),       # one slot
    (5, 2, 1100),     # two column blocks, the second partial
    (37, 8, 96),      # Qwen3-MoE's eight experts a token
    (0, 4, 64),       # no tokens
])
@pytest.mark.kernels
def test_slot_sum_in_slot_order_equals_torchs_sum(device, dtype, tokens, top_k, width):
    src, _, _, _ = _slots(tokens, top_k, width, device, dtype)
    got = moe_sum.slot_sum(src, top_k)
    want = src.float().view(tokens, top_k, width).sum(1).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,top_k,width", [(5, 2, 1100), (37, 8, 96)])
@pytest.mark.kernels
def test_slot_sum_gathers_sorted_rows_and_weighs_them_into_a_strided_output(
        device, dtype, tokens, top_k, width):
    src, order, rows, weights = _slots(tokens, top_k, width, device, dtype)
    in_slot_order = torch.empty_like(src).index_copy_(0, order, src)
    want = (in_slot_order.float().view(tokens, top_k, width)
            * weights.float()[:, :, None]).sum(1).to(dtype)
    wide = torch.full((tokens, width + 16), float("nan"), device=device, dtype=dtype)
    out = wide[:, 8:8 + width]  # rows of a wider buffer
    got = moe_sum.slot_sum(src, top_k, out, rows=rows, weights=weights)
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert wide[:, :8].isnan().all() and wide[:, 8 + width:].isnan().all()
    ref = moe_sum.slot_sum_reference(src, top_k, rows=rows, weights=weights)
    torch.testing.assert_close(ref, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.kernels
def test_slot_sum_adds_each_slots_expert_bias_before_weighing(device, dtype):
    """gpt-oss's down bias in the sum (``moe.grouped_mm``): row + bias[expert], rounded to the
    rows' dtype as a GEMM's epilogue writes it, then weighted."""
    tokens, top_k, width, num_experts = 9, 3, 1100, 5
    src, order, rows, weights = _slots(tokens, top_k, width, device, dtype)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(num_experts, width, generator=g).to(device)
    experts = torch.randint(0, num_experts, (tokens, top_k), generator=g).to(device)
    in_slot_order = torch.empty_like(src).index_copy_(0, order, src)
    biased = (in_slot_order.float() + bias[experts.reshape(-1)]).to(dtype)
    want = (biased.float().view(tokens, top_k, width)
            * weights.float()[:, :, None]).sum(1).to(dtype)
    got = moe_sum.slot_sum(src, top_k, rows=rows, weights=weights, bias=bias, experts=experts)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    ref = moe_sum.slot_sum_reference(src, top_k, rows=rows, weights=weights, bias=bias,
                                     experts=experts)
    torch.testing.assert_close(ref, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.kernels
def test_slot_sum_adds_a_shared_experts_gated_output_rounded_as_torchs_ops(device, dtype):
    """Qwen3.5-MoE's shared expert in the sum: the kernel's own sum of the slots, then
    ``sigmoid(logit) * x`` added as transformers' three torch ops round it (within a unit in
    the last place: Triton's sigmoid against torch's), the logit a column of a wider
    projection's output."""
    tokens, top_k, width = 7, 4, 1100
    src, _, rows, weights = _slots(tokens, top_k, width, device, dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, width, generator=g).to(device, dtype)
    logit = (torch.randn(tokens, 3, generator=g) * 4).to(device, dtype)[:, 1:2]
    summed = moe_sum.slot_sum(src, top_k, rows=rows, weights=weights)
    want = summed + torch.sigmoid(logit) * x
    got = moe_sum.slot_sum(src, top_k, rows=rows, weights=weights, gated=(x, logit))
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, atol=ulp * want.abs().max().item(), rtol=ulp)
    assert (got - summed).abs().max() > 0.1  # the shared expert was added
    summed = moe_sum.slot_sum_reference(src, top_k, rows=rows, weights=weights)
    ref = moe_sum.slot_sum_reference(src, top_k, rows=rows, weights=weights, gated=(x, logit))
    torch.testing.assert_close(ref, summed + torch.sigmoid(logit) * x, atol=0, rtol=0)
