"""Reading the prompt JSONL file: one request per line, every error named by file and line.

Built for files of millions of lines: the file is streamed, each line parsed into a request
(``runtime/inputs/parse.py``, which the Python API shares: there a request keeps its token ids
as an ``array('i')``, 4 bytes a token, and prompts are tokenized in batches).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import stat
import sys
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pagedgen.cli.formats import openai_batch, tables
from pagedgen.errors import PagedgenError
from pagedgen.runtime.inputs.parse import RequestFile, parse_line
from pagedgen.runtime.inputs.request import InputOptions, Request

_BLANK = object()  # a blank line's value: no request
MAX_DEPTH = 64  # deepest nesting of lists and objects a line may hold
UTF8_BOM = b"\xef\xbb\xbf"  # skipped at the start of an input
# compressed inputs by their first bytes: gzip is read as it is; the others, each with the
# command that decompresses it to standard output
GZIP_MAGIC = b"\x1f\x8b"
OTHER_COMPRESSION = {b"\x28\xb5\x2f\xfd": ("zstd", "zstd -dc"), b"\xfd7zXZ\x00": ("xz", "xz -dc"),
                     b"BZh": ("bzip2", "bzip2 -dc")}


class InputError(PagedgenError):
    """An error of the whole input (the options it is read with), found at a line: it ends
    the run under ``--on-bad-line error`` too, never one line's record."""


@dataclass(frozen=True)
class InputSource:
    """One input to read: a file, a pipe, or standard input (``-``)."""

    name: str  # as errors show it: the path, or "<stdin>"
    path: Path | None  # None: standard input
    size: int | None  # bytes, where known (progress)
    identity: tuple[int, int] | None  # (device, inode) of what is read: never the output
    gzipped: bool = False  # a gzip file, read decompressed (its lines, not its bytes, count)

    def open(self) -> ContextManager[BinaryIO]:
        if self.path is None:
            return contextlib.nullcontext(sys.stdin.buffer)  # not closed after reading
        return gzip.open(self.path, "rb") if self.gzipped else self.path.open("rb")

    @classmethod
    def of_path(cls, path: Path) -> InputSource:
        st = path.stat()
        regular = stat.S_ISREG(st.st_mode)
        gzipped = regular and _gzipped(path)
        return cls(str(path), path, st.st_size if regular and not gzipped else None,
                   (st.st_dev, st.st_ino), gzipped)

    @classmethod
    def stdin(cls) -> InputSource:
        if sys.stdin is None or not hasattr(sys.stdin, "buffer"):
            raise PagedgenError("-: there is no standard input to read")
        try:
            st = os.fstat(sys.stdin.fileno())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return cls("<stdin>", None, None, None)  # not a file descriptor (a test's stream)
        return cls("<stdin>", None, st.st_size if stat.S_ISREG(st.st_mode) else None,
                   (st.st_dev, st.st_ino))


def _gzipped(path: Path) -> bool:
    """Whether the file at ``path`` is gzip-compressed; a file compressed otherwise is an
    error naming the command that decompresses it (one it cannot open is read, and fails,
    later)."""
    try:
        with path.open("rb") as f:
            head = f.read(6)
    except OSError:
        return False
    for magic, (name, command) in OTHER_COMPRESSION.items():
        if head.startswith(magic):
            raise PagedgenError(f"{path}: {name}-compressed (gzip is read as it is): "
                                f"decompress it, or pipe it in: {command} {path} | "
                                "pagedgen generate - -o OUTPUT")
    return head.startswith(GZIP_MAGIC)


def input_files(spec: str, note: Callable[[str], None] | None = None) -> list[InputSource]:
    """The inputs of ``spec``: ``-`` (standard input), a file (or a pipe such as
    ``/dev/stdin``; gzip-compressed or not), a directory (its ``*.jsonl``, ``*.jsonl.gz`` and
    table files, sorted, or a Hugging Face dataset's: ``tables``) or a glob pattern (its
    matches, sorted); a directory's or glob's earlier outputs are left out (``note``)."""
    if spec == "-":
        return [InputSource.stdin()]
    path = Path(spec)
    if any(c in spec for c in "*?["):
        files = sorted(p for p in Path(path.anchor or ".").glob(
            str(path.relative_to(path.anchor)) if path.anchor else spec) if p.is_file())
        files = _without_outputs(files, spec, note)
        if not files:
            raise PagedgenError(f"{spec}: no file matches")
        return [InputSource.of_path(p) for p in files]
    if path.is_dir():
        files = tables.saved_dataset_files(path)
        if files is None:
            files = _without_outputs(sorted(p for p in path.iterdir() if p.is_file() and (
                p.name.endswith((".jsonl", ".jsonl.gz")) or tables.table_kind(p))), spec, note)
        files = files or tables.hub_dataset_files(path)
        if not files:
            raise PagedgenError(f"{spec}: a directory without prompts (.jsonl, .csv, .tsv or "
                                ".parquet files, or a Hugging Face dataset)")
        return [InputSource.of_path(p) for p in files]
    if not path.exists():
        raise PagedgenError(f"{spec}: no such file")
    try:
        return [InputSource.of_path(path)]
    except OSError as e:
        raise PagedgenError(f"{spec}: cannot read: {e.strerror or e}")


def is_output_file(path: Path) -> bool:
    """Whether ``path`` is a completions file pagedgen wrote: the default output name, or a
    resume record beside it."""
    return path.name.endswith(".completions.jsonl") or \
        path.with_name(path.name + ".resume.json").is_file()


def _without_outputs(files: list[Path], spec: str, note: Callable[[str], None] | None
                     ) -> list[Path]:
    """``files`` of a directory or glob without the completions files of earlier runs (which
    would otherwise run again as prompts); ``note`` hears which it leaves out."""
    keep = [p for p in files if not is_output_file(p)]
    if len(keep) < len(files) and note is not None:
        names = [p.name for p in files if is_output_file(p)]
        note(f"{spec}: leaving out {len(names)} earlier output file(s) "
             f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return keep


def read_requests(inputs: Path | list[Path] | list[InputSource],
                  progress: Callable[[int], None] | None = None,
                  options: InputOptions = InputOptions()) -> RequestFile:
    """Parse and validate every line of ``inputs`` (in order) up front, so bad input fails
    before any work is done. The first line decides the format: an OpenAI batch line
    (``custom_id``, ``body``) or pagedgen's own; a later line of the other format is an error.
    ``progress(bytes_read)`` is called every few thousand lines."""
    inputs = [inputs] if isinstance(inputs, Path) else inputs
    sources = [s if isinstance(s, InputSource) else _source(s) for s in inputs]
    rf = RequestFile([s.name for s in sources], [], {}, sources=sources,
                     on_bad_line=options.on_bad_line)
    digest = hashlib.sha256()
    reader = _Reader(rf, options, digest, progress)
    for source, src in enumerate(sources):
        reader.read(source, src)
    if progress is not None:
        progress(reader.nbytes)
    if not rf.requests:
        one = len(rf.names) == 1
        why = ("the file is empty" if one else "the files are empty") if not reader.nbytes \
            else "only blank lines"
        raise PagedgenError(f"{rf.names[0] if one else 'the input'}: no requests ({why})")
    rf.format = reader.fmt or "pagedgen"
    rf.fingerprint = digest.hexdigest()
    return rf


def _source(path: Path) -> InputSource:
    if not path.exists() or path.is_dir():
        raise PagedgenError(f"{path}: no such file")
    return InputSource.of_path(path)


class _Reader:
    """Appends the requests of one input after another to ``rf``; the first line of the
    first input sets the format."""

    def __init__(self, rf: RequestFile, options: InputOptions, digest, progress) -> None:
        self.rf, self.options, self.digest, self.progress = rf, options, digest, progress
        self.nbytes = 0
        self.fmt: str | None = None
        self.first_where = ""

    def read(self, source: int, src: InputSource) -> None:
        kind = tables.table_kind(src.path)
        if kind is not None:  # CSV, TSV, Parquet: a request a row
            for row, obj in tables.rows(src.path, kind, self.options, self.digest):
                self._take(source, row, f"{src.name}:{row}", obj)
            self.nbytes += src.size or 0
            return
        lineno = 0
        try:
            with src.open() as f:
                for lineno, raw in enumerate(f, start=1):
                    self.digest.update(raw)
                    self.nbytes += len(raw)
                    if self.progress is not None and lineno % 4096 == 0:
                        self.progress(self.nbytes)
                    self._line(source, lineno, raw)
        except OSError as e:
            raise PagedgenError(f"{src.name}: cannot read: {e.strerror or e}")
        except (EOFError, zlib.error) as e:  # a gzip file cut short, or damaged
            past = f" past line {lineno}" if lineno else ""
            raise PagedgenError(f"{src.name}: cannot read{past}: the compressed data is cut "
                                f"short or damaged ({e})")

    def _line(self, source: int, lineno: int, raw: bytes) -> None:
        where = f"{self.rf.names[source]}:{lineno}"
        try:
            obj = _parsed(lineno, raw, where)
        except PagedgenError as e:
            self._failed(source, lineno, e, None)
            return
        if obj is not _BLANK:  # only an escape can make a lone surrogate
            self._take(source, lineno, where, obj, b"\\ud" in raw or b"\\uD" in raw)

    def _take(self, source: int, lineno: int, where: str, obj: Any,
              escapes: bool = False) -> None:
        """One line's (or row's) object as a request; ``escapes``: it may hold a lone
        surrogate."""
        try:
            if escapes:
                check_encodable(obj, where)
            self._object(source, lineno, where, obj)
        except PagedgenError as e:
            self._failed(source, lineno, e, obj)

    def _failed(self, source: int, lineno: int, e: PagedgenError, obj: Any) -> None:
        """Under ``--on-bad-line error`` a line that fails is kept as a request with its
        ``error`` (and its id, where the line gives a usable one); an error of the whole
        input (``InputError``) ends the run in either mode."""
        if self.rf.on_bad_line == "stop" or isinstance(e, InputError):
            raise e
        self._bad(source, lineno, str(e), obj)

    def _bad(self, source: int, lineno: int, message: str, obj: Any) -> None:
        rf = self.rf
        key = "custom_id" if self.fmt == "openai" else "id"
        given = obj.get(key) if isinstance(obj, dict) else None
        index = len(rf.requests)
        ident = given if isinstance(given, (str, int)) and not isinstance(given, bool) \
            and given not in rf.index_of else (f"line {lineno}" if self.fmt == "openai"
                                               else index)
        if ident in rf.index_of:  # a number another line took as its id
            ident = f"{rf.names[source]}:{lineno}"
        rf.index_of[ident] = index
        rf.requests.append(Request(index, lineno, ident, source=source, error=message))

    def _object(self, source: int, lineno: int, where: str, obj: Any) -> None:
        """One line's (or row's) object as a request of ``rf``."""
        rf = self.rf
        batch_line = openai_batch.is_batch_line(obj, self.options.prompt_fields)
        if self.fmt is None:
            self.fmt = "openai" if batch_line else "pagedgen"
            self.first_where = where
            if batch_line:
                _check_openai_options(self.options)
        elif batch_line != (self.fmt == "openai"):
            this, first = ("an OpenAI batch line", "pagedgen's") if batch_line \
                else ("not an OpenAI batch line", "an OpenAI batch")
            raise PagedgenError(f"{where}: {this}, but the input's first line "
                                f"({self.first_where}) is {first} format; one input holds one "
                                "format")
        parse = openai_batch.parse_line if self.fmt == "openai" else parse_line
        req = parse(obj, len(rf.requests), lineno, where, self.options)
        req.source = source
        first = rf.index_of.setdefault(req.id, req.index)
        if first != req.index:
            prev = rf.requests[first]
            at = f"line {prev.line}" if prev.source == source \
                else f"{rf.names[prev.source]}:{prev.line}"
            raise PagedgenError(f"{where}: duplicate id {req.id!r} (first on {at})")
        rf.requests.append(req)


def _parsed(lineno: int, raw: bytes, where: str) -> Any:
    """A line's JSON value, or ``_BLANK`` for a blank line."""
    if lineno == 1 and raw.startswith(UTF8_BOM):  # as Windows editors save UTF-8
        raw = raw[len(UTF8_BOM):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PagedgenError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start + 1} "
                            "of the line)")
    return parse_json(text, where) if text.strip() else _BLANK


def parse_json(text: str, where: str) -> Any:
    """One line's JSON value; NaN and infinities (which Python's json accepts and JSON does
    not), nesting deeper than ``MAX_DEPTH`` and over-long numbers are ``where:`` errors."""
    try:
        obj = STRICT_JSON.decode(text)
    except json.JSONDecodeError as e:
        raise PagedgenError(f"{where}: invalid JSON: {e.msg} (column {e.colno})")
    except RecursionError:
        raise PagedgenError(f"{where}: invalid JSON: nested deeper than {MAX_DEPTH} levels")
    except ValueError as e:  # _no_constant, or an integer of thousands of digits
        raise PagedgenError(f"{where}: invalid JSON: {e}")
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(obj) > MAX_DEPTH:
        raise PagedgenError(f"{where}: invalid JSON: nested deeper than {MAX_DEPTH} levels")
    return obj


def check_encodable(obj: Any, where: str) -> None:
    """A ``where:`` error for a string (value or key) that holds a lone surrogate (JSON's
    ``"\\udc80"`` escape): it is no Unicode text, so it could never be written back out."""
    stack, path = [(obj, "")], ""
    while stack:
        o, path = stack.pop()
        if isinstance(o, dict):
            for k, v in o.items():
                _encodable(k, f"{path}.{k}" if path else str(k), where, key=True)
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(o, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(o))
        elif isinstance(o, str):
            _encodable(o, path, where)


def _encodable(s: Any, path: str, where: str, key: bool = False) -> None:
    if not isinstance(s, str):
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        what = "a key" if key else "field"
        name = path.encode("utf-8", "backslashreplace").decode()
        raise PagedgenError(f"{where}: {what} '{name}' holds a lone surrogate "
                            f"({s[e.start].encode('unicode_escape').decode()}, half of a "
                            "UTF-16 pair): not Unicode text, so it cannot be written out")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (use a number or null)")


# JSON as the standard has it (no NaN, no Infinity): one decoder for every line (C scanner)
STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)


def _depth(obj: Any) -> int:
    """How deep lists and objects nest in ``obj`` (iteratively: no recursion limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def _check_openai_options(options: InputOptions) -> None:
    if options.prompt_field != "prompt" or options.messages_field != "messages":
        raise InputError("--prompt-field and --messages-field do not apply to OpenAI batch "
                            "files (their prompt is in \"body\")")
