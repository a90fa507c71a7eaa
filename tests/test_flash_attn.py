"""The flash-attn backend on CPU: each flavour's calls against eager, through torch models of the
flash-attn APIs (tests/fake_flash_attn.py); cache layout, page sizes, flavour selection."""

from __future__ import annotations

import os
import subprocess
import sys

import fake_flash_attn
import pytest
import torch
from conftest import make_paged_batch, padded_decodes, run_backend

from pagedgen.attention.cases import backend_cache
from pagedgen.attention.eager import EagerBackend
from pagedgen.attention.flash_attn import fa4, flavours
from pagedgen.attention.flash_attn.backend import FlashAttnBackend, FlashAttnState
from pagedgen.errors import PagedgenError
from pagedgen.runtime.worker.cuda_graphs import cascade_segments


@pytest.fixture(autouse=True)
def _fresh_selection():
    flavours.select_flavour.cache_clear()
    yield
    flavours.select_flavour.cache_clear()


def _state(batch, flavour: str) -> FlashAttnState:
    return FlashAttnState(FlashAttnBackend, [batch.spec], batch.block_size, batch.q.dtype,
                          batch.kv_cache.dtype, batch.q.device, flavour=flavours.BY_NAME[flavour])


@pytest.mark.parametrize("flavour,page", [("fa4", 16), ("fa4", 128), ("fa3", 16), ("fa2", 256)])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 19}, {"soft_cap": 20.0}],
                         ids=["plain", "window", "softcap"])
def test_flavour_calls_match_eager(monkeypatch, flavour, page, opts):
    fake_flash_attn.install(monkeypatch, flavour)
    for seed in range(3):
        b = make_paged_batch(seed, num_heads=8, num_kv_heads=2, head_size=64, block_size=page,
                             num_prefills=1 + seed, num_decodes=2 + seed, max_context=2 * page + 5,
                             max_new=40, **opts)
        ref, ref_cache = run_backend(EagerBackend, b)
        out, cache = run_backend(FlashAttnBackend, b, state=_state(b, flavour))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(cache, ref_cache)  # K/V written to the same slots


@pytest.mark.parametrize("opts", [{}, {"sliding_window": 19}, {"soft_cap": 20.0}],
                         ids=["plain", "window", "softcap"])
def test_fa4_decode_tile_calls_match_eager(monkeypatch, opts):
    """``$PAGEDGEN_FA4_DECODE_TILE`` routes decodes (and cascade suffixes) through FA4's
    ``_flash_attn_fwd`` with ``tile_mn``; the same keywords mean the same attention."""
    fake_flash_attn.install(monkeypatch, "fa4")
    monkeypatch.setenv(fa4.ENV_DECODE_TILE, "64x128")
    b = make_paged_batch(4, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                         num_prefills=2, num_decodes=5, max_context=45, max_new=30, **opts)
    st = _state(b, "fa4")
    assert st.decode_tile == (64, 128)
    ref, _ = run_backend(EagerBackend, b)
    out, _ = run_backend(FlashAttnBackend, b, state=st)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cc,env,tile", [((9, 0), None, (64, 64)), ((10, 0), None, None),
                                         ((9, 0), "fa4", None), ((10, 0), "64x128", (64, 128))])
def test_fa4_decode_tile_default_is_64x64_on_sm90(monkeypatch, cc, env, tile):
    _pretend_gpu(monkeypatch, cc)
    if env:
        monkeypatch.setenv(fa4.ENV_DECODE_TILE, env)
    else:
        monkeypatch.delenv(fa4.ENV_DECODE_TILE, raising=False)
    assert fa4.fa4_decode_tile(torch.device("cuda")) == tile
    assert fa4.fa4_decode_tile(torch.device("cpu")) == (tile if env else None)
    fake_flash_attn.install(monkeypatch, "fa4")
    shown = "x".join(map(str, tile)) if tile else "FA4 own"
    assert f"decode tile {shown}" in FlashAttnBackend.describe(torch.device("cuda"))
    prefill = "128x64" if cc[0] == 9 else "FA4 own"  # SM90's pages: 64 tokens
    assert f"prefill tile over head size 128 {prefill}" in FlashAttnBackend.describe(
        torch.device("cuda"))


@pytest.mark.parametrize("cc,env,tile", [((9, 0), None, (64, 128)), ((10, 0), None, None),
                                         ((9, 0), "fa4", None), ((10, 0), "64x64", (64, 64))])
def test_fa4_group_tile_default_is_64x128_on_sm90(monkeypatch, cc, env, tile):
    _pretend_gpu(monkeypatch, cc)
    if env:
        monkeypatch.setenv(fa4.ENV_GROUP_TILE, env)
    else:
        monkeypatch.delenv(fa4.ENV_GROUP_TILE, raising=False)
    assert fa4.fa4_group_tile(torch.device("cuda")) == tile
    monkeypatch.setenv(fa4.ENV_GROUP_TILE, "64")
    with pytest.raises(PagedgenError, match="PAGEDGEN_FA4_GROUP_TILE=64: expected"):
        fa4.fa4_group_tile(torch.device("cuda"))


@pytest.mark.parametrize("cc,page,env,tiles", [
    ((9, 0), 64, None, (None, (128, 64))), ((9, 0), 128, None, (None, None)),
    ((10, 0), 64, None, (None, None)), ((9, 0), 64, "fa4", (None, None)),
    ((9, 0), 16, "128x80", ((128, 80), (128, 80)))])
def test_fa4_prefill_tile_is_a_page_of_keys_over_head_size_128_on_sm90(monkeypatch, cc, page,
                                                                        env, tiles):
    """(up to 128, over 128): the default only where FA4's own tile is not one 64-key page."""
    _pretend_gpu(monkeypatch, cc)
    if env:
        monkeypatch.setenv(fa4.ENV_PREFILL_TILE, env)
    else:
        monkeypatch.delenv(fa4.ENV_PREFILL_TILE, raising=False)
    assert fa4.fa4_prefill_tiles(torch.device("cuda"), page) == tiles
    monkeypatch.setenv(fa4.ENV_PREFILL_TILE, "128")  # `pagedgen backends` shows the error
    fake_flash_attn.install(monkeypatch, "fa4")
    assert "PAGEDGEN_FA4_PREFILL_TILE=128: expected" in FlashAttnBackend.describe(
        torch.device("cuda"))


def test_fa4_prefill_and_decode_run_each_head_size_with_its_tile():
    from types import SimpleNamespace

    from pagedgen.attention.backend import LayerSpec

    seen = []

    def fwd(q, k, v, tile_mn=None, **kw):
        seen.append((q.shape[-1], tile_mn))
        return q, None, None
    mod = SimpleNamespace(interface=SimpleNamespace(_flash_attn_fwd=fwd))
    prefill, decode, _ = fa4.fa4_calls(mod, False, decode_tile=(64, 64),
                                       prefill_tiles=((64, 128), (128, 64)))
    md = SimpleNamespace(query_start_loc=None, max_query_len=1, seq_lens=None, block_tables=None)
    for d in (64, 128, 256):
        prefill(torch.zeros(1, 2, d), None, None, md, LayerSpec(2, 1, d, d ** -0.5))
        decode(torch.zeros(1, 2, d), None, None, md, LayerSpec(2, 1, d, d ** -0.5))
    assert seen == [(64, (64, 128)), (64, (64, 64)), (128, (64, 128)), (128, (64, 64)),
                    (256, (128, 64)), (256, (64, 64))]


@pytest.mark.parametrize("value", ["64", "65x128", "0x128", "big"])
def test_fa4_decode_tile_rejects_bad_values(monkeypatch, value):
    fake_flash_attn.install(monkeypatch, "fa4")
    monkeypatch.setenv(fa4.ENV_DECODE_TILE, value)
    b = make_paged_batch(0, num_heads=4, num_kv_heads=4, block_size=16)
    with pytest.raises(PagedgenError, match="PAGEDGEN_FA4_DECODE_TILE"):
        _state(b, "fa4")
    _pretend_gpu(monkeypatch)  # `pagedgen backends` shows the error instead of failing
    assert f"PAGEDGEN_FA4_DECODE_TILE={value}" in FlashAttnBackend.describe(torch.device("cuda"))


def test_fa4_cascade_suffix_kernel_rejects_bad_values(monkeypatch):
    fake_flash_attn.install(monkeypatch, "fa4")
    monkeypatch.setenv(fa4.ENV_CASCADE_SUFFIX, "cutlass")
    b = make_paged_batch(0, num_heads=4, num_kv_heads=4, block_size=16)
    with pytest.raises(PagedgenError, match="PAGEDGEN_FA4_CASCADE_SUFFIX=cutlass: expected"):
        _state(b, "fa4")


def test_decode_only_and_prefill_only_steps(monkeypatch):
    fake_flash_attn.install(monkeypatch, "fa4")
    for p, d in ((0, 5), (3, 0)):
        b = make_paged_batch(7, num_heads=4, num_kv_heads=4, block_size=16, num_prefills=p,
                             num_decodes=d)
        ref, _ = run_backend(EagerBackend, b)
        out, _ = run_backend(FlashAttnBackend, b, state=_state(b, "fa4"))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page,tile,suffix", [(16, "fa4", "triton"), (128, "fa4", "fa4"),
                                              (128, "64x128", "fa4"), (128, "fa4", "triton")])
@pytest.mark.kernels
def test_fa4_cascade_decode_matches_eager(monkeypatch, page, tile, suffix):
    """FA4's cascade calls: the batch over the shared pages (one non-causal sequence), each
    suffix (our Triton paged decode, or FA4's with the decode tile), merged by log-sum-exp (the
    Triton kernels in Triton's interpreter)."""
    from pagedgen.attention.cases import make_shared_prefix_batch
    fake_flash_attn.install(monkeypatch, "fa4")
    monkeypatch.setenv(fa4.ENV_DECODE_TILE, tile)
    monkeypatch.setenv(fa4.ENV_CASCADE_SUFFIX, suffix)
    for seed in range(2):
        b = make_shared_prefix_batch(seed, shared_pages=-(-256 // page) + seed, num_decodes=9,
                                     num_heads=8, num_kv_heads=2, block_size=page,
                                     max_suffix=page + 5)
        st = _state(b, "fa4")
        assert st.supports_cascade
        ref, _ = run_backend(EagerBackend, b)
        out, _ = run_backend(FlashAttnBackend, b, state=st)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed,suffix", [(0, "triton"), (1, "fa4"), (2, "triton"), (3, "fa4"),
                                         (3, "triton")])
@pytest.mark.kernels
def test_fa4_grouped_cascade_decode_matches_eager(monkeypatch, seed, suffix):
    """Random nested groups (rows shuffled, groups of one, pages cut mid-block): per level one
    varlen call over the sorted queries (fillers over no keys), written in place, merged with
    the suffixes (our Triton decode's split partials, or FA4's decode) by the Triton merge
    kernel (interpreter)."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_grouped_batch
    fake_flash_attn.install(monkeypatch, "fa4")
    monkeypatch.setenv(fa4.ENV_CASCADE_SUFFIX, suffix)
    monkeypatch.setenv(fa4.ENV_GROUP_TILE, "64x128" if seed % 2 else "fa4")
    monkeypatch.setattr(cl, "MIN_TOKENS", 1)
    monkeypatch.setattr(cl, "MIN_SEQS", 1)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    page = (16, 128)[seed % 2]
    b = make_grouped_batch(seed, num_decodes=(5, 12, 30, 9)[seed], num_heads=8, num_kv_heads=2,
                           block_size=page, soft_cap=20.0 if seed == 2 else None)
    md = b.metadata()
    assert md.cascade is not None
    ref, _ = run_backend(EagerBackend, b)
    out, _ = run_backend(FlashAttnBackend, b, state=_state(b, "fa4"))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # a CUDA graph's path: buffers of a bigger batch holding the segments the runner's key
    # gives a level (fewer than batch + 1), the layout copied in
    st, bs = _state(b, "fa4"), md.num_decodes + 5
    segs = cascade_segments(md.cascade, bs)
    st.make_graph_plan(bs, bs * md.block_tables.shape[1], md.cascade_levels, segs)
    gmd = st.build(padded_decodes(md, bs, b.kv_cache.shape[0], segs), graph_batch_size=bs)
    assert gmd.cascade_inputs.kv_lens.shape[1] == segs
    impl = FlashAttnBackend.get_impl_cls()(b.spec, st)
    pad = lambda t: torch.cat([t, t.new_zeros(bs - t.shape[0], *t.shape[1:])])  # noqa: E731
    out = impl.forward(pad(b.q), pad(b.k), pad(b.v), backend_cache(FlashAttnBackend, b.kv_cache),
                       gmd)[:md.num_decodes]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_separate_k_and_v_caches_and_block_ops():
    shape = FlashAttnBackend.get_kv_cache_shape(6, 16, 2, 64)
    assert shape == (2, 6, 16, 2, 64)
    cache = torch.randn(shape)
    k_cache, v_cache = cache[0], cache[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()  # [pages, page, H, D] each
    blocks = FlashAttnBackend.blocks_view(cache)
    assert torch.equal(blocks[3, 0], k_cache[3]) and torch.equal(blocks[3, 1], v_cache[3])
    before = cache.clone()
    FlashAttnBackend.copy_blocks([cache], torch.tensor([[1, 4]]))
    assert torch.equal(cache[:, 4], before[:, 1]) and torch.equal(cache[:, 0], before[:, 0])
    host = torch.zeros_like(cache)
    FlashAttnBackend.swap_blocks(cache, host, torch.tensor([[2, 5]]))
    assert torch.equal(host[:, 5], cache[:, 2]) and host[:, :5].abs().sum() == 0


def _pretend_gpu(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_page_sizes_come_from_the_flavour(monkeypatch):
    fake_flash_attn.install(monkeypatch, "fa2")
    _pretend_gpu(monkeypatch)
    assert FlashAttnBackend.unavailable_reason(torch.device("cuda")) is None
    assert "fa2" in FlashAttnBackend.describe(torch.device("cuda"))
    assert FlashAttnBackend.resolve_block_size(None) == 256
    assert FlashAttnBackend.resolve_block_size(512) == 512
    with pytest.raises(PagedgenError, match="block size 16.*256, 512"):
        FlashAttnBackend.resolve_block_size(16)


@pytest.mark.parametrize("cc,page", [((9, 0), 64), ((10, 0), 128)])
def test_fa4_page_size_is_64_on_sm90(monkeypatch, cc, page):
    fake_flash_attn.install(monkeypatch, "fa4")
    _pretend_gpu(monkeypatch, cc)
    assert FlashAttnBackend.resolve_block_size(None) == page
    assert FlashAttnBackend.resolve_block_size(128) == 128  # asked for: as asked
    assert f"page size {page}," in FlashAttnBackend.describe(torch.device("cuda"))


def test_flavour_choice_and_reasons(monkeypatch):
    fake_flash_attn.install(monkeypatch, "fa3")
    _pretend_gpu(monkeypatch, (8, 0))
    why = FlashAttnBackend.unavailable_reason(torch.device("cuda"))
    assert "fa3: runs on SM9x, not SM80" in why
    flavours.select_flavour.cache_clear()
    _pretend_gpu(monkeypatch, (9, 0))
    assert flavours.select_flavour(torch.device("cuda"))[0].name == "fa3"
    assert FlashAttnBackend.resolve_block_size(None) == 16
    flavours.select_flavour.cache_clear()
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "fa4")
    assert "fa4: flash_attn.cute is not installed" in \
        FlashAttnBackend.unavailable_reason(torch.device("cuda"))


def test_unavailable_on_cpu_says_how_to_install():
    why = FlashAttnBackend.unavailable_reason(torch.device("cpu"))
    assert why is not None and ("pagedgen[flash-attn]" in why or "needs a CUDA GPU" in why)


@pytest.mark.kernels
def test_warmup_runs_every_shape(monkeypatch):
    fake_flash_attn.install(monkeypatch, "fa4")
    b = make_paged_batch(0, num_heads=4, num_kv_heads=2, block_size=16)
    st = _state(b, "fa4")
    st.warmup(max_num_seqs=300, max_num_batched_tokens=2048, max_model_len=300)
    stats = st.compile_stats()
    assert stats["attention_warmup_s"] > 0
    assert stats["attention_kernels_compiled_later"] == 0


FAKE_QUACK_INIT = "raise AssertionError('quack.__init__ ran')\n"
FAKE_QUACK = {
    "quack/__init__.py": FAKE_QUACK_INIT,
    "quack/dsl/__init__.py": "import builtins\nbuiltins.quack_dsl_patched = True\n",
    "quack/rmsnorm.py": "import heavy_autotuner\ndef rmsnorm(x):\n    return x\n",
    "quack/softmax.py": "def softmax(x):\n    return x\n",
    "quack/cross_entropy.py": "def cross_entropy(x):\n    return x\n",
    "quack/rounding.py": "RoundingMode = 'enum'\n",
    "quack/layout_utils.py": "import quack\nVERSION = quack.__version__\n",
    "heavy_autotuner.py": "",
}


def _fake_quack(tmp_path, version: str):
    for rel, text in FAKE_QUACK.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    info = tmp_path / f"quack_kernels-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: quack-kernels\n"
                                   f"Version: {version}\n")


def _run(tmp_path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.process
def test_quack_imports_lean_for_fa4(tmp_path):
    """FA4's quack import runs quack.dsl (its CuTe patches) but not the kernels that pull in
    torch._dynamo; those resolve at first access, as quack's own attributes."""
    _fake_quack(tmp_path, "0.6.5")
    done = _run(tmp_path, """
import sys
from pagedgen.attention.fa4_import import import_quack_lean
assert import_quack_lean()
import builtins, quack
from quack import layout_utils
assert builtins.quack_dsl_patched and layout_utils.VERSION == '0.6.5'
assert 'heavy_autotuner' not in sys.modules and 'quack.rmsnorm' not in sys.modules
from quack import rmsnorm, RoundingMode
assert rmsnorm(3) == 3 and quack.rmsnorm is rmsnorm and RoundingMode == 'enum'
assert 'heavy_autotuner' in sys.modules and quack.softmax(2) == 2
assert not import_quack_lean()  # already imported
try:
    quack.nothing
except AttributeError as e:
    print(e)
""")
    assert done.returncode == 0, done.stderr
    assert "no attribute 'nothing'" in done.stdout


@pytest.mark.process
def test_other_quack_versions_import_as_they_are(tmp_path):
    _fake_quack(tmp_path, "0.7.0")
    done = _run(tmp_path, """
from pagedgen.attention.fa4_import import import_quack_lean
assert not import_quack_lean()
import quack
""")
    assert "quack.__init__ ran" in done.stderr  # the real __init__, unchanged


@pytest.mark.parametrize("seed,suffix", [(0, "triton"), (1, "fa4"), (2, "triton")])
@pytest.mark.kernels
def test_fa4_grouped_cascade_in_a_step_with_prefills_matches_eager(monkeypatch, seed, suffix):
    """Prefill chunks in front of grouped decodes: FA4's prefill call for the chunks, its
    cascade (group calls, suffixes, merge) for the decodes, together equal to eager."""
    from pagedgen.attention import cascade_layout as cl
    from pagedgen.attention.cases import make_grouped_batch, with_prefills
    fake_flash_attn.install(monkeypatch, "fa4")
    monkeypatch.setenv(fa4.ENV_CASCADE_SUFFIX, suffix)
    monkeypatch.setattr(cl, "MIN_TOKENS", 1)
    monkeypatch.setattr(cl, "MIN_SEQS", 1)
    monkeypatch.setattr(cl, "ROW_TOKENS", 0)
    b = with_prefills(make_grouped_batch(seed, num_decodes=(6, 12, 25)[seed], num_heads=8,
                                         num_kv_heads=2, block_size=16), seed, 1 + seed)
    b.mixed_cascade = True
    assert b.metadata().cascade is not None
    st = _state(b, "fa4")
    assert st.supports_mixed_cascade
    ref, ref_cache = run_backend(EagerBackend, b)
    out, cache = run_backend(FlashAttnBackend, b, state=st)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache, ref_cache)
