"""Triton kernels made while pagedgen runs (``runtime/worker/jit_monitor.py``): Triton's JIT
hooks, as Triton calls them, time each variant made, chain to the hooks set before, and the
summary splits start-up from the run. (Triton's interpreter makes no kernels: the hooks are
called here as Triton's JIT calls them; the GPU runs show real ones.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedgen.runtime.worker import jit_monitor


def _made(monitor: jit_monitor.JitMonitor, kernel: str, key: str = "k") -> None:
    info = {"key": key, "repr": kernel, "fn": SimpleNamespace(name=kernel), "compile": {},
            "is_manual_warmup": False, "already_compiled": False}
    assert monitor.before(**info) is None  # a truthy answer would make Triton skip the kernel
    monitor.after(**info)


def test_each_variant_made_is_counted_at_start_up_or_in_the_run_with_the_slowest_named():
    monitor = jit_monitor.JitMonitor()
    runtime = SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    assert monitor.install(runtime) and runtime.jit_post_compile_hook == monitor.after
    startup = monitor.mark()
    _made(monitor, "_grouped_gemm_kernel")
    run = monitor.mark()
    assert monitor.summary(startup, run) == {
        "kernels_compiled_at_startup": 1,
        "kernel_compile_at_startup_s": monitor.compiles[0].seconds,
        "kernels_compiled_in_run": 0}
    for name in ("decode_kernel", "rms_norm_kernel", "prefill_kernel", "_align_kernel"):
        _made(monitor, name, key=name)
    monitor.compiles[-1].seconds = 9.0  # the slowest comes first
    s = monitor.summary(startup, run)
    assert s["kernels_compiled_in_run"] == 4
    assert s["kernel_compile_in_run_s"] == pytest.approx(
        sum(c.seconds for c in monitor.compiles[run:]))
    assert s["slowest_compiles_in_run"].startswith("_align_kernel 9.00 s, ")
    assert s["slowest_compiles_in_run"].count(" s") == 3
    assert list(s["compiles_in_run_s"]) == [f"{n}[]" for n in (
        "decode_kernel", "rms_norm_kernel", "prefill_kernel", "_align_kernel")]


def test_a_variant_is_named_by_its_constexpr_arguments_warps_and_stages():
    """As Triton 3.x hands its hooks a variant: the signature in parameter order, constexpr
    values keyed by argument path (a tensor's path is never a constexpr)."""
    info = {"signature": {"a_ptr": "*bf16", "M": "i32", "BLOCK_M": "constexpr",
                          "GATED": "constexpr", "dtype": "constexpr"},
            "constants": {(2,): 64, (3,): True, (4,): object()},
            "num_warps": 8, "num_stages": 3}
    assert jit_monitor.variant(info) == "BLOCK_M=64,GATED=True,w8s3"
    offset = {**info, "configs": [{(1,): [["tt.divisibility", 16]]}]}  # a_ptr not aligned
    assert jit_monitor.variant(offset) == "BLOCK_M=64,GATED=True,unaligned=a_ptr,w8s3"
    aligned = {**info, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    assert jit_monitor.variant(aligned) == "BLOCK_M=64,GATED=True,w8s3"
    assert jit_monitor.variant({}) == ""
    monitor = jit_monitor.JitMonitor()
    run = monitor.mark()
    monitor.before(key="k", fn=SimpleNamespace(name="moe"), compile=info)
    monitor.after(key="k", fn=SimpleNamespace(name="moe"), compile=info)
    assert list(monitor.summary(0, run)["compiles_in_run_s"]) == ["moe[BLOCK_M=64,GATED=True,w8s3]"]


def test_the_hooks_set_before_still_run_and_answer_for_triton():
    calls = []
    runtime = SimpleNamespace(jit_cache_hook=lambda **kw: calls.append("cache") or True,
                              jit_post_compile_hook=lambda **kw: calls.append("post"))
    monitor = jit_monitor.JitMonitor()
    monitor.install(runtime)
    info = {"key": 1, "fn": SimpleNamespace(name="k")}
    assert monitor.before(**info) is True  # the earlier hook's "skip" reaches Triton
    monitor.after(**info)
    assert calls == ["cache", "post"] and len(monitor.compiles) == 1
    monitor.install(runtime)  # once: installing again chains nothing to itself
    assert monitor._chained[0] is not monitor.before


def test_a_triton_without_hooks_is_left_alone():
    monitor = jit_monitor.JitMonitor()
    assert not monitor.install(SimpleNamespace())
    assert monitor.mark() == 0


def test_the_process_monitor_sits_on_tritons_own_hooks():
    knobs = pytest.importorskip("triton.knobs")
    mark = jit_monitor.install()
    assert knobs.runtime.jit_post_compile_hook == jit_monitor.MONITOR.after
    assert knobs.runtime.jit_cache_hook == jit_monitor.MONITOR.before
    assert mark == jit_monitor.MONITOR.mark()
