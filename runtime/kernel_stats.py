"""Attribute every GPU kernel of a torch.profiler trace to a phase and a group.

A kernel's phase is the ``pagedgen.<phase>`` range around the step that launched it; its group
is the innermost ``pg:<group>`` scope around its launch (profiling.py), else a
group learned from an eager reference forward for kernels replayed from a CUDA graph (whose
launches carry no scope: the replay's kernels are matched position by position with the
reference, or by name), else a guess from the kernel's name.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedgen.profiling import PREFIX

TOP = 20  # kernels listed by time in ``kernel_table``
GROUPS = ("attention", "linear attention", "GEMM", "FP8 GEMM", "MoE", "normalization",
          "activation", "rotary", "sampling", "KV-cache write", "all-reduce", "vision encoder",
          "memory copy", "other")
_SCOPE_GROUP = {"attention": "attention", "normalization": "normalization",
                "activation": "activation", "rotary": "rotary", "sampling": "sampling",
                "kv_cache_write": "KV-cache write", "all_reduce": "all-reduce",
                "logits_processors": "sampling", "sampling_controls": "sampling",
                "structured_output": "sampling",
                "fp8_gemm": "FP8 GEMM", "moe": "MoE", "linear_attention": "linear attention",
                "vision_encoder": "vision encoder"}
_NAME_RULES = [  # (group, pattern) tried in order on kernel names
    ("all-reduce", re.compile(r"nccl|all_?reduce|all_?gather|cross_device", re.I)),
    ("KV-cache write", re.compile(r"reshape_and_cache|append_paged_kv|index_copy|write_kv",
                                  re.I)),
    # ours (attention/recurrent/triton_kernels.py) and flash-linear-attention's chunked ones
    # (and vLLM's: FlashInfer's GDN prefill, its fla copy, causal-conv1d)
    ("linear attention", re.compile(r"gated_delta|delta_rule|gdn|causal_conv1d|conv_kernel|"
                                    r"conv_state_kernel|chunk_fwd|chunk_local_cumsum|"
                                    r"solve_tril|recompute_w_u|kkt|l2norm", re.I)),
    # ... and the triton backend's (attention/ops/triton_kernels.py), unscoped in graphs
    ("attention", re.compile(r"flashinfer|fmha|flash|attention|attn|paged_att|decode_kernel|"
                             r"prefill_kernel|merge_kernel", re.I)),
    ("FP8 GEMM", re.compile(r"scaled_gemm|_quant_kernel|e4m3|fp8_?gemm|f8f8", re.I)),
    ("MoE", re.compile(r"grouped_gemm|moe|matmul_ogs|_reduce_grouped", re.I)),  # triton_kernels
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|\bmm\b|splitk|Kernel2", re.I)),
    ("sampling", re.compile(r"argmax|sort|topk|exponential|multinomial|gumbel", re.I)),
    ("activation", re.compile(r"silu|gelu|swiglu|act_and_mul", re.I)),
    ("normalization", re.compile(r"rms|layernorm|norm_kernel|rsqrt", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("memory copy", re.compile(r"memcpy|memset|copy_kernel|direct_copy|CatArray", re.I)),
]


def group_from_name(name: str) -> str:
    for group, pat in _NAME_RULES:
        if pat.search(name):
            return group
    return "other"


def short_name(name: str, width: int = 70) -> str:
    """Kernel name without 'void ', namespaces' template arguments, cut to ``width``."""
    n = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in n:  # drop template arguments
        if ch == "<":
            depth += 1
            if depth == 1:
                out.append("<…>")
            continue
        if ch == ">":
            depth = max(0, depth - 1)
            continue
        if depth == 0:
            out.append(ch)
    n = "".join(out).split("(")[0]
    return n if len(n) <= width else n[:width - 1] + "…"


@dataclass
class Kernel:
    name: str
    ts: float  # µs
    dur: float  # µs
    phase: str | None  # "prefill" | "decode" | other range names | None
    group: str
    graph_launch: int | None  # correlation id of the cudaGraphLaunch that ran it
    in_forward: bool = False  # launched inside the model forward (pg:forward)


@dataclass
class _Range:
    start: float
    end: float
    name: str


class _Ranges:
    """One thread's ranges of one kind, for 'which ones contain time t' (they nest shallowly)."""

    def __init__(self, ranges: list[_Range], window: int) -> None:
        self.ranges = sorted(ranges, key=lambda r: r.start)
        self.starts = [r.start for r in self.ranges]
        self.window = window

    def containing(self, t: float) -> list[str]:
        i = bisect.bisect_right(self.starts, t)
        return [r.name for r in self.ranges[max(0, i - self.window):i] if r.start <= t <= r.end]


def load_kernels(trace: str | Path | dict[str, Any]) -> list[Kernel]:
    """Every GPU kernel / memcpy / memset of a Chrome trace, with phase and group."""
    if isinstance(trace, dict):
        data = trace
    else:  # vLLM's workers write theirs gzipped
        opener = gzip.open if str(trace).endswith(".gz") else open
        with opener(trace, "rt") as f:
            data = json.load(f)
    outer: dict[Any, list[_Range]] = defaultdict(list)  # phases and pg:forward
    inner: dict[Any, list[_Range]] = defaultdict(list)  # group scopes
    runtime: dict[int, tuple[Any, float, str]] = {}
    gpu = []
    for e in data.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat == "user_annotation":
            r = _Range(e["ts"], e["ts"] + e.get("dur", 0), e["name"])
            if r.name[len(PREFIX):] in _SCOPE_GROUP and r.name.startswith(PREFIX):
                inner[e["tid"]].append(r)
            else:
                outer[e["tid"]].append(r)
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            runtime[args["correlation"]] = (e["tid"], e["ts"], e["name"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
    outer_idx = {tid: _Ranges(rs, 16) for tid, rs in outer.items()}
    inner_idx = {tid: _Ranges(rs, 8) for tid, rs in inner.items()}
    kernels = []
    for e in gpu:
        corr = (e.get("args") or {}).get("correlation")
        tid, t, launch = runtime.get(corr, (None, None, ""))
        names = outer_idx[tid].containing(t) if tid in outer_idx else []
        scoped = inner_idx[tid].containing(t) if tid in inner_idx else []
        phases = [n.split(".", 1)[1] for n in names if n.startswith("pagedgen.")]
        if e.get("cat") != "kernel":
            group = "memory copy"
        elif scoped:
            group = _SCOPE_GROUP[scoped[-1][len(PREFIX):]]
        else:
            group = group_from_name(e["name"])
        k = Kernel(e["name"], e["ts"], e.get("dur", 0.0), phases[-1] if phases else None,
                   group, corr if launch == "cudaGraphLaunch" else None,
                   in_forward=PREFIX + "forward" in names)
        kernels.append(k)
    kernels.sort(key=lambda k: k.ts)
    return kernels


def attribute_graph_kernels(kernels: list[Kernel], reference: list[Kernel]) -> int:
    """Give kernels replayed from CUDA graphs the groups their eager counterparts had.

    ``reference``: the kernels of one eager forward of the same model (with scopes). Each
    replay whose kernel names match the reference one for one takes its groups by position;
    others take each name's most common group in the reference. Returns how many matched
    by position.
    """
    by_name: dict[str, Counter] = defaultdict(Counter)
    for k in reference:
        by_name[k.name][k.group] += 1
    ref_names = [k.name for k in reference]
    replays: dict[int, list[Kernel]] = defaultdict(list)
    for k in kernels:
        if k.graph_launch is not None:
            replays[k.graph_launch].append(k)
    positional = 0
    for ks in replays.values():
        if [k.name for k in ks] == ref_names:
            for k, r in zip(ks, reference):
                k.group = r.group
            positional += 1
            continue
        for k in ks:
            if k.name in by_name:
                k.group = by_name[k.name].most_common(1)[0][0]
    return positional


def summarize(kernels: list[Kernel], phases: tuple[str, ...] = ("prefill", "decode"),
              top: int = 15, time_key: str = "gpu_time_us") -> dict[str, Any]:
    """Per phase: total time (under ``time_key``), time by group, and the top kernels (or, for
    CPU operator records, the top operators)."""
    out: dict[str, Any] = {}
    for phase in phases:
        ks = [k for k in kernels if k.phase == phase]
        total = sum(k.dur for k in ks)
        groups = Counter()
        per_kernel: dict[tuple[str, str], list[float]] = defaultdict(list)
        for k in ks:
            groups[k.group] += k.dur
            per_kernel[(k.name, k.group)].append(k.dur)
        rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
        out[phase] = {
            time_key: total,
            "groups_us": {g: groups.get(g, 0.0) for g in GROUPS},
            "graph_kernels": sum(k.graph_launch is not None for k in ks),
            "top_kernels": [{"name": short_name(n), "group": g, "calls": len(d),
                             "total_us": sum(d), "mean_us": sum(d) / len(d),
                             "share": sum(d) / total if total else 0.0} for (n, g), d in rows],
        }
    return out


def kernel_table(kernels: Iterable[tuple[str, float]], top: int = TOP) -> dict[str, Any]:
    """Seconds by group, launches, and the ``top`` kernels by time, of (name, µs) pairs (a
    whole run's: ``pagedgen bench kernels``, ``benchmarks/run_kernels.py``)."""
    groups: dict[str, float] = defaultdict(float)
    by_name: Counter[str] = Counter()
    launches = 0
    for name, us in kernels:
        groups[group_from_name(name)] += us / 1e6
        by_name[short_name(name)] += us / 1e6
        launches += 1
    return {"gpu_s": sum(groups.values()), "launches": launches,
            "groups_s": {g: groups[g] for g in GROUPS if groups.get(g)},
            "top_s": by_name.most_common(top)}


def named(kernels: Iterable[Kernel]) -> list[tuple[str, float]]:
    """(name, µs) of these kernels, memory copies apart."""
    return [(k.name, k.dur) for k in kernels if k.group != "memory copy"]
