"""The `pagedgen` console script: signals first, then the app.

SIGTERM and SIGHUP become ``Terminated`` in the main thread (as SIGINT becomes
KeyboardInterrupt), so a run ends the same way on any of them: output kept and resumable, one
line, exit code 130 / 143 / 129. A second such signal while the first one's clean-up runs (a
worker that will not stop, say) ends the process at once with the same exit code. This module
imports nothing heavy before the handlers are in place, and holds the signals during the app's
imports and, unless only help is asked for, torch's (seconds), so Ctrl-C then is one line too,
once the imports are done.
"""

from __future__ import annotations

import os
import signal
import sys

from pagedgen.errors import Terminated
from pagedgen.runtime import clock, cpu_load

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []


def _on_signal(signum, frame) -> None:
    if _received:  # the first one's clean-up is running: the user wants out now
        os.write(2, b"stopped at once (a second signal); --resume finishes the output\n")
        os._exit(_received[0] if _received[0] else 128 + signum)
        return
    _received.append(130 if signum == signal.SIGINT else 128 + signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def install_handlers() -> None:
    for sig in _SIGNALS:
        if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
            continue  # a background job started with Ctrl-C ignored keeps it so
        signal.signal(sig, _on_signal)


def _help_only(args: list[str]) -> bool:
    """Whether the command line only asks for help or the version (nothing imports torch)."""
    return not args or any(a in ("-h", "--help", "-V", "--version") for a in args)


def main() -> int:
    clock.mark()  # the start-up figure counts from here
    install_handlers()
    cpu_load.start()  # other processes' load over our start-up sizes a CPU run's threads
    try:
        # Held during the imports (some library's bare ``except`` would swallow the
        # KeyboardInterrupt); one that came is delivered when they are done, and ends here.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))
        try:
            if len(sys.argv) == 2 and sys.argv[1] in ("--version", "-V"):
                from pagedgen.meta import __version__
                print(f"pagedgen {__version__}")
                return 0
            from pagedgen.cli.app import app
            if not _help_only(sys.argv[1:]):
                # a command that runs imports torch (the commands do it when they run, so
                # that --help stays quick): here, under the held signals, as a Ctrl-C inside
                # torch's import aborts the process (pybind11's terminate), not one line
                import torch  # noqa: F401
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"{e.words}: nothing was written", file=sys.stderr)
        return e.exit_code
    app()
    return 0


if __name__ == "__main__":
    sys.exit(main())
