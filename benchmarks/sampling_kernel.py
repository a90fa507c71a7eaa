"""The sampler on a decode step's logits (256 rows x Llama-3's 128,256 tokens, float32):
temperature sampling as the torch chain against the one-pass Triton kernel
(runtime/sampling/gumbel_kernel.py), CUDA-event timed; and how often the two pick the same
token (they differ only on float32 near-ties).

    python -m benchmarks.sampling_kernel
"""

from __future__ import annotations

import json

import torch

from benchmarks.common import event_ms
from pagedgen.runtime.sampling.sampler import SamplingBatch, sample


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for b, v in ((1, 128_256), (64, 128_256), (256, 128_256), (256, 151_936)):
        logits = torch.randn(b, v, device=dev) * 4
        sb = SamplingBatch.build([1.0] * b, [0] * b, [1.0] * b, list(range(b)),
                                 [7] * b, dev)
        torch_ms = event_ms(lambda: sample(logits, sb, fused=False), 50)
        fused_ms = event_ms(lambda: sample(logits, sb, fused=True), 50)
        same = sum(sum(sample(logits, SamplingBatch.build(
            [1.0] * b, [0] * b, [1.0] * b, list(range(b)), [s] * b, dev), fused=f).eq(
                sample(logits, SamplingBatch.build([1.0] * b, [0] * b, [1.0] * b,
                                                   list(range(b)), [s] * b, dev),
                       fused=not f)).tolist()) for s, f in ((s, True) for s in range(20)))
        rows.append({"rows": b, "vocab": v, "torch_ms": round(torch_ms, 3),
                     "fused_ms": round(fused_ms, 3), "speedup": round(torch_ms / fused_ms, 1),
                     "same_token": f"{same}/{20 * b}"})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
