"""Attention backends against each other and against a dense (unpaged) reference."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_reference, make_paged_batch, run_backend

from pagedgen.attention.eager import EagerBackend
from pagedgen.attention.registry import backend_status, get_backend
from pagedgen.attention.sdpa import SdpaBackend
from pagedgen.errors import PagedgenError


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_eager_matches_dense_reference(seed, heads):
    b = make_paged_batch(seed, num_heads=heads[0], num_kv_heads=heads[1])
    out, _ = run_backend(EagerBackend, b)
    torch.testing.assert_close(out.double(), dense_reference(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,cap", [(7, None), (None, 30.0), (20, 5.0)])
def test_eager_sliding_window_and_soft_cap(window, cap):
    b = make_paged_batch(11, sliding_window=window, soft_cap=cap)
    out, _ = run_backend(EagerBackend, b)
    torch.testing.assert_close(out.double(), dense_reference(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_sinks_take_their_share_of_every_softmax(window):
    """Eager's extra softmax column against the reference's rescaling by the sink's share;
    sdpa's extra zero key against eager, in every dtype."""
    b = make_paged_batch(12, sliding_window=window, sinks=True)
    out, _ = run_backend(EagerBackend, b)
    torch.testing.assert_close(out.double(), dense_reference(b), atol=1e-5, rtol=1e-5)
    plain = make_paged_batch(12, sliding_window=window)
    assert not torch.allclose(out, run_backend(EagerBackend, plain)[0], atol=1e-2)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        b = make_paged_batch(13, num_heads=8, num_kv_heads=2, dtype=dtype,
                             sliding_window=window, sinks=True)
        want, _ = run_backend(EagerBackend, b)
        got, _ = run_backend(SdpaBackend, b)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_layer_with_sinks_hands_them_to_its_impl():
    from pagedgen.runtime.layers.attention import PagedAttention
    b = make_paged_batch(12, sinks=True)
    layer = PagedAttention(b.spec)
    layer.sinks.copy_(b.sinks)
    state = EagerBackend.get_state_cls()(EagerBackend, [b.spec], b.block_size, b.q.dtype,
                                         b.kv_cache.dtype, b.q.device)
    layer.impl = EagerBackend.get_impl_cls()(b.spec, state)
    assert layer.impl.sinks is layer.sinks and "sinks" in dict(layer.named_parameters())
    assert PagedAttention(make_paged_batch(12).spec).sinks is None


def test_eager_writes_new_tokens_into_their_slots():
    b = make_paged_batch(3)
    _, cache = run_backend(EagerBackend, b)
    t = 0
    for s in b.prefills + b.decodes:
        for i in range(s.num_new):
            pos = s.num_context + i
            blk, off = s.block_table[pos // b.block_size], pos % b.block_size
            assert torch.equal(cache[blk, 0, off], b.k[t + i])
            assert torch.equal(cache[blk, 1, off], b.v[t + i])
        t += s.num_new


def test_a_wrong_causal_offset_is_caught():
    """The reference comparison can fail: shifting positions by one changes the output."""
    b = make_paged_batch(5)
    out, _ = run_backend(EagerBackend, b)
    b.prefills[1].num_context += 1  # pretend one more cached token
    b.prefills[1].block_table.append(b.prefills[1].block_table[-1])
    assert not torch.allclose(out.double(), dense_reference(b), atol=1e-3)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("window", [None, 9])
def test_sdpa_matches_eager(seed, head_size, heads, dtype, tol, window):
    b = make_paged_batch(seed, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                         dtype=dtype, sliding_window=window, block_size=16 if seed % 2 else 32)
    ref, ref_cache = run_backend(EagerBackend, b)
    out, cache = run_backend(SdpaBackend, b)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(cache, ref_cache)


def test_decode_only_and_prefill_only_batches():
    for np_, nd in [(0, 4), (3, 0), (1, 1)]:
        b = make_paged_batch(7, num_prefills=np_, num_decodes=nd)
        ref, _ = run_backend(EagerBackend, b)
        out, _ = run_backend(SdpaBackend, b)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fp8_kv_cache_in_eager_is_close_to_full_precision():
    b = make_paged_batch(2, cache_dtype=torch.float8_e4m3fn)
    out, _ = run_backend(EagerBackend, b)
    b_full = make_paged_batch(2)
    b_full.kv_cache = b.kv_cache.float()  # same (already-rounded) cached values
    full, _ = run_backend(EagerBackend, b_full)
    err = (out - full).abs().max().item()
    assert 0 < err < 0.25  # new tokens are rounded to fp8 on write; the rest is identical


def test_registry_errors_are_one_line_and_list_alternatives():
    cpu = torch.device("cpu")
    assert get_backend("auto", cpu) is SdpaBackend
    with pytest.raises(PagedgenError, match="unknown backend 'nope'; available here: .*eager"):
        get_backend("nope", cpu)
    status = {s.name: s for s in backend_status(cpu)}
    assert status["eager"].available and status["sdpa"].available
    if not status["flashinfer"].available:
        with pytest.raises(PagedgenError, match="unavailable on cpu"):
            get_backend("flashinfer", cpu)
        assert "\n" not in status["flashinfer"].reason


def test_check_layer_reports_unsupported_features():
    b = make_paged_batch(0, soft_cap=10.0)
    assert "soft-cap" in SdpaBackend.check_layer(b.spec, torch.float32)
    assert EagerBackend.check_layer(b.spec, torch.float32) is None
    from pagedgen.attention.flashinfer import FlashInferBackend
    b = make_paged_batch(0, sinks=True)
    assert FlashInferBackend.check_layer(b.spec, torch.bfloat16) == \
        "attention sinks not supported"
    assert SdpaBackend.check_layer(b.spec, torch.float32) is None


def test_flashinfer_paged_kv_arrays_from_block_tables():
    from pagedgen.attention.flashinfer import paged_kv_arrays
    tables = torch.tensor([[5, 6, 7, 0], [1, 2, 0, 0], [9, 0, 0, 0]], dtype=torch.int32)
    lens = [33, 16, 1]
    indptr, indices, last = paged_kv_arrays(lens, torch.tensor(lens), tables, 16)
    assert indptr.tolist() == [0, 3, 4, 5]
    assert indices.tolist() == [5, 6, 7, 1, 9]
    assert last.tolist() == [1, 16, 1]


@pytest.mark.parametrize("flavour,expected,loaded", [
    ("fa4", "flash-attn", ["flash-attn"]), ("fa3", "flash-attn", ["flash-attn"]),
    ("fa2", "flashinfer", ["flash-attn", "flashinfer"])])
def test_auto_prefers_flash_attn_with_fa4_or_fa3(monkeypatch, flavour, expected, loaded):
    """On a GPU, auto takes flash-attn when it runs FA4 or FA3 (fastest in our measurements),
    flashinfer when flash-attn could only run FA2 (pages of 256); it loads no backend past
    the one it takes."""
    from types import SimpleNamespace

    from pagedgen.attention import registry

    seen = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def unavailable_reason(self, device):
            return None

        def flavour(self, device):
            return SimpleNamespace(name=flavour)

    def load(name):
        seen.append(name)
        return Stub(name)

    monkeypatch.setattr(registry, "_load", load)
    assert registry.get_backend("auto", torch.device("cuda")).name == expected
    assert sorted(set(seen)) == sorted(loaded)


def test_a_named_backend_loads_only_itself(monkeypatch):
    """`--backend X` imports X's module only (start-up: flashinfer's import alone is ~2 s)."""
    from pagedgen.attention import registry

    seen = []
    real = registry._load
    monkeypatch.setattr(registry, "_load", lambda name: seen.append(name) or real(name))
    assert get_backend("sdpa", torch.device("cpu")) is SdpaBackend
    assert set(seen) == {"sdpa"}
