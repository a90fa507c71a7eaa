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
    variant: str = ""  # its constexpr values, warps and stages: what a warm-up must match


def _index(path: Any) -> Any:
    return path[0] if isinstance(path, tuple) and path else path


def variant(compile_info: dict[str, Any]) -> str:
    """A variant's constexpr arguments by name (scalars only), its pointers not specialized
    as 16-byte aligned (``unaligned=``: offset, or marked not to be; another variant than an
    aligned call's), warps and stages, from the ``compile`` dict Triton hands its hooks
    (``signature``: the parameters in order, pointers typed ``*...``; ``constants``:
    constexpr values by argument path; ``configs[0]``: the specializations,
    ``tt.divisibility`` among them, by path)."""
    signature = compile_info.get("signature") or {}
    names = list(signature)
    parts = []
    for path, value in (compile_info.get("constants") or {}).items():
        first = _index(path)
        if isinstance(value, (bool, int, float, str)) and isinstance(first, int) \
                and first < len(names):
            parts.append(f"{names[first]}={value}")
    configs = compile_info.get("configs") or [None]
    if isinstance(configs[0], dict):
        aligned = {_index(p) for p, attrs in configs[0].items()
                   if any(a and a[0] == "tt.divisibility" for a in attrs)}
        loose = [n for i, n in enumerate(names)
                 if str(signature[n]).startswith("*") and i not in aligned]
        if loose:
            parts.append("unaligned=" + "+".join(loose))
    if "num_warps" in compile_info:
        parts.append(f"w{compile_info['num_warps']}s{compile_info.get('num_stages')}")
    return ",".join(parts)


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
            self.compiles.append(Compile(kernel, time.perf_counter() - started,
                                         variant(kw.get("compile") or {})))
        return self._chained[1](**kw) if self._chained[1] else None

    def mark(self) -> int:
        return len(self.compiles)

    def summary(self, startup: int, run: int) -> dict[str, Any]:
        """The variants made from mark ``startup`` to mark ``run`` (start-up) and since ``run``
        (inside the run: count, seconds, the three slowest, and seconds by variant)."""
        made, late = self.compiles[startup:run], self.compiles[run:]
        out: dict[str, Any] = {"kernels_compiled_at_startup": len(made),
                               "kernel_compile_at_startup_s": sum(c.seconds for c in made),
                               "kernels_compiled_in_run": len(late)}
        if late:
            out["kernel_compile_in_run_s"] = sum(c.seconds for c in late)
            slow = sorted(late, key=lambda c: -c.seconds)[:3]
            out["slowest_compiles_in_run"] = ", ".join(f"{c.kernel} {c.seconds:.2f} s"
                                                       for c in slow)
            by_variant: dict[str, float] = {}
            for c in late:
                name = f"{c.kernel}[{c.variant}]"
                by_variant[name] = by_variant.get(name, 0.0) + c.seconds
            out["compiles_in_run_s"] = by_variant
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
