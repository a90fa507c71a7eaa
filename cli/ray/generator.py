"""``pagedgen.ray.Generator``: a pagedgen engine per Ray actor in a Ray Data pipeline of your
own (``pip install 'pagedgen[ray]'``)::

    import ray, pagedgen.ray
    ds = ray.data.read_json("prompts/")            # rows with the fields of a JSONL line
    out = ds.map_batches(pagedgen.ray.Generator, fn_constructor_kwargs={"model": "/ckpt"},
                         compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1,
                         batch_size=512)

Rows are read as pagedgen's JSONL lines are (``cli/formats``), so it lives with the formats;
the engine plumbing of ``pagedgen generate --ray`` is ``runtime/drivers/ray_data.py``.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from pagedgen.cli.formats import records
from pagedgen.runtime.drivers.replica import Replica
from pagedgen.runtime.engine.requests import check_request
from pagedgen.runtime.inputs.parse import RequestFile, check_requests, parse_line, tokenize_requests
from pagedgen.runtime.inputs.request import InputOptions


class Generator:
    """A callable class for ``Dataset.map_batches``: one pagedgen engine per actor.

    Takes batches of request rows (the fields of a pagedgen JSONL line: ``prompt`` |
    ``prompt_token_ids`` | ``messages``, optional ``id`` and sampling fields, fields of your
    own) and returns the output rows (the fields of an output line, ``metadata`` included; a
    field a row lacks is null). A row without ``id`` gets its position in the batch; a row
    without ``seed`` samples with one derived from its ``id`` (else its fields), so rows at the
    same position of different batches draw different numbers, the same on every rerun.
    Constructor arguments are ``pagedgen generate``'s: ``model``, ``profile``, ``engine``
    (EngineConfig fields), ``sampling`` (default SamplingParams fields), ``strict_fields``,
    ``prompt_field``, ``messages_field``.
    """

    def __init__(self, model: str | None = None, profile: str | None = None,
                 engine: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None,
                 strict_fields: bool = False, prompt_field: str = "prompt",
                 messages_field: str = "messages") -> None:
        from pagedgen.runtime.inputs.settings import engine_and_sampling

        cfg, defaults, _ = engine_and_sampling(profile, model, engine or {}, sampling or {})
        defaults.validate()
        self.options = InputOptions(prompt_field, messages_field, strict_fields)
        self.replica = Replica(cfg, defaults, records.record)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows = _rows(batch)
        reqs = [parse_line(row, i, i + 1, f"row {i}", self.options)
                for i, row in enumerate(rows)]
        for row, r in zip(rows, reqs):  # positions repeat from batch to batch; ids do not
            if not (r.overrides and "seed" in r.overrides):
                key = json.dumps(row.get("id", row), sort_keys=True, default=str)
                r.overrides = {**(r.overrides or {}), "seed": zlib.crc32(key.encode()) >> 1}
        rf = RequestFile(["batch row"], reqs, {r.id: r.index for r in reqs})
        eng = self.replica.engine
        tokenize_requests(rf, eng.tokenizer)
        check_requests(rf, lambda r: check_request(
            r.prompt_token_ids, r.sampling(self.replica.defaults), eng.max_model_len,
            eng.src.hf_config.vocab_size, eng.config.max_num_seqs))
        lines, _, _ = self.replica.run(reqs)
        keys = list(dict.fromkeys(k for line in lines for k in line))
        return {k: [line.get(k) for line in lines] for k in keys}


def _rows(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Ray Data's columns back to JSON-like rows: numpy values to Python ones; a missing field
    (null, or NaN in a number column) left out."""
    names = list(batch)
    n = len(batch[names[0]]) if names else 0
    rows = []
    for i in range(n):
        row = {}
        for k in names:
            v = _py(batch[k][i])
            if v is not None and not (isinstance(v, float) and v != v):
                row[k] = v
        rows.append(row)
    return rows


def _py(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return [_py(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _py(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_py(x) for x in v]
    return v
