"""Claiming the output file before a run: never an input, never replaced silently, one writer
at a time, and resumed only from the same input and settings.

``OutputClaim`` runs its checks when the input has been read, before the tokenizer and the
model load, and touches nothing the user owns: it reads the output and its resume record, and
holds an exclusive lock on a hidden lock file beside the output (``.NAME.lock``, holding the
writer's process id; removed when the run ends). The lock is filelock's ``lock_descriptor``
(flock on Unix, LockFileEx on Windows) on a descriptor this module opens, not a ``FileLock``:
the file holds who writes, for a second run's message, and is checked after locking to be the
one its path names (a holder may remove it between our open and our lock). The output itself
is created or truncated by the writer at its first write, once every check that can fail
before the first step has passed. Its path is the regular file
``output_target.resolve_output`` found (a symlink's target), whose sidecar names were checked
there.

The resume record (``NAME.resume.json``, written when the output is first opened) ties the
output to its input (a SHA-256 of every input byte) and to the settings that choose the results
(model, weights, dtypes, seed, sampling defaults, input options); ``--resume`` with another
input or other settings is a one-line error saying what differs. Settings that change only
speed (backend, batch limits, page size, CUDA graphs, -tp/-dp) may change between runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

try:
    from filelock import lock_descriptor
except ImportError:  # filelock before 3.30 (an environment installed without our pins): flock
    import fcntl

    def lock_descriptor(fd: int, blocking: bool = True) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

from pagedgen.cli.formats.output_target import OutputTarget, resolve_output, sidecar
from pagedgen.errors import PagedgenError

RECORD_VERSION = 2


def record_path(output: Path) -> Path:
    return sidecar(output, "", ".resume.json")


def lock_path(output: Path) -> Path:
    return sidecar(output, ".", ".lock")


def reorder_path(output: Path) -> Path:
    """Where the final reordering writes before it replaces the output (a killed one leaves
    it; the next run that holds the lock removes it)."""
    return sidecar(output, ".", ".tmp")


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names, symlinks followed; None when it does not exist."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


class OutputLock:
    """An exclusive lock on ``.NAME.lock`` beside the output, held for the whole run. A
    second writer fails at once, naming the process that holds it. A process killed with -9
    leaves the file but not the lock (the kernel drops it), so a later run takes it over."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = lock_path(output)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (needs the output's folder to exist); PagedgenError when another
        process holds it."""
        if self._fd is not None:
            return
        for _ in range(10):  # the holder may remove the file between our open and flock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise PagedgenError(f"{self.output}: cannot lock ({self.path.name}): "
                                    f"{e.strerror or e}")
            try:
                locked = lock_descriptor(fd, blocking=False)
            except OSError as e:  # a file system without locks
                os.close(fd)
                raise PagedgenError(f"{self.output}: cannot lock ({self.path.name}): "
                                    f"{e.strerror or e}")
            if not locked:
                holder = _read_holder(fd)
                os.close(fd)
                raise PagedgenError(f"{self.output}: another pagedgen run is writing it "
                                    f"({holder}); wait for it to end, or give another --output")
            if _identity(self.path) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                break
            os.close(fd)  # locked a file its holder had just removed: take the new one
        else:
            raise PagedgenError(f"{self.output}: cannot lock ({self.path.name} keeps changing)")
        info = (f"process {os.getpid()} on {socket.gethostname()}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv[:3])}")
        os.ftruncate(fd, 0)
        os.write(fd, info.encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self._fd)  # closing drops the lock
        self._fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not said which"


class OutputClaim:
    """The checks on an output path that must pass before any work: see the module's text.

    ``output``: a regular-file target (or a path, resolved here); ``inputs``: (device, inode)
    of every input; ``fingerprint``: the inputs' SHA-256; ``settings``: what chooses the
    results (compared on ``--resume``)."""

    def __init__(self, output: OutputTarget | Path | str, inputs: list[tuple[int, int] | None],
                 fingerprint: str, settings: dict[str, Any], resume: bool,
                 overwrite: bool) -> None:
        if resume and overwrite:
            raise PagedgenError("--resume keeps the output's lines and --overwrite replaces "
                                "them: give one")
        target = output if isinstance(output, OutputTarget) else resolve_output(str(output))
        if target.path is None:
            raise PagedgenError(f"{target.given}: is {target.stream}, not a file to write and lock")
        self.given = target.given
        self.path, self.resume, self.overwrite = target.path, resume, overwrite
        self.record = {"version": RECORD_VERSION, "inputs_sha256": fingerprint,
                       "settings": settings}
        self.lock = OutputLock(self.path)
        self._check_path(inputs)
        try:
            if self.path.parent.is_dir():
                self.lock.acquire()  # else at the first write, which makes the folders
            self._check_existing()
        except BaseException:
            self.lock.release()
            raise

    def _check_path(self, inputs: list[tuple[int, int] | None]) -> None:
        path, given = self.path, self.given
        if path.is_dir():
            raise PagedgenError(f"{given}: is a directory; --output needs a file path")
        me = _identity(path)
        if me is not None and me in inputs:
            raise PagedgenError(f"{given}: is the prompts file (the same file, by a link or "
                                "another path); give another --output")
        parent = path.parent
        while not parent.exists():  # the writer creates the missing folders
            parent = parent.parent
        if not parent.is_dir():
            raise PagedgenError(f"{given}: cannot be created ({parent} is not a directory)")
        if not os.access(parent, os.W_OK | os.X_OK):  # its lock and record go beside it
            raise PagedgenError(f"{given}: cannot write beside it ({parent} is not writable)")
        if me is not None and not os.access(path, os.W_OK):
            raise PagedgenError(f"{given}: not writable")

    def _has_lines(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except OSError:
            return False

    def _check_existing(self) -> None:
        """An output with lines is kept (``--resume``, same input and settings) or replaced
        (``--overwrite``), never silently either; each error's hint works when followed."""
        if not self._has_lines() or self.overwrite:
            return
        given = self.given
        rec_path = record_path(self.path)
        try:
            old = json.loads(rec_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PagedgenError(f"{given}: already holds lines with no resume record "
                                f"({rec_path.name}), so they cannot be matched to this input; "
                                "--overwrite replaces them, or give another --output")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise PagedgenError(f"{rec_path}: unreadable resume record ({e}); --overwrite "
                                "replaces the output, or give another --output")
        why = _difference(old, self.record)
        if why:
            what = "--resume: " if self.resume else ""
            raise PagedgenError(f"{what}{given} holds completions and was made {why}; run "
                                "with what made it to finish it, --overwrite to replace it, "
                                "or give another --output")
        if not self.resume:
            raise PagedgenError(f"{given}: already holds completions of this input; --resume "
                                "finishes it, --overwrite replaces it")

    def fresh(self) -> bool:
        """Whether the writer starts an empty file (else it appends to resumed lines)."""
        return not (self.resume and self._has_lines())

    def open(self) -> None:
        """At the first write: the folders, the lock (if not taken yet) and, for a fresh
        output, the resume record (after the output is emptied, so a record never describes
        lines it did not make)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PagedgenError(f"{self.given}: cannot write: {e.strerror or e}")
        if not self.lock.held:
            self.lock.acquire()
            self._check_existing()  # another run may have written it since our checks

    def write_record(self) -> None:
        rec = record_path(self.path)
        tmp = rec.with_name(f".{rec.name}.tmp")
        try:
            tmp.write_text(json.dumps(self.record, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, rec)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise PagedgenError(f"{rec}: cannot write the resume record: {e.strerror or e}")

    def release(self) -> None:
        self.lock.release()


def _difference(old: Any, new: dict[str, Any]) -> str | None:
    """What makes record ``old`` differ from ``new``, in words; None when they match."""
    if not isinstance(old, dict) or old.get("version") != RECORD_VERSION:
        return "by another version of pagedgen"
    if old.get("inputs_sha256") != new["inputs_sha256"]:
        return "from another input (its content differs)"
    was = old.get("settings") or {}
    now = json.loads(json.dumps(new["settings"]))  # as the record reads back (string keys)
    for key in sorted(set(was) | set(now)):
        if was.get(key) != now.get(key):
            return f"with {key} = {_show(was.get(key))}, this run has {_show(now.get(key))}"
    return None


def _show(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)
