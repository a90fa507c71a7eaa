"""The Gemma 2 family (runtime/models/families/gemma2.py) against transformers (fp32, CPU): a
tiny random checkpoint with a 12-token window on every other layer and soft-caps that bite."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hf_models import make_checkpoint
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from test_hf_equivalence import engine, hf_model, prefill_logits


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint("gemma2", tmp_path_factory.mktemp("gemma2"))


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BACKENDS = ["eager"] + (["triton"] if importlib.util.find_spec("triton") else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(path, backend):
    """Prefill in one chunk and in chunks of 11 (later chunks over cached pages, across the
    window) gives transformers' logits: 1 + w norms, four norms a layer, the embedding scale,
    the score scale, both soft-caps, alternating windows, GeGLU."""
    prompt = ids(30)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0]
    for chunk in (30, 11):
        got = prefill_logits(engine(path, backend), prompt, chunk)
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(path):
    """Greedy continuations equal transformers' generate, with prefix caching on and a cache
    small enough to preempt."""
    prompts = [ids(n, seed) for seed, n in enumerate((5, 17, 9, 26))]
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                              block_size=8, num_blocks=10, max_num_seqs=8,
                              max_num_batched_tokens=64))
    seqs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert eng.stats.num_preemptions > 0
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_token_ids == ref


def test_unsupported_variants_are_one_line_errors(path, tmp_path):
    from pagedgen.runtime.models.hf_config import model_config
    fields = json.loads((path / "config.json").read_text())
    with pytest.raises(PagedgenError, match="hidden_activation 'gelu' is not supported"):
        model_config({**fields, "hidden_activation": "gelu"}, "config.json")
    with pytest.raises(PagedgenError, match="layer_types must list"):
        model_config({**fields, "layer_types": ["full_attention"]}, "config.json")
    with pytest.raises(PagedgenError, match="query_pre_attn_scalar must be a positive"):
        model_config({**fields, "query_pre_attn_scalar": 0}, "config.json")


def test_layer_types_default_as_transformers(path):
    """Configs written before ``layer_types`` existed: every other layer slides, the first
    included, as transformers' Gemma2Config fills it in."""
    import transformers as tf
    from pagedgen.runtime.models.hf_config import model_config
    fields = json.loads((path / "config.json").read_text())
    fields.pop("layer_types")
    for n in (2, 5):
        got = model_config({**fields, "num_hidden_layers": n}, "config.json").layer_types
        assert got == tf.Gemma2Config(num_hidden_layers=n).layer_types
