"""Packed attention (a vision tower's images end to end, each attending within itself): SDPA's
path against a float64 softmax per sequence, no sequence seeing another, cuDNN left out; the
rules that pick FA4; and on a GPU, FA4's one varlen call against SDPA's (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from pagedgen.attention import packed
from pagedgen.attention.packed import PackedAttention, fa4_reason
from pagedgen.errors import PagedgenError

LENGTHS = [5, 1, 12, 7]


def reference(q, k, v, lengths, scale) -> torch.Tensor:
    """Each sequence's softmax(q k^T scale) v in float64, alone."""
    out, at = [], 0
    for n in lengths:
        s = slice(at, at + n)
        w = torch.einsum("qhd,khd->hqk", q[s].double(), k[s].double()) * scale
        out.append(torch.einsum("hqk,khd->qhd", w.softmax(-1), v[s].double()))
        at += n
    return torch.cat(out).to(q.dtype)


def packed_inputs(lengths, heads=3, dim=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), heads, dim, generator=g).to(device, dtype)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def fake_fa4(monkeypatch, fwd) -> None:
    """FA4 taken to run here, its forward ``fwd`` (a stand-in on the CPU)."""
    from types import SimpleNamespace

    from pagedgen.attention import fa4_import

    monkeypatch.setattr(packed, "fa4_reason", lambda *a: None)
    monkeypatch.setattr(fa4_import, "import_fa4",
                        lambda: SimpleNamespace(interface=SimpleNamespace(_flash_attn_fwd=fwd)))


def test_sdpa_attends_within_each_sequence_and_leaves_cudnn_out(monkeypatch):
    """Each sequence's output is its own softmax's (a sequence whose keys change leaves the
    others' outputs as they were), with cuDNN's attention off during the calls and 4-D
    inputs (on CUDA SDPA's fused kernels take only those)."""
    seen = []
    own = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        assert all(t.dim() == 4 for t in a[:3])  # the fused kernels' shape (else math's)
        return own(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    att = PackedAttention(torch.device("cpu"), 16, torch.float32)
    assert att.kernel == "sdpa" and att.why is None  # the default; FA4 not asked
    q, k, v, cu = packed_inputs(LENGTHS)
    out = att(q, k, v, cu, 0.25)
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, 0.25), rtol=1e-5, atol=1e-5)
    k2 = k.clone()
    k2[6:18] += 1.0  # the third sequence's keys
    again = att(q, k2, v, cu, 0.25)
    assert torch.equal(again[:6], out[:6]) and torch.equal(again[18:], out[18:])
    assert not torch.equal(again[6:18], out[6:18])
    assert seen and not any(seen)


def test_fa4_is_chosen_only_where_it_takes_the_type_and_head_size(monkeypatch):
    cpu = torch.device("cpu")
    assert fa4_reason(cpu, 72, torch.bfloat16)  # not here: FA4 absent or no GPU
    assert PackedAttention(cpu, 72, torch.bfloat16, kernel="fa4").why  # asked: says why not
    monkeypatch.setattr(packed, "flavour_reason", lambda f, device: None)
    for major, dim, dtype, ok in [(9, 72, torch.bfloat16, True), (9, 256, torch.float16, True),
                                  (9, 72, torch.float32, False), (9, 70, torch.bfloat16, False),
                                  (9, 264, torch.bfloat16, False), (10, 128, torch.bfloat16, True),
                                  (10, 256, torch.bfloat16, False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert (fa4_reason(cpu, dim, dtype) is None) == ok, (major, dim, dtype)
    assert PackedAttention(cpu, 72, torch.bfloat16).kernel == "sdpa"  # FA4 not asked
    monkeypatch.setenv("PAGEDGEN_VISION_ATTENTION", "fa3")
    with pytest.raises(PagedgenError, match="expected sdpa or fa4"):
        PackedAttention(cpu, 72, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fa4_packed_attention_matches_sdpa_on_the_gpu():
    """Qwen3.5's tower shape (16 heads of 72) over sequences of image sizes: FA4's one call
    against SDPA's, both in bf16, against the float64 reference."""
    device = torch.device("cuda")
    fa4 = PackedAttention(device, 72, torch.bfloat16, kernel="fa4")
    if fa4.kernel != "fa4":
        pytest.skip(f"FA4 does not run here: {fa4.why}")
    lengths = [784, 4800, 1200, 16, 2304]
    q, k, v, cu = packed_inputs(lengths, 16, 72, torch.bfloat16, device)
    want = reference(q, k, v, lengths, 72 ** -0.5).float()
    sdpa = PackedAttention(device, 72, torch.bfloat16, kernel="sdpa")(q, k, v, cu, 72 ** -0.5)
    got = fa4(q, k, v, cu, 72 ** -0.5)
    err_fa4 = (got.float() - want).abs().max().item()
    err_sdpa = (sdpa.float() - want).abs().max().item()
    print(f"FA4 packed: max error {err_fa4:.2e}; SDPA's {err_sdpa:.2e}")
    assert err_fa4 <= max(2 * err_sdpa, 1e-2)


def test_an_fa4_kernel_that_fails_to_build_leaves_sdpa_and_says_why(monkeypatch):
    def fwd(*a, **kw):
        raise RuntimeError("no kernel for this head size\nmore")

    fake_fa4(monkeypatch, fwd)
    att = PackedAttention(torch.device("cpu"), 16, torch.float32, kernel="fa4")
    assert att.kernel == "sdpa"
    assert att.why == "FA4 failed here: RuntimeError: no kernel for this head size"
    q, k, v, cu = packed_inputs(LENGTHS)
    torch.testing.assert_close(att(q, k, v, cu, 0.25), reference(q, k, v, LENGTHS, 0.25),
                               rtol=1e-5, atol=1e-5)


def test_the_fa4_path_gives_fa4_the_bounds_once_and_its_output(monkeypatch):
    """FA4's call (faked by the float64 reference) gets every sequence in one call: int32
    bounds uploaded once for all the layers that pass the same host tensor, the longest
    sequence, the scale, no causal mask."""
    calls = []

    def fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal):
        calls.append(cu_seqlens_q)
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        assert cu_seqlens_q is cu_seqlens_k and cu_seqlens_q.dtype == torch.int32
        assert max_seqlen_q == max_seqlen_k == max(lengths)
        assert not causal and q.is_contiguous() and v.is_contiguous()
        return reference(q, k, v, lengths, softmax_scale), None

    fake_fa4(monkeypatch, fwd)
    monkeypatch.setenv("PAGEDGEN_VISION_ATTENTION", "fa4")  # asked by the environment
    att = PackedAttention(torch.device("cpu"), 16, torch.float32)
    assert att.kernel == "fa4" and att.why is None and len(calls) == 1  # checked when made
    q, k, v, cu = packed_inputs(LENGTHS)
    cu = cu.long()  # made anew as int32 (on a GPU: uploaded) unless kept
    v = v.transpose(0, 1).contiguous().transpose(0, 1)  # a strided view, as qkv's split gives
    want = reference(q, k, v, LENGTHS, 0.25)
    for _ in range(3):  # three layers, one upload
        torch.testing.assert_close(att(q, k, v, cu, 0.25), want)
    assert len(calls) == 4 and calls[1] is calls[2] is calls[3]
    assert calls[1].tolist() == cu.tolist()


def test_an_fa4_kernel_whose_output_differs_from_sdpas_is_not_used(monkeypatch):
    """FA4 is held to SDPA's output when made: a kernel attending across sequences (faked)
    leaves SDPA running, and says by how much it differed."""
    def across(q, k, v, *, cu_seqlens_q, softmax_scale, **_):
        return reference(q, k, v, [q.shape[0]], softmax_scale), None

    fake_fa4(monkeypatch, across)
    att = PackedAttention(torch.device("cpu"), 16, torch.float32, kernel="fa4")
    assert att.kernel == "sdpa" and att.why.startswith(
        "FA4 failed here: RuntimeError: its output differs from SDPA's by up to")
