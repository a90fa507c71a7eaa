"""Qwen3.5's vision tower by attention kernel, over image sizes it meets for the first time
and again (issue 96).

On an H100 a first run of image workload i spent 21.7 s in the tower and the second run, the
same images, 5.9 s (`results/h100-images-i-pagedgen-host-indices.json`): torch's SDPA took
cuDNN's attention, which builds an execution plan for each sequence length it has not seen.
This times the tower over the first ``--images`` images of workload i (published tower,
random weights, ``--per-call`` images a call as a step encodes them), each pass twice: SDPA an
image at a time with cuDNN left out (FlashAttention-2, then memory-efficient, then math), then
in torch's own order (cuDNN first on Hopper: its first pass meets every length anew), then
FlashAttention-4's one varlen call for all of a call's images (``PAGEDGEN_VISION_ATTENTION=fa4``),
then SDPA and FA4 with the rotary in one Triton kernel (a GPU run's default, not transformers'
float32 passes); and names each row's attention kernels and its costliest kernels over one call.

    python -m benchmarks.vision_tower --images 300 --json $OUT/vision-tower.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import print_table
from benchmarks.image_workloads import ImageWorkload
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.models.families.qwen3_5 import (
    VisionAttention,
    host_indices,
    packed_attention,
    vision_tower,
)

# PackedAttention's choices, in this order: the first warms nothing the second builds per length
# ("fused": the rotary in one Triton kernel, as a run on a GPU has it, not transformers')
CHOICES: dict[str, dict] = {"no cuDNN": {"kernel": "sdpa"},
                            "torch's order": {"kernel": "sdpa", "sdpa_backends": None},
                            "fa4": {"kernel": "fa4"},
                            "no cuDNN, fused rotary": {"kernel": "sdpa", "fused": True},
                            "fa4, fused rotary": {"kernel": "fa4", "fused": True}}
PATCH = 16  # Qwen3.5's patches; the workload's sides are multiples of 32 (two merged)


def grids(n: int) -> list[tuple[int, int, int]]:
    """The (t, h, w) patch grids of workload i's first ``n`` images."""
    return [(1, h // PATCH, w // PATCH) for w, h in map(ImageWorkload().size, range(n))]


def encoder(tower: torch.nn.Module, device: str):
    """A function encoding a list of grids in one tower call (random pixels)."""
    cfg = tower.config
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    dtype = next(tower.parameters()).dtype

    def encode(gs: list[tuple[int, int, int]]) -> torch.Tensor:
        grid = torch.tensor(gs)
        pixels = torch.randn(int(grid.prod(-1).sum()), width, device=device, dtype=dtype)
        idx = {k: v if k == "cu_seqlens" else v.to(device)
               for k, v in host_indices(tower, grid).items()}
        with torch.no_grad():
            return tower(pixels, grid_thw=grid, **idx).pooler_output
    return encode


def timed_pass(encode, gs: list, per_call: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for i in range(0, len(gs), per_call):
        encode(gs[i:i + per_call])
    sync()
    return time.perf_counter() - t


def kernels(encode, gs: list) -> tuple[list[str], list[tuple[str, float]]]:
    """The attention kernels one call over ``gs`` runs, and its six costliest kernels with
    their milliseconds (CUDA only)."""
    if not torch.cuda.is_available():
        return [], []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        encode(gs)
        torch.cuda.synchronize()
    keys = ("attn", "fmha", "sdpa", "attention", "flash")
    ms: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[e.name[:80]] = ms.get(e.name[:80], 0.0) + e.device_time_total / 1e3
    attention = sorted(n for n in ms if any(k in n.lower() for k in keys))
    return attention, sorted(ms.items(), key=lambda kv: -kv[1])[:6]


def measure(tower: torch.nn.Module, device: str, images: int, per_call: int) -> list[dict]:
    encode = encoder(tower, device)
    gs = grids(images)
    encode([(1, 2, 2)])  # the tower's first call (allocations, module loads)
    rows = []
    for name, choice in CHOICES.items():
        choice = dict(choice)
        fused = choice.pop("fused", False)
        why = fused and fused_ops.unavailable_reason(torch.device(device))
        if why:
            rows.append({"choice": name, "skipped": why})
            continue
        packed = packed_attention(tower, torch.device(device), **choice)
        for m in tower.modules():
            if isinstance(m, VisionAttention):
                m.fused = fused
        if choice["kernel"] == "fa4" and packed.why:
            rows.append({"choice": name, "skipped": packed.why})
            continue
        try:
            first, again = timed_pass(encode, gs, per_call), timed_pass(encode, gs, per_call)
            attention, costliest = kernels(encode, gs[:per_call])
        except RuntimeError as e:  # a backend this device or build does not have
            rows.append({"choice": name, "skipped": str(e).splitlines()[0][:160]})
            continue
        rows.append({"choice": name, "images": images, "sizes": len(set(gs)),
                     "first_s": first, "again_s": again,
                     "first_ms_per_image": 1e3 * first / images,
                     "again_ms_per_image": 1e3 * again / images, "kernels": attention,
                     "costliest_ms": costliest})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-9b", help="its text model's width")
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--per-call", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    import transformers as tf

    from pagedgen.runtime.models.loader import resolve_model

    hidden = resolve_model(a.preset).hf_config.hidden_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tower = vision_tower(tf.Qwen3_5VisionConfig(out_hidden_size=hidden).to_dict())
    tower = tower.to(device, dtype).eval()
    rows = measure(tower, device, a.images, a.per_call)
    meta = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "preset": a.preset, "per_call": a.per_call}
    print(json.dumps(meta))
    print_table("Qwen3.5's vision tower by attention kernel (seconds over the images)",
                [r for r in rows if "skipped" not in r],
                ["choice", "images", "sizes", "first_s", "again_s", "first_ms_per_image",
                 "again_ms_per_image"])
    for r in rows:
        print(r["choice"] + ": " + (r.get("skipped") or ", ".join(r["kernels"]) or "-"))
        for name, ms in r.get("costliest_ms", []):
            print(f"  {ms:9.2f} ms  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
