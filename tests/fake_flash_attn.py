"""Torch models of the flash-attn family's paged entry points, with their real signatures.

They let the CPU tests drive the flash-attn backend's calls for every flavour: a wrong keyword
raises TypeError, a wrong tensor (e.g. context lengths passed as sequence lengths, a window off by
one) gives a wrong result. The real kernels are checked on the GPU (tests/test_gpu_flash_attn.py).
"""

from __future__ import annotations

import importlib.machinery
import types

import torch


def paged_reference(q: torch.Tensor, cu_q: list[int], k_cache, v_cache, seq_lens: torch.Tensor,
                    page_table: torch.Tensor, scale: float, window_left: int | None,
                    softcap: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each sequence's queries (the last tokens of the sequence: bottom-right
    causal, or every query over every key) over its first ``seq_lens[i]`` cached tokens, read
    through ``page_table``; and the log-sum-exp [H, total_q] (natural log)."""
    assert page_table.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    page = k_cache.shape[1]
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].double()
        n, L = qi.shape[0], int(seq_lens[i])
        pages = page_table[i, :-(-L // page)].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:L].double()
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:L].double()
        group = qi.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(L - n, L)[:, None]
        kpos = torch.arange(L)[None, :]
        ok = kpos <= qpos if causal else torch.ones(n, L, dtype=torch.bool)
        if window_left is not None and window_left >= 0:
            ok &= kpos >= qpos - window_left
        s = s.masked_fill(~ok, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        lses.append(s.logsumexp(-1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1).float()


def _dense_q(q):
    """[B, Sq, H, D] → flat q and cumulative query lengths."""
    b, sq = q.shape[:2]
    return q.reshape(b * sq, *q.shape[2:]), list(range(0, b * sq + 1, sq)), (b, sq)


def _run(q, cu_seqlens_q, k, v, seq_lens, page_table, scale, causal, window_left, softcap,
         with_lse=False):
    """The output ([T, H, D], or [B, Sq, H, D] for dense q) and, ``with_lse``, also FA4's
    log-sum-exp layout: [H, T] for varlen q, [B, H, Sq] for dense q."""
    shape = None
    if cu_seqlens_q is None:
        q, cu, shape = _dense_q(q)
    else:
        assert cu_seqlens_q.dtype == torch.int32
        cu = cu_seqlens_q.tolist()
    out, lse = paged_reference(q, cu, k, v, seq_lens, page_table, scale, window_left, softcap,
                               causal)
    if shape is not None:
        out = out.reshape(*shape, *out.shape[1:])
        lse = lse.reshape(lse.shape[0], *shape).permute(1, 0, 2)
    return (out, lse) if with_lse else out


# ---- FlashAttention-4: flash_attn.cute ----------------------------------------------------------

def fa4_flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                               seqused_q=None, seqused_k=None, gather_kv_indices=None,
                               page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
                               score_mod_bwd=None, mask_mod=None, block_sparse_tensors=None,
                               aux_tensors=None, aux_scalars=None, return_lse=False,
                               scheduler_metadata=None, seqlen_k_per_split=None,
                               disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
                               gather_bwd_token_chunk=None):
    assert cu_seqlens_k is None and page_table is not None and seqused_k is not None
    if cu_seqlens_q is not None:
        assert isinstance(max_seqlen_q, int) and max_seqlen_q >= 1
    assert window_size[1] in (None, 0)
    out, lse = _run(q, cu_seqlens_q, k, v, seqused_k, page_table, softmax_scale, causal,
                    window_size[0], softcap, with_lse=True)
    return out, lse if return_lse else None


def fa4_flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                      seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                      page_table=None, softmax_scale=None, causal=False, softcap=None,
                      window_size_left=None, window_size_right=None, learnable_sink=None,
                      tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                      num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                      block_sparse_tensors=None, return_lse=False, out=None, lse=None,
                      aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
                      v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
                      seqlen_k_per_split=None, disable_scheduler_metadata=False,
                      gather_bwd_recompute_p=False):
    """``flash_attn.cute.interface._flash_attn_fwd``: (out, lse, p, row_max, o_lo)."""
    assert tile_mn is None or (len(tile_mn) == 2 and tile_mn[0] % 64 == 0)
    assert softcap is None or softcap > 0  # 0.0 means none: the public function maps it
    assert window_size_right in (None, 0)
    out_, lse_ = _run(q, cu_seqlens_q, k, v, seqused_k, page_table, softmax_scale, causal,
                      window_size_left, softcap or 0.0, with_lse=True)
    if cu_seqlens_q is not None:
        # the kernel computes the first ``max_seqlen_q`` rows of each sequence (at least):
        # rows beyond keep what ``out`` / ``lse`` held (NaN here without them)
        assert isinstance(max_seqlen_q, int) and max_seqlen_q >= 1
        cu = cu_seqlens_q.tolist()
        beyond = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
        for a, b in zip(cu, cu[1:]):
            beyond[a + max_seqlen_q:b] = True
        if beyond.any():
            assert lse_.shape[-1] == q.shape[0]
            out_[beyond] = out[beyond] if out is not None else float("nan")
            lse_[:, beyond] = lse[:, beyond] if lse is not None else float("nan")
    if out is not None:  # written in place, as the real one does
        assert out.shape == out_.shape and out.dtype == q.dtype
        out_ = out.copy_(out_)
    if lse is not None:
        assert lse.shape == lse_.shape and lse.dtype == torch.float32 and lse.is_contiguous()
        lse_ = lse.copy_(lse_)
    return out_, lse_ if return_lse else None, None, None, None


# ---- FlashAttention-3: flash_attn_interface -----------------------------------------------------

def fa3_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                                cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None,
                                sm_margin=0, return_softmax_lse=False):
    assert k is None and v is None and page_table is not None
    assert window_size[1] in (-1, 0)
    return _run(q, cu_seqlens_q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale,
                causal, window_size[0], softcap)


# ---- FlashAttention-2: flash_attn -----------------------------------------------------------

def fa2_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
    assert block_table is not None and k.shape[1] % 256 == 0, "FA2 pages: multiples of 256"
    seq_lens = cu_seqlens_k.diff().to(torch.int32)
    assert max_seqlen_k == int(seq_lens.max()) and max_seqlen_q == int(cu_seqlens_q.diff().max())
    return _run(q, cu_seqlens_q, k, v, seq_lens, block_table, softmax_scale, causal,
                window_size[0], softcap)


def fa2_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
    assert block_table is not None and k_cache.shape[1] % 256 == 0, "FA2 pages: multiples of 256"
    return _run(q, None, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                window_size[0], softcap)


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__dict__.update(attrs)
    return m


def install(monkeypatch, flavour: str) -> None:
    """Put the fake modules of ``flavour`` (fa4, fa3, fa2) into sys.modules."""
    import sys

    if flavour == "fa4":
        interface = _module("flash_attn.cute.interface", _flash_attn_fwd=fa4_flash_attn_fwd)
        cute = _module("flash_attn.cute", flash_attn_varlen_func=fa4_flash_attn_varlen_func,
                       interface=interface)
        monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn", cute=cute))
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    elif flavour == "fa3":
        monkeypatch.setitem(sys.modules, "flash_attn_interface", _module(
            "flash_attn_interface", flash_attn_with_kvcache=fa3_flash_attn_with_kvcache))
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", _module(
            "flash_attn", flash_attn_varlen_func=fa2_flash_attn_varlen_func,
            flash_attn_with_kvcache=fa2_flash_attn_with_kvcache))
        monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", _module("flash_attn_2_cuda"))
