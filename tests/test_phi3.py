"""The Phi-3 family (runtime/models/families/phi3.py) against transformers (fp32, CPU): a tiny
random checkpoint whose q/k/v and gate/up tensors are fused, with a 12-token window."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_models import make_checkpoint
from test_gemma2 import BACKENDS
from test_hf_equivalence import check_greedy_with_preemption, check_logits

from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.models.hf_config import model_config
from pagedgen.runtime.models.loader import build_model, resolve_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint("phi3", tmp_path_factory.mktemp("phi3"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.kernels
def test_logits_match_transformers(path, backend):
    check_logits(path, backend)


def test_greedy_generation_matches_transformers(path):
    """As Gemma 2's: prefix caching on, a cache small enough to preempt."""
    check_greedy_with_preemption(path)


def test_fused_tensors_split_by_rank(path):
    """Under -tp 2 each rank's fused qkv and gate_up hold its heads' rows of the checkpoint's
    fused tensors (q, k and v parts; gate and up halves)."""
    from safetensors.torch import load_file
    ckpt = load_file(str(path / "model.safetensors"))
    src = resolve_model(str(path))
    c = src.hf_config
    d, q, kv, inter = c.head_dim, c.num_attention_heads * c.head_dim, \
        c.num_key_value_heads * c.head_dim, c.intermediate_size
    fused = ckpt["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = ckpt["model.layers.1.mlp.gate_up_proj.weight"]
    for rank in range(2):
        model = build_model(src, "safetensors", torch.float32, torch.device("cpu"),
                            tp=TensorParallel(rank, 2))
        p = dict(model.named_parameters())
        hq, hkv, hi = q // 2, kv // 2, inter // 2
        want = torch.cat([fused[rank * hq:(rank + 1) * hq],
                          fused[q + rank * hkv:q + (rank + 1) * hkv],
                          fused[q + kv + rank * hkv:q + kv + (rank + 1) * hkv]])
        assert torch.equal(p["model.layers.1.self_attn.qkv_proj.weight"], want)
        up = inter + rank * hi
        assert torch.equal(p["model.layers.1.mlp.gate_up_proj.weight"], torch.cat(
            [gate_up[rank * hi:(rank + 1) * hi], gate_up[up:up + hi]]))
        assert d == 64


LONG = dict(original_max_position_embeddings=16, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.05 * i for i in range(32)],
    "long_factor": [1.0 + 0.9 * i for i in range(32)]})


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """Phi-3's 128k variants' rope on a 16-token original length (factor 512 / 16 = 32)."""
    return make_checkpoint("phi3", tmp_path_factory.mktemp("phi3-longrope"), **LONG)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_longrope_logits_match_transformers_within_the_original_length(longrope, backend):
    """A 14-token prompt (short factors, the attention factor on cos/sin), whole and in chunks
    over cached pages."""
    check_logits(longrope, backend, length=14, chunks=(14, 5))


def test_longrope_table_takes_the_long_factors_past_the_original_length(longrope):
    """Rows from position 16 on are transformers' long-factor cos/sin (which transformers
    uses once a sequence passes 16 tokens); rows before, its short-factor ones."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pagedgen.runtime.layers.rotary import RotaryEmbedding
    cfg = resolve_model(str(longrope)).hf_config
    ours = RotaryEmbedding(cfg, cfg.head_dim, 64, torch.device("cpu"))
    hf = Phi3RotaryEmbedding(AutoConfig.from_pretrained(str(longrope)))
    x = torch.zeros(1, 1, cfg.head_dim)
    long_cos, long_sin = hf(x, torch.arange(64)[None])  # 64 positions: the long factors
    short_cos, short_sin = hf(x, torch.arange(16)[None])
    torch.testing.assert_close(ours.cos[16:], long_cos[0, 16:])
    torch.testing.assert_close(ours.sin[16:], long_sin[0, 16:])
    torch.testing.assert_close(ours.cos[:16], short_cos[0])
    torch.testing.assert_close(ours.sin[:16], short_sin[0])
    short_all, _ = RotaryEmbedding._table(cfg.rope_parameters, cfg.head_dim,
                                          cfg.max_position_embeddings, 64, torch.device("cpu"),
                                          long=False)
    assert not torch.allclose(ours.cos[16:], short_all[16:])  # the splice took effect


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """Phi-4-mini's shape of rope: a partial rotary factor (here half of each 64-wide head)
    with LongRoPE factors for the rotated half."""
    rope = {**LONG["rope_parameters"], "short_factor": LONG["rope_parameters"]["short_factor"][:16],
            "long_factor": LONG["rope_parameters"]["long_factor"][:16],
            "partial_rotary_factor": 0.5}
    return make_checkpoint("phi3", tmp_path_factory.mktemp("phi3-partial"),
                           original_max_position_embeddings=16, rope_parameters=rope)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_partial_rotary_logits_match_transformers(partial, backend):
    check_logits(partial, backend, length=14, chunks=(5,))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors run Triton kernels only when interpreted")
@pytest.mark.kernels
def test_partial_rotary_in_the_fused_kernel_matches_transformers(partial):
    from test_hf_equivalence import fused_kernels
    check_logits(partial, "eager", length=14, chunks=(14,), setup=fused_kernels)


def test_unsupported_variants_are_one_line_errors(path):
    fields = json.loads((path / "config.json").read_text())
    with pytest.raises(PagedgenError, match="rope_parameters.long_factor must list 32 "):
        model_config({**fields, "rope_scaling": {"type": "su", "short_factor": [1.0] * 32,
                                                 "long_factor": [1.0]}}, "config.json")
    with pytest.raises(PagedgenError, match="partial_rotary_factor 0.3 must leave an even"):
        model_config({**fields, "rope_parameters": {**fields["rope_parameters"],
                                                    "partial_rotary_factor": 0.3}},
                     "config.json")  # 64 * 0.3 = 19 features
    with pytest.raises(PagedgenError, match="partial rotary embeddings .* not supported for "
                                            "llama"):
        model_config({"model_type": "llama", "partial_rotary_factor": 0.5}, "config.json")
    with pytest.raises(PagedgenError, match="sliding_window must be"):
        model_config({**fields, "sliding_window": 0}, "config.json")


def test_phi4_preset_reads_as_transformers_would():
    import transformers as tf
    cfg = resolve_model("phi-4").hf_config
    ref = tf.Phi3Config(vocab_size=100352, hidden_size=5120, intermediate_size=17920,
                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                        max_position_embeddings=16384, rope_theta=250000.0)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window) == (128, 10, None)
    assert cfg.rope_parameters == ref.rope_parameters
