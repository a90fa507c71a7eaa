"""The Gemma 4 text family (runtime/models/families/gemma4.py) against transformers (fp32,
CPU): local and global layers of two head sizes (64 and 512), values that are the keys'
projection, per-layer inputs, layers that read an earlier layer's K/V, and the MoE block beside
the dense MLP."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import make_checkpoint
from test_gemma2 import BACKENDS
from test_hf_equivalence import (
    check_greedy_with_preemption,
    check_logits,
    fused_kernels,
    hf_model,
    ids,
)

from pagedgen.attention.sdpa import SdpaBackend, SdpaImpl
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.rotary import rope_frequencies
from pagedgen.runtime.models.hf_config import model_config

VARIANTS = {
    # global layers: one KV head of 512 whose values are the keys' projection
    "k-eq-v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    # per-layer inputs, and the last two layers reading layers 1 and 2's K/V (double-wide MLPs)
    "shared-kv": dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=320,
                      num_kv_shared_layers=2, use_double_wide_mlp=True),
    # routed experts beside the dense MLP in every layer
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                attention_k_eq_v=True, num_global_key_value_heads=1),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def path(request, tmp_path_factory):
    return make_checkpoint("gemma4_text", tmp_path_factory.mktemp(request.param),
                           **VARIANTS[request.param])


@pytest.mark.parametrize("backend", ["eager", "sdpa", *BACKENDS[1:]])
@pytest.mark.kernels
def test_logits_match_transformers(path, backend):
    """Prefill whole and in chunks over cached pages (windows of 12 crossed); the Triton
    kernels (in Triton's interpreter on a CPU) at both head sizes."""
    check_logits(path, backend)


def test_greedy_generation_matches_transformers_through_preemption(path):
    """Ten pages of 8 hold every sequence only with a preemption."""
    check_greedy_with_preemption(path, num_blocks=10)


def test_samples_of_one_prompt_each_equal_a_greedy_run(path):
    """``n`` = 3 greedy samples fork from one prefill and share its pages (windows and the
    pages the shared-KV layers read included): each equals transformers' greedy output."""
    prompt = ids(20, 4)
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                              block_size=8, max_num_seqs=8, max_num_batched_tokens=64))
    seq = eng.generate([prompt], SamplingParams(n=3, max_tokens=10, temperature=0.0,
                                                ignore_eos=True))[0]
    assert [s.output_token_ids for s in seq.samples] == [ref] * 3


def test_two_kv_shapes_plan_their_own_groups_and_shared_layers_hold_no_cache(path):
    """The local layers (heads of 64) and the global ones (512) plan groups of their own kind;
    a layer that reads another's K/V has no cache of its own."""
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                              block_size=8, max_num_seqs=4, max_num_batched_tokens=64))
    cfg, runner = eng.runner.model.config, eng.runner
    owners = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    assert len(runner.kv_caches) == len(runner.specs) == owners
    kinds = [{(runner.specs[i].sliding_window, runner.specs[i].head_size) for i in g.layers}
             for g in runner.layout.groups]
    assert kinds[0] == {(None, 512)} and {(12, 64)} in kinds
    assert all(k in ({(None, 512)}, {(12, 64)}) for k in kinds)
    assert all(g.window is None for g, k in zip(runner.layout.groups, kinds) if k == {(None, 512)})


def test_window_layers_wider_than_the_global_ones_hold_just_their_window(tmp_path):
    """Gemma-4-31B's proportions (window layers 4 KV heads of 64, global ones one of 128, half
    as wide: two to a slab's page): in a budget that holds the four sequences at once only
    because the window layers keep just their window, none is preempted; with every layer
    holding every page the same bytes take more steps. Both give transformers' tokens."""
    from test_kv_groups import PARAMS, PROMPTS, reference

    path = make_checkpoint("gemma4_text", tmp_path, num_key_value_heads=4, global_head_dim=128,
                           attention_k_eq_v=True, num_global_key_value_heads=1)
    want, steps = reference(path), {}
    for groups in (True, False):
        eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                  backend="eager", block_size=8, kv_cache_memory=96 * 8 * 512 * 4,
                                  max_num_seqs=8, max_num_batched_tokens=64,
                                  kv_cache_groups=groups))
        seqs = eng.generate(PROMPTS, PARAMS)
        assert [s.output_token_ids for s in seqs] == want, groups
        steps[groups] = eng.stats.num_steps
        if groups:
            layout = eng.runner.layout
            assert layout.num_slabs == 1 and layout.groups[0].layers == (2, 5)
            assert [layout.share(i) for i in (2, 5)] == [(0, 2), (1, 2)]
            assert eng.stats.num_preemptions == 0
    assert steps[False] > steps[True]


class Sdpa256(SdpaBackend):
    """A stand-in for FA4 on a CPU: heads up to 256 (its kernels refuse wider ones), and
    kernels that read only their own cache strides."""

    name = "sdpa-256"
    reads_any_strides = False

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128, 256]

    @staticmethod
    def get_impl_cls():
        class Impl(SdpaImpl):
            def attend(self, q, k, v, kv_cache, metadata):
                assert q.shape[-1] <= 256 and kv_cache.is_contiguous()
                return super().attend(q, k, v, kv_cache, metadata)
        return Impl


def test_auto_runs_each_kv_group_on_the_best_backend_that_takes_it(tmp_path, monkeypatch):
    """With a backend before sdpa that takes heads up to 256 only, ``auto`` runs the local
    groups on it and the 512-wide global group on sdpa (which reads the other's slabs through
    views): transformers' logits, and the summary names both. Where the local layers do not
    fill their slabs' pages (narrower than the global ones), or neither backend reads the
    other's strides, one backend runs the model."""
    from pagedgen.attention import registry

    monkeypatch.setitem(registry._BACKENDS, "sdpa-256", f"{__name__}:Sdpa256")
    monkeypatch.setitem(registry._AUTO_ORDER, "cpu", ["sdpa-256", "sdpa"])
    # local layers 4 KV heads of 128, global ones 1 of 512: as wide, a slab page each
    path = make_checkpoint("gemma4_text", tmp_path / "even", head_dim=128,
                           num_key_value_heads=4, **VARIANTS["k-eq-v"])
    narrow = make_checkpoint("gemma4_text", tmp_path / "narrow", **VARIANTS["k-eq-v"])
    check_logits(path, "auto")

    def backends(p) -> Engine:
        return Engine(EngineConfig(model=str(p), device="cpu", dtype="float32", block_size=8,
                                   max_num_seqs=4, max_num_batched_tokens=64))
    runner = backends(path).runner
    on = {runner.specs[i].head_size: b.name for b, g in zip(runner.group_backends,
                                                           runner.layout.groups)
          for i in g.layers}
    assert on == {128: "sdpa-256", 512: "sdpa"} and runner.backend.name == "sdpa-256"
    assert runner.backend_name == "sdpa-256 (4 layers) + sdpa (2 layers)"
    assert backends(narrow).backend_name == "sdpa"  # local layers half a page each
    monkeypatch.setattr(SdpaBackend, "reads_any_strides", False)
    assert backends(path).backend_name == "sdpa"


def test_proportional_rope_turns_a_quarter_of_the_head_as_transformers_does():
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = tf.Gemma4TextConfig(num_hidden_layers=6, head_dim=32, global_head_dim=64)
    ref, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type="full_attention")
    ours, scale = rope_frequencies(cfg.rope_parameters["full_attention"], 64, 512)
    torch.testing.assert_close(ours, ref)
    assert scale == 1.0 and int((ours > 0).sum()) == 8  # a quarter of 64 / 2 turn


def test_published_and_transformers_written_configs_read_alike(tmp_path):
    """``global_head_dim`` + ``num_global_key_value_heads`` (the published files) and the
    ``per_layer_config`` transformers writes give the same shapes; a multimodal ``gemma4``
    file's ``text_config`` is its language model; configs it cannot run are one line."""
    path = make_checkpoint("gemma4_text", tmp_path, **VARIANTS["k-eq-v"])
    written = json.loads((path / "config.json").read_text())
    published = {k: v for k, v in written.items() if k != "per_layer_config"}
    published.update(global_head_dim=512, num_global_key_value_heads=1)
    a, b = model_config(written, "a"), model_config(published, "b")
    assert (a.global_head_dim, a.num_global_key_value_heads) == (512, 1)
    assert vars(a) == vars(b)
    nested = model_config({"model_type": "gemma4", "text_config": published,
                           "tie_word_embeddings": True}, "c")
    assert vars(nested) == vars(b)
    no_k_eq_v = model_config({**published, "attention_k_eq_v": False}, "d")
    assert no_k_eq_v.num_global_key_value_heads == no_k_eq_v.num_key_value_heads
    with pytest.raises(PagedgenError, match="num_kv_shared_layers 6"):
        model_config({**published, "num_kv_shared_layers": 6}, "e")
    with pytest.raises(PagedgenError, match="use_bidirectional_attention 'all'"):
        model_config({**published, "use_bidirectional_attention": "all"}, "f")
    with pytest.raises(PagedgenError, match="top_k_experts"):
        model_config({**published, "enable_moe_block": True, "num_experts": 2,
                      "top_k_experts": 3, "moe_intermediate_size": 8}, "g")


@pytest.mark.skipif(not fused_ops.HAVE_TRITON, reason="triton is not installed")
@pytest.mark.kernels
def test_fused_kernels_match_transformers(path):
    """Norms and rotary as the fused Triton kernels (Triton's interpreter on a CPU), a layer
    reading shared K/V rotating its queries alone."""
    check_logits(path, "eager", chunks=(11,), setup=fused_kernels)


@pytest.mark.parametrize("preset", ["gemma-4-31b", "gemma-4-26b-a4b"])
def test_presets_read_as_transformers_would(preset):
    """The preset's layers, per-layer shapes and rope as transformers' Gemma4TextConfig gives
    them for the same fields; the engine's specs follow them."""
    from importlib.resources import files

    import transformers as tf
    import yaml

    from pagedgen.runtime.models.families.gemma4 import Gemma4ForCausalLM
    from pagedgen.runtime.models.loader import resolve_model
    cfg = resolve_model(preset).hf_config
    fields = yaml.safe_load(files("pagedgen.profiles").joinpath(f"{preset}.yaml").read_text())
    ref = tf.Gemma4TextConfig(**{k: v for k, v in fields["model"]["config"].items()
                                 if k != "model_type"})
    assert cfg.layer_types == ref.layer_types and cfg.rope_parameters == ref.rope_parameters
    specs = Gemma4ForCausalLM.layer_specs(cfg)
    got = [(s.head_size, s.num_kv_heads) for s in specs]
    want = [(ref.per_layer_config[i].head_dim, ref.per_layer_config[i].num_key_value_heads)
            for i in range(ref.num_hidden_layers)]
    assert got == want and {s.sliding_window for s in specs} == {None, 1024}
    for field in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size",
                  "intermediate_size", "attention_k_eq_v"):
        assert getattr(cfg, field, None) == getattr(ref, field, None), field


@pytest.mark.process
def test_tp2_equals_tp1(tmp_path_factory):
    """Every variant sharded over 2 gloo ranks (a global layer's one KV head replicated, the
    experts' width split, per-layer inputs whole on each rank) gives one rank's logits and
    greedy tokens. Within 3e-5 (relative) rather than 1e-5: each layer sums its dense MLP's
    and its experts' partial sums apart, in another float32 order than one rank's (measured
    worst 1.1e-5 on the MoE variant)."""
    from test_tensor_parallel import assert_tp2_equals_tp1
    assert_tp2_equals_tp1([str(make_checkpoint("gemma4_text", tmp_path_factory.mktemp(name),
                                               **fields))
                           for name, fields in VARIANTS.items()], tol=3e-5)


def test_verify_checks_the_model_on_the_backends_auto_mixes(tmp_path, monkeypatch):
    """``pagedgen verify --backend auto --model-only``: where ``auto`` runs the KV groups on
    two backends (the stand-in above; "all" then adds this row), the model check names both
    and passes against the eager reference; a backend that cannot run the model's layers is
    skipped with the reason."""
    import json

    from typer.testing import CliRunner

    from pagedgen.attention import registry
    from pagedgen.cli.app import app

    monkeypatch.setitem(registry._BACKENDS, "sdpa-256", f"{__name__}:Sdpa256")
    monkeypatch.setitem(registry._AUTO_ORDER, "cpu", ["sdpa-256", "sdpa"])
    path = make_checkpoint("gemma4_text", tmp_path / "even", head_dim=128,
                           num_key_value_heads=4, **VARIANTS["k-eq-v"])
    from pagedgen.cli.verify.runner import mixes_backends, plan_backend

    assert mixes_backends(str(path), "float32", torch.device("cpu"))
    report, checks = plan_backend("sdpa-256", torch.device("cpu"), str(path), "float32", 1, 4,
                                  0, kernels=False)
    assert report.status == "skipped" and "head size 512" in report.reason and not checks
    res = CliRunner().invoke(app, ["verify", "--model", str(path), "--model-only", "--device",
                                   "cpu", "--dtype", "float32", "--steps", "4", "--json",
                                   "--backend", "auto"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index("{"):])
    auto = next(b for b in report["backends"] if b["backend"] == "auto")
    assert auto["status"] == "checked" and auto["rows"] and all(r["passed"]
                                                               for r in auto["rows"])
    assert "on sdpa-256 (4 layers) + sdpa (2 layers)" in auto["rows"][0]["group"]
