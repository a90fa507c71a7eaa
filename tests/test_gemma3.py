"""The Gemma 3 text family (runtime/models/families/gemma3.py) against transformers (fp32,
CPU): q/k norms, and local and global layers on rope of their own (the global one scaled)."""

from __future__ import annotations

import json

import pytest
from hf_models import make_checkpoint
from test_gemma2 import BACKENDS
from test_hf_equivalence import check_greedy_with_preemption, check_logits

from pagedgen.errors import PagedgenError
from pagedgen.runtime.models.hf_config import model_config


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("gemma3"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.kernels
def test_logits_match_transformers(path, backend):
    check_logits(path, backend)


def test_greedy_generation_matches_transformers(path):
    """As Gemma 2's: prefix caching on, a cache small enough to preempt."""
    check_greedy_with_preemption(path)


def test_older_config_files_read_alike(path):
    """``rope_theta`` + ``rope_scaling`` for the global layers and ``rope_local_base_freq``
    for the local ones give the same rope per layer type; ``layer_types`` defaults as
    transformers' Gemma3TextConfig fills it in."""
    import transformers as tf
    fields = json.loads((path / "config.json").read_text())
    new = model_config(fields, "config.json")
    old = {k: v for k, v in fields.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    got = model_config(old, "config.json")
    assert got.rope_parameters == new.rope_parameters
    for n in (2, 7, 12):
        got = model_config({**old, "num_hidden_layers": n}, "config.json").layer_types
        assert got == tf.Gemma3TextConfig(num_hidden_layers=n).layer_types
    with pytest.raises(PagedgenError, match="rope_parameters has no full_attention"):
        model_config({**fields, "rope_parameters": {"sliding_attention": {
            "rope_type": "default", "rope_theta": 1e4}}}, "config.json")


def test_preset_reads_as_transformers_would():
    """The gemma-3-12b preset (dummy weights): its layers and rope as transformers' config
    class gives them for the same fields."""
    from importlib.resources import files

    import transformers as tf
    import yaml

    from pagedgen.runtime.models.loader import resolve_model
    cfg = resolve_model("gemma-3-12b").hf_config
    fields = yaml.safe_load(files("pagedgen.profiles").joinpath("gemma-3-12b.yaml").read_text())
    ref = tf.Gemma3TextConfig(**{k: v for k, v in fields["model"]["config"].items()
                                 if k != "model_type"})
    assert cfg.layer_types == ref.layer_types and cfg.layer_types.count("full_attention") == 8
    assert cfg.rope_parameters == ref.rope_parameters
