"""The gated delta rule's kernels (issue 60): the torch reference against a token-by-token
recurrence written here from the rule's definition and against transformers' own functions;
our Triton kernels against the reference (on CPU in Triton's interpreter); and the state slots
(taken with a sequence's first blocks, freed with them, copied to forked samples)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
from pagedgen.attention.recurrent import reference
from pagedgen.attention.recurrent.gated_delta import HAVE_TRITON, GatedDeltaImpl, GatedDeltaKernels
from pagedgen.attention.recurrent.state import GatedDeltaSpec, RecurrentStates
from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.sequence import Sequence

SPEC = GatedDeltaSpec(num_k_heads=2, num_v_heads=4, head_k=16, head_v=8, conv_kernel=4)
CPU = torch.device("cpu")
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not HAVE_TRITON,
                                 reason="CPU tensors run Triton only under TRITON_INTERPRET=1")


def rule(q, k, v, g, beta, state):
    """The gated delta rule, one token at a time, from its definition (one head)."""
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()
        state = state + torch.outer(k[t], beta[t] * (v[t] - state.t() @ k[t]))
        out.append(state.t() @ q[t])
    return torch.stack(out), state


def test_the_chunked_form_equals_the_rule_from_any_state_and_any_chunk():
    torch.manual_seed(0)
    n, h = 37, 3
    q, k = (F.normalize(torch.randn(n, h, 16), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(n, h, 8), -torch.rand(n, h), torch.rand(n, h)
    s0 = torch.randn(h, 16, 8)
    want = [rule(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s0[i]) for i in range(h)]
    for chunk in (1, 5, 16, 64):
        o, s = reference.gated_delta_chunked(q, k, v, g, beta, s0, chunk)
        for i, (wo, ws) in enumerate(want):
            torch.testing.assert_close(o[:, i], wo, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s[i], ws, atol=1e-5, rtol=1e-5)
    o, s = reference.gated_delta_step(q[:1], k[:1], v[:1], g[:1], beta[:1], s0[None])
    torch.testing.assert_close(o[0], torch.stack([w[0][0] for w in want]), atol=1e-5, rtol=1e-5)


def test_the_reference_equals_transformers_functions():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.manual_seed(1)
    n = 70
    q, k = torch.randn(1, n, 2, 16), torch.randn(1, n, 2, 16)
    v, a, b = torch.randn(1, n, 4, 8), torch.randn(1, n, 4), torch.randn(1, n, 4)
    g, beta = reference.gates(a, b, torch.rand(4), torch.rand(4))
    want, state = torch_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    qq, kk = reference._heads(q[0], k[0], 4)
    got, s = reference.gated_delta_chunked(qq, kk, v[0], g[0], beta[0], torch.zeros(4, 16, 8))
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, state[0], atol=1e-5, rtol=1e-5)


def _steps(kernels: GatedDeltaKernels, dtype: torch.dtype, steps, device=CPU, spec=SPEC):
    """Run a layer's core over ``steps`` ((prefills (slot, context, new)), (decodes (slot,
    context))) from fresh slots on ``device``; the outputs and the final states."""
    gen = torch.Generator().manual_seed(3)
    states = RecurrentStates([spec], 6, dtype, device)
    c, hv = spec.conv_dim, spec.num_v_heads
    weight = (torch.randn(c, 4, generator=gen) * 0.5).to(dtype)
    a_log, dt_bias = torch.rand(hv, generator=gen), torch.rand(hv, generator=gen)
    weight, a_log, dt_bias = weight.to(device), a_log.to(device), dt_bias.to(device)
    impl = GatedDeltaImpl(spec, kernels)
    builder = AttentionMetadataBuilder(16, device)
    table = list(range(64))
    outs = []
    for prefills, decodes in steps:
        md = builder.build([ScheduledSeq(table, ctx, n, slot) for slot, ctx, n in prefills],
                           [ScheduledSeq(table, ctx, 1, slot) for slot, ctx in decodes])
        qkv = torch.randn(md.num_tokens, c, generator=gen).to(device, dtype)
        ab = torch.randn(md.num_tokens, 2 * hv, generator=gen).to(device, dtype)
        outs.append(impl.forward(qkv, ab[:, :hv], ab[:, hv:], weight, None, a_log, dt_bias,
                                 states.layers[0], md))
    return outs, states.layers[0]


# chunks of every kind: fresh prompts, a chunk shorter than the convolution, a one-token
# prompt, prefills beside decodes, a long prompt over several 64-token chunks
STEPS = [([(0, 0, 5), (1, 0, 2), (2, 0, 1)], []),
         ([(0, 5, 3), (1, 2, 1)], [(2, 1)]),
         ([], [(0, 8), (1, 3), (2, 2)]),
         ([(3, 0, 70)], [(0, 9), (1, 4)])]


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.kernels
def test_triton_kernels_equal_the_reference(dtype):
    want, ref_state = _steps(GatedDeltaKernels("torch", "torch"), dtype, STEPS)
    got, state = _steps(GatedDeltaKernels("triton", "triton"), dtype, STEPS)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **tol)
    torch.testing.assert_close(state.ssm[:4], ref_state.ssm[:4], **tol)
    torch.testing.assert_close(state.conv[:4], ref_state.conv[:4], **tol)


@INTERPRETED
@pytest.mark.parametrize("taps,bias", [(4, False), (3, True), (5, True)])
@pytest.mark.kernels
def test_the_convolution_of_a_long_step_equals_the_reference(taps, bias):
    """Prompts continuing their windows, a fresh one, and decodes, against
    ``reference.causal_conv``; the blocks inside a prompt run row by row (up to 4 taps), the
    rest (and every block of 5 taps) as a block."""
    from pagedgen.attention.recurrent.gated_delta import conv_triton

    gen = torch.Generator().manual_seed(5)
    c = SPEC.conv_dim
    md = AttentionMetadataBuilder(16, CPU).build(
        [ScheduledSeq(list(range(80)), ctx, n, slot)
         for slot, ctx, n in ((0, 7, 600), (1, 0, 500), (2, 3, 2))],
        [ScheduledSeq(list(range(80)), 9, 1, slot) for slot in (3, 4)])
    qkv = torch.randn(md.num_tokens, c, generator=gen)
    weight = torch.randn(c, taps, generator=gen)
    b = torch.randn(c, generator=gen) if bias else None
    conv = torch.randn(6, taps - 1, c, generator=gen)  # [slots, K - 1, C]
    want_conv = conv.clone()
    slots, has, _ = md.recurrent_inputs()
    want = reference.causal_conv(qkv, weight, b, want_conv, slots.tolist(),
                                 md.query_lens_cpu, has.tolist())
    got = conv_triton(qkv, weight, b, conv, md)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, want_conv, atol=0, rtol=0)


@INTERPRETED
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.kernels
def test_the_q_and_k_heads_for_the_chunked_prefill_are_normalized_as_the_reference_does(
        tokens):
    """``qk_norm_triton``: the q and k heads at the start of each projected row (the v heads
    after them untouched) → [2, T, Hk, Dk], as ``reference.l2_normalize``."""
    from pagedgen.attention.recurrent.gated_delta import qk_norm_triton
    torch.manual_seed(0)
    hk, dk = SPEC.num_k_heads, SPEC.head_k
    mixed = torch.randn(tokens, 2 * hk * dk + SPEC.num_v_heads * SPEC.head_v) * 3
    got = qk_norm_triton(mixed, hk, dk)
    want = reference.l2_normalize(mixed[:, :2 * hk * dk].reshape(tokens, 2, hk, dk))
    torch.testing.assert_close(got, want.transpose(0, 1), atol=1e-6, rtol=1e-5)


def _seq(i: int) -> Sequence:
    return Sequence(i, [1, 2, 3], SamplingParams(), seed=0)


def test_a_sequence_holds_a_slot_from_its_first_blocks_until_it_lets_go():
    bm = BlockManager(16, 4, state_slots=3)
    seqs = [_seq(i) for i in range(3)]
    for s in seqs:
        bm.allocate(s, 3)
    assert sorted(s.state_slot for s in seqs) == [0, 1, 2] and not bm.free_slots
    bm.allocate(seqs[0], 9)  # more blocks: the same slot
    assert seqs[0].state_slot in (0, 1, 2)
    held = seqs[1].state_slot
    bm.free(seqs[1])  # finished or preempted: the slot goes back
    assert seqs[1].state_slot is None and bm.free_slots == [held]
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        bm.allocate(_seq(7), 3) or bm.allocate(_seq(8), 3)


def test_a_forked_sample_takes_a_slot_of_its_own():
    bm = BlockManager(16, 4, state_slots=3)
    parent, child = _seq(0), _seq(1)
    bm.allocate(parent, 3)
    bm.fork(parent, child, 3)
    assert child.state_slot is not None and child.state_slot != parent.state_slot
    assert BlockManager(16, 4).fork(parent, _seq(2), 3) is not None  # no state: none taken


def test_state_copies_fork_every_layer():
    states = RecurrentStates([SPEC, SPEC], 4, torch.float32, CPU)
    for layer in states.layers:
        layer.ssm[1].normal_()
        layer.conv[1].normal_()
    states.copy(torch.tensor([[1, 3]]))
    for layer in states.layers:
        assert torch.equal(layer.ssm[3], layer.ssm[1])
        assert torch.equal(layer.conv[3], layer.conv[1])


def test_a_graph_recorded_after_a_warm_up_makes_its_own_step_tensors():
    """CUDA graphs record a forward over metadata an eager warm-up already ran: the warm-up's
    cached slots, flags and token map must be dropped, or the graph would read them after
    they are freed (on a GPU: an illegal memory access at a later replay)."""
    md = AttentionMetadataBuilder(16, CPU).build([], [ScheduledSeq([0], 0, 1, 2)])
    first = md.recurrent_inputs()
    assert first[1].tolist() == [0] and md.recurrent_inputs() is first  # once a step
    md.context_lens.fill_(5)  # the graph's static buffers, refilled before a replay
    md.forget_step_tensors()
    again = md.recurrent_inputs()
    assert again is not first and again[1].tolist() == [1]


@INTERPRETED
@pytest.mark.kernels
def test_verify_checks_the_triton_kernels_against_the_reference():
    from pagedgen.cli.verify.linear_checks import kernel_row

    row = kernel_row("triton", CPU, 2, 0, longest=20, dims=(16,))  # small: interpreted
    assert row.passed and row.cases == 2 and 0 < row.worst_rel < row.tol


def test_the_chunked_prefill_runs_only_where_its_library_takes_the_layers(monkeypatch):
    """FlashInfer's gated-delta prefill: on Hopper, bf16 or fp16, heads of 128 (else fla's,
    else our scan); asked for where it cannot run, a one-line reason."""
    from pagedgen.attention.recurrent import gated_delta as gd

    assert GatedDeltaKernels.for_device(CPU) == GatedDeltaKernels("torch", "torch")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        GatedDeltaKernels.for_device(CPU, "flashinfer")
    cuda, wide = torch.device("cuda"), GatedDeltaSpec(16, 32, 128, 128, 4)
    monkeypatch.setattr(gd, "HAVE_FLASHINFER", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "Hopper" in gd.chunked_unavailable("flashinfer", cuda, (wide,), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "not torch.float32" in gd.chunked_unavailable("flashinfer", cuda, (wide,),
                                                         torch.float32)
    assert "not 16 (keys) and 8 (values)" in gd.chunked_unavailable(
        "flashinfer", cuda, (wide, SPEC), torch.bfloat16)
    monkeypatch.setattr(gd, "HAVE_FLASHINFER", False)
    monkeypatch.setattr(gd, "HAVE_TRITON", True)
    monkeypatch.setattr(gd, "HAVE_FLA", True)
    assert GatedDeltaKernels.for_device(cuda, None, (wide,), torch.bfloat16).prefill == "fla"
    monkeypatch.setattr(gd, "HAVE_FLA", False)
    assert GatedDeltaKernels.for_device(cuda, None, (wide,), torch.bfloat16).prefill == "triton"
    with pytest.raises(ValueError, match="FlashInfer is not installed"):
        GatedDeltaKernels.for_device(cuda, "flashinfer", (wide,), torch.bfloat16)
