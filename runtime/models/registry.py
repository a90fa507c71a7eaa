"""The model registry: each family registers itself from its own module in ``families/``.

A family names the ``model_type`` values it runs (with the defaults transformers' config class
gives each), the rules its config follows beyond those defaults (``normalize``: which layers
slide, say) and its model class (a ``CausalLM``). Adding a family is one file in ``families/``
plus its test: the registry finds the modules there the first time it is asked.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedgen.attention.backend import AttentionImpl, LayerSpec
from pagedgen.attention.metadata import AttentionMetadata


class CausalLM(Protocol):
    """What the engine needs of a model (a torch module; this rank's shard under -tp)."""

    @classmethod
    def layer_specs(cls, config: Any, tp_size: int) -> list[LayerSpec]:
        """Every layer's attention shape on one of ``tp_size`` ranks (ValueError when the
        model cannot be split that way)."""

    @classmethod
    def tensor_parallel_error(cls, config: Any, tp_size: int) -> str | None:
        """Why the model cannot be sharded over ``tp_size`` ranks, or None."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """A step's hidden states [T, hidden]."""

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits [rows, vocab] (gathered in full on every rank): float32, or where
        ``float32`` is False whatever dtype the family computes them in."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None: ...

    def setup_rotary(self, max_positions: int, device: torch.device) -> None: ...

    def bind_attention(self, impls: list[AttentionImpl]) -> None: ...

    @classmethod
    def state_specs(cls, config: Any, tp_size: int) -> list:
        """Each linear-attention layer's recurrent-state shape (``GatedDeltaSpec``; none for
        a model of attention layers only)."""

    def bind_recurrent(self, impls: list, states: list) -> None:
        """Each linear-attention layer's core and its state (``attention/recurrent``)."""

    def use_fused_kernels(self, enabled: bool) -> None: ...

    def defer_all_reduces(self) -> None: ...

    def step_weight_bytes(self, tokens: int = 1) -> int: ...


def _no_rules(fields: dict[str, Any], model_type: str, where: str) -> None:
    pass


@dataclass(frozen=True)
class ModelFamily:
    """``model_types``: each model_type this family runs → its config defaults;
    ``normalize(fields, model_type, where)``: the family's own rules on a config's fields,
    applied in place after the defaults (a PagedgenError starting with ``where`` when one is
    broken); ``model_cls``: builds the model from (config, tensor-parallel group);
    ``activations``: the ``hidden_act`` values it runs; ``partial_rotary``: whether heads may
    rotate only part of their features; ``multimodal``: the model_type of a multimodal
    checkpoint → that of its language model, whose config is the checkpoint's
    ``text_config``; ``images``: whether its model reads a multimodal checkpoint's images
    (its vision tower from ``vision_config``), else it runs the language model on text;
    ``image_prompter``: its images' prompt rules where they are not Qwen's
    (``multimodal.ImagePrompter``'s subclass)."""

    name: str
    model_types: dict[str, dict[str, Any]]
    model_cls: type
    normalize: Callable[[dict[str, Any], str, str], None] = field(default=_no_rules)
    activations: tuple[str, ...] = ("silu",)
    partial_rotary: bool = False  # runs a partial_rotary_factor below 1
    multimodal: dict[str, str] = field(default_factory=dict)
    images: bool = False
    image_prompter: type | None = None


_FAMILIES: dict[str, ModelFamily] = {}  # by model_type
_MULTIMODAL: dict[str, str] = {}  # a multimodal checkpoint's model_type → its language model's
_DISCOVERED = False


def register(family: ModelFamily) -> ModelFamily:
    """Called by a family's module when it is imported."""
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    _MULTIMODAL.update(family.multimodal)
    return family


def _discover() -> None:
    """Import every module of ``families/`` once (each registers its families)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    package = importlib.import_module(f"{__package__}.families")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def family(model_type: str) -> ModelFamily | None:
    _discover()
    return _FAMILIES.get(model_type)


def supported_model_types() -> tuple[str, ...]:
    _discover()
    return tuple(_FAMILIES)


def language_model_type(model_type: str) -> str | None:
    """The model_type of a supported multimodal checkpoint's language model, or None."""
    _discover()
    return _MULTIMODAL.get(model_type)


def takes_images(config: Any) -> bool:
    """Whether a (normalized) config's model reads images: a family that takes them, on a
    multimodal checkpoint's config (its vision tower's ``vision_config`` kept)."""
    fam = family(config.model_type)
    return bool(fam and fam.images and isinstance(getattr(config, "vision_config", None), dict))


def model_class(config: Any) -> type:
    """The CausalLM class of a (normalized) config."""
    fam = family(config.model_type)
    if fam is None:
        raise ValueError(f"model_type '{config.model_type}' is not supported (supported: "
                         f"{', '.join(supported_model_types())})")
    return fam.model_cls
