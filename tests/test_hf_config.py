"""pagedgen reads model configs without transformers' model modules: every field the model uses,
and every rope type's frequencies, must equal what transformers' own config classes give."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.models.hf_config import model_config
from pagedgen.runtime.models.registry import supported_model_types

SUPPORTED_MODEL_TYPES = supported_model_types()
from pagedgen.runtime.layers.rotary import rope_frequencies
from pagedgen.runtime.models.loader import resolve_model

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
          "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
          "rope_parameters")
SMALL = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=3)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # a full-attention layer in 4
CASES = [(t, {}) for t in SUPPORTED_MODEL_TYPES] + [
    (t, {**SMALL, "num_hidden_layers": 4} if t in HYBRID else SMALL)
    for t in SUPPORTED_MODEL_TYPES] + [
    ("llama", {**SMALL, "num_key_value_heads": None, "head_dim": None, "attention_bias": True,
               "mlp_bias": True, "tie_word_embeddings": True, "eos_token_id": [5, 6]}),
    ("mistral", {**SMALL, "sliding_window": None, "head_dim": None}),
    ("qwen2", {**SMALL, "use_sliding_window": True, "sliding_window": 64,
               "max_window_layers": 1}),
    ("qwen3", {**SMALL, "use_sliding_window": True, "sliding_window": 64,
               "max_window_layers": 2, "head_dim": 64}),
    ("qwen3", {**SMALL, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
               "use_sliding_window": True, "sliding_window": 16}),
    # rope: older files (rope_theta + rope_scaling, "type" or "rope_type"), newer ones
    # (rope_parameters), and every supported type
    ("llama", {**SMALL, "rope_theta": 500000.0, "rope_scaling": LLAMA3,
               "max_position_embeddings": 131072}),
    ("llama", {**SMALL, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}),
    ("llama", {**SMALL, "rope_scaling": {"type": "linear", "factor": 4.0}}),
    ("mistral", {**SMALL, "rope_scaling": {"type": "dynamic", "factor": 3.3},
                 "max_position_embeddings": 5000}),
    ("qwen2", {**SMALL, "rope_theta": 1e6, "max_position_embeddings": 131072,
               "rope_scaling": {"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}}),
    ("qwen3", {**SMALL, "max_position_embeddings": 131072,
               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}),
    ("phi3", {**SMALL, "original_max_position_embeddings": 64, "max_position_embeddings": 512,
              "rope_scaling": {"type": "longrope",
                               "short_factor": [1.0 + i / 10 for i in range(16)],
                               "long_factor": [2.0 + i for i in range(16)]}}),
    ("phi3", {**SMALL, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                           "attention_factor": 1.2,
                                           "original_max_position_embeddings": 128,
                                           "short_factor": [1.0] * 16,
                                           "long_factor": [4.0] * 16}}),
    ("llama", {**SMALL, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "beta_fast": 16, "mscale": 0.707,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4}}),
]


def _reference(model_type: str, fields: dict):
    from transformers import AutoConfig

    return _global_values(AutoConfig.for_model(model_type, **json.loads(json.dumps(fields))))


def _global_values(cfg):
    """A config of per-layer shapes (Gemma 4) reading its global fields (the local layers'
    shape, as ours holds them; each layer's own: tests/test_gemma4.py)."""
    if hasattr(cfg, "per_layer_config"):
        cfg.allow_global_per_layer_attribute_access = True
    return cfg


def _rotary(cfg):
    """transformers' rotary module with a table per layer type (Gemma 3, Gemma 4)."""
    if cfg.model_type == "gemma4_text":
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
        return Gemma4TextRotaryEmbedding(cfg)
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    return Gemma3RotaryEmbedding(cfg)


def _windows(cfg) -> list[int | None]:
    """Each layer's sliding window, as the family's transformers modeling code applies it."""
    if cfg.model_type == "llama":
        return [None] * cfg.num_hidden_layers
    if cfg.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return [cfg.sliding_window] * cfg.num_hidden_layers
    return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]


def _activation(cfg) -> str:
    """The MLP's activation (Gemma's config classes name it ``hidden_activation``)."""
    return getattr(cfg, "hidden_act", None) or cfg.hidden_activation


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@pytest.mark.parametrize("model_type,fields", CASES)
def test_fields_equal_transformers_config_classes(model_type, fields):
    ours = model_config({"model_type": model_type, **fields}, "config.json")
    for ref in (_reference(model_type, fields), _global_values(ours.to_transformers())):
        for f in FIELDS:
            if hasattr(ref, f):  # Qwen3.5-MoE's class has no intermediate_size
                assert getattr(ours, f) == getattr(ref, f), f
        assert ours.hidden_act == _activation(ref)
        for f in ("attention_bias", "mlp_bias"):  # absent from some classes: False
            assert getattr(ours, f) == getattr(ref, f, False), f
        assert ours.head_dim == _head_dim(ref)
        assert _windows(ours) == _windows(ref)


@pytest.mark.parametrize("model_type,fields", CASES)
def test_rope_frequencies_equal_transformers(model_type, fields):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ours = model_config({"model_type": model_type, **fields}, "config.json")
    if "rope_type" not in ours.rope_parameters:  # one per layer type (Gemma 3, Gemma 4)
        ref = _rotary(_reference(model_type, fields))
        for kind in set(ours.layer_types):  # transformers builds the kinds the layers use
            rope = ours.rope_parameters[kind]
            head = ours.global_head_dim if kind == "full_attention" and hasattr(
                ours, "global_head_dim") else ours.head_dim  # Gemma 4's global heads
            inv_freq, scaling = rope_frequencies(rope, head, ours.max_position_embeddings)
            assert torch.equal(inv_freq, getattr(ref, f"{kind}_inv_freq"))
            assert scaling == getattr(ref, f"{kind}_attention_scaling")
        return
    ref = LlamaRotaryEmbedding(_reference(model_type, fields))
    inv_freq, scaling = rope_frequencies(ours.rope_parameters, ours.head_dim,
                                         ours.max_position_embeddings)
    assert torch.equal(inv_freq, ref.inv_freq)
    assert scaling == ref.attention_scaling


def test_a_saved_checkpoint_reads_as_transformers_wrote_it(tmp_path):
    from hf_models import make_checkpoint
    from transformers import AutoConfig

    for kind in SUPPORTED_MODEL_TYPES:
        path = make_checkpoint(kind, tmp_path / kind)
        ours = resolve_model(str(path)).hf_config
        ref = _global_values(AutoConfig.from_pretrained(str(path)))
        for f in FIELDS:
            if hasattr(ref, f):
                assert getattr(ours, f) == getattr(ref, f), (kind, f)
        assert ours.hidden_act == _activation(ref), kind
        assert (ours.head_dim, _windows(ours)) == (_head_dim(ref), _windows(ref))


@pytest.mark.parametrize("fields,message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_size": 64}, "has no model_type"),
    ({"model_type": "llama", "hidden_size": "big"}, "hidden_size must be a positive integer"),
    ({"model_type": "llama", "num_hidden_layers": 0}, "num_hidden_layers must be a positive"),
    ({"model_type": "qwen2", "num_key_value_heads": 2.5}, "num_key_value_heads must be"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"model_type": "llama", "rope_scaling": {"type": "magic"}},
     "rope type 'magic' is not supported"),
    ({"model_type": "llama", "rope_scaling": {"type": "longrope"}},
     "rope_parameters.short_factor must list 64 positive numbers"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial rotary"),
    ({"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["full_attention"]},
     "layer_types must list"),
    ({"model_type": "mistral", "sliding_window": -1}, "sliding_window must be"),
    ({"model_type": "llama", "rms_norm_eps": "tiny"}, "rms_norm_eps must be"),
])
def test_bad_fields_are_one_line_errors(fields, message):
    with pytest.raises(PagedgenError, match=message) as e:
        model_config(fields, "m/config.json")
    assert str(e.value).startswith("m/config.json: ") and "\n" not in str(e.value)


def test_unreadable_config_json_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PagedgenError, match="cannot read the config"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(PagedgenError, match="not a JSON object"):
        resolve_model(str(tmp_path))


def test_llama_ignores_a_sliding_window_field_as_transformers_llama_does():
    cfg = model_config({"model_type": "llama", **SMALL, "sliding_window": 8}, "config.json")
    assert _windows(cfg) == [None] * 3 and getattr(cfg, "sliding_window", None) is None


@pytest.mark.process
def test_a_preset_run_imports_neither_transformers_nor_sympy(tmp_path):
    """Start-up: transformers' model config modules import torchvision and scikit-learn where
    installed, and torch's meta-tensor helpers import sympy (seconds each); a preset with the
    byte tokenizer needs none of them."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "from pagedgen.cli.app import app\n"
            f"res = CliRunner().invoke(app, ['generate', {str(prompts)!r}, '--model', 'tiny', "
            "'--device', 'cpu', '--max-tokens', '2'])\n"
            "assert res.exit_code == 0, res.output\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', "
            "'sympy')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "p.completions.jsonl").read_text().count("\n") == 1
