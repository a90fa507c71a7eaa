"""The gated delta rule's decode kernel alone (issue 60): ``gated_delta_kernel`` at decode
(one token a sequence) on Qwen3.5-9B's linear-attention shapes, replayed from a CUDA graph
(timed as ``moe.kernels`` times), for each value block and warp count it can launch with,
against the floor of reading and writing every sequence's state once (float32 states, as
Qwen3.5's configs name, and bf16). The launch ``scan_triton`` uses is marked.

``--conv``: the causal convolution (``conv_triton``'s kernels) at a decode step of 256 sequences
and a prefill chunk of 16 new prompts of 1,024 tokens, for each token and channel tile, against
reading the inputs and writing the outputs and windows once.

``--prefill``: the chunked prefill instead, flash-linear-attention's kernel (ours) against
FlashInfer's Hopper kernel (what vLLM runs), on prompt chunks of the workloads' shapes, float32
states in and out (FlashInfer's laid out [N, H, V, K]: its transposes are timed with it), each
first call's seconds (compiles) apart, and the two outputs' largest difference.

    python -m benchmarks.gdn_kernels [--conv | --prefill] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import event_ms
from benchmarks.moe_kernels import _replay_ms
from pagedgen.attention.recurrent.state import GatedDeltaSpec

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.5-9B: key heads, value heads, their widths
SPEC = GatedDeltaSpec(HK, HV, DK, DV, 4, torch.float32)  # its layer: 4 taps, float32 states


def rows(seqs: tuple[int, ...] = (256, 64)) -> list[dict]:
    from pagedgen.attention.recurrent import triton_kernels as tk
    from pagedgen.attention.recurrent.gated_delta import DECODE_LAUNCH
    from pagedgen.runtime.hardware import copy_bandwidth

    bw, dev, out_rows = copy_bandwidth(), "cuda", []
    for n in seqs:
        qkv = torch.randn(n, SPEC.conv_dim, device=dev, dtype=torch.bfloat16)
        a, b = (torch.randn(n, HV, device=dev, dtype=torch.bfloat16) for _ in range(2))
        a_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, device=dev)
        slots = torch.arange(n, device=dev, dtype=torch.int32)
        has = torch.ones(n, device=dev, dtype=torch.int32)
        qsl = torch.arange(n + 1, device=dev, dtype=torch.int32)
        out = torch.empty(n, HV * DV, device=dev, dtype=torch.bfloat16)
        for state_dtype in (torch.float32, torch.bfloat16):
            ssm = torch.randn(n, HV, DV, DK, device=dev, dtype=state_dtype) * 0.1
            floor_us = 2 * ssm.numel() * ssm.element_size() / bw * 1e6
            for bv in (16, 32, 64):
                for warps in (1, 2, 4):
                    def launch():
                        tk.gated_delta_kernel[(DV // bv, HV, n)](
                            qkv, qkv.stride(0), a, b, a.stride(0), a_log, dt_bias, ssm, slots,
                            has, qsl, out, out.stride(0), HK, HV, DK ** -0.5, DK=DK, DV=DV,
                            BK=DK, BV=bv, num_warps=warps)
                    t = 1000 * _replay_ms(launch, calls=10)
                    row = {"seqs": n, "state": str(state_dtype).split(".")[-1], "block_v": bv,
                           "warps": warps, "us": round(t, 1), "floor_us": round(floor_us, 1),
                           "of_floor": round(floor_us / t, 3),
                           "used": (bv, warps) == DECODE_LAUNCH}
                    out_rows.append(row)
                    print(json.dumps(row), flush=True)
    return out_rows


def _layer_prefill_ms(n: int, length: int) -> dict[str, float]:
    """A Qwen3.5-9B layer's core (``GatedDeltaImpl.forward``: convolution, q/k norms, gates,
    states gathered and written back, the chunked kernel) over a prefill step of ``n``
    continuing prompts of ``length`` new tokens, with each library's chunked prefill."""
    from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
    from pagedgen.attention.recurrent.gated_delta import GatedDeltaImpl, GatedDeltaKernels
    from pagedgen.attention.recurrent.state import RecurrentStates

    dev = torch.device("cuda")
    states = RecurrentStates([SPEC], n + 1, torch.bfloat16, dev)
    blocks = -(-(length + 64) // 16)
    md = AttentionMetadataBuilder(16, dev).build(
        [ScheduledSeq(list(range(blocks)), 64, length, i) for i in range(n)], [])
    c = SPEC.conv_dim
    qkv = torch.randn(md.num_tokens, c, device=dev, dtype=torch.bfloat16)
    ab = torch.randn(md.num_tokens, 2 * HV, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(c, 4, device=dev, dtype=torch.bfloat16) * 0.5
    a_log, dt_bias = torch.rand(HV, device=dev), torch.rand(HV, device=dev)
    out = {}
    for prefill in ("fla", "flashinfer"):
        impl = GatedDeltaImpl(SPEC, GatedDeltaKernels("triton", prefill))
        out[f"layer_{prefill}_ms"] = round(event_ms(lambda: impl.forward(
            qkv, ab[:, :HV], ab[:, HV:], weight, None, a_log, dt_bias, states.layers[0], md)), 3)
    return out


def prefill_rows(shapes: tuple[tuple[int, int], ...] = ((16, 512), (32, 512), (8, 2048),
                                                        (1, 16384))) -> list[dict]:
    import time

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi_chunk
    except ImportError as e:
        fi_chunk, why = None, str(e)
    dev, out_rows = "cuda", []
    for n, length in shapes:
        t = n * length
        q, k = (torch.nn.functional.normalize(torch.randn(t, HK, DK, device=dev), dim=-1)
                .to(torch.bfloat16) for _ in range(2))
        v = torch.randn(t, HV, DV, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(t, HV, device=dev) * 0.1  # log decay
        beta = torch.rand(t, HV, device=dev)
        h0 = torch.randn(n, HV, DK, DV, device=dev) * 0.1  # [N, H, K, V]: fla's
        cu = torch.arange(0, t + 1, length, device=dev, dtype=torch.long)
        cu_cpu = cu.cpu()

        def fla():
            return fla_chunk(q[None], k[None], v[None], g=g[None], beta=beta.to(v.dtype)[None],
                             initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             cu_seqlens_cpu=cu_cpu)

        row = {"seqs": n, "tokens_each": length}
        t0 = time.perf_counter()
        o_fla, h_fla = fla()
        torch.cuda.synchronize()
        row["fla_first_s"], row["fla_ms"] = round(time.perf_counter() - t0, 2), round(
            event_ms(fla), 3)
        if fi_chunk is None:
            row["flashinfer"] = why
        else:
            alpha = g.exp()

            def flashinfer(use_cp="auto"):  # its split path for few sequences, or not
                o, h = fi_chunk(q, k, v, g=alpha, beta=beta, initial_state=h0.transpose(
                    -1, -2).contiguous(), output_final_state=True, cu_seqlens=cu,
                    use_cp=use_cp)
                return o, h.transpose(-1, -2).contiguous()

            try:
                t0 = time.perf_counter()
                o_fi, h_fi = flashinfer()
                torch.cuda.synchronize()
                row["flashinfer_first_s"] = round(time.perf_counter() - t0, 2)
                row["flashinfer_ms"] = round(event_ms(flashinfer), 3)
                row["flashinfer_no_cp_ms"] = round(event_ms(lambda: flashinfer(False)), 3)
                row["max_diff_o"] = float((o_fi.float() - o_fla[0].float()).abs().max())
                row["max_diff_state"] = float((h_fi - h_fla.float()).abs().max())
                row["fla_over_flashinfer"] = round(row["fla_ms"] / row["flashinfer_ms"], 3)
                row.update(_layer_prefill_ms(n, length))
            except Exception as e:  # a kernel this machine cannot build: say why
                row["flashinfer"] = f"{type(e).__name__}: {str(e)[:200]}"
        out_rows.append(row)
        print(json.dumps(row), flush=True)
    return out_rows


def conv_rows(tiles=((8, 256), (4, 512), (16, 128), (16, 256), (16, 512), (32, 64),
                     (32, 128), (32, 256), (64, 64), (64, 128)),
              warps=(4, 8)) -> list[dict]:
    from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
    from pagedgen.attention.recurrent import gated_delta
    from pagedgen.attention.recurrent import triton_kernels as tk
    from pagedgen.runtime.hardware import copy_bandwidth

    bw, dev, out_rows = copy_bandwidth(), "cuda", []
    c, taps = SPEC.conv_dim, SPEC.conv_kernel
    builder = AttentionMetadataBuilder(16, torch.device(dev))
    steps = {"decode 256": ([], [ScheduledSeq(list(range(8)), 100, 1, i) for i in range(256)]),
             "prefill 16 x 1024": ([ScheduledSeq(list(range(64)), 0, 1024, i)
                                    for i in range(16)], [])}
    for name, (prefills, decodes) in steps.items():
        md = builder.build(prefills, decodes)
        t = md.num_tokens
        qkv = torch.randn(t, c + HV * DV, device=dev, dtype=torch.bfloat16)[:, :c]
        weight = torch.randn(c, taps, device=dev, dtype=torch.bfloat16)
        conv = torch.randn(300, taps - 1, c, device=dev, dtype=torch.bfloat16)  # [slots, K - 1, C]
        slots, has, token_seq = md.recurrent_inputs()
        out = torch.empty(t, c, device=dev, dtype=torch.bfloat16)
        nbytes = 2 * (2 * t * c + 2 * md.num_seqs * c * (taps - 1))
        floor_us = nbytes / bw * 1e6
        whole = 1000 * _replay_ms(lambda: gated_delta.conv_triton(qkv, weight, None, conv, md))
        print(json.dumps({"step": name, "conv_triton_us": round(whole, 1),
                          "floor_us": round(floor_us, 1), "tile": gated_delta.CONV_TILE}),
              flush=True)
        for bt, bc in tiles:
            for w in warps:
                def launch():
                    tk.conv_kernel[(-(-t // bt), -(-c // bc))](
                        qkv, qkv.stride(0), weight, weight, conv, slots, has, token_seq,
                        md.query_start_loc, out, out.stride(0), c, t, K=taps, HAS_BIAS=False,
                        BT=bt, BC=bc, num_warps=w)
                us = 1000 * _replay_ms(launch)
                row = {"step": name, "tokens": bt, "channels": bc, "warps": w,
                       "conv_kernel_us": round(us, 1), "floor_us": round(floor_us, 1),
                       "conv_triton_us": round(whole, 1),
                       "used": (bt, bc, w) == (*gated_delta.CONV_TILE, gated_delta.CONV_WARPS)}
                out_rows.append(row)
                print(json.dumps(row), flush=True)
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conv", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    result = prefill_rows() if args.prefill else conv_rows() if args.conv else rows()
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": result}, indent=1))


if __name__ == "__main__":
    main()
