"""pagedgen's own paged-attention kernels, in Triton.

* ``write_kv_kernel``: reshape-and-cache, one program per new token, every KV head at once
  (K and V page views of the same strides: either cache layout; see kv_cache.write_kv_triton).
* ``prefill_kernel``: causal attention of new tokens (with prior cached context) over K/V read
  through the block table; FlashAttention-style online softmax over BLOCK_N-token tiles. The
  query heads of one KV head are processed together: a tile's rows are (token, head) pairs.
* ``decode_kernel``: one query token per sequence; the G query heads of a KV head form the rows
  of a [G, D] x [D, BLOCK_N] product. Long contexts are split across programs (split-KV /
  flash-decoding) and ``merge_kernel`` combines the partial results by their log-sum-exp.
* ``cascade_merge_kernel``: the same merge for a decode's own keys and the pages its groups
  attended once (grouped cascade decode, attention/cascade.py).

All accumulate in float32. Sliding window: keys ``pos - window < j <= pos``. Soft-cap:
``cap * tanh(s / cap)``. Kernels run compiled on CUDA GPUs and, for tests, under
``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def write_kv_kernel(K, V, KCache, VCache, Slots, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_cs, stride_ch, H, PAGE, k_scale, v_scale,
                    HP: tl.constexpr, D: tl.constexpr):
    # Stores x / scale (rounded to the cache's dtype: FP8 caches hold scaled values; the
    # scales are 1.0 for 16-bit caches, where the division is exact).
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = h < H
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask).to(tl.float32) / k_scale
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask).to(tl.float32) / v_scale
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


# Arguments that change from step to step (the block table's width, metadata rows sliced at the
# step's first decode) are not specialized on: each value class would be another variant,
# compiled the first time a run's step meets it (runtime/worker/jit_monitor.py counts them).
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["BlockTables", "Sinks", "QStartLoc", "ContextLens",
                                            "TileSeq", "TileQStart"])
def prefill_kernel(Q, Cache, Out, Lse, BlockTables, Sinks, QStartLoc, ContextLens, TileSeq,
                   TileQStart,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                   stride_cb, stride_c2, stride_cs, stride_ch, stride_bt,
                   scale, v_scale, soft_cap, window, G, G_TILE, PAGE,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                   CAUSAL: tl.constexpr = True, WRITE_LSE: tl.constexpr = False,
                   USE_SINKS: tl.constexpr = False, DV: tl.constexpr = 0):
    # DV (0: D): the output columns a program makes, the third grid axis choosing which; every
    # program of a tile computes the whole of Q K^T, so a split trades those FLOPs for an
    # accumulator of [BLOCK_M, DV] (heads of 512: half of one, and tiles twice as tall).
    # An FP8 cache's K and V are read in the queries' dtype: ``scale`` carries K's scale,
    # ``v_scale`` multiplies the output.
    # CAUSAL=False: every query sees exactly the ``ctx`` cached keys and none of the new tokens
    # (cascade: the batch's decode queries over their shared prefix). WRITE_LSE: also store
    # each row's natural-log log-sum-exp at Lse[token, head]. USE_SINKS: each head's
    # Sinks[head] logit joins the softmax with a zero value (the running max and sum start
    # from it).
    tile = tl.program_id(0)
    hp = tl.program_id(1)
    kvh = hp // (G // G_TILE)
    g0 = (hp % (G // G_TILE)) * G_TILE
    seq = tl.load(TileSeq + tile)
    qs = tl.load(TileQStart + tile)
    q_off = tl.load(QStartLoc + seq)
    q_len = tl.load(QStartLoc + seq + 1) - q_off
    ctx = tl.load(ContextLens + seq)
    block_q = BLOCK_M // G_TILE
    r = tl.arange(0, BLOCK_M)
    tok = qs + r // G_TILE
    head = kvh * G + g0 + r % G_TILE
    row_ok = (tok >= 0) & (tok < q_len)  # a tile may start before the step's first token
    q_pos = ctx + tok
    d = tl.arange(0, D)
    DV_: tl.constexpr = D if DV == 0 else DV
    dv = tl.program_id(2) * DV_ + tl.arange(0, DV_)
    q = tl.load(Q + (q_off + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    hi = ctx  # keys [lo, hi) can be seen by this tile
    if CAUSAL:
        hi = ctx + tl.minimum(qs + block_q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + qs - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        m_i = tl.load(Sinks + head).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, DV_], tl.float32)
    for n in range(lo, hi, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        kv_ok = offs < hi
        blk = tl.load(BlockTables + seq * stride_bt + offs // PAGE, mask=kv_ok,
                      other=0).to(tl.int64)  # pages past 2**31 elements
        row = Cache + blk[:, None] * stride_cb + (offs % PAGE)[:, None] * stride_cs \
            + kvh * stride_ch
        k = tl.load(row + d[None, :], mask=kv_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = soft_cap * _tanh(s / soft_cap)
        ok = (offs[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if not CAUSAL:
            ok = kv_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            ok = ok & (offs[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(row + stride_c2 + dv[None, :], mask=kv_ok[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(Out + (q_off + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:  # each split's the same
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(Lse + (q_off + tok) * stride_lt + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["stride_bt", "stride_ps", "stride_ls", "num_splits"],
            do_not_specialize_on_alignment=["BlockTables", "SeqLens", "Sinks"])
def decode_kernel(Q, Cache, Out, OutPart, LsePart, BlockTables, SeqLens, Sinks,
                  stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_cb, stride_c2, stride_cs, stride_ch, stride_bt,
                  stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  scale, v_scale, soft_cap, window, num_splits, G, PAGE,
                  GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  DIRECT: tl.constexpr, PRECISION: tl.constexpr,
                  USE_SINKS: tl.constexpr = False):
    # USE_SINKS: each head's Sinks[head] logit joins the softmax with a zero value, in split 0
    # only (the merge then counts it once). FP8 caches: as in ``prefill_kernel``.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    lo = start // BLOCK_N * BLOCK_N
    n_tiles = tl.cdiv(seq_len - lo, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, n_tiles)
    g = tl.arange(0, GP)
    head = kvh * G + g
    g_ok = g < G
    d = tl.arange(0, D)
    q = tl.load(Q + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if USE_SINKS:
        first = g_ok & (split == 0)
        m_i = tl.where(first, tl.load(Sinks + head, mask=g_ok, other=0.0).to(tl.float32), m_i)
        l_i = tl.where(first, 1.0, 0.0)
    acc = tl.zeros([GP, D], tl.float32)
    for t in range(t0, t1):
        offs = lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = (offs < seq_len) & (offs >= start)
        blk = tl.load(BlockTables + seq * stride_bt + offs // PAGE, mask=kv_ok,
                      other=0).to(tl.int64)  # pages past 2**31 elements
        kp = Cache + blk[:, None] * stride_cb + (offs % PAGE)[:, None] * stride_cs \
            + kvh * stride_ch + d[None, :]
        k = tl.load(kp, mask=kv_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kp + stride_c2, mask=kv_ok[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if DIRECT:
        tl.store(Out + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None])
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(OutPart + split * stride_ps + seq * stride_pt + head[:, None] * stride_ph
                 + d[None, :], out, mask=g_ok[:, None])
        tl.store(LsePart + split * stride_ls + seq * stride_lt + head, lse, mask=g_ok)


@triton.jit(do_not_specialize=["stride_ps", "stride_ls", "num_splits"])
def merge_kernel(Out, OutPart, LsePart, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph,
                 stride_ls, stride_lt, num_splits, D: tl.constexpr, SP: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    s_ok = s < num_splits
    lse = tl.load(LsePart + s * stride_ls + seq * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    w = w / tl.sum(w, 0)
    d = tl.arange(0, D)
    part = tl.load(OutPart + s[:, None] * stride_ps + seq * stride_pt + h * stride_ph + d[None, :],
                   mask=s_ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(Out + seq * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))


@triton.jit
def cascade_merge_kernel(Out, Suf, SufLse, Lvl, LvlLse, Member, Pos, stride_ot, stride_oh,
                         stride_ss, stride_st, stride_sh, stride_lss, stride_lst, stride_lsh,
                         stride_vl, stride_vt, stride_vh, stride_ll, stride_lt, stride_lh,
                         stride_ml, num_splits, num_levels,
                         D: tl.constexpr, SP: tl.constexpr, LP: tl.constexpr,
                         HB: tl.constexpr):
    """Out[t, h] = the softmax-weighted union of attentions of query (t, h) over disjoint key
    sets, from each part's output and natural-log log-sum-exp: ``num_splits`` parts of the row's
    own keys (Suf, by row) and one per level whose group holds the row (Lvl, by the row's sorted
    position ``Pos[t]``, where ``Member[level, position]`` is set): grouped cascade decode.
    A program merges heads ``HB * program_id(1)`` to ``+ HB`` of row ``program_id(0)``."""
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
    p = tl.load(Pos + t)
    s = tl.arange(0, SP)
    s_ok = s < num_splits
    lse_s = tl.load(SufLse + s[:, None] * stride_lss + t * stride_lst + h[None, :] * stride_lsh,
                    mask=s_ok[:, None], other=float("-inf"))  # [SP, HB]
    lv = tl.arange(0, LP)
    l_ok = lv < num_levels
    l_ok = l_ok & (tl.load(Member + lv * stride_ml + p, mask=l_ok, other=0) != 0)
    lse_l = tl.load(LvlLse + lv[:, None] * stride_ll + p * stride_lt + h[None, :] * stride_lh,
                    mask=l_ok[:, None], other=float("-inf"))  # [LP, HB]
    m = tl.maximum(tl.max(lse_s, 0), tl.max(lse_l, 0))  # [HB]
    ok_s = s_ok[:, None] & (lse_s > float("-inf"))
    ok_l = l_ok[:, None] & (lse_l > float("-inf"))
    w_s = tl.where(ok_s, tl.exp(lse_s - m[None, :]), 0.0)
    w_l = tl.where(ok_l, tl.exp(lse_l - m[None, :]), 0.0)
    d = tl.arange(0, D)
    suf = tl.load(Suf + s[:, None, None] * stride_ss + t * stride_st
                  + h[None, :, None] * stride_sh + d[None, None, :],
                  mask=ok_s[:, :, None], other=0.0).to(tl.float32)  # [SP, HB, D]
    lvl = tl.load(Lvl + lv[:, None, None] * stride_vl + p * stride_vt
                  + h[None, :, None] * stride_vh + d[None, None, :],
                  mask=ok_l[:, :, None], other=0.0).to(tl.float32)  # [LP, HB, D]
    out = (tl.sum(suf * w_s[:, :, None], 0) + tl.sum(lvl * w_l[:, :, None], 0)) \
        / (tl.sum(w_s, 0) + tl.sum(w_l, 0))[:, None]
    tl.store(Out + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty))
