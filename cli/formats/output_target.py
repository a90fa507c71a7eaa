"""What ``--output`` names: a regular file (reached through any symlinks) or a stream.

A regular file is written where the user's path leads: a symlink's target, with its mode and
owner kept; every file pagedgen keeps beside it (lock, resume record, temporary file) is named
after the target and checked against the file system's name limit before anything is opened.
Anything else (a terminal, a pipe or FIFO, a character device such as ``/dev/null``, this
process's standard output, ``-``) is a stream: lines go out in completion order as they finish,
with no lock, no resume record and no reordering pass, since none of those can work there.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedgen.errors import PagedgenError

# the names pagedgen keeps beside an output NAME, as (prefix, suffix)
SIDECARS = ((".", ".lock"), ("", ".resume.json"), (".", ".resume.json.tmp"), (".", ".tmp"))


@dataclass(frozen=True)
class OutputTarget:
    """``given``: the path as the user wrote it (for messages); ``path``: the regular file
    written (symlinks resolved), or None for a stream; ``stream``: the stream's kind in words
    (None for a file); ``fd``: a stream already open (standard output), else None."""

    given: str
    path: Path | None
    stream: str | None = None
    fd: int | None = None

    @property
    def is_stream(self) -> bool:
        return self.stream is not None

    def open_stream(self) -> int:
        """The stream's file descriptor, opened now (a FIFO waits here for its reader, with
        signals free: Ctrl-C ends the wait)."""
        if self.fd is not None:
            return self.fd
        try:
            return os.open(self.given, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise PagedgenError(f"{self.given}: cannot write: {e.strerror or e}")


def _same_file(st: os.stat_result, fd: int) -> bool:
    try:
        other = os.fstat(fd)
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _stdout_fd() -> int:
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a test's captured stream
        return 1


def resolve_output(given: str) -> OutputTarget:
    """What ``given`` names, checked before anything is opened (see the module's text)."""
    if given == "":
        raise PagedgenError("--output is empty: give a file path (or - for standard output)")
    if given == "-":
        return OutputTarget(given, None, "standard output", _stdout_fd())
    try:
        st = os.stat(given)
    except (FileNotFoundError, NotADirectoryError):  # the claim says why it cannot be made
        st = None
    except OSError as e:
        raise PagedgenError(f"{given}: cannot use as --output: {e.strerror or e}")
    if st is not None and _same_file(st, _stdout_fd()):
        return OutputTarget(given, None, "standard output", _stdout_fd())
    if st is not None and _same_file(st, 2):
        raise PagedgenError(f"{given}: is this process's standard error, where its messages "
                            "go; give a file, or - for standard output")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise PagedgenError(f"{given}: is a directory; --output needs a file path")
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a terminal" if _is_tty(given) else "a character device"
                if stat.S_ISCHR(st.st_mode) else "not a regular file")
        if stat.S_ISSOCK(st.st_mode) or stat.S_ISBLK(st.st_mode):
            raise PagedgenError(f"{given}: is {kind}; give a file, a FIFO or a terminal")
        return OutputTarget(given, None, kind)
    path = Path(os.path.realpath(given))  # through symlinks, dangling ones too
    check_names(path, given)
    return OutputTarget(given, path)


def _is_tty(path: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.isatty(fd)
    finally:
        os.close(fd)


def check_names(path: Path, given: str) -> None:
    """A one-line error when the output's name, or a name pagedgen keeps beside it, is too
    long for the file system (checked on the nearest folder that exists)."""
    folder = path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
        path_max = os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    name = os.fsencode(path.name)
    longest = max(len(prefix) + len(name) + len(suffix) for prefix, suffix in SIDECARS)
    if longest > name_max:
        raise PagedgenError(f"{given}: the name is too long for the files kept beside it "
                            f"(up to {longest} bytes with '.resume.json.tmp'; this file system "
                            f"takes {name_max}): give a shorter --output")
    if len(os.fsencode(str(path))) + longest - len(name) >= path_max:
        raise PagedgenError(f"{given}: the path is too long for this file system "
                            f"({path_max} bytes)")


def sidecar(path: Path, prefix: str, suffix: str) -> Path:
    return path.with_name(f"{prefix}{path.name}{suffix}")


def check_creatable(path: Path, label: str) -> None:
    """A one-line error now, before any work, when a result file ``path`` could not be
    written later (``label``: the option that names it): a directory, a folder that cannot
    be made, or no write permission."""
    if path.is_dir():
        raise PagedgenError(f"{label} {path}: is a directory; give a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PagedgenError(f"{label} {path}: not writable")
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PagedgenError(f"{label} {path}: cannot be created ({parent} is not a writable "
                            "directory)")
    check_names(path.resolve(), str(path))


def write_result(path: Path, text: str, label: str) -> None:
    """``text`` into ``path`` (its folders made), through a temporary file beside it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = sidecar(path, ".", ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise PagedgenError(f"{label} {path}: cannot write: {e.strerror or e}")
