"""The one exception type the CLI turns into a one-line error (no traceback)."""


class PagedgenError(Exception):
    """A user-facing error: bad input, missing files, an unavailable backend."""
