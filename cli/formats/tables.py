"""CSV, TSV, Parquet and Arrow inputs: each row a request whose columns are the fields of a
JSONL line (the prompt under ``--prompt-field``, sampling fields, an ``id``, the user's own),
read by pyarrow where it is installed (``pip install pyarrow``). A Hugging Face dataset
directory is read as its files: one saved with ``Dataset.save_to_disk`` (Arrow streams, in the
order its ``state.json`` lists), or a dataset repository downloaded from the Hub (its Parquet
files, one split); the ``datasets`` library is not needed for either.

pyarrow types a CSV column from its cells (whole numbers: integers; an empty cell: null, which
leaves a field unset). A CSV cell holds text only, so a column that needs a list or an object
(``messages``, ``prompt_token_ids``, ``stop``, ``logit_bias``, a constraint) holds it as JSON;
Parquet keeps lists and structs as they are. This module maps rows to line objects; reading
and typing are pyarrow's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedgen.errors import PagedgenError, first_line
from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.inputs import structured
from pagedgen.runtime.inputs.request import SAMPLING_FIELDS, InputOptions

KINDS = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet",
         ".arrow": "arrow"}
ROWS_PER_BATCH = 4096
HUB_SHARD = re.compile(r"(.+?)-\d{5}-of-\d{5}\.parquet")  # the Hub's: train-00000-of-00001


def table_kind(path: Path | None) -> str | None:
    """``csv``, ``tsv``, ``parquet`` or ``arrow`` for such a file (by its suffix), else None."""
    return None if path is None else KINDS.get(path.suffix.lower())


def rows(path: Path, kind: str, options: InputOptions, digest) -> Iterator[tuple[int, dict]]:
    """(row number from 1, the row as a line object) of the table at ``path``; ``digest``
    takes the file's bytes (the input's fingerprint)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise PagedgenError(f"{path}: reading {kind.upper()} needs pyarrow (pip install "
                            "pyarrow), or give the prompts as JSONL") from None
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    json_columns = _json_columns(options) if kind in ("csv", "tsv") else set()
    n = 0
    try:
        for batch in _batches(path, kind):
            for row in batch.to_pylist():
                n += 1
                yield n, {k: _cell(k, v, json_columns, path, n) for k, v in row.items()
                          if v is not None}  # a null cell: the field unset
    except PagedgenError:
        raise
    except Exception as e:  # pyarrow's own errors: a damaged file, a ragged CSV row
        raise PagedgenError(f"{path}: cannot read it as {kind.upper()}"
                            f"{f' past row {n}' if n else ''}: "
                            f"{first_line(e)}")


def saved_dataset_files(path: Path) -> list[Path] | None:
    """The Arrow files of a dataset saved with ``save_to_disk`` at ``path``, in the order its
    ``state.json`` lists, or None where ``path`` holds no such dataset. A dataset of several
    splits is an error naming them."""
    splits = path / "dataset_dict.json"  # DatasetDict.save_to_disk: a directory a split
    if splits.is_file():
        names = _json(splits).get("splits") or []
        raise PagedgenError(f"{path}: a dataset of {len(names)} splits ({', '.join(names)}): "
                            f"give one, e.g. {path / (names[0] if names else 'train')}")
    state = path / "state.json"
    if not state.is_file():
        return None
    listed = _json(state).get("_data_files")
    if not isinstance(listed, list) or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in listed):
        raise PagedgenError(f"{state}: '_data_files' is not a list of {{\"filename\": ...}}")
    files = [path / f["filename"] for f in listed]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise PagedgenError(f"{state}: lists {missing[0]}, which is not there")
    return files


def hub_dataset_files(path: Path) -> list[Path]:
    """The Parquet files below ``path`` (a dataset repository from the Hub, as
    ``huggingface-cli download --repo-type dataset`` leaves it), sorted; files of several
    splits (the Hub names them ``split-00000-of-00001.parquet``) are an error naming them."""
    found = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    by_split: dict[str, list[Path]] = {}
    for p in found:  # a name of another pattern is no split's: its folder's
        m = HUB_SHARD.fullmatch(p.name)
        by_split.setdefault(str(p.parent / m.group(1)) if m else str(p.parent), []).append(p)
    if len(by_split) > 1:
        first = next((k for k in by_split if Path(k).name == "train"), next(iter(by_split)))
        raise PagedgenError(f"{path}: Parquet files of {len(by_split)} splits "
                            f"({', '.join(Path(k).name for k in by_split)}): give one as a "
                            f"glob, e.g. '{first}-*.parquet'")
    return found


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PagedgenError(f"{path}: cannot read it: {e}")
    if not isinstance(value, dict):
        raise PagedgenError(f"{path}: not a JSON object")
    return value


def _batches(path: Path, kind: str) -> Iterator[Any]:
    if kind == "arrow":  # save_to_disk writes IPC streams; an IPC file is read too
        import pyarrow as pa
        with pa.memory_map(str(path)) as source:
            try:
                stream = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:  # not a stream: an IPC file
                source.seek(0)
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
                return
            yield from stream
        return
    if kind == "parquet":
        import pyarrow.parquet as pq
        yield from pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_BATCH)
        return
    from pyarrow import csv
    yield from csv.open_csv(path, parse_options=csv.ParseOptions(
        delimiter="\t" if kind == "tsv" else ","), convert_options=csv.ConvertOptions(
        strings_can_be_null=True))


def _json_columns(options: InputOptions) -> set[str]:
    """The fields whose CSV cells hold JSON: lists and objects."""
    listed = {f.name for f in dataclasses.fields(SamplingParams) if f.name in SAMPLING_FIELDS
              and str(f.type).startswith(("list[", "dict["))}  # by the field's type
    return listed | set(structured.FIELDS) | {options.messages_field, "prompt_token_ids",
                                               "chat_template_kwargs"}


def _cell(name: str, value: Any, json_columns: set[str], path: Path, row: int) -> Any:
    if name not in json_columns or not isinstance(value, str) or \
            not value.lstrip().startswith(("[", "{")):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise PagedgenError(f"{path}: row {row}: column '{name}' holds invalid JSON ({e})")
