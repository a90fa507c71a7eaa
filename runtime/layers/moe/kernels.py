"""Mixture-of-experts arithmetic after routing (``moe.route``): tokens sorted by expert, and one
grouped GEMM kernel (Triton, our own) run twice per layer: gate/up with SiLU-and-mul in its
epilogue, then down with the routing weight in its epilogue.

A token's ``top_k`` choices are its *slots* (slot ``t * top_k + j``). ``moe.align`` sorts the
slots by expert into blocks of ``block_m`` rows (an expert's last block padded with the sentinel
slot ``num_slots``), so each program of the GEMM multiplies one block of rows by one expert's weight
tile: only the experts that got tokens are read. Everything is sized by the token count alone
(no host sync), so it runs inside CUDA graphs; programs past the last expert's blocks return at
once. ``reference`` is the per-expert loop the tests check the kernels against (and the path of
CPU runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pagedgen.runtime.layers.moe.act import bias_and_act, swiglu
from pagedgen.runtime.layers.moe.align import align
from pagedgen.runtime.layers.moe.combine import slot_sum
from pagedgen.runtime.quantization.fp8.kernels import quantize_activations
from pagedgen.runtime.quantization.fp8.moe import ExpertScales
from pagedgen.runtime.quantization.invariant_gemm import by_rows

try:
    import triton
    import triton.language as tl

    from pagedgen.runtime.quantization.mxfp4.kernels import (
        exps_in_words,
        mxfp4_operands,
        mxfp4_rows,
        mxfp4_tile,
    )
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the per-expert loop
    HAVE_TRITON = False


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, act=swiglu, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, rowwise: bool = False) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))`` over each token's
    experts ``e = ids[t, j]``, one expert at a time (``w13`` [E, 2I, H]: gate rows, then up;
    ``w2`` [E, H, I]; biases ``b13`` [E, 2I], ``b2`` [E, H] where the experts have them);
    [T, H] in ``x``'s dtype. A token's experts add in the order of their ids; ``rowwise``
    (``--batch-invariant``): each token's products and activation on their own, so its bits
    follow none of the other tokens an expert gets."""
    rows = by_rows if rowwise else (lambda op, *a: op(*a))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = rows(F.linear, x[token], w13[e], None if b13 is None else b13[e].to(x.dtype))
        inner = rows(lambda gu: act(*gu.chunk(2, -1)), gate_up)
        y = rows(F.linear, inner, w2[e], None if b2 is None else b2[e].to(x.dtype))
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


@dataclass(frozen=True)
class Tiles:
    """One launch shape of the grouped GEMM."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # the weights multiply as the MMA's left operand (rows of outputs)
    tma: bool = False  # bf16 / FP8 weights' tiles loaded by TMA (the copy engine)

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}"
                f"w{self.num_warps}s{self.num_stages}" + ("x" if self.swap else "")
                + ("t" if self.tma else ""))


if HAVE_TRITON:
    # the step's slot and block counts vary with every token count: one variant for all (a
    # plan's measurement compiles what a run's steps then take)
    @triton.jit(do_not_specialize=["num_slots", "num_blocks"])
    def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, slots_ptr, block_experts_ptr, weights_ptr,
                             a_scale_ptr, b_scale_ptr, bias_ptr, num_slots, N, K, num_blocks,
                             group_k, num_groups, stride_am, stride_be, stride_bn, stride_bse,
                             stride_bsg, stride_biase, stride_cm, A_ROW_DIV: tl.constexpr,
                             GATED: tl.constexpr, WEIGHTED: tl.constexpr, BIASED: tl.constexpr,
                             B_FP8: tl.constexpr, A_FP8: tl.constexpr, B_FP4: tl.constexpr,
                             SCALED_DOT: tl.constexpr,
                             A_FORMAT: tl.constexpr, PER_ROW: tl.constexpr,
                             PRECISION: tl.constexpr, SWAP: tl.constexpr,
                             EXP_WORDS: tl.constexpr, FOLDED: tl.constexpr,
                             B_DESC: tl.constexpr, EVEN_K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[slot, n] = (A[slot // A_ROW_DIV] @ B[expert]^T)[n] for one block of sorted slots
        and BLOCK_N outputs; BIASED: plus the expert's bias [E, N] (not with GATED); GATED:
        silu(gate) * up of rows n and N + n of B; WEIGHTED: times the slot's routing weight.
        B_FP8: B in e4m3 with float32 scales [E, rows, num_groups] over K groups of
        ``group_k`` (PER_ROW: one group, applied once at the end; else each K tile lies in one
        group), converted to A's dtype in registers unless A_FP8: A in e4m3 with scales [A
        rows, num_groups], both multiplied on the FP8 tensor cores. B_FP4: B in MXFP4's kernel
        layout (``mxfp4_tile``; exponents [E, groups, rows], ``stride_bsg`` a group apart,
        EXP_WORDS: four a load; FOLDED: each at most ``mxfp4.FOLD_MAX_EXPONENT``), converted
        in registers; A's even and odd columns multiply
        B's low and high nibbles; or with SCALED_DOT, codes and scales as they are into
        ``tl.dot_scaled`` (A in A_FORMAT), which Triton lowers for the GPU. SWAP: each product
        is taken as (B A^T)^T, the weights the MMA's left operand (Hopper's takes it from
        registers, where converted weights are; a block of few rows fills its narrow side),
        one scale per row (PER_ROW) only. B_DESC: ``b_ptr`` is a TMA descriptor of the
        weights as [experts * rows, K] (bf16 or FP8 weights), its tiles loaded by the copy
        engine. EVEN_K: K is a multiple of BLOCK_K (no column masks). Programs walk GROUP_M
        blocks per column of tiles (a run of blocks mostly shares an expert: its tiles stay in
        L2)."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = min(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        expert = tl.load(block_experts_ptr + pid_m)
        if expert < 0:
            return
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        rows = (slot // A_ROW_DIV).to(tl.int64)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        if B_DESC:  # this expert's first B row of the tile (gate's; up's N rows on)
            b_row = (expert * (stride_be // stride_bn) + n0).to(tl.int32)
        else:
            b_at = b_ptr + expert.to(tl.int64) * stride_be  # this expert's B
            b_ptrs = b_at + offs_n[None, :] * stride_bn + offs_k[:, None]
        s_at = b_scale_ptr + expert.to(tl.int64) * stride_bse  # and its scales
        bs_ptrs = s_at + offs_n * num_groups
        as_ptrs = a_scale_ptr + rows * num_groups
        if SWAP:  # the products' transposes: rows of outputs by rows of A
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if B_FP4 and SCALED_DOT:
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :],
                            other=0.0)
                codes, exps = mxfp4_operands(b_at, s_at, k0, n0, N, K, stride_bn, stride_bsg,
                                             BLOCK_N, BLOCK_K, EXP_WORDS)
                if SWAP:
                    acc = tl.dot_scaled(tl.trans(codes), exps, "e2m1", tl.trans(a), None,
                                        A_FORMAT, acc)
                else:
                    acc = tl.dot_scaled(a, None, A_FORMAT, codes, exps, "e2m1", acc)
                if GATED:
                    codes, exps = mxfp4_operands(b_at + N * stride_bn, s_at + N, k0, n0, N,
                                                 K, stride_bn, stride_bsg, BLOCK_N, BLOCK_K,
                                                 EXP_WORDS)
                    if SWAP:
                        acc_up = tl.dot_scaled(tl.trans(codes), exps, "e2m1", tl.trans(a),
                                               None, A_FORMAT, acc_up)
                    else:
                        acc_up = tl.dot_scaled(a, None, A_FORMAT, codes, exps, "e2m1", acc_up)
            elif B_FP4 and SWAP:  # whole rows of weights converted, A's columns in order
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :],
                            other=0.0)
                w = mxfp4_rows(b_at, s_at, k0, n0, N, K, stride_bn, stride_bsg, a.dtype,
                               BLOCK_N, BLOCK_K, EXP_WORDS, FOLDED)
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
                if GATED:
                    w = mxfp4_rows(b_at + N * stride_bn, s_at + N, k0, n0, N, K, stride_bn,
                                   stride_bsg, a.dtype, BLOCK_N, BLOCK_K, EXP_WORDS, FOLDED)
                    acc_up = tl.dot(w, tl.trans(a), acc_up, input_precision=PRECISION)
            elif B_FP4:  # A's even columns meet the low nibbles, its odd ones the high
                kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                k_even = 2 * kb
                a_row = a_ptr + rows[:, None] * stride_am + k_even[None, :]
                a_lo = tl.load(a_row, mask=valid[:, None] & (k_even < K)[None, :], other=0.0)
                a_hi = tl.load(a_row + 1, mask=valid[:, None] & (k_even + 1 < K)[None, :],
                               other=0.0)
                lo, hi = mxfp4_tile(b_at, s_at, k0, n0, N, K, stride_bn, stride_bsg,
                                    a_lo.dtype, BLOCK_N, BLOCK_K, EXP_WORDS, FOLDED)
                acc = tl.dot(a_lo, lo, acc, input_precision=PRECISION)
                acc = tl.dot(a_hi, hi, acc, input_precision=PRECISION)
                if GATED:
                    lo, hi = mxfp4_tile(b_at + N * stride_bn, s_at + N, k0, n0, N, K,
                                        stride_bn, stride_bsg, a_lo.dtype, BLOCK_N, BLOCK_K,
                                        EXP_WORDS, FOLDED)
                    acc_up = tl.dot(a_lo, lo, acc_up, input_precision=PRECISION)
                    acc_up = tl.dot(a_hi, hi, acc_up, input_precision=PRECISION)
            else:
                if EVEN_K:
                    a_mask, b_mask = valid[:, None], n_ok[None, :]
                else:
                    k_ok = offs_k < K - k0
                    a_mask, b_mask = valid[:, None] & k_ok[None, :], k_ok[:, None] & n_ok[None, :]
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                if B_DESC:  # rows past N (or the expert) multiply into masked outputs only
                    b = b_ptr.load([b_row, k0]).T
                else:
                    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
                if B_FP8 and not A_FP8:
                    b = b.to(a.dtype)
                if GATED:
                    if B_DESC:
                        u = b_ptr.load([b_row + N, k0]).T
                    else:
                        u = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
                    if B_FP8 and not A_FP8:
                        u = u.to(a.dtype)
                if PER_ROW and SWAP:
                    acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=PRECISION)
                    if GATED:
                        acc_up = tl.dot(tl.trans(u), tl.trans(a), acc_up,
                                        input_precision=PRECISION)
                elif PER_ROW:
                    acc = tl.dot(a, b, acc, input_precision=PRECISION)
                    if GATED:
                        acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
                else:  # this K tile's group: its scales on the partial product
                    g = k0 // group_k
                    s = tl.load(bs_ptrs + g, mask=n_ok, other=0.0)[None, :]
                    if A_FP8:
                        a_s = tl.load(as_ptrs + g, mask=valid, other=0.0)[:, None]
                        s = a_s * s
                    acc += tl.dot(a, b, input_precision=PRECISION) * s
                    if GATED:
                        s_up = tl.load(bs_ptrs + N * num_groups + g, mask=n_ok,
                                       other=0.0)[None, :]
                        if A_FP8:
                            s_up = a_s * s_up
                        acc_up += tl.dot(a, u, input_precision=PRECISION) * s_up
            a_ptrs += BLOCK_K
            if not B_DESC:
                b_ptrs += BLOCK_K
        if SWAP:
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        if B_FP8 and PER_ROW:
            acc = acc * tl.load(bs_ptrs, mask=n_ok, other=0.0)[None, :]
            if GATED:
                acc_up = acc_up * tl.load(bs_ptrs + N * num_groups, mask=n_ok, other=0.0)[None, :]
        if A_FP8 and PER_ROW:
            a_s = tl.load(as_ptrs, mask=valid, other=0.0)[:, None]
            acc = acc * a_s
            if GATED:
                acc_up = acc_up * a_s
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if BIASED:
            acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_biase + offs_n, mask=n_ok,
                           other=0.0).to(tl.float32)[None, :]
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + slot, mask=valid, other=0.0)[:, None]
        c_ptrs = c_ptr + slot[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])



SCALED_DOT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # tl.dot_scaled's names


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                 block_experts: torch.Tensor, num_slots: int, tiles: Tiles, a_row_div: int,
                 gated: bool, weights: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                 group_k: int | None = None, scaled_dot: bool = False,
                 bias: torch.Tensor | None = None, small_exps: bool = False) -> torch.Tensor:
    """``out[slot] = f(a[slot // a_row_div] @ w[expert]^T + bias[expert])`` for every sorted
    slot (``align`` with ``tiles.block_m``); ``gated``: ``w`` holds gate then up rows and ``f``
    is SiLU-and-mul (no ``bias`` then); ``weights`` (float32, per slot): the output scaled by
    them. ``w_scale``: ``w`` is e4m3
    with these scales (``ExpertScales``; a K tile wider than their group of ``group_k``
    columns narrows to it); ``a_scale``: ``a`` is e4m3 too, quantized per row (and K
    group). ``w`` uint8: MXFP4 in the kernel layout (``mxfp4.to_kernel_layout``: codes [E,
    rows, K / 2], ``w_scale`` their e8m0 exponents [E, K / 32, rows]), converted in
    registers (``small_exps``: each exponent at most ``mxfp4.FOLD_MAX_EXPONENT``, converted
    with one multiply fewer), or with ``scaled_dot`` (``a`` in bf16 or fp16) multiplied by
    ``tl.dot_scaled``."""
    fp4 = w.dtype == torch.uint8
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2] * (2 if fp4 else 1)
    nb = block_experts.numel()
    groups = w_scale.shape[1 if fp4 else 2] if w_scale is not None else 1
    if fp4:  # the kernel's MXFP4 path reads each column's scale itself: any K tile
        if w_scale is None or a_scale is not None or groups * 32 != k \
                or w_scale.shape[2] != w.shape[1] or n % 4 or groups > 1 and w_scale.stride(1) % 4:
            raise ValueError("MXFP4 experts take their e8m0 scales, one per 32 columns "
                             "(group-major: [experts, K / 32, rows], rows a multiple of "
                             "four), and activations as they are")
        group, block_k = k, tiles.block_k
        if scaled_dot and a.dtype not in SCALED_DOT_FORMATS:
            raise ValueError(f"tl.dot_scaled takes bf16 or fp16 activations, not {a.dtype}")
    else:
        group = k if groups == 1 else group_k
        block_k = tiles.block_k if groups == 1 else min(tiles.block_k, group)  # in a group
        if groups > 1 and group % block_k:
            raise ValueError(f"K group {group} is not a multiple of the K tile {block_k}")
        if groups > 1 and tiles.swap:
            raise ValueError(f"swapped tiles ({tiles.name}) take one scale per weight row, "
                             f"not {groups} K groups")
    if tiles.tma and (fp4 or not w.is_contiguous() or k * w.element_size() % 16):
        tiles = replace(tiles, tma=False)  # TMA takes bf16 or FP8 rows of 16-byte multiples
    if bias is not None and (gated or bias.shape != (w.shape[0], n)):
        raise ValueError(f"an expert bias is [experts, outputs] = [{w.shape[0]}, {n}] of an "
                         f"ungated GEMM, not {list(bias.shape)}{' gated' if gated else ''}")
    grid = (nb * triton.cdiv(n, tiles.block_n),)
    b = w
    if tiles.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b = TensorDescriptor.from_tensor(w.view(-1, k), [tiles.block_n, block_k])
    _grouped_gemm_kernel[grid](
        a, b, out, slots, block_experts, weights if weights is not None else out,
        a_scale if a_scale is not None else out, w_scale if w_scale is not None else out,
        bias if bias is not None else out, num_slots, n, k, nb, group, groups, a.stride(0),
        w.stride(0), w.stride(1), w_scale.stride(0) if w_scale is not None else 0,
        w_scale.stride(1) if fp4 else 0, bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, WEIGHTED=weights is not None,
        BIASED=bias is not None,
        B_FP8=w_scale is not None and not fp4, A_FP8=a_scale is not None, B_FP4=fp4,
        SCALED_DOT=fp4 and scaled_dot, A_FORMAT=SCALED_DOT_FORMATS.get(a.dtype, "bf16"),
        PER_ROW=groups == 1 or fp4, EXP_WORDS=fp4 and exps_in_words(tiles.block_n, block_k),
        FOLDED=fp4 and small_exps, B_DESC=tiles.tma, EVEN_K=k % block_k == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", SWAP=tiles.swap,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def gated_up(act, b13: torch.Tensor | None, b2: torch.Tensor | None) -> bool:
    """Whether ``fused_experts`` runs gate/up's GEMM with SiLU-and-mul in its epilogue (plain
    SwiGLU experts without biases); else it writes gate and up for ``bias_and_act``."""
    return act is swiglu and b13 is None and b2 is None


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, tiles: tuple[Tiles, Tiles],
                  out: torch.Tensor | None = None, scales: ExpertScales | None = None,
                  native: bool = False, act=swiglu, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, dropped: bool = False,
                  gated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``reference``'s result by the kernels (``tiles``: gate/up's and down's, one block_m),
    summed over each token's slots into ``out`` ([T, H], or a new tensor). ``scales``: the
    weights are e4m3 (or MXFP4: uint8 weights); ``native``: the weights' own format meets
    the tensor cores (FP8: each GEMM's input quantized per token, per token and K group for
    block scales; MXFP4: ``tl.dot_scaled``), else the weights are converted to the
    activations' dtype in registers. Another ``act`` or biases (gpt-oss): the first GEMM
    writes gate and up, the gate/up biases and the activation run between the GEMMs
    (``bias_and_act``), and the down bias joins the second GEMM's epilogue, before the routing
    weight. ``dropped``: slots of expert ``E`` (one past ``w13``'s; weight 0: another
    expert-parallel rank's) are skipped and add nothing. ``gated``: a shared expert's output
    and gate logit, added in the sum (``slot_sum``)."""
    if tiles[0].block_m != tiles[1].block_m:
        raise ValueError("both GEMMs of a MoE layer sort their rows in blocks of one size")
    (t, top_k), h = ids.shape, x.shape[1]
    n, experts = t * top_k, w13.shape[0]
    slots, block_experts = align(ids, experts + dropped, tiles[0].block_m)
    if dropped:  # the dropped expert's blocks return at once
        block_experts = torch.where(block_experts == experts, -1, block_experts)
    inter = x.new_empty(n, w13.shape[1] // 2)
    s13, s2, group_k = (scales.w13, scales.w2, scales.group_k) if scales else (None,) * 3
    small = scales is not None and scales.small_exponents
    fp8_input, dot = (native and w13.dtype != torch.uint8, native and w13.dtype == torch.uint8)
    a, a_scale = quantize_activations(x, group_k) if fp8_input else (x, None)
    plain = gated_up(act, b13, b2)
    if plain:
        grouped_gemm(a, w13, inter, slots, block_experts, n, tiles[0], top_k, gated=True,
                     w_scale=s13, a_scale=a_scale, group_k=group_k, scaled_dot=dot,
                     small_exps=small)
    else:
        expert = ids.reshape(-1).long()  # each slot's expert, for its biases (token-major)
        if dropped:
            expert = expert.clamp(max=experts - 1)  # a dropped slot's bias: weighted by 0
        gate_up = grouped_gemm(a, w13, x.new_empty(n, w13.shape[1]), slots, block_experts, n,
                               tiles[0], top_k, gated=False, w_scale=s13, a_scale=a_scale,
                               group_k=group_k, scaled_dot=dot, small_exps=small)
        inter = bias_and_act(gate_up, act, b13, expert)
    a, a_scale = quantize_activations(inter, group_k) if fp8_input else (inter, None)
    slot_weights = weights.reshape(-1).float()
    down = grouped_gemm(a, w2, (x.new_zeros if dropped else x.new_empty)(n, h), slots,
                        block_experts, n, tiles[1], 1, gated=False, weights=slot_weights,
                        w_scale=s2, a_scale=a_scale, group_k=group_k, scaled_dot=dot, bias=b2,
                        small_exps=small)
    return slot_sum(down, top_k, out, gated=gated)
