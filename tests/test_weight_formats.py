"""Weight formats as a registry (``runtime/quantization/registry.py``): a checkpoint's
``quant_method`` finds its format's package, ``--quantization`` the formats that quantize at
load; a format added to ``FORMATS`` gives the layers its methods with nothing else touched;
an experts-only checkpoint format (MXFP4) keeps its experts under ``--quantization fp8``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization import registry
from pagedgen.runtime.quantization.base import WeightFormat
from pagedgen.runtime.quantization.fp8.moe import Fp8Moe
from pagedgen.runtime.quantization.fp8.scheme import Fp8
from pagedgen.runtime.quantization.mxfp4.moe import Mxfp4Moe
from pagedgen.runtime.quantization.unquantized import Unquantized, UnquantizedMoe


def config(**quantization_config: Any) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quantization_config or None)


class Toy(WeightFormat):
    """A format of the test's own: dense methods, its scheme the checkpoint's ``bits``."""

    name: ClassVar[str] = "toy"
    checkpoint_methods: ClassVar[tuple[str, ...]] = ("toy-ckpt",)

    def from_checkpoint(self, fields, where):
        return fields["bits"], tuple(fields.get("skip", ()))

    def linear_method(self, scheme):
        return Unquantized()

    def moe_method(self, scheme):
        return UnquantizedMoe()

    def describe(self, scheme):
        return f"{scheme}-bit"


def test_a_format_added_to_the_registry_serves_its_checkpoints(monkeypatch):
    monkeypatch.setattr(registry, "FORMATS", (*registry.FORMATS, Toy()))
    q = registry.quant_config(config(quant_method="toy-ckpt", bits=3, skip=["lm_head"]),
                              None, "ckpt")
    assert (q.name, q.scheme, q.describe()) == ("toy", 3, "toy: 3-bit")
    assert isinstance(q.method_for(["model.layers.0.mlp.down_proj"]), Unquantized)
    assert q.method_for(["lm_head"]) is None
    assert "toy-ckpt" in str(pytest.raises(PagedgenError, registry.quant_config,
                                           config(quant_method="awq"), None, "ckpt").value)


def test_fp8_reads_both_checkpoint_spellings_and_quantizes_at_load():
    hf = registry.quant_config(config(quant_method="fp8", weight_block_size=[128, 128]),
                               None, "ckpt")
    assert hf.name == "fp8" and hf.scheme.block == (128, 128)
    online = registry.quant_config(config(), "fp8", "ckpt")
    assert isinstance(online.method_for(["model.layers.0.self_attn.o_proj"]), Fp8)
    assert online.method_for(["lm_head"]) is None
    assert isinstance(online.moe_method_for(["model.layers.0.mlp.experts.0.up_proj"]), Fp8Moe)
    with pytest.raises(PagedgenError, match="unknown quantization 'int3'; use fp8"):
        registry.quant_config(config(), "int3", "ckpt")


def test_mxfp4_experts_stay_4_bit_and_under_fp8_the_rest_is_fp8():
    """gpt-oss's checkpoints: linear layers dense, experts MXFP4; ``--quantization fp8`` makes
    the linear layers FP8 and keeps the checkpoint's experts."""
    experts = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    attn = ["model.layers.0.self_attn.q_proj"]
    own = registry.quant_config(config(quant_method="mxfp4"), None, "ckpt")
    assert own.method_for(attn) is None and isinstance(own.moe_method_for(experts), Mxfp4Moe)
    both = registry.quant_config(config(quant_method="mxfp4"), "fp8", "ckpt")
    assert isinstance(both.method_for(attn), Fp8)
    assert isinstance(both.moe_method_for(experts), Mxfp4Moe)
    assert both.describe().startswith("fp8: ") and "experts mxfp4: e2m1" in both.describe()
    assert "in whole MXFP4 groups of 32" in registry.experts_split_error(
        config(quant_method="mxfp4"), 64, 4)
    assert registry.quant_config(config(quant_method="fp8"), "fp8", "ckpt").scheme.serialized
