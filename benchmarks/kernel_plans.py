"""The kernel plans shipped with the package (issue 59): every FP8 GEMM and MoE tile plan the
presets' runs ask for, measured on this GPU as a first start here would measure them (nothing
read from a cache or a shipped file), written to ``runtime/plans/<gpu>.json``: a run on a GPU
of that name then times nothing at start-up (``runtime/kernel_plans.py``).

Each preset is built with dummy weights in each quantization at each tensor-parallel size
(rank 0's shard: every rank's has its shape; ``:ep`` adds expert parallel), on one GPU, with
its first ``--layers`` layers only (default 4: every layer kind of the presets, and a plan is
keyed by a layer's shape, not by how many layers have it; so a preset larger than the GPU
plans too, and no time goes into drawing the other layers' weights). The file is rewritten
after each, so a run cut short keeps what it measured; shapes measured before (other presets)
stay.

    python -m benchmarks.kernel_plans [--models qwen3-30b-a3b,...] [--quantizations none,fp8]
        [--tp 1,2,2:ep] [--layers 4] [--out FILE]
    python -m benchmarks.kernel_plans --merge FILE...  # runs on other GPUs into the shipped
    python -m benchmarks.kernel_plans --list  # the runs as MODEL:QUANT lines (to deal over GPUs)

A preset too large for the GPU is skipped with the reason (a one-GPU share that does not fit,
or memory running out while its dummy weights are drawn), and the next one runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import triton

from pagedgen.errors import PagedgenError
from pagedgen.runtime import kernel_plans
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.models.loader import build_model, model_quantization, presets, resolve_model

DENSE_FP8 = ("llama-3-8b", "llama-3-70b", "qwen3-32b", "qwen3-0.6b")  # the FP8 runs we measure


def is_moe(src) -> bool:
    cfg = src.hf_config
    return bool(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0))


def default_runs() -> list[tuple[str, str | None]]:
    """Every MoE preset as it ships and in FP8 (where its weights are not quantized already),
    and the dense presets we run in FP8."""
    runs = []
    for name in presets():
        if is_moe(resolve_model(name)):
            runs += [(name, None), (name, "fp8")]
        elif name in DENSE_FP8:
            runs.append((name, "fp8"))
    return runs


def shortened(src, layers: int):
    """``src`` with its first ``layers`` layers only (per-layer lists cut alike; more where
    those hold not every kind of layer: Gemma 4's first global layer is its sixth); as it is
    when it has no more."""
    cfg = src.hf_config
    types = getattr(cfg, "layer_types", None)
    if layers > 0 and isinstance(types, list):
        layers = max(layers, max(types.index(t) for t in set(types)) + 1)
    if layers <= 0 or cfg.num_hidden_layers <= layers:
        return src
    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    return dataclasses.replace(src, hf_config=cfg)


def merge(path: Path, gpu: str, plans: dict[str, dict[str, Any]]) -> dict[str, int]:
    """``plans`` (by kind, then shape key) merged into the file at ``path``: shapes measured
    before stay, except those of an older version of a kind that arrives (a key's first field
    is its kind's version: a plan of another version would never be read again); counts."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.update(gpu=gpu, measured_with=f"torch {torch.__version__}, triton {triton.__version__}",
                written=datetime.date.today().isoformat())
    for name, new in plans.items():
        versions = {key.split("|")[0] for key in new}
        kept = {k: v for k, v in data.get(name, {}).items() if k.split("|")[0] in versions}
        data[name] = {**kept, **new}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return {k: len(v) for k, v in data.items() if isinstance(v, dict)}


def merge_files(paths: list[Path]) -> None:
    """Plan files measured apart (one GPU each, ``--out``) merged into the shipped file of
    their GPU; run one at a time (``flock``)."""
    for p in paths:
        data = json.loads(p.read_text())
        plans = {k: v for k, v in data.items() if isinstance(v, dict)}
        shipped = kernel_plans.shipped_file(data["gpu"])
        counts = merge(shipped, data["gpu"], plans)
        print(f"{p.name} merged into {shipped.name}: {counts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="", help="presets (default: every MoE preset, and the "
                    f"dense ones we run in FP8: {', '.join(DENSE_FP8)})")
    ap.add_argument("--quantizations", default="none,fp8")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes; N:ep for expert parallel")
    ap.add_argument("--layers", type=int, default=4,
                    help="build each preset's first N layers only (0: all)")
    ap.add_argument("--out", default=None, help="default: runtime/plans/<this GPU>.json")
    ap.add_argument("--copy-to", type=Path, default=None,
                    help="a folder that gets a copy of the file after each preset (what a "
                         "call cut by its time limit brings back)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="only merge these plan files (--out of runs on other GPUs) into the "
                         "shipped file of their GPU")
    ap.add_argument("--list", action="store_true",
                    help="only print the runs, one MODEL:QUANT a line")
    args = ap.parse_args()
    if args.merge:
        merge_files(args.merge)
        return
    quants = [None if q == "none" else q for q in args.quantizations.split(",")]
    runs = [(m, q) for m, q in default_runs() if q in quants] if not args.models else \
        [(m, q) for m in args.models.split(",") for q in quants]
    if args.list:
        print("\n".join(f"{m}:{q or 'none'}" for m, q in runs))
        return
    if not torch.cuda.is_available():
        raise SystemExit("kernel plans are measured on a CUDA GPU; none is visible here")
    os.environ["PAGEDGEN_SHIPPED_PLANS"] = "0"  # measure everything, as a first start would
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pagedgen-plans-")
    device = torch.device("cuda")
    gpu = kernel_plans.gpu_name(device)
    out = kernel_plans.shipped_file(gpu) if args.out is None else Path(args.out)
    sizes = [(int(t.split(":")[0]), t.endswith(":ep")) for t in args.tp.split(",")]
    for size, ep in sizes:  # one GPU's shapes first: a run cut short keeps those
        for name, quant in runs:
            src = shortened(resolve_model(name), args.layers)
            if ep and not is_moe(src):
                continue
            label = f"{name} {quant or 'as shipped'} tp {size}{' ep' if ep else ''}"
            t0 = time.perf_counter()
            before = sum(kernel_plans.sources.values())
            skipped = build(src, quant, size, ep, device)
            if skipped:
                print(f"{label}: skipped: {skipped}", flush=True)
                continue
            counts = merge(out, gpu, kernel_plans.taken())
            if args.copy_to is not None:
                shutil.copy(out, args.copy_to / out.name)
            print(f"{label}: {sum(kernel_plans.sources.values()) - before} new shapes in "
                  f"{time.perf_counter() - t0:.0f} s; {out.name}: {counts}", flush=True)


def build(src, quant: str | None, size: int, ep: bool, device: torch.device) -> str | None:
    """Builds ``src`` with dummy weights (its kernel plans measured at the end of the build)
    and frees it; where it cannot be built, why (None when it was)."""
    why = None
    try:
        model = build_model(src, "dummy", torch.bfloat16, device,
                            tp=TensorParallel(0, size, expert_parallel=ep),
                            quant=model_quantization(src, quant))
    except PagedgenError as e:
        return str(e)
    except torch.OutOfMemoryError:
        why = "out of memory while building it on this GPU"
    else:
        del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return why


if __name__ == "__main__":
    main()
