"""Triton kernels made ready while pagedgen runs: compiled, or loaded from Triton's disk cache,
at a kernel variant's first launch in the process. One inside a run stalls the step that
launches it (a second or more for a variant new to the machine), which a fresh machine's
first run pays and a second run does not; start-up should have made them.

Counted process-wide through Triton's JIT hooks (``triton.knobs.runtime.jit_cache_hook``
before a variant is made, ``jit_post_compile_hook`` after), chained to any hook set before;
an engine reads what came after its marks (the summary: at start-up, and inside the run with
the slowest named). Triton's interpreter (CPU runs) makes no kernels: nothing is counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Compile:
    kernel: str
    seconds: float


@dataclass
class JitMonitor:
    """Every kernel variant made since ``install``, in order."""

    compiles: list[Compile] = field(default_factory=list)
    installed: bool = False
    _open: dict[tuple[str, str], float] = field(default_factory=dict)
    _chained: tuple[Any, Any] = (None, None)

    def install(self, runtime: Any) -> bool:
        """Set the hooks on Triton's ``knobs.runtime`` (once); False where it has none."""
        if not self.installed and hasattr(runtime, "jit_post_compile_hook"):
            self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self.before, self.after
            self.installed = True
        return self.installed

    @staticmethod
    def _key(kw: dict[str, Any]) -> tuple[str, str]:
        fn = kw.get("fn")
        return getattr(fn, "name", str(fn)), str(kw.get("key"))

    def before(self, **kw: Any) -> Any:
        """Triton is about to make a variant (a truthy return would skip it: the chained
        hook's answer is passed on)."""
        self._open[self._key(kw)] = time.perf_counter()
        return self._chained[0](**kw) if self._chained[0] else None

    def after(self, **kw: Any) -> Any:
        kernel, key = self._key(kw)
        started = self._open.pop((kernel, key), None)
        if started is not None:
            self.compiles.append(Compile(kernel, time.perf_counter() - started))
        return self._chained[1](**kw) if self._chained[1] else None

    def mark(self) -> int:
        return len(self.compiles)

    def summary(self, startup: int, run: int) -> dict[str, Any]:
        """The variants made from mark ``startup`` to mark ``run`` (start-up) and since ``run``
        (inside the run: count, seconds, the three slowest)."""
        made, late = self.compiles[startup:run], self.compiles[run:]
        out: dict[str, Any] = {"kernels_compiled_at_startup": len(made),
                               "kernel_compile_at_startup_s": sum(c.seconds for c in made),
                               "kernels_compiled_in_run": len(late)}
        if late:
            out["kernel_compile_in_run_s"] = sum(c.seconds for c in late)
            slow = sorted(late, key=lambda c: -c.seconds)[:3]
            out["slowest_compiles_in_run"] = ", ".join(f"{c.kernel} {c.seconds:.2f} s"
                                                       for c in slow)
        return out


MONITOR = JitMonitor()


def install() -> int:
    """The process's monitor on Triton's hooks where Triton has them; its mark now."""
    try:
        from triton import knobs
        MONITOR.install(knobs.runtime)
    except (ImportError, AttributeError):  # no Triton, or one older than its knobs
        pass
    return MONITOR.mark()
