"""What every `pagedgen` command shares: consoles, one-line errors, run settings from options."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import typer
from rich.console import Console
from rich.markup import escape

from pagedgen.errors import PagedgenError, Terminated

console = Console(stderr=True)


def out_console() -> Console:
    """Console for results on stdout; 160 columns when piped, so that wide tables (verify,
    profile) stay readable in logs (the generate summary is 100 wide on its own)."""
    c = Console()
    return c if c.is_terminal else Console(width=160)


def set_verbosity(verbose: int, quiet: bool) -> None:
    """``-v`` (INFO: start-up phases, the backend, the KV cache, graphs) or ``-vv`` (DEBUG)
    from pagedgen's loggers onto stderr; ``--quiet``: errors only (no progress bars, notes or
    summary; a run's one-line error still prints)."""
    log = logging.getLogger("pagedgen")
    if verbose and not log.handlers:
        from rich.logging import RichHandler
        log.addHandler(RichHandler(console=console, show_time=False, show_path=False,
                                   markup=False, rich_tracebacks=False))
    log.setLevel(logging.ERROR if quiet else logging.WARNING - 10 * min(verbose, 2))
    console.quiet = quiet


def cli_errors(fn: Callable) -> Callable:
    """Turn PagedgenError into a one-line message and exit code 1 (no traceback); Ctrl-C and
    SIGTERM into one line and exit codes 130 and 143 (a command that writes files says what
    it kept before this)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        set_verbosity(0, False)  # each command as it sets it (in-process callers run several)
        try:
            return fn(*args, **kwargs)
        except PagedgenError as e:
            console.quiet = False  # --quiet keeps errors
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False,
                          soft_wrap=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]", soft_wrap=True)
            raise typer.Exit(130)
        except Terminated as e:
            console.print(f"[yellow]{e.words}[/]")
            raise typer.Exit(e.exit_code)

    return wrapper
