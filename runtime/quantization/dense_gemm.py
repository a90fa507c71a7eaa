"""The dense GEMM ``x W^T (+ b)`` with weights in the activations' dtype, on each device.

``F.linear`` everywhere except float32 on an AMD CPU: there torch's CPU build sends it to
MKL's sgemm, whose path for a few rows against a large weight (every decode step) runs at a
fraction of the core's arithmetic and of the memory's bandwidth, while oneDNN's inner-product
kernel (in the same build, torch's ``mkldnn._linear_pointwise``) reads the same row-major
weight, in place, and computes the same sums in another order. Below ``MIN_WEIGHT`` elements
(a weight that stays in the caches) oneDNN's fixed cost a call outweighs what it gains, and on
Intel CPUs MKL is left as it is (not measured against it). Measurements are in
benchmarks/results/LOG.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_WEIGHT = 1 << 19  # elements


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id as the kernel reports it ("" where it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def onednn_available() -> bool:
    """Whether this torch has oneDNN's inner product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


@functools.cache
def onednn_pays() -> bool:
    """Whether float32 GEMMs on this CPU go to oneDNN: an AMD CPU, a torch built with it."""
    return cpu_vendor() == "AuthenticAMD" and onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through oneDNN where ``onednn_pays`` (float32 on a CPU,
    a weight of at least ``MIN_WEIGHT`` elements, rows to compute, no gradient asked)."""
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and weight.numel() >= MIN_WEIGHT and x.numel() and onednn_pays()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """oneDNN's inner product: ``x W^T (+ b)``, the weight read as it lies."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
