"""Test tiers, and a guard that keeps the fast one fast.

Marks (pyproject's ``markers``): ``process`` for a test that starts processes (a command in a
subprocess, ``-dp``/``-tp`` workers, Ray), ``kernels`` for one that runs Triton kernels in
Triton's interpreter (on a CPU), ``model`` for one that runs a trained model (SmolLM2-135M)
through whole checks, ``gpu`` (skipped without CUDA). The unit tier is the rest:

    python -m pytest -m "not process and not kernels and not model"

The guard fails a test that starts a process or interprets a kernel without its mark (the
error names the mark to add), so the unit tier stays what it says as tests are added. It
stands where there is no GPU (conftest sets ``TRITON_INTERPRET=1`` there), as in CI: on a GPU
machine Triton's compiler starts processes (ptxas) from any test that runs a kernel.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

_marks: set[str] = set()  # the running test's marks
_FREE = {"gpu"}  # a tier of its own: anything goes


class TierError(AssertionError):
    pass


def _guard(mark: str, what: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args, **kwargs):
        if mark not in _marks and not _marks & _FREE:
            raise TierError(f"{what} in a test not marked '{mark}': add @pytest.mark.{mark} "
                            "(tests/tiers.py)")
        return call(*args, **kwargs)
    return guarded


# Where there is no GPU (CI): on a GPU machine Triton's compiles start ptxas in any test
if os.environ.get("TRITON_INTERPRET") == "1":
    # matplotlib's first import on a fresh machine builds its font cache with a subprocess
    # (fc-list), in whichever test imports it first: built here, before the guard
    import matplotlib.font_manager  # noqa: F401
    subprocess.Popen.__init__ = _guard("process", "a subprocess", subprocess.Popen.__init__)
    multiprocessing.process.BaseProcess.start = _guard(
        "process", "a process", multiprocessing.process.BaseProcess.start)
    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton: no kernels to run
        interpreter = None
    if interpreter is not None:
        interpreter.GridExecutor.__call__ = _guard(
            "kernels", "a Triton kernel in the interpreter", interpreter.GridExecutor.__call__)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The test's marks, before its fixtures are set up (a module's fixtures count as its
    first test's)."""
    _marks.clear()
    _marks.update(m.name for m in item.iter_markers())
