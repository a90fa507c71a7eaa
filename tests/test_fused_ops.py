"""The fused Triton kernels (norm, rotary, SwiGLU) against their torch references.

On CPU they run in Triton's interpreter (float32 and float16); on a GPU, compiled, in bfloat16 too.
Inputs are strided views, as the model passes them (q/k/v split from one projection), and sizes
are not powers of two, so the masks are exercised.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedgen.runtime.layers import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.HAVE_TRITON, reason="triton is not installed")

CUDA = torch.cuda.is_available()
# CPU tensors need Triton's interpreter (conftest turns it on where there is no GPU)
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors run only under TRITON_INTERPRET=1")
CASES = [pytest.param("cpu", dt, marks=INTERPRETED) for dt in (torch.float32, torch.float16)] + [
    pytest.param("cuda", dt, marks=pytest.mark.gpu)
    for dt in (torch.float32, torch.float16, torch.bfloat16)]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}  # one unit in the last place


def _randn(*shape, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", [96, 300])
@pytest.mark.kernels
def test_rms_norm(device, dtype, n):
    wide = _randn(7, n + 40, device=device, dtype=dtype, seed=0)
    x = wide[:, 8:8 + n]  # strided rows
    res = _randn(7, n, device=device, dtype=dtype, seed=1)
    w = _randn(n, device=device, dtype=dtype, seed=2)
    torch.testing.assert_close(fused_ops.rms_norm_fused(x, w, 1e-6),
                               fused_ops.rms_norm_ref(x, w, 1e-6), **TOL[dtype])
    out, new_res = fused_ops.rms_norm_fused(x, w, 1e-6, res)
    ref_out, ref_res = fused_ops.rms_norm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)  # one rounding, as torch
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("heads,kv_heads,d,norm,rot", [
    (4, 2, 64, False, 64), (6, 6, 32, True, 32), (12, 4, 128, True, 128),
    (4, 2, 64, True, 16),   # partial rotary after q/k norms (Qwen3.5: a quarter of each head)
    (3, 1, 40, True, 16),   # the features past the rotated ones not a power of two
    (6, 2, 48, False, 16),  # partial rotary without norms
    (4, 2, 64, False, 48),  # rotated halves not a power of two (Phi-4-mini: 96 of 128)
    (6, 6, 24, True, 24),   # nor whole heads
])
@pytest.mark.kernels
def test_rotary(device, dtype, heads, kv_heads, d, norm, rot):
    t = 9
    qkv = _randn(t, (heads + 2 * kv_heads) * d, device=device, dtype=dtype, seed=3)
    q = qkv[:, :heads * d].view(t, heads, d)  # strided, as split from the qkv projection
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    pos = torch.tensor([0, 1, 2, 17, 300, 301, 5, 1000, 4095], device=device)
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot)
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    norms = ()
    if norm:
        norms = (1 + 0.1 * _randn(d, device=device, dtype=dtype, seed=4),
                 1 + 0.1 * _randn(d, device=device, dtype=dtype, seed=5), 1e-6)
    q_f, k_f = fused_ops.rotary_fused(q, k, cos, sin, *norms)
    q_r, k_r = fused_ops.rotary_ref(q, k, cos, sin, *norms)
    assert q_f.is_contiguous() and k_f.is_contiguous()
    torch.testing.assert_close(q_f, q_r, **TOL[dtype])
    torch.testing.assert_close(k_f, k_r, **TOL[dtype])
    if not norm:  # position 0 is the identity rotation; unrotated features pass as they are
        torch.testing.assert_close(q_f[0], q[0], atol=0, rtol=0)
        torch.testing.assert_close(k_f[:, :, rot:], k[:, :, rot:], atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", [88, 1500])
@pytest.mark.kernels
def test_silu_and_mul(device, dtype, n):
    x = _randn(5, 2 * n, device=device, dtype=dtype, seed=6) * 3
    torch.testing.assert_close(fused_ops.silu_and_mul_fused(x),
                               fused_ops.silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("d", [128, 48])
@pytest.mark.kernels
def test_gated_rms_norm(device, dtype, d):
    """x [T, H, D] as the delta rule writes it; z a strided view of the projection's columns."""
    t, h = 5, 3
    x = _randn(t, h, d, device=device, dtype=dtype, seed=0)
    z = _randn(t, 2 * h * d + 8, device=device, dtype=dtype, seed=1)[:, 8:8 + h * d]
    z = z.reshape(t, h, d)
    w = _randn(d, device=device, dtype=dtype, seed=2)
    torch.testing.assert_close(fused_ops.gated_rms_norm_fused(x, z, w, 1e-6),
                               fused_ops.gated_rms_norm_ref(x, z, w, 1e-6), **TOL[dtype])


def test_empty_batches():
    x = torch.empty(0, 64)
    w = torch.ones(64)
    assert fused_ops.rms_norm_fused(x, w, 1e-6).shape == (0, 64)
    assert fused_ops.silu_and_mul_fused(torch.empty(0, 64)).shape == (0, 32)
    q, k = fused_ops.rotary_fused(torch.empty(0, 4, 16), torch.empty(0, 2, 16),
                                  torch.empty(0, 16), torch.empty(0, 16))
    assert q.shape == (0, 4, 16) and k.shape == (0, 2, 16)


def test_unavailable_reason():
    assert fused_ops.unavailable_reason(torch.device("cpu")) is not None
    if CUDA:
        assert fused_ops.unavailable_reason(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_engine_fused_vs_torch_ops(backend):
    """Whole model in bf16 on the GPU, CUDA graphs on: fused kernels against torch ops, stepped
    in lockstep (tokens from the torch-ops engine)."""
    from engine_checks import byte_prompts, engine, lockstep_logits

    from pagedgen.runtime.config import SamplingParams

    common = dict(backend=backend, async_scheduling=False, advance_decode_on_device=False,
                  num_blocks=1024)
    fused = engine(fused_kernels=True, **common)
    plain = engine(fused_kernels=False, **common)
    assert fused.runner.fused_kernels and not plain.runner.fused_kernels
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    worst, agree, total = lockstep_logits(fused, plain, byte_prompts(12), params)
    print(f"fused vs torch ops ({backend}): worst relative logit diff {worst:.4f}, "
          f"argmax agreement {agree}/{total}")
    assert worst < 2e-2 and agree >= 0.95 * total
