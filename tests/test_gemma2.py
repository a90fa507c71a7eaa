"""The Gemma 2 family (runtime/models/families/gemma2.py) against transformers (fp32, CPU): a
tiny random checkpoint with a 12-token window on every other layer and soft-caps that bite."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hf_models import make_checkpoint
from test_hf_equivalence import check_greedy_with_preemption, check_logits

from pagedgen.errors import PagedgenError


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint("gemma2", tmp_path_factory.mktemp("gemma2"))


BACKENDS = ["eager"] + (["triton"] if importlib.util.find_spec("triton") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.kernels
def test_logits_match_transformers(path, backend):
    """1 + w norms, four norms a layer, the embedding scale, the score scale, both soft-caps,
    alternating windows (the chunks cross them), GeGLU."""
    check_logits(path, backend)


def test_greedy_generation_matches_transformers(path):
    check_greedy_with_preemption(path)


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
