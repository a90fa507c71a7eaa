"""A model's Hugging Face config (``config.json``, or a preset's ``model.config``) as attributes,
with the defaults each family's transformers config class fills in, and rope parameters in
transformers' standardized form.

Read without transformers: its model config modules import torchvision and scikit-learn
wherever those are installed (about 6 s of a 20 s start-up on the GPU machine, for packages
pagedgen never uses). ``tests/test_hf_config.py`` checks every field here against transformers'
own config classes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.layers.rotary import ROPE_TYPES, rotary_dim
from pagedgen.runtime.models import registry

# The fields every family reads, as transformers' config classes default them; each family
# adds its own defaults (``registry.ModelFamily.model_types``).
_COMMON = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=None,
               hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False)
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


class ModelConfig(SimpleNamespace):
    """Config fields as attributes, like the transformers config class would hold them."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def to_transformers(self) -> Any:
        """The same config as transformers' own config class (for the benchmarks' peers, and
        the tests that compare the two); rope as ``rope_theta`` + ``rope_scaling``, which
        transformers 4.x and 5.x both read."""
        from transformers import AutoConfig

        fields = self.to_dict()
        rope = dict(fields.pop("rope_parameters"))
        if "rope_type" not in rope:  # one per layer type (Gemma 3): as transformers 5 reads it
            fields["rope_parameters"] = rope
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        fields["rope_theta"] = rope.pop("rope_theta")
        fields["rope_scaling"] = rope if rope["rope_type"] != "default" else None
        return AutoConfig.for_model(fields.pop("model_type"), **fields)


def model_config(fields: dict[str, Any], where: str) -> ModelConfig:
    """The complete config of a supported family from a config's own fields; ``where`` (a file)
    starts every error message."""
    model_type = fields.get("model_type")
    inner = registry.language_model_type(model_type) if isinstance(model_type, str) else None
    if inner is not None:
        fields = language_model_fields(fields, inner, where)
        model_type = inner
    supported = ", ".join(registry.supported_model_types())
    if model_type is None:
        raise PagedgenError(f"{where}: has no model_type (supported: {supported})")
    fam = registry.family(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise PagedgenError(f"{where}: model_type '{model_type}' is not supported "
                            f"(supported: {supported})")
    f = {**_COMMON, **fam.model_types[model_type], **fields}
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        check_int(f, key, where)
    if f["num_key_value_heads"] is None:
        f["num_key_value_heads"] = f["num_attention_heads"]
    if f["head_dim"] is None:
        f["head_dim"] = f["hidden_size"] // f["num_attention_heads"]
    for key in _SIZES:
        check_int(f, key, where)
    if f["hidden_act"] not in fam.activations:
        raise PagedgenError(f"{where}: hidden_act '{f['hidden_act']}' is not supported for "
                            f"{model_type} ({', '.join(fam.activations)})")
    if not isinstance(f["rms_norm_eps"], (int, float)) or f["rms_norm_eps"] <= 0:
        raise PagedgenError(f"{where}: rms_norm_eps must be a positive number")
    f["rope_parameters"] = _rope_parameters(f, where)
    fam.normalize(f, model_type, where)
    return ModelConfig(**f)


def language_model_fields(fields: dict[str, Any], model_type: str, where: str
                          ) -> dict[str, Any]:
    """A multimodal checkpoint's language-model config: its ``text_config``, with the top
    level's ``tie_word_embeddings`` unless it has its own, and the vision tower's config and
    image tokens (``vision_config``, ``image_token_id``, Gemma 4's ``boi_token_id`` and
    ``eoi_token_id``) for the families that take images."""
    text = fields.get("text_config")
    if not isinstance(text, dict):
        raise PagedgenError(f"{where}: a {fields['model_type']} config needs a text_config "
                            "mapping (its language model's config)")
    out = {**text, "model_type": model_type}
    if "tie_word_embeddings" in fields:
        out.setdefault("tie_word_embeddings", fields["tie_word_embeddings"])
    if "quantization_config" in fields:
        out.setdefault("quantization_config", fields["quantization_config"])
    for key in ("vision_config", "image_token_id", "boi_token_id", "eoi_token_id"):  # images
        if key in fields:
            out.setdefault(key, fields[key])
    return out


def check_heads(cfg: ModelConfig, where: str) -> None:
    """A PagedgenError starting with ``where`` unless the query heads fall into groups, one per
    KV head (transformers' configs take any counts; the model cannot run them)."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % kv_heads:
        raise PagedgenError(f"{where}: num_attention_heads ({heads}) must be a multiple of "
                            f"num_key_value_heads ({kv_heads}): each KV head serves a group "
                            "of query heads")


def check_int(f: dict[str, Any], key: str, where: str, zero: bool = False) -> int:
    """``f[key]``, which must be a positive integer (or 0 too, with ``zero``): else a
    PagedgenError starting with ``where`` (the families' rules use it as well)."""
    value = f[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        kind = "a non-negative" if zero else "a positive"
        raise PagedgenError(f"{where}: {key} must be {kind} integer, not {value!r}")
    return value


def _rope_parameters(f: dict[str, Any], where: str) -> dict[str, Any]:
    """transformers' standardization: ``rope_scaling`` (older files) or ``rope_parameters``,
    with ``rope_type`` and ``rope_theta`` always present; or one such mapping per layer type
    (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``)."""
    rope = f.pop("rope_scaling", None) or f.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise PagedgenError(f"{where}: rope_parameters must be a mapping, not {rope!r}")
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        per_type = {kind: _rope_parameters({**f, "rope_parameters": sub}, f"{where} ({kind})")
                    for kind, sub in rope.items()}
        f.pop("rope_theta", None)  # popped either way, as below
        return per_type
    rope = dict(rope)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "su":  # Phi-3's older name for LongRoPE
        rope["rope_type"] = "longrope"
    rope.setdefault("rope_theta", f.pop("rope_theta", 10000.0))  # popped either way
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", f.get(
            "original_max_position_embeddings", f["max_position_embeddings"]))
    if rope["rope_type"] not in ROPE_TYPES:
        raise PagedgenError(f"{where}: rope type '{rope['rope_type']}' is not supported "
                            f"(supported: {', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", f.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        fam = registry.family(f["model_type"])
        if not fam.partial_rotary:
            raise PagedgenError(f"{where}: partial rotary embeddings (partial_rotary_factor "
                                f"{partial}) are not supported for {f['model_type']}")
        if not (isinstance(partial, (int, float)) and 0 < partial <= 1
                and int(f["head_dim"] * partial) % 2 == 0):
            raise PagedgenError(f"{where}: partial_rotary_factor {partial!r} must leave an "
                                f"even number of rotated features of the {f['head_dim']}")
        rope["partial_rotary_factor"] = partial
    if rope["rope_type"] == "longrope":
        _check_longrope(rope, f, where)
    return rope


def _check_longrope(rope: dict[str, Any], f: dict[str, Any], where: str) -> None:
    """LongRoPE's factor lists: one number per rotary frequency (rotated features / 2)."""
    half = rotary_dim(rope, f["head_dim"]) // 2
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        if not isinstance(values, list) or len(values) != half or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for v in values):
            raise PagedgenError(f"{where}: rope_parameters.{key} must list {half} positive "
                                f"numbers (one per rotary frequency)")
