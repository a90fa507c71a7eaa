"""The MXFP4 experts' kernel layout (``mxfp4.to_kernel_layout``): each scale group's bytes
reordered so one thread of Hopper's MMA finds its four together, undone exactly; and the
swapped MXFP4 tile built for sm90 (no GPU needed: Triton compiles for a named target) takes its
codes into the MMA's registers by ``ldmatrix``, not a shared-memory byte at a time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedgen.runtime.quantization import mxfp4


def test_the_kernel_layout_puts_the_four_bytes_an_mma_thread_takes_of_a_group_together():
    codes = torch.arange(2 * 3 * 32, dtype=torch.int64).reshape(2, 3, 32).to(torch.uint8)
    scales = torch.arange(2 * 3 * 2, dtype=torch.uint8).reshape(2, 3, 2)
    kc, ke = mxfp4.to_kernel_layout(codes, scales)
    for g in range(2):  # thread t takes bytes t, t + 4, t + 8, t + 12 of a group
        for t in range(4):
            for j in range(4):
                assert torch.equal(kc[..., 16 * g + 4 * t + j], codes[..., 16 * g + 4 * j + t])
    assert ke.shape == (2, 2, 3) and torch.equal(ke, scales.transpose(1, 2))
    blocks, back = mxfp4.from_kernel_layout(kc, ke)
    assert torch.equal(blocks, codes.unflatten(-1, (-1, 16))) and torch.equal(back, scales)


# the plan's decode tile for gpt-oss's experts (m16n128k128, four warps, weights on the left)
COMPILE = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedgen.runtime.layers import moe_kernels as mk
fn = mk._grouped_gemm_kernel
ints = ["num_slots", "N", "K", "num_blocks", "group_k", "num_groups", "stride_am",
        "stride_be", "stride_bn", "stride_bse", "stride_bsg", "stride_biase", "stride_cm"]
sig = dict(a_ptr="*bf16", b_ptr="*u8", c_ptr="*bf16", slots_ptr="*i32",
           block_experts_ptr="*i32", weights_ptr="*fp32", a_scale_ptr="*fp32",
           b_scale_ptr="*u8", bias_ptr="*bf16", **{n: "i32" for n in ints})
consts = dict(A_ROW_DIV=4, GATED=True, WEIGHTED=False, BIASED=False, B_FP8=False,
              A_FP8=False, B_FP4=True, SCALED_DOT=False, A_FORMAT="bf16", PER_ROW=True,
              PRECISION="tf32", SWAP=True, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1)
sig.update({k: "constexpr" for k in consts})
aligned = [n for n in sig if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
print(len(re.findall(r"ldmatrix", ptx)), len(re.findall(r"ld\\.shared\\.b8", ptx)))
"""


def test_the_swapped_mxfp4_tile_takes_its_codes_into_the_mma_by_ldmatrix_not_by_bytes():
    """In checkpoint order a thread's bytes of a group lie four apart: the tile read them from
    shared memory one byte at a time (128 loads a K step of gate and up); in the kernel layout
    they are one word, which ``ldmatrix`` moves (the exponents' bytes remain: 32)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         env=env, timeout=300)
    if run.returncode and "ptxas" in run.stderr:
        pytest.skip(f"no sm90 build here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    ldmatrix, byte_loads = map(int, run.stdout.split())
    assert ldmatrix >= 8 and byte_loads <= 32, run.stdout
