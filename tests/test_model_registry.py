"""The seams new capabilities plug into: the model registry (a family is one module) and the
quantization method of every linear layer."""

from __future__ import annotations

import torch

from pagedgen.runtime import quantization
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models import registry
from pagedgen.runtime.models.families.llama import LlamaForCausalLM
from pagedgen.runtime.models.hf_config import model_config
from pagedgen.runtime.quantization.unquantized import Unquantized


def test_families_register_themselves_and_bring_their_defaults(monkeypatch):
    assert set(registry.supported_model_types()) >= {"llama", "mistral", "qwen2", "qwen3"}
    assert registry.family("qwen3").model_cls is LlamaForCausalLM

    class Tiny(LlamaForCausalLM):
        pass

    fam = registry.ModelFamily("test", {"test-llama": dict(
        vocab_size=300, intermediate_size=64, num_key_value_heads=None,
        max_position_embeddings=64, bos_token_id=None, eos_token_id=None)}, Tiny)
    monkeypatch.setitem(registry._FAMILIES, "test-llama", fam)
    cfg = model_config({"model_type": "test-llama", "hidden_size": 32, "num_hidden_layers": 1,
                        "num_attention_heads": 2}, "here")
    assert cfg.intermediate_size == 64 and cfg.num_key_value_heads == 2  # defaults, then rules
    assert registry.model_class(cfg) is Tiny


class Counting(Unquantized):
    """The dense method, counting what the layers ask of it."""

    applied = 0
    processed = 0

    def apply(self, layer, x, bias, out=None):
        type(self).applied += 1
        return super().apply(layer, x, bias, out)

    def process_weights_after_loading(self, layer) -> None:
        type(self).processed += 1


def test_every_linear_layer_runs_through_its_quantization_method(monkeypatch):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(device="cpu", backend="sdpa", load_format="dummy", max_num_seqs=4)
    plain = [s.output_token_ids for s in Engine(cfg).generate([[256, 5, 6]], params)]
    monkeypatch.setitem(quantization.METHODS, "none", Counting)
    eng = Engine(cfg)
    linears = [m for m in eng.runner.model.modules() if hasattr(m, "quant_method")]
    layers = eng.src.hf_config.num_hidden_layers
    assert len(linears) == 4 * layers  # qkv, o, gate_up, down
    assert all(isinstance(m.quant_method, Counting) for m in linears)
    assert Counting.processed == len(linears)  # after loading, once each
    assert [s.output_token_ids for s in eng.generate([[256, 5, 6]], params)] == plain
    assert Counting.applied >= len(linears) * params.max_tokens  # every step, every linear
    assert isinstance(eng.runner.model.lm_head.weight, torch.nn.Parameter)  # dense, no method
