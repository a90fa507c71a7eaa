"""The `pagedgen` console script: signals first, then the app.

SIGTERM becomes ``Terminated`` in the main thread (as SIGINT becomes KeyboardInterrupt), so a
run ends the same way on either: output kept and resumable, one line, exit code 130 / 143. This
module imports nothing heavy before the handlers are in place, and holds both signals during
the app's imports (torch: seconds), so Ctrl-C then is one line too, once the imports are done.
"""

from __future__ import annotations

import signal
import sys

from pagedgen.errors import Terminated


def _terminate(signum, frame) -> None:
    raise Terminated()


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        # Held during the imports (some library's bare ``except`` would swallow the
        # KeyboardInterrupt); one that came is delivered when they are done, and ends here.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            from pagedgen.cli.app import app
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated (SIGTERM): nothing was written", file=sys.stderr)
        return 143
    app()
    return 0


if __name__ == "__main__":
    sys.exit(main())
