"""The Phi-3 family (runtime/models/families/phi3.py) against transformers (fp32, CPU): a tiny
random checkpoint whose q/k/v and gate/up tensors are fused, with a 12-token window."""

from __future__ import annotations

import json

import pytest
import torch

from hf_models import make_checkpoint
from pagedgen.errors import PagedgenError
from pagedgen.runtime.distributed.parallel import TensorParallel
from pagedgen.runtime.models.hf_config import model_config
from pagedgen.runtime.models.loader import build_model, resolve_model
from test_gemma2 import BACKENDS
from test_hf_equivalence import check_greedy_with_preemption, check_logits


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint("phi3", tmp_path_factory.mktemp("phi3"))


@pytest.mark.parametrize("backend", BACKENDS)
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


def test_unsupported_variants_are_one_line_errors(path):
    fields = json.loads((path / "config.json").read_text())
    with pytest.raises(PagedgenError, match="rope type 'longrope' is not supported"):
        model_config({**fields, "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                                                 "long_factor": [1.0]}}, "config.json")
    with pytest.raises(PagedgenError, match="partial rotary"):
        model_config({**fields, "rope_parameters": {**fields["rope_parameters"],
                                                    "partial_rotary_factor": 0.75}},
                     "config.json")  # Phi-4-mini's: transformers 5 keeps it in the rope
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
