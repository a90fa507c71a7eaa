"""CSV, TSV and Parquet inputs: each row a request whose columns are the fields of a JSONL
line (the prompt under ``--prompt-field``, sampling fields, an ``id``, the user's own), read by
pyarrow where it is installed (``pip install pyarrow``).

pyarrow types a CSV column from its cells (whole numbers: integers; an empty cell: null, which
leaves a field unset). A CSV cell holds text only, so a column that needs a list or an object
(``messages``, ``prompt_token_ids``, ``stop``, ``logit_bias``, a constraint) holds it as JSON;
Parquet keeps lists and structs as they are. This module maps rows to line objects; reading
and typing are pyarrow's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from pagedgen.cli.formats import structured
from pagedgen.cli.formats.request import SAMPLING_FIELDS, InputOptions
from pagedgen.errors import PagedgenError

KINDS = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet"}
ROWS_PER_BATCH = 4096


def table_kind(path: Path | None) -> str | None:
    """``csv``, ``tsv`` or ``parquet`` for such a file (by its suffix), else None."""
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
    json_columns = _json_columns(options) if kind != "parquet" else set()
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
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")


def _batches(path: Path, kind: str) -> Iterator[Any]:
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
    listed = {name for name, (types, _) in SAMPLING_FIELDS.items()
              if list in types or dict in types}
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
