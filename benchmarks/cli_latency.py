"""Wall time of the commands that should answer at once: ``pagedgen --help``, each command's
``--help`` and ``--version``, each run as a fresh process (the installed console script) several
times; prints the median and the worst, and which modules the top-level help imported that it
should not (torch, transformers, numpy, triton: the commands import them when they run).

    python -m benchmarks.cli_latency --repeats 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "transformers", "numpy", "triton")
COMMANDS = (["--help"], ["--version"], ["generate", "--help"], ["verify", "--help"],
            ["profile", "--help"], ["backends", "--help"])


def timed(argv: list[str], repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "worst_s": max(times)}


def heavy_imports() -> list[str]:
    """The heavy modules importing the app (what ``--help`` loads) brings in."""
    code = ("import sys; import pagedgen.cli.app; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    exe = shutil.which("pagedgen") or sys.exit("the pagedgen console script is not installed")
    rows = [{"command": " ".join(["pagedgen", *args]), **timed([exe, *args], a.repeats)}
            for args in COMMANDS]
    for r in rows:
        print(f"{r['command']:<28} median {r['median_s']:.3f} s, worst {r['worst_s']:.3f} s")
    print(json.dumps({"heavy_modules_imported_for_help": heavy_imports()}))


if __name__ == "__main__":
    main()
