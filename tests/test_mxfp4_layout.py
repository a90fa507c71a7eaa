"""The MXFP4 experts' kernel layout (``mxfp4.to_kernel_layout``): each scale group's bytes
reordered so one thread of Hopper's MMA finds its four together, undone exactly; and the
swapped MXFP4 tile built for sm90 (no GPU needed: Triton compiles for a named target) takes its
codes into the MMA's registers by ``ldmatrix``, not a shared-memory byte at a time, and its K
loop waits on no load of its own (the exponents too are copied stages ahead)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4


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


# a swapped MXFP4 tile of the grouped GEMM (argv: block_m block_n block_k warps stages gated)
# built for sm90: ldmatrix count, shared-memory byte loads, loads the K loop waits on
COMPILE = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.quantization.mxfp4.kernels import exps_in_words
bm, bn, bk, warps, stages, gated = map(int, sys.argv[1:])
fn = mk._grouped_gemm_kernel
ints = ["num_slots", "N", "K", "num_blocks", "group_k", "num_groups", "stride_am",
        "stride_be", "stride_bn", "stride_bse", "stride_bsg", "stride_biase", "stride_cm"]
sig = dict(a_ptr="*bf16", b_ptr="*u8", c_ptr="*bf16", slots_ptr="*i32",
           block_experts_ptr="*i32", weights_ptr="*fp32", a_scale_ptr="*fp32",
           b_scale_ptr="*u8", bias_ptr="*bf16", **{n: "i32" for n in ints})
consts = dict(A_ROW_DIV=4, GATED=bool(gated), WEIGHTED=False, BIASED=False, B_FP8=False,
              A_FP8=False, B_FP4=True, SCALED_DOT=False, A_FORMAT="bf16", PER_ROW=True,
              PRECISION="tf32", SWAP=True, EXP_WORDS=exps_in_words(bn, bk), FOLDED=True,
              B_DESC=False, EVEN_K=True, BLOCK_M=bm,
              BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1)
sig.update({k: "constexpr" for k in consts})
aligned = [n for n in sig if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
built = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
ptx, ttgir = built.asm["ptx"], built.asm["ttgir"]
loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
print(len(re.findall(r"ldmatrix", ptx)), len(re.findall(r"ld\\.shared\\.b8", ptx)),
      loop.count("tt.load"))
"""


def sm90_build(*tile: int) -> tuple[int, int, int]:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, *map(str, tile)], capture_output=True,
                         text=True, env=env, timeout=300)
    if run.returncode and "ptxas" in run.stderr:
        pytest.skip(f"no sm90 build here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    return tuple(map(int, run.stdout.split()))


@pytest.mark.process
def test_the_swapped_mxfp4_tile_takes_its_codes_into_the_mma_by_ldmatrix_not_by_bytes():
    """In checkpoint order a thread's bytes of a group lie four apart: the tile read them from
    shared memory one byte at a time (128 loads a K step of gate and up); in the kernel layout
    they are one word, which ``ldmatrix`` moves (the exponents' bytes remain: 32)."""
    ldmatrix, byte_loads, _ = sm90_build(16, 128, 128, 4, 3, 1)  # the plan's decode tile, gated
    assert ldmatrix >= 8 and byte_loads <= 32, (ldmatrix, byte_loads)


@pytest.mark.parametrize("tile", [(64, 128, 64, 8, 4, 0), (16, 64, 128, 4, 4, 0)],
                         ids=["m64n128k64w8", "m16n64k128w4"])
@pytest.mark.process
def test_the_swapped_mxfp4_tiles_load_nothing_their_k_loop_waits_on(tile):
    """A K step's exponents of a tile are a few hundred bytes: loaded as bytes (one or two a
    thread in these tiles) they were a synchronous load inside the K loop, a memory latency
    every step; as 32-bit words they are copied asynchronously stages ahead, as the codes
    and activations are."""
    assert sm90_build(*tile)[2] == 0
