"""The exceptions the CLI turns into one-line errors (no traceback), and the first line of any
other exception's message for them."""

import signal


def first_line(e: BaseException, default: str | None = None) -> str:
    """The first line of ``e``'s message (a library's may run on for pages), or ``default``
    (``e``'s type name when None) where it says nothing."""
    text = str(e).strip()
    return text.splitlines()[0] if text else (type(e).__name__ if default is None else default)


class PagedgenError(Exception):
    """A user-facing error: bad input, missing files, an unavailable backend."""


class BackendCannotRun(PagedgenError):
    """A named attention backend cannot run one of the model's layers (a sink, a soft cap, a
    head size...): commands that try several backends pass over it."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP (a closed terminal), raised in the main thread (as KeyboardInterrupt
    is for SIGINT) so that a run ends as after Ctrl-C: output closed, workers stopped, one
    line, exit code 128 + the signal's number (143, 129)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def words(self) -> str:
        """How the run ended, for its last line."""
        return "hung up (SIGHUP)" if self.signum == signal.SIGHUP else \
            f"terminated ({self.name})"
