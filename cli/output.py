"""The completions file: lines appended as requests finish, put in input order at the end.

Each step's finished lines go out in one ``os.write`` (a crash or Ctrl-C loses nothing
finished). The writer remembers the byte offset of every request's line (8 bytes a request),
so the final reorder is one linear pass that copies lines in input order, never holding them in
memory, and is skipped when the file is already in order. ``--resume`` scans the file once,
drops a last line a crash cut short, and appends after it.
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from pagedgen.errors import PagedgenError


def check_output_path(path: Path) -> None:
    """Fail now (before any model loads) when ``path`` cannot be created or written; creates
    nothing."""
    if path.is_dir():
        raise PagedgenError(f"{path}: is a directory; --output needs a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PagedgenError(f"{path}: not writable")
        return
    parent = path.parent
    while not parent.exists():  # the writer creates the missing folders
        parent = parent.parent
    if not parent.is_dir():
        raise PagedgenError(f"{path}: cannot be created ({parent} is not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PagedgenError(f"{path}: cannot be created ({parent} is not writable)")


class OutputWriter:
    def __init__(self, path: Path, index_of: Mapping[Any, int], resume: bool,
                 key: str = "id") -> None:
        """``index_of``: each request id's position in the input (the final order); ``key``:
        the field of a line that holds its request's id (its first field)."""
        self.path = path
        self.index_of = index_of
        self.key = key
        self.offsets = array("q", [-1]) * len(index_of)  # input index -> line offset
        self.extra: list[int] = []  # offsets of resumed lines whose id is not in this input
        self.num_done = 0
        self.failed = False
        self._dirty = False  # the file holds lines the reorder must drop
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            end = self._scan() if resume and path.exists() else 0
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.ftruncate(self._fd, end)  # drops a cut-short last line (or the old file)
            os.lseek(self._fd, end, os.SEEK_SET)
        except OSError as e:
            raise PagedgenError(f"{path}: cannot write: {e.strerror or e}")
        self._pos = end

    def _scan(self) -> int:
        """Record the offsets of the lines already in the file; returns where its last
        complete line ends."""
        decoder = json.JSONDecoder()
        pos = 0
        with self.path.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a partial last line from an interrupted run
                rid = _line_id(raw, decoder, self.key)
                index = self.index_of.get(rid) if isinstance(rid, (str, int)) else None
                if rid is _NO_ID:
                    self._dirty = True  # not a completion line: the reorder drops it
                elif index is None:
                    self.extra.append(pos)
                elif self.offsets[index] >= 0:
                    self._dirty = True  # a second line for one request: keep the first
                else:
                    self.offsets[index] = pos
                    self.num_done += 1
                pos += len(raw)
        return pos

    def is_done(self, index: int) -> bool:
        return self.offsets[index] >= 0

    def write_lines(self, lines: list[tuple[int, str]]) -> None:
        """Append finished requests' (input index, JSON text) lines in one write. A failed
        write (disk full, ...) is a one-line error; the lines before it stay."""
        if not lines:
            return
        encoded = [(text + "\n").encode() for _, text in lines]
        data = b"".join(encoded)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            self.failed = True
            raise PagedgenError(
                f"{self.path}: cannot write: {e.strerror or e}; the {self.num_done} lines "
                "written before are kept (run again with --resume to finish)")
        for (index, _), line in zip(lines, encoded):
            self.offsets[index] = self._pos
            self._pos += len(line)
        self.num_done += len(lines)

    def close(self) -> None:
        """Close the file and put its lines in input order (skipped after a failed write: the
        file then keeps its lines in completion order, which ``--resume`` reads as well)."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if self.failed:
            return
        if not self._dirty and _increasing(self._order()):
            return  # already in input order
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with self.path.open("rb") as src, tmp.open("wb") as dst:
                for off in self._order():
                    src.seek(off)
                    dst.write(src.readline())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PagedgenError(f"{self.path}: cannot put the lines in input order: "
                                f"{e.strerror or e}; every line is there, in completion order")


    def _order(self) -> Iterator[int]:
        """Line offsets in output order: the input's, then lines of ids it does not have."""
        yield from (o for o in self.offsets if o >= 0)
        yield from self.extra


def _increasing(xs: Iterable[int]) -> bool:
    prev = -1
    for x in xs:
        if x <= prev:
            return False
        prev = x
    return True


_NO_ID = object()


def _line_id(raw: bytes, decoder: json.JSONDecoder, key: str) -> Any:
    """The id (field ``key``) of an output line, read from its start (the writer puts it first)
    without parsing the rest; the whole line is parsed only when it does not start that way."""
    text = raw.decode("utf-8", errors="replace")
    head = f'{{"{key}": '
    try:
        if text.startswith(head):
            return decoder.raw_decode(text, len(head))[0]
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _NO_ID
    return obj[key] if isinstance(obj, dict) and key in obj else _NO_ID


class ShardWriter:
    """An output directory of shards (``--ray`` with ``--output DIR/``): each write is one
    file ``part-NNNNN.jsonl``, lines in completion order, written under a temporary name and
    renamed when complete (a crash leaves whole shards only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.num_done = 0
        self._next = 0
        try:
            path.mkdir(parents=True, exist_ok=True)
            if any(path.glob("part-*.jsonl")):
                raise PagedgenError(f"{path}/: already holds shards; give an empty directory")
        except OSError as e:
            raise PagedgenError(f"{path}/: cannot write: {e.strerror or e}")

    def is_done(self, index: int) -> bool:
        return False

    def write_lines(self, lines: list[tuple[int, str]]) -> None:
        if not lines:
            return
        shard = self.path / f"part-{self._next:05d}.jsonl"
        tmp = shard.with_name("." + shard.name + ".tmp")
        try:
            tmp.write_text("".join(text + "\n" for _, text in lines), encoding="utf-8")
            os.replace(tmp, shard)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PagedgenError(f"{shard}: cannot write: {e.strerror or e}; the {self.num_done}"
                                " lines written before are kept")
        self._next += 1
        self.num_done += len(lines)

    def close(self) -> None:
        pass
