"""The one exception type the CLI turns into a one-line error (no traceback)."""


class PagedgenError(Exception):
    """A user-facing error: bad input, missing files, an unavailable backend."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (like KeyboardInterrupt for SIGINT) so that a run
    ends as after Ctrl-C: output closed, workers stopped, one line, exit code 143."""
