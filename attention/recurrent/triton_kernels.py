"""pagedgen's gated-delta-rule kernels, in Triton (the math: ``reference.py``).

* ``conv_kernel``: the causal depthwise convolution (SiLU after) of every new token of a step,
  one program per (token block, channel block); taps before a sequence's first new token read its
  conv state (rows [K - 1, C]: read and written along the channels), or zeros for a sequence
  without one. A sequence of one new token (every decode)
  has its new window written there too: its program is the only one reading that slot. A block
  inside one sequence's inputs (most of a prefill's) runs row by row, reading each input once.
* ``conv_state_kernel``: then each longer sequence's conv state becomes its last ``K - 1``
  inputs (one program per (prefill, channel block): every read before the barrier, then the
  writes).
* ``gated_delta_kernel``: the delta rule over each sequence's new tokens in order, one program
  per (value block, value head, sequence): the state block [BV, Dk] (BV value rows of the slot's
  [Dv, Dk] matrix: one span of memory) stays in registers from the first token to the last,
  read from the sequence's slot once and written back once; the gates
  (``g``, ``beta``) and the q/k L2 norms are computed in the kernel. A decode is the one-token
  case; long prefills go to a library's chunked kernel where one runs (``gated_delta.py``).
* ``qk_norm_kernel``: those prefills' q and k heads L2-normalized into one contiguous
  [2, T, Hk, Dk] tensor for that chunked kernel (one launch shape for every token count: its
  own normalization autotunes afresh per bucket of token counts, inside a run).

All in float32; states are stored in their own dtype. Compiled on CUDA GPUs, and for the tests
under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _l2_normalized(x, AXIS: tl.constexpr):
    """``x / sqrt(sum(x^2) + 1e-6)`` along ``AXIS`` (``reference.l2_normalize``)."""
    return x * tl.rsqrt(tl.sum(x * x, AXIS, keep_dims=True) + 1e-6)


# The slot and offset rows are sliced at a step's first scanned sequence: no variant per
# alignment (each would compile inside a run).
@triton.jit(do_not_specialize=["T"],
            do_not_specialize_on_alignment=["Slots", "HasState", "TokenSeq", "QSL"])
def conv_kernel(X, stride_x, W, Bias, Conv, Slots, HasState, TokenSeq, QSL, Y, stride_y, C, T,
                K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm, cm = t < T, c < C
    s = tl.load(TokenSeq + t, mask=tm, other=0)
    start = tl.load(QSL + s, mask=tm, other=0)
    # a block whose every tap is an input of its own sequence (no window, no sequence start
    # inside): row by row, each input read once and kept for the next K - 1 rows
    need = K - 1
    if K > 4:  # more taps than registers held: the block path alone
        need = 1 << 30
    if tl.min(tl.where(tm, t - start, need), 0) >= need:
        _conv_inside(X, stride_x, W, Bias, Y, stride_y, C, T, tl.program_id(0) * BT, c, cm, K,
                     HAS_BIAS, BT)
    else:
        _conv_block(X, stride_x, W, Bias, Conv, Slots, HasState, QSL, Y, stride_y, C, t, c, tm,
                    cm, s, start, K, HAS_BIAS, BT, BC)


@triton.jit
def _conv_inside(X, stride_x, W, Bias, Y, stride_y, C, T, t0, c, cm, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BT: tl.constexpr):
    """``conv_kernel``'s rows t0 .. t0 + BT - 1 with every tap inside their sequence (K <= 4):
    the inputs K - 1 .. 1 rows back held in registers (weights 0 past K)."""
    x_row = X + t0.to(tl.int64) * stride_x + c
    w = W + c * K
    # w_j: the weight of the input j rows back; x_j: that input (for the first row)
    w0 = tl.load(w + K - 1, mask=cm, other=0.0).to(tl.float32)
    w1, w2, w3 = tl.zeros_like(w0), tl.zeros_like(w0), tl.zeros_like(w0)
    x1, x2, x3 = tl.zeros_like(w0), tl.zeros_like(w0), tl.zeros_like(w0)
    if K >= 2:
        w1 = tl.load(w + K - 2, mask=cm, other=0.0).to(tl.float32)
        x1 = tl.load(x_row - stride_x, mask=cm, other=0.0).to(tl.float32)
    if K >= 3:
        w2 = tl.load(w + K - 3, mask=cm, other=0.0).to(tl.float32)
        x2 = tl.load(x_row - 2 * stride_x, mask=cm, other=0.0).to(tl.float32)
    if K >= 4:
        w3 = tl.load(w + K - 4, mask=cm, other=0.0).to(tl.float32)
        x3 = tl.load(x_row - 3 * stride_x, mask=cm, other=0.0).to(tl.float32)
    bias = tl.zeros_like(w0)
    if HAS_BIAS:
        bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)
    y_row = Y + t0.to(tl.int64) * stride_y + c
    for i in tl.static_range(BT):
        m = cm & (c * 0 + t0 + i < T)  # the row as a vector (a scalar mask: not in every Triton)
        x0 = tl.load(x_row + i * stride_x, mask=m, other=0.0).to(tl.float32)
        acc = tl.zeros_like(w0)  # the oldest tap first, as ``_conv_block`` sums them
        if K >= 4:
            acc += x3 * w3
        if K >= 3:
            acc += x2 * w2
        if K >= 2:
            acc += x1 * w1
        acc += x0 * w0
        if HAS_BIAS:
            acc += bias
        tl.store(y_row + i * stride_y, (acc / (1.0 + tl.exp(-acc))).to(Y.dtype.element_ty),
                 mask=m)
        x3, x2, x1 = x2, x1, x0


@triton.jit
def _conv_block(X, stride_x, W, Bias, Conv, Slots, HasState, QSL, Y, stride_y, C, t, c, tm, cm,
                s, start, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):
    """``conv_kernel``'s block of any rows: each tap a load of the block's rows, shifted."""
    single = (tl.load(QSL + s + 1, mask=tm, other=0) - start) == 1
    slot = tl.load(Slots + s, mask=tm, other=0).to(tl.int64)
    has = tl.load(HasState + s, mask=tm, other=0) != 0
    m = tm[:, None] & cm[None, :]
    window = Conv + slot[:, None] * C * (K - 1) + c[None, :]  # the slot's rows [K - 1, C]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads the input K - 1 - j tokens back
        src = t - (K - 1) + j
        x = tl.load(X + src.to(tl.int64)[:, None] * stride_x + c[None, :],
                    mask=m & (src >= start)[:, None], other=0.0)
        col = src - start + (K - 1)  # the conv state's row of an earlier input
        past = tl.load(window + col[:, None] * C, mask=m & ((src < start) & has)[:, None],
                       other=0.0)
        tap = x.to(tl.float32) + past.to(tl.float32)
        if j > 0:  # a one-token sequence's new window is its taps 1 .. K - 1 (column j read)
            tl.store(window + (j - 1) * C, tap.to(Conv.dtype.element_ty),
                     mask=m & single[:, None])
        w = tl.load(W + c * K + j, mask=cm, other=0.0).to(tl.float32)
        acc += tap * w[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(Y + t.to(tl.int64)[:, None] * stride_y + c[None, :], y.to(Y.dtype.element_ty),
             mask=m)


@triton.jit(do_not_specialize_on_alignment=["Slots", "HasState", "QSL"])
def conv_state_kernel(X, stride_x, Conv, Slots, HasState, QSL, C, K: tl.constexpr,
                      KP: tl.constexpr, BC: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    start = tl.load(QSL + s)
    n = tl.load(QSL + s + 1) - start
    slot = tl.load(Slots + s).to(tl.int64)
    i = tl.arange(0, KP)
    m = (c[:, None] < C) & (i[None, :] < K - 1)
    has = (tl.zeros([BC, KP], dtype=tl.int32) + tl.load(HasState + s)) != 0
    m = m & ((tl.zeros([BC, KP], dtype=tl.int32) + n) != 1)  # else conv_kernel writes it
    pos = n - (K - 1) + i[None, :]  # input index within the sequence's new tokens
    x = tl.load(X + (start + pos) * stride_x + c[:, None], mask=m & (pos >= 0), other=0.0)
    base = Conv + slot * C * (K - 1) + c[:, None]  # the slot's rows [K - 1, C]
    old = tl.load(base + (n + i[None, :]) * C, mask=m & (pos < 0) & has, other=0.0)
    new = x.to(tl.float32) + old.to(tl.float32)
    tl.debug_barrier()  # every program's reads of the slot before any of its writes
    tl.store(base + i[None, :] * C, new.to(Conv.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize_on_alignment=["Slots", "HasState", "QSL"])
def gated_delta_kernel(QKV, stride_qkv, A, B, stride_ab, ALog, DtBias, S, Slots, HasState, QSL,
                       O, stride_o, HK, HV, scale, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
    # each program's state block is BV whole value rows of the head's [Dv, Dk] matrix: one span
    # of memory; the head's value blocks are neighbouring programs
    s = tl.program_id(2)
    hv = tl.program_id(1)
    hk = hv // (HV // HK)
    rk = tl.arange(0, BK)
    rv = tl.program_id(0) * BV + tl.arange(0, BV)
    km, vm = rk < DK, rv < DV
    start = tl.load(QSL + s)
    end = tl.load(QSL + s + 1)
    slot = tl.load(Slots + s).to(tl.int64)
    has = (tl.zeros([BV, BK], dtype=tl.int32) + tl.load(HasState + s)) != 0
    ptr = S + (slot * HV + hv) * DV * DK + rv[:, None] * DK + rk[None, :]
    sm = vm[:, None] & km[None, :]
    state = tl.load(ptr, mask=sm & has, other=0.0).to(tl.float32)
    a_log = tl.load(ALog + hv).to(tl.float32)
    dt_bias = tl.load(DtBias + hv).to(tl.float32)
    for t in range(start, end):
        row = QKV + t * stride_qkv
        q = tl.load(row + hk * DK + rk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(row + (HK + hk) * DK + rk, mask=km, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + hv * DV + rv, mask=vm, other=0.0).to(tl.float32)
        q = _l2_normalized(q, 0) * scale
        k = _l2_normalized(k, 0)
        a = tl.load(A + t * stride_ab + hv).to(tl.float32) + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        g = -tl.exp(a_log) * softplus
        b = tl.load(B + t * stride_ab + hv).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-b))
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[None, :], 1)) * beta
        state = state + delta[:, None] * k[None, :]
        o = tl.sum(state * q[None, :], 1)
        tl.store(O + t * stride_o + hv * DV + rv, o.to(O.dtype.element_ty), mask=vm)
    tl.store(ptr, state.to(S.dtype.element_ty), mask=sm)


@triton.jit(do_not_specialize=["T"])
def qk_norm_kernel(X, stride_x, Y, T, HK, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # rows r = (token, head) of the 2 * HK heads of D channels at the start of each X row
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    ok = r < T * 2 * HK
    t = (r // (2 * HK)).to(tl.int64)
    h = r % (2 * HK)
    m = ok[:, None] & (d[None, :] < D)
    x = tl.load(X + t[:, None] * stride_x + h[:, None] * D + d[None, :], mask=m,
                other=0.0).to(tl.float32)
    y = _l2_normalized(x, 1)
    row = ((h // HK) * T + t) * HK + h % HK  # Y [2 (q, k), T, HK, D]
    tl.store(Y + row[:, None] * D + d[None, :], y.to(Y.dtype.element_ty), mask=m)
