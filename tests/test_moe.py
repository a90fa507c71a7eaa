"""Mixture-of-experts: the grouped GEMM kernels against the per-expert loop (Triton interpreter
on the CPU), the router against transformers', the Qwen3-MoE and Mixtral families against
transformers (fp32), their checkpoint forms, -tp 2, presets and bad input."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from hf_models import make_checkpoint
from test_gemma2 import BACKENDS
from test_hf_equivalence import check_greedy_with_preemption, check_logits

from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe import align as moe_align
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe import route as moe_route
from pagedgen.runtime.layers.moe.layer import FusedMoE
from pagedgen.runtime.layers.moe.plan import CANDIDATES, INTERPRETED, MoePlan, fits, plan_moe
from pagedgen.runtime.models import registry
from pagedgen.runtime.models.hf_config import model_config
from pagedgen.runtime.models.loader import build_model, resolve_model

INTERPRETED_ONLY = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not mk.HAVE_TRITON,
    reason="Triton kernels run on CPU tensors only when interpreted")
KINDS = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return request.param, make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _experts(t: int, e: int, k: int, h: int, i: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.1).to(dtype)
    weights, chosen = moe_route.route(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, chosen


ALIGNS = [moe_align.align_reference,
          pytest.param(getattr(moe_align, "align_by_expert", None), marks=INTERPRETED_ONLY,
                       id="triton"),
          # two chunks' share at a time: the per-expert loop over chunks carries its count
          pytest.param(functools.partial(moe_align.align_by_chunks, chunk_step=2),
                       marks=INTERPRETED_ONLY, id="triton-chunks")]


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("t,e,k,h,i,block_m", [
    (1, 8, 2, 48, 40, 16),     # one token: two experts of eight get a row each
    (3, 32, 2, 64, 96, 16),    # most experts get no token
    (37, 8, 3, 40, 24, 32),    # full and partial blocks; N and K not multiples of the tiles
    (20, 16, 16, 32, 48, 16),  # every token to every expert
    (300, 128, 8, 8, 8, 64),   # more slots than one chunk of either Triton way
])
@pytest.mark.kernels
def test_align_sorts_every_slot_once_into_its_experts_blocks(t, e, k, h, i, block_m, align):
    _, _, _, _, chosen = _experts(t, e, k, h, i)
    slots, block_experts = align(chosen, e, block_m)
    n = t * k
    if align is not moe_align.align_reference:  # torch's stable sort: each run in slot order
        want, want_blocks = moe_align.align_reference(chosen, e, block_m)
        assert torch.equal(slots, want) and torch.equal(block_experts, want_blocks)
    assert block_experts.numel() == moe_align.max_blocks(n, e, block_m)
    real = slots[slots < n]
    assert sorted(real.tolist()) == list(range(n))
    flat = chosen.reshape(-1)
    for b, expert in enumerate(block_experts.tolist()):
        rows = slots[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows.long()] == expert).all()
    used = (block_experts >= 0).sum().item()
    assert used == sum(-(-int((flat == x).sum()) // block_m) for x in range(e))


@INTERPRETED_ONLY
@pytest.mark.parametrize("swap,tma", [(False, False), (True, False), (False, True)],
                         ids=["a-left", "weights-left", "weights-by-tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,k,h,i,block_m", [
    (1, 8, 2, 48, 40, 16), (3, 32, 2, 64, 96, 16), (37, 8, 3, 40, 24, 32),
    (20, 16, 16, 32, 48, 16)])
@pytest.mark.kernels
def test_grouped_gemm_kernels_equal_the_per_expert_loop(t, e, k, h, i, block_m, dtype, swap,
                                                        tma):
    """By TMA, a tile's rows past an expert's N read the next rows (masked outputs only) and
    its columns past K zeros."""
    x, w13, w2, weights, chosen = _experts(t, e, k, h, i, dtype)
    ref = mk.reference(x.float(), w13.float(), w2.float(), weights, chosen)
    tiles = mk.Tiles(block_m, 32, 32, swap=swap, tma=tma)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    got = mk.fused_experts(x, w13, w2, weights, chosen, (tiles, tiles), out)
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@INTERPRETED_ONLY
@pytest.mark.kernels
def test_a_tma_tile_on_weights_tma_cannot_load_runs_them_by_pointers():
    """A plan's TMA tile meeting experts that are not contiguous (TMA reads rows of a
    descriptor) runs as its pointer twin, with the same result."""
    x, w13, w2, weights, chosen = _experts(9, 8, 2, 40, 24)
    ref = mk.reference(x, w13, w2, weights, chosen)
    strided = torch.stack([w13, torch.zeros_like(w13)], 1).flatten(0, 1)[::2]  # every 2nd
    assert torch.equal(strided, w13) and not strided.is_contiguous()
    tiles = mk.Tiles(16, 32, 32, tma=True)
    got = mk.fused_experts(x, strided, w2, weights, chosen, (tiles, tiles))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


ROUTES = [moe_route.route_reference, pytest.param(getattr(moe_route, "route_triton", None),
                                                  marks=INTERPRETED_ONLY, id="triton")]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("experts,top_k", [(16, 4), (60, 3), (128, 8)])
@pytest.mark.kernels
def test_router_equals_transformers(route, experts, top_k):
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(3))  # programs of 8 rows
    for renorm in (True, False):
        cfg = tf.Qwen3MoeConfig(hidden_size=32, num_experts=experts, num_experts_per_tok=top_k,
                                norm_topk_prob=renorm)
        router = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(router.weight)
        _, want_w, want_ids = router(x)
        logits = x @ router.weight.t()
        got_w, got_ids = route(logits, top_k, renorm)
        assert torch.equal(got_ids.long(), want_ids)
        torch.testing.assert_close(got_w, want_w.float())
        wide = torch.cat([logits, torch.randn(37, 5)], 1)  # a merged GEMM's strided columns
        assert torch.equal(route(wide[:, :experts], top_k, renorm)[1], got_ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.kernels
def test_logits_match_transformers(checkpoint, backend):
    """Prefill in one chunk and in chunks over cached pages (test_hf_equivalence)."""
    check_logits(checkpoint[1], backend)


def _moe_kernels(eng) -> None:
    """``check_logits`` setup: the MoE layers in the grouped GEMM kernels."""
    layers = [m for m in eng.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers
    for m in layers:
        m.use_triton = True


@INTERPRETED_ONLY
@pytest.mark.kernels
def test_fused_kernels_match_transformers(checkpoint):
    """The model with its MoE layers in the grouped GEMM kernels (Triton's interpreter)."""
    check_logits(checkpoint[1], "eager", chunks=(11,), setup=_moe_kernels)


def test_greedy_generation_matches_transformers(checkpoint):
    """Prefix caching on, a cache small enough to preempt."""
    check_greedy_with_preemption(checkpoint[1])


def test_stacked_expert_tensors_load_as_the_per_expert_ones(checkpoint, tmp_path):
    """transformers 5 holds experts stacked (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]); a checkpoint written so loads to the same parameters."""
    from safetensors.torch import load_file, save_file
    kind, path = checkpoint
    names = ("gate_proj", "up_proj", "down_proj") if kind == "qwen3_moe" else ("w1", "w3", "w2")
    tensors = load_file(str(path / "model.safetensors"))
    stacked, experts = {}, {}
    for name, t in tensors.items():
        if ".experts." not in name:
            stacked[name] = t
            continue
        head, rest = name.split(".experts.")
        e, proj, _ = rest.split(".")
        experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
    for head, projs in experts.items():
        head = head.replace(".block_sparse_moe", ".mlp")  # as transformers 5 names it
        n = len(projs[names[0]])
        gate_up = [torch.cat([projs[names[0]][e], projs[names[1]][e]]) for e in range(n)]
        stacked[f"{head}.experts.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{head}.experts.down_proj"] = torch.stack([projs[names[2]][e]
                                                            for e in range(n)])
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(stacked, str(tmp_path / "model.safetensors"))
    a = build_model(resolve_model(str(path)), "safetensors", torch.float32, torch.device("cpu"))
    b = build_model(resolve_model(str(tmp_path)), "safetensors", torch.float32,
                    torch.device("cpu"))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_each_rank_holds_its_share_of_every_expert(checkpoint):
    """-tp 2: gate and up rows, down columns of each expert, cut from the checkpoint's."""
    from safetensors.torch import load_file
    kind, path = checkpoint
    ckpt = load_file(str(path / "model.safetensors"))
    block, (g, u, d) = (("mlp", ("gate_proj", "up_proj", "down_proj")) if kind == "qwen3_moe"
                        else ("block_sparse_moe", ("w1", "w3", "w2")))
    src = resolve_model(str(path))
    for rank in range(2):
        model = build_model(src, "safetensors", torch.float32, torch.device("cpu"),
                            tp=TensorParallel(rank, 2))
        moe = model.model.layers[0].mlp
        half = moe.experts.w2_weight.shape[2]
        cut = slice(rank * half, (rank + 1) * half)
        for e in (0, 3):
            base = f"model.layers.0.{block}.experts.{e}"
            assert torch.equal(moe.experts.w13_weight[e], torch.cat(
                [ckpt[f"{base}.{g}.weight"][cut], ckpt[f"{base}.{u}.weight"][cut]]))
            assert torch.equal(moe.experts.w2_weight[e], ckpt[f"{base}.{d}.weight"][:, cut])
        assert torch.equal(moe.gate.weight, ckpt[f"model.layers.0.{block}.gate.weight"])


@pytest.mark.process
def test_tp2_equals_tp1(tmp_path_factory):
    from test_tensor_parallel import assert_tp2_equals_tp1
    assert_tp2_equals_tp1([str(make_checkpoint(k, tmp_path_factory.mktemp(f"tp-{k}")))
                           for k in KINDS])


def test_a_missing_expert_tensor_is_named_as_the_checkpoint_names_it(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    kind, path = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    name = next(n for n in sorted(tensors) if ".experts.1." in n and "layers.0." in n)
    del tensors[name]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PagedgenError, match=f"missing 1 tensor.*'{name}'"):
        build_model(resolve_model(str(tmp_path)), "safetensors", torch.float32,
                    torch.device("cpu"))
    tensors[name.replace(".experts.1.", ".experts.99.")] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PagedgenError, match="unexpected tensor"):
        build_model(resolve_model(str(tmp_path)), "safetensors", torch.float32,
                    torch.device("cpu"))


@pytest.mark.parametrize("kind,fields,message", [
    ("qwen3_moe", {"shared_expert_intermediate_size": 512},
     "shared_expert_intermediate_size: shared experts are not supported"),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 8},
     r"num_experts_per_tok \(8\) exceeds the number of experts \(4\)"),
    ("mixtral", {"num_local_experts": -1}, "num_local_experts must be a non-negative"),
    ("qwen3_moe", {"mlp_only_layers": "all"}, "mlp_only_layers must be a list"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive"),
])
def test_unsupported_variants_are_one_line_errors(kind, fields, message):
    with pytest.raises(PagedgenError, match=message) as e:
        model_config({"model_type": kind, **fields}, "m/config.json")
    assert str(e.value).startswith("m/config.json: ") and "\n" not in str(e.value)


def test_tp_that_does_not_divide_the_experts_says_which_field():
    cfg = model_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
                        "num_key_value_heads": 4, "num_hidden_layers": 2,
                        "moe_intermediate_size": 30}, "c")
    with pytest.raises(ValueError, match="moe_intermediate_size 30 cannot be split over 4"):
        registry.model_class(cfg).layer_specs(cfg, 4)


def test_presets_read_as_transformers_would():
    import transformers as tf
    q = resolve_model("qwen3-30b-a3b").hf_config
    ref = tf.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            max_position_embeddings=40960, rope_theta=1e6)
    assert (q.num_local_experts, q.num_experts_per_tok, q.norm_topk_prob, q.sliding_window,
            q.mlp_only_layers) == (ref.num_experts, 8, True, None, [])
    assert q.rope_parameters == ref.rope_parameters
    m = resolve_model("mixtral-8x7b").hf_config
    ref = tf.MixtralConfig(max_position_embeddings=32768)
    assert (m.num_local_experts, m.num_experts_per_tok, m.intermediate_size, m.head_dim) == \
        (ref.num_local_experts, ref.num_experts_per_tok, ref.intermediate_size, 128)
    assert m.rope_parameters == ref.rope_parameters


def test_step_weight_bytes_counts_the_experts_a_step_is_expected_to_read():
    """Roofline bytes: one token reads exactly top-k experts per layer; many tokens all."""
    cfg = resolve_model("qwen3-30b-a3b").hf_config
    with torch.device("meta"):
        model = registry.model_class(cfg)(cfg)
    per_expert = 3 * 768 * 2048 * 4  # float32 on the meta device
    all_experts = 48 * 128 * per_expert
    one, many = model.step_weight_bytes(1), model.step_weight_bytes(100_000)
    assert many - one == pytest.approx(all_experts - 48 * 8 * per_expert)
    expected = 128 * (1 - (1 - 8 / 128) ** 16)
    assert model.step_weight_bytes(16) - one == pytest.approx(
        48 * (expected - 8) * per_expert, rel=1e-9)


def test_plan_chooses_by_token_count_and_reads_its_disk_form(monkeypatch):
    tiles = list(CANDIDATES.values())
    plan = MoePlan([(1, tiles[0], tiles[1], False), (64, tiles[2], tiles[2], True),
                    (float("inf"), tiles[4], tiles[5], False)])
    assert plan.choose(1) == (tiles[0], tiles[1]) and plan.choose(2) == (tiles[2], tiles[2])
    assert plan.choose(10_000) == (tiles[4], tiles[5])
    assert [plan.native(m) for m in (1, 2, 64, 65)] == [False, True, True, False]
    w = torch.empty(4, 8, 16)
    assert plan_moe(w, w, 2).choose(5) == (INTERPRETED, INTERPRETED)  # CPU: the interpreter's
    monkeypatch.setenv("PAGEDGEN_MOE_TILES", tiles[3].name)
    assert plan_moe(w, w, 2).choose(5) == (tiles[3], tiles[3])
    monkeypatch.setenv("PAGEDGEN_MOE_TILES", "m7")
    with pytest.raises(ValueError, match="PAGEDGEN_MOE_TILES=m7: use one of"):
        plan_moe(w, w, 2)


def test_every_block_height_has_tiles_that_fit_shared_memory():
    """The plan times only tiles whose pipeline fits (gate/up stages two B tiles); each block
    height keeps a down tile in bf16, and bf16 and fp32 keep gate/up tiles."""
    heights = {t.block_m for t in CANDIDATES.values()}
    for m in heights:
        assert any(fits(t, 2, gated=False) for t in CANDIDATES.values() if t.block_m == m)
        assert any(fits(t, 2, gated=True) for t in CANDIDATES.values() if t.block_m == m)
    assert not fits(CANDIDATES["m128n256k64g8w8s3"], 2, gated=True)
    assert any(fits(t, 4, gated=True) for t in CANDIDATES.values())


def test_fp8_experts_have_gate_up_tiles_of_128_byte_k_steps_at_prefill_heights():
    """FP8 rows are half bf16's bytes: at the block heights prefill chunks take, FP8 plans
    time tiles whose K step spans 128 bytes (as bf16's K of 64 does) and that fit shared
    memory with both gate and up B tiles, where no bf16 gate/up tile that deep fits."""
    for m in (64, 128):
        deep = [t for t in CANDIDATES.values()
                if t.block_m == m and not t.swap and t.block_k == 128]
        assert any(fits(t, 1, gated=True) for t in deep), m
        assert not any(fits(t, 2, gated=True) for t in deep), m


def test_generate_runs_a_moe_checkpoint_end_to_end(tmp_path):
    from typer.testing import CliRunner

    from pagedgen.cli.app import app
    path = make_checkpoint("qwen3_moe", tmp_path / "m", with_tokenizer=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a b c {i}"}) + "\n" for i in range(4)))
    res = CliRunner().invoke(app, ["generate", str(prompts), "--model", str(path), "--device",
                                   "cpu", "--max-tokens", "5", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    lines = (tmp_path / "p.completions.jsonl").read_text().splitlines()
    assert len(lines) == 4
    assert all(json.loads(x)["num_output_tokens"] == 5 for x in lines)


def test_kernel_plans_are_read_or_measured_once_a_process(monkeypatch, tmp_path):
    """Every MoE layer (and FP8 linear) of a shape asks for its plan: the file is read and the
    timing done once a process, even where the cache cannot be written."""
    from pagedgen.runtime import kernel_plans
    monkeypatch.setattr(kernel_plans, "_MEMORY", {})
    monkeypatch.setattr(kernel_plans, "SHIPPED", tmp_path / "none")
    monkeypatch.setattr(kernel_plans, "versions", lambda: "t|t")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    (tmp_path / "ro").write_text("")  # a file where the cache folder should be: unwritable
    measured, reads = [], []

    def read(saved):
        reads.append(saved)
        return saved

    for _ in range(3):
        plan = kernel_plans.cached("t.json", "GPU", "k", read,
                                   lambda: measured.append(1) or [7], lambda p: p)
    assert plan == [7] and len(measured) == 1 and reads == [None, None]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "rw"))
    monkeypatch.setattr(kernel_plans, "_MEMORY", {})
    kernel_plans.cached("t.json", "GPU", "k", read, lambda: [8], lambda p: p)
    monkeypatch.setattr(kernel_plans, "_MEMORY", {})  # a new process reads the file
    assert kernel_plans.cached("t.json", "GPU", "k", read, lambda: [9], lambda p: p) == [8]
    monkeypatch.setattr(kernel_plans, "versions", lambda: "t|other triton")  # measured again
    monkeypatch.setattr(kernel_plans, "_MEMORY", {})
    assert kernel_plans.cached("t.json", "GPU", "k", read, lambda: [9], lambda p: p) == [9]


def test_a_plan_timed_on_other_kernel_sources_is_timed_again(monkeypatch, tmp_path):
    """The machine's cache holds a plan for the kernels it timed: a change to a kernel's source
    (an upgrade, a new tile) gives another key, so the old plan is not taken."""
    from pagedgen.runtime import kernel_plans
    kernels = tmp_path / "layers"
    kernels.mkdir()
    (kernels / "moe_kernels.py").write_text("TILES = [64]\n")
    monkeypatch.setattr(kernel_plans, "KERNEL_SOURCES", (kernels,))
    monkeypatch.setattr(kernel_plans, "SHIPPED", tmp_path / "none")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def plan(measured: list[int]) -> list[int]:
        monkeypatch.setattr(kernel_plans, "_MEMORY", {})  # each call a new process
        kernel_plans.sources_digest.cache_clear()
        return kernel_plans.cached("t.json", "GPU", "k", lambda saved: saved,
                                   lambda: measured, lambda p: p)

    assert plan([1]) == [1]
    assert plan([2]) == [1]  # the same kernels: the cached plan
    (kernels / "moe_kernels.py").write_text("TILES = [64, 128]\n")
    assert plan([3]) == [3]
    (kernels / "fp8_kernels.py").write_text("")  # a new kernel module
    assert plan([4]) == [4]
    assert plan([5]) == [4]


def test_the_h100_plans_hold_every_shape_the_h200_plans_hold():
    """A first run on an H100 measures nothing for a preset that ships H200 plans: the H100's
    file holds every shape of the H200's, each file under the name CUDA gives its GPU."""
    from pagedgen.runtime import kernel_plans

    files = {f.name: json.loads(f.read_text()) for f in kernel_plans.SHIPPED.glob("*.json")}
    h100, h200 = files["nvidia-h100-80gb-hbm3.json"], files["nvidia-h200.json"]
    for name, data in files.items():
        assert kernel_plans.shipped_file(data["gpu"]).name == name
    for kind in ("moe-plans.json", "fp8-gemm-plans.json"):
        assert set(h200[kind]) <= set(h100[kind]), kind


def test_shipped_kernel_plans_are_taken_by_gpu_name_before_measuring(monkeypatch, tmp_path):
    """A first start on a GPU we ship plans for times nothing: the plan comes from the shipped
    file named after the GPU; another GPU measures; ``PAGEDGEN_SHIPPED_PLANS=0`` passes over
    the shipped one, and the summary says where each plan came from."""
    from pagedgen.runtime import kernel_plans
    monkeypatch.setattr(kernel_plans, "SHIPPED", tmp_path / "plans")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_plans, "versions", lambda: "t|t")
    file = kernel_plans.shipped_file("NVIDIA H200")
    assert file.name == "nvidia-h200.json"
    file.parent.mkdir()
    file.write_text(json.dumps({"gpu": "NVIDIA H200", "t.json": {"k": [5]}}))

    def plan(gpu: str) -> list[int]:
        return kernel_plans.cached("t.json", gpu, "k", lambda saved: saved, lambda: [6],
                                   lambda p: p)

    for env, gpu, want, source in ((None, "NVIDIA H200", [5], "1 shipped"),
                                   (None, "NVIDIA H100 80GB HBM3", [6], "1 measured"),
                                   ("0", "NVIDIA H200", [6], "1 measured")):
        monkeypatch.setattr(kernel_plans, "_MEMORY", {})
        monkeypatch.setattr(kernel_plans, "sources", kernel_plans.Counter())
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache-{gpu}-{env}"))
        if env:
            monkeypatch.setenv("PAGEDGEN_SHIPPED_PLANS", env)
        assert plan(gpu) == want
        assert kernel_plans.summary().startswith(source)


def test_the_shipped_kernel_plans_parse_into_plans_of_this_version():
    """Every shipped file names kernels and tiles this version has, in increasing counts (a
    change to the candidates must regenerate them: ``benchmarks/kernel_plans.py``)."""
    from pagedgen.runtime import kernel_plans
    from pagedgen.runtime.layers.moe.plan import PLAN_VERSION as MOE_VERSION
    from pagedgen.runtime.layers.moe.plan import _from_json
    from pagedgen.runtime.quantization.fp8 import gemm as fp8_gemm
    files = sorted(kernel_plans.SHIPPED.glob("*.json"))
    for file in files:
        data = json.loads(file.read_text())
        assert kernel_plans.shipped_file(data["gpu"]) == file
        for shape, saved in data.get("moe-plans.json", {}).items():
            if shape.startswith(f"{MOE_VERSION}|"):
                assert _from_json(saved) is not None, (file.name, shape)
        for shape, saved in data.get("fp8-gemm-plans.json", {}).items():
            if shape.startswith(f"{fp8_gemm.PLAN_VERSION}|"):
                assert fp8_gemm._valid(saved, list(fp8_gemm.KINDS)), (file.name, shape)


def test_every_moe_preset_finds_its_plan_in_each_shipped_file():
    """Each MoE preset's layers, as shipped and in FP8 (built on the meta device), ask for a
    plan key every shipped file holds: a change to what a key holds, or a preset added,
    regenerates the files (``benchmarks/kernel_plans.py``), or its first run times the plan
    at start-up."""
    from pagedgen.runtime import kernel_plans
    from pagedgen.runtime.layers.moe.plan import plan_key
    from pagedgen.runtime.models.loader import model_quantization, presets
    keys = set()
    for name in presets():
        src = resolve_model(name)
        cfg = src.hf_config
        if not (getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)):
            continue
        for quant in (None, "fp8"):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device("meta"):
                    model = registry.model_class(cfg)(cfg, TensorParallel(),
                                                      model_quantization(src, quant))
            finally:
                torch.set_default_dtype(default)
            for m in model.modules():
                if isinstance(m, FusedMoE):
                    m.mxfp4_small_exponents = True  # asked of loaded exponents; not in a key
                    keys.add((name, quant or "as shipped", plan_key(
                        m.w13_weight, m.top_k, m.method.scales(m), m.act_dtype, m.act,
                        m.w13_bias, m.w2_bias if m.adds_down_bias else None)))
    assert {name for name, *_ in keys} >= {"qwen3-30b-a3b", "gpt-oss-20b"}
    for file in sorted(kernel_plans.SHIPPED.glob("*.json")):
        shipped = json.loads(file.read_text()).get("moe-plans.json", {})
        missing = sorted((name, quant, key) for name, quant, key in keys if key not in shipped)
        pending = {name for name, f in PLANS_PENDING if f == file.name}
        assert not [m for m in missing if m[0] not in pending], (file.name, missing)
        # an entry goes once its plans are measured
        assert pending <= {m[0] for m in missing}, (file.name, pending)


# (preset, shipped file) whose MoE plans are not measured yet, and why: a first run on that GPU
# times the preset's MoE tiles at load (about 30 s a quantization)
PLANS_PENDING = {("gemma-4-26b-a4b", "nvidia-h200.json"):
                 "added 2026-12-07 when no H200 could be started; H100 plans shipped"}


def test_moe_layers_plan_their_kernels_at_load_not_in_the_first_step(monkeypatch, tmp_path):
    """The loader asks every MoE layer for its plan (shipped, cached or timed) before the
    engine exists, so a run's first step times nothing."""
    planned = []
    monkeypatch.setattr(FusedMoE, "plan_kernels", lambda self: planned.append(self.act_dtype))
    src = resolve_model(make_checkpoint("qwen3_moe", tmp_path / "m"))
    model = build_model(src, "safetensors", torch.bfloat16, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and planned == [torch.bfloat16] * len(layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.kernels
def test_torch_grouped_gemm_path_equals_the_per_expert_loop(dtype, top_k):
    """Prefill-sized counts may run on torch's grouped GEMM: its result equals ``reference``,
    with experts that get no token and a token count that is no multiple of anything."""
    from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm

    torch.manual_seed(top_k)
    e, h, inter, t = 8, 64, 48, 37
    w13 = (torch.randn(e, 2 * inter, h) * 0.1).to(dtype)
    w2 = (torch.randn(e, h, inter) * 0.1).to(dtype)
    x = torch.randn(t, h).to(dtype)
    weights, ids = moe_route.route_reference(torch.randn(t, e), top_k, True)
    ids[:, 0] = 3  # most slots to one expert; experts 6 and 7 get none
    ids = torch.where(ids >= 6, ids - 6, ids).int()  # as the Triton router gives them
    ref = mk.reference(x, w13, w2, weights, ids)
    out = torch.empty_like(ref)
    got = moe_grouped_mm.experts(x, w13, w2, weights, ids, out)
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("has_tma", [True, False], ids=["hopper", "before-hopper"])
def test_a_plan_times_the_tma_twin_of_each_gemms_winner_only(monkeypatch, has_tma):
    """The TMA twins are timed only for each block height's winning pointer tile of each GEMM
    (a start-up's plan grows by at most two timings a height) and taken where faster; a GPU
    without TMA times none."""
    from dataclasses import replace

    from pagedgen.runtime import kernel_plans
    from pagedgen.runtime.layers.moe import plan as moe_plan
    calls = []

    def gemm(a, w, out, slots, experts, n, tiles, a_row_div, gated, **kw):
        calls.append((tiles, gated))

    order = [t for t in CANDIDATES.values() if not t.tma]

    def graph_time(fn):  # earlier candidates faster; a twin a quarter faster than its base
        before = len(calls)
        fn()
        if len(calls) == before:
            return 1e-6  # the sort
        tiles = calls[-1][0]
        return (1 + order.index(replace(tiles, tma=False)) / 100) * (0.75 if tiles.tma else 1)

    monkeypatch.setattr(mk, "grouped_gemm", gemm)
    monkeypatch.setattr(moe_align, "align", lambda ids, experts, block_m: (None, None))
    monkeypatch.setattr(kernel_plans, "graph_time", graph_time)
    monkeypatch.setattr(moe_plan, "hopper_or_later", lambda device: has_tma)
    w13, w2 = torch.zeros(8, 64, 32), torch.zeros(8, 32, 32)
    plan = moe_plan._measure(w13, w2, 2, None, torch.float32)
    timed = {}  # (block height, gated): tiles timed
    for tiles, gated in calls:
        timed.setdefault((tiles.block_m, gated), []).append(tiles)
    twins = [t for ts in timed.values() for t in ts if t.tma]
    assert bool(twins) == has_tma
    for ts in timed.values():  # at every count, the twin of the fastest pointer tile only
        fastest = min((t for t in ts if not t.tma), key=order.index)
        assert {t for t in ts if t.tma} <= {replace(fastest, tma=True)}
    chosen = [t for _, up, down, _ in plan.choices for t in (up, down)]
    assert any(t.tma for t in chosen) == has_tma  # a quarter faster: taken where timed


def test_plan_says_where_torch_grouped_gemm_runs_and_keeps_it_on_disk():
    from pagedgen.runtime.layers.moe.plan import _from_json

    tiles = list(CANDIDATES.values())
    plan = MoePlan([(256, tiles[0], tiles[1], True), (float("inf"), tiles[2], tiles[2], False)],
                   2048)
    assert not plan.uses_grouped_mm(2047) and plan.uses_grouped_mm(2048)
    assert not MoePlan(plan.choices).uses_grouped_mm(10**6)  # never, unless measured faster
    saved = json.loads(json.dumps({"choices": [(m, u.name, d.name, a8)
                                               for m, u, d, a8 in plan.choices],
                                   "grouped_mm_from": plan.grouped_mm_from}))
    assert _from_json(saved) == plan
    assert _from_json([[256, tiles[0].name, tiles[1].name]]) is None  # the old form: remeasure
    old = {"choices": [(m, u.name, d.name) for m, u, d, _ in plan.choices],
           "grouped_mm_from": 2048}
    assert _from_json(old) is None  # version 3's choices had no FP8 flag
