"""The completions file: lines appended as requests finish, put in input order at the end.

The file is created (or emptied, with ``--overwrite``) at the first write, after every check
(``output_claim.py``), where the user's path leads (a symlink's target). Each step's finished
lines go out in one appending ``os.write`` with SIGINT and SIGTERM held (a crash or Ctrl-C loses
nothing finished and cuts no line); before each, the writer checks that its file is still the
one it writes and holds exactly what it wrote, and stops with a one-line error if another
program removed, replaced or truncated it; a write that fails (a full disk) leaves whole lines
only, its cut line cut back. The writer remembers the byte offset of every
request's line (8 bytes a request), so the final reorder is one linear pass that copies lines
in input order into a temporary file (the output's mode and owner), never holding them in
memory, and is skipped when the file is already in order. ``--resume`` parses every line once:
a whole record of this input is kept; a damaged, foreign or repeated line anywhere, or a last
line a crash cut short, is dropped and its request run again; the file is left in input order
even when nothing is left to run. A stream (``output_target.py``) gets its lines in completion
order (``StreamWriter``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pagedgen.cli.formats.output_claim import OutputClaim, OutputLock, reorder_path
from pagedgen.cli.formats.output_target import OutputTarget
from pagedgen.cli.formats.reader import STRICT_JSON
from pagedgen.errors import PagedgenError


class OutputWriter:
    """Lines appended as requests finish, into the output ``claim`` checked (its lock held).
    The file is opened at the first write, so a run that fails before its first line leaves
    an existing output as it was."""

    def __init__(self, claim: OutputClaim, index_of: Mapping[Any, int],
                 is_complete: Callable[[Any], bool], key: str = "id") -> None:
        """``index_of``: each request id's position in the input (the final order);
        ``is_complete(obj)``: whether a parsed line is a whole output record (``--resume``
        keeps only those); ``key``: the field of a line that holds its request's id (its
        first field)."""
        self.claim = claim
        self.path = claim.path
        self.given = claim.given  # as the user wrote it
        self.index_of = index_of
        self.key = key
        self.is_complete = is_complete
        self.offsets = array("q", [-1]) * len(index_of)  # input index -> line offset
        self.num_done = 0
        self.num_dropped = 0  # resumed lines that were damaged or not of this input
        self.failed = False
        self._dirty = False  # the file holds lines the reorder must drop
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None  # (device, inode) of the file written
        self._closed = False
        self._end = 0  # where the resumed file's last whole line ends
        if not claim.fresh():
            try:
                self._end = self._scan()
            except OSError as e:
                claim.release()
                raise PagedgenError(f"{self.given}: cannot read: {e.strerror or e}")
            except BaseException:
                claim.release()
                raise
        self._pos = self._end

    def _scan(self) -> int:
        """Record the offsets of the whole, valid lines already in the file; returns where
        its last line that ends in a newline ends."""
        pos = 0
        with self.path.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    self._dirty = True  # a partial last line from an interrupted run
                    break
                index = self._valid_index(raw)
                if index is None or self.offsets[index] >= 0:
                    self._dirty = True  # damaged, foreign or repeated: the reorder drops it
                    self.num_dropped += 1
                else:
                    self.offsets[index] = pos
                    self.num_done += 1
                pos += len(raw)
        return pos

    def _valid_index(self, raw: bytes) -> int | None:
        """The input index of a whole output record of this input, else None."""
        try:
            obj = STRICT_JSON.decode(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # JSON, UTF-8 and constant errors
            return None
        if not isinstance(obj, dict) or not self.is_complete(obj):
            return None
        rid = obj.get(self.key)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            return None
        return self.index_of.get(rid)

    def is_done(self, index: int) -> bool:
        return self.offsets[index] >= 0

    def _open(self) -> None:
        """Create or append (signals free: nothing here holds them): the claim's folders and
        lock, then the file (emptied unless resumed; a resumed file loses a cut-short last
        line), then the resume record. A killed reordering's leftover goes."""
        self.claim.open()
        reorder_path(self.path).unlink(missing_ok=True)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            os.ftruncate(self._fd, self._end)
            st = os.fstat(self._fd)
        except OSError as e:
            raise PagedgenError(f"{self.given}: cannot write: {e.strerror or e}")
        self._ident = (st.st_dev, st.st_ino)
        if not self._end:
            self.claim.write_record()

    def _check_intact(self) -> None:
        """PagedgenError (and no more writing) when another program removed, replaced or
        truncated the file, or wrote to it, since the last write (logrotate's copytruncate,
        an editor, ``rm``): what is in it is left as it is."""
        try:
            size = os.fstat(self._fd).st_size
            now = os.stat(self.path)
            same = (now.st_dev, now.st_ino) == self._ident
        except OSError:
            same = False
        if not same:
            self.failed = True
            raise PagedgenError(f"{self.given}: removed or replaced by another program during "
                                f"the run; stopped writing ({self.num_done} lines went to the "
                                "file it replaced): run again to redo them")
        if size != self._pos:
            self.failed = True
            raise PagedgenError(f"{self.given}: truncated or written to by another program "
                                f"during the run (it holds {size:,} bytes where this run wrote "
                                f"{self._pos:,}); stopped writing: --resume redoes what is "
                                "missing")

    def write_lines(self, lines: list[tuple[int, str]]) -> None:
        """Append finished requests' (input index, JSON text) lines in one write, with
        SIGINT and SIGTERM held until it is done (never half a line from a signal). A failed
        write (disk full, ...) is a one-line error; the whole lines before it stay, counted,
        and a line it cut short is cut from the file."""
        if not lines:
            return
        encoded = [(text + "\n").encode() for _, text in lines]
        data = b"".join(encoded)
        if self._fd is None:
            self._open()
        self._check_intact()
        try:
            write_all(self._fd, data)
        except OSError as e:
            self.failed = True
            self._keep_whole(lines, encoded, getattr(e, "written", 0))
            with contextlib.suppress(OSError):  # a cut line goes (else --resume drops it)
                if os.fstat(self._fd).st_size > self._pos:
                    os.ftruncate(self._fd, self._pos)
            raise PagedgenError(
                f"{self.given}: cannot write: {e.strerror or e}; the {self.num_done} lines "
                "written are kept (run again with --resume to finish)")
        self._keep_whole(lines, encoded, len(data))

    def _keep_whole(self, lines: list[tuple[int, str]], encoded: list[bytes],
                    written: int) -> None:
        """Count the lines of a write whose bytes all went out (its first ``written``)."""
        for (index, _), line in zip(lines, encoded[:whole_lines(encoded, written)[0]]):
            self.offsets[index] = self._pos
            self._pos += len(line)
            self.num_done += 1

    def close(self, reorder: bool = True) -> None:
        """Close the file and put its lines in input order, dropping damaged ones (skipped
        after a failed write, or with ``reorder`` False, as after Ctrl-C: the file then keeps
        its lines in completion order, which ``--resume`` puts in order); release the lock.
        A resumed file is put in order even when this run wrote nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._fd is not None:
                try:
                    if reorder and not self.failed:
                        self._check_intact()
                finally:
                    os.close(self._fd)
                    self._fd = None
            elif not (reorder and self._pos and not self.failed):
                return
            if reorder and not self.failed and self._pos and (
                    self._dirty or not _increasing(self._order())):
                self._reorder()
            elif reorder and not self.failed:
                reorder_path(self.path).unlink(missing_ok=True)  # a killed reorder's
        finally:
            self.claim.release()

    def _reorder(self) -> None:
        """The lines in input order, through a temporary file that takes the output's mode
        and owner and then replaces it (atomic: a kill leaves the output as it was)."""
        tmp = reorder_path(self.path)
        try:
            st = os.stat(self.path)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with self.path.open("rb") as src, os.fdopen(fd, "wb") as dst:
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
                if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                    try:
                        os.fchown(fd, st.st_uid, st.st_gid)
                    except PermissionError:  # not ours to give away: ours, as before
                        pass
                for off in self._order():
                    src.seek(off)
                    dst.write(src.readline())
                dst.flush()
                os.fsync(fd)
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PagedgenError(f"{self.given}: cannot put the lines in input order: "
                                f"{e.strerror or e}; every line is there, in completion order "
                                "(--resume puts them in order)")

    def resume_hint(self, total: int) -> str:
        return (f"{self.num_done} of {total} requests are in {self.given}; run again with "
                "--resume to finish")

    def _order(self) -> Iterator[int]:
        """Line offsets in input order."""
        return (o for o in self.offsets if o >= 0)


def whole_lines(encoded: list[bytes], written: int) -> tuple[int, int]:
    """How many of the lines ``encoded`` lie whole in their first ``written`` bytes, and how
    many bytes of the next went out too."""
    n = 0
    while n < len(encoded) and written >= len(encoded[n]):
        written -= len(encoded[n])
        n += 1
    return n, written


def write_all(fd: int, data: bytes) -> None:
    """``data`` to ``fd`` whole, with SIGINT and SIGTERM held until it is (never half a line
    from a signal). A failed write's OSError tells how many bytes went out first
    (``written``)."""
    with _signals_held():
        view, written = memoryview(data), 0
        while view:
            try:
                n = os.write(fd, view)
            except OSError as e:
                e.written = written
                raise
            written += n
            view = view[n:]


@contextlib.contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGHUP delivered after the block, not inside it (main thread
    only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _increasing(xs: Iterable[int]) -> bool:
    prev = -1
    for x in xs:
        if x <= prev:
            return False
        prev = x
    return True


class StreamWriter:
    """Lines to a stream (a terminal, a pipe or FIFO, standard output, a character device) in
    completion order, each step's in one write with signals held: there is no lock, no resume
    record and no reordering, as none can work on a stream (``output_target.py``)."""

    def __init__(self, target: OutputTarget) -> None:
        self.target = target
        self.path = target.given
        self.given = target.given
        self.num_done = 0
        self.num_dropped = 0
        self.failed = False
        self._fd: int | None = None

    def open(self) -> None:
        """Open now, before the model loads: a FIFO waits here for its reader."""
        if self._fd is None:
            self._fd = self.target.open_stream()

    def is_done(self, index: int) -> bool:
        return False

    def write_lines(self, lines: list[tuple[int, str]]) -> None:
        if not lines:
            return
        self.open()
        encoded = [(text + "\n").encode() for _, text in lines]
        try:
            write_all(self._fd, b"".join(encoded))
        except OSError as e:
            self.failed = True
            whole, part = whole_lines(encoded, getattr(e, "written", 0))
            raise PagedgenError(f"{self.given}: cannot write: {e.strerror or e}; "
                                f"{self.num_done + whole} whole lines were written"
                                + (", and part of the next" if part else ""))
        self.num_done += len(lines)

    def close(self, reorder: bool = True) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and fd != self.target.fd:  # standard output stays open
            os.close(fd)

    def resume_hint(self, total: int) -> str:
        return (f"{self.num_done} of {total} requests were written to {self.given} "
                f"({self.target.stream}: in completion order; a stream cannot be resumed)")


class ShardWriter:
    """An output directory of shards (``--ray`` with ``--output DIR/``): each write is one
    file ``part-NNNNN.jsonl``, lines in completion order, written under a temporary name and
    renamed when complete (a crash leaves whole shards only). The directory is made at the
    first write; a lock beside it (``.DIR.lock``) keeps a second run out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.num_done = 0
        self.num_dropped = 0  # never resumed: nothing to drop
        self._next = 0
        self.lock = OutputLock(path)
        if path.exists() and not path.is_dir():
            raise PagedgenError(f"{path}/: is a file; give a directory for shards")
        self._check_empty()
        if path.parent.is_dir():
            self.lock.acquire()

    def _check_empty(self) -> None:
        if self.path.is_dir() and any(self.path.glob("part-*.jsonl")):
            raise PagedgenError(f"{self.path}/: already holds shards; give an empty directory")

    def is_done(self, index: int) -> bool:
        return False

    def write_lines(self, lines: list[tuple[int, str]]) -> None:
        if not lines:
            return
        if not self._next:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PagedgenError(f"{self.path}/: cannot write: {e.strerror or e}")
            if not self.lock.held:
                self.lock.acquire()
                self._check_empty()
        shard = self.path / f"part-{self._next:05d}.jsonl"
        tmp = shard.with_name("." + shard.name + ".tmp")
        try:
            with _signals_held():
                tmp.write_text("".join(text + "\n" for _, text in lines), encoding="utf-8")
                os.replace(tmp, shard)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PagedgenError(f"{shard}: cannot write: {e.strerror or e}; the {self.num_done}"
                                " lines written before are kept")
        self._next += 1
        self.num_done += len(lines)

    def close(self, reorder: bool = True) -> None:
        self.lock.release()

    def resume_hint(self, total: int) -> str:
        return f"{self.num_done} of {total} requests are in shards under {self.path}/"
