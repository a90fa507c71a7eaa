"""The key lines of a GPU-session step's output (``.ci/gpu_session.sh``: each step names its
report in ``.ci/gpu_steps.yaml``), so a call's tail says what a run measured without the whole
log coming back.

    python -m benchmarks.session_report peers FILE.json [...]
    python -m benchmarks.session_report {verify,startup,profile,attention} FILE [...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _round(d: dict[str, Any], digits: int = 3) -> dict[str, Any]:
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in d.items()}


def _rows(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def peers(path: Path) -> list[str]:
    """Each system's runs, start-up, plans and ratios; where a first run loses time."""
    out = []
    for r in _rows(path):
        out.append(" ".join(str(x) for x in (
            r["workload"], r["system"], r.get("backend", ""), "runs tok/s",
            [round(x) for x in r.get("runs_output_tokens_per_s", [])], "start-up",
            round(r.get("startup_s") or r.get("load_time_s") or 0, 1), r.get("kernel_plans", ""),
            {k: round(v, 3) for k, v in r.items() if k.startswith("vs ")},
            "KV slots", r.get("kv_cache_token_slots") or r.get("vllm_kv_cache_tokens"),
            "preemptions", r.get("preemptions"))))
        if "startup_breakdown_s" in r:
            out.append(f"   start-up phases {_round(r['startup_breakdown_s'], 1)}")
        out += [f"   vLLM: {line[:200]}" for line in r.get("kernel_lines", [])]
        out += [f"   {t:6.2f} s  {name[:180]}"
                for name, t in r.get("first_run_compiles_s", {}).items()]
    return out


def verify(path: Path) -> list[str]:
    """Each backend's seconds and its slowest checks."""
    out = []
    for b in json.loads(path.read_text())["backends"]:
        rows = sorted(b["rows"], key=lambda r: -r["seconds"])
        out.append(f"{b['backend']} {round(sum(r['seconds'] for r in rows))} s; slowest: "
                   f"{[(r['group'], round(r['seconds'])) for r in rows[:4]]}")
    return out


def startup(path: Path) -> list[str]:
    """A ``generate --json`` log's summary: start-up by phase."""
    text = path.read_text()
    d = json.loads(text[text.index("{"):text.rindex("}") + 1])
    return [f"{path.stem} {round(d['startup_s'], 1)} s {_round(d['startup_breakdown_s'], 2)}"]


def profile(path: Path) -> list[str]:
    """``profile.json``: each batch's step against its floor, each phase's kernel groups."""
    out = []
    for r in json.loads(path.read_text())["results"]:
        out += [str(_round(b)) for b in r["batches"]]
        for phase, v in r["phases"].items():
            groups = {k: round(us / 1000, 2)
                      for k, us in sorted(v["groups_us"].items(), key=lambda x: -x[1]) if us}
            out.append(f"{phase} {round(v.get('gpu_time_us', 0) / 1000, 2)} ms: {groups}")
    return out


def attention(path: Path) -> list[str]:
    """``attention_kernels`` rows: backend, shape, time and rate."""
    return [" ".join(str(r.get(k, "")) for k in ("backend", "kind", "heads", "head_dim", "batch",
                                                  "context", "page", "fa4_decode_tile"))
            + f" {r['ms']:.4f} ms " + (f"{r['GB_s']:.0f} GB/s" if "GB_s" in r
                                       else f"{r.get('TFLOP_s', 0):.0f} TFLOP/s")
            for r in _rows(path)]


REPORTS: dict[str, Callable[[Path], list[str]]] = {
    f.__name__: f for f in (peers, verify, startup, profile, attention)}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in REPORTS:
        print(f"usage: session_report {{{','.join(REPORTS)}}} FILE...", file=sys.stderr)
        return 2
    for name in argv[1:]:
        try:
            print("\n".join(REPORTS[argv[0]](Path(name))))
        except (OSError, ValueError, KeyError) as e:  # the step failed: its log says why
            print(f"{name}: no report ({type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
