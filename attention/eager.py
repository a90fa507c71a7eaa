"""The eager backend: the oracle every other backend is checked against.

For each sequence it gathers K/V through the block table and computes softmax(QKᵀ·scale)V in
float32 with an explicit causal (and optional sliding-window) mask and logits soft-cap; a layer
with sinks adds each head's sink logit as one more column of the softmax, of value zero.
Slow and simple on purpose; runs on CPU and GPU. With the state's ``batch_invariant``
(``--batch-invariant``, its backend on a CPU) each query row is computed alone over exactly the
keys it sees: a CPU BLAS rounds a row by its place among the rows, and a softmax or product
over more keys (masked ones too) sums in another order; so a token's output is the same bits
in any batch, chunk or step, prefill or decode.
"""

from __future__ import annotations

import torch

from pagedgen.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionState,
    AttentionType,
    LayerSpec,
)
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.kv_cache import gather_kv, write_kv
from pagedgen.attention.ops.softmax import attention_probs, dequantize


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Boolean [q, k] mask of allowed pairs: causal, then the sliding window if any."""
    if spec.attn_type == AttentionType.ENCODER:
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if spec.sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - spec.sliding_window
    return allowed


class EagerState(AttentionState):
    """The base state, and the mode's switch: each query row alone (``--batch-invariant``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_invariant = False


class EagerImpl(AttentionImpl):
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping, self.state.k_scale, self.state.v_scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        st, spec = self.state, self.spec
        out = torch.empty_like(q)
        group = spec.num_heads // spec.num_kv_heads
        qsl = metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q_i = q[qsl[i]:qsl[i + 1]].float()  # [n, Hq, D]
            n = q_i.shape[0]
            k_i, v_i = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            k_i = dequantize(k_i, st.k_scale).repeat_interleave(group, dim=1)
            v_i = dequantize(v_i, st.v_scale).repeat_interleave(group, dim=1)
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            allowed = attention_mask(q_pos, torch.arange(seq_len, device=q.device), spec)
            if st.batch_invariant:
                out[qsl[i]:qsl[i + 1]] = self._rows_alone(q_i, k_i, v_i, allowed).to(q.dtype)
                continue
            scores = torch.einsum("qhd,khd->hqk", q_i, k_i) * spec.scale
            probs = self._probs(scores, ~allowed)
            out[qsl[i]:qsl[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v_i).to(q.dtype)
        return out

    def _probs(self, scores: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
        return attention_probs(scores, self.spec.logits_soft_cap, self.sinks, masked)

    def _rows_alone(self, q_i: torch.Tensor, k_i: torch.Tensor, v_i: torch.Tensor,
                    allowed: torch.Tensor) -> torch.Tensor:
        """Each query row of one sequence (float32, [n, Hq, D]) over exactly the keys it
        sees (``allowed`` [n, keys], ``attention_mask``'s: a run of keys a row)."""
        first = allowed.int().argmax(1).tolist()
        ends = (allowed.shape[1] - allowed.flip(1).int().argmax(1)).tolist()
        rows = []
        for r, (lo, hi) in enumerate(zip(first, ends)):
            scores = torch.einsum("hd,khd->hk", q_i[r], k_i[lo:hi]) * self.spec.scale
            rows.append(torch.einsum("hk,khd->hd", self._probs(scores), v_i[lo:hi]))
        return torch.stack(rows)


class EagerBackend(AttentionBackend):
    name = "eager"
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True
    supports_fp8_kv_cache = True
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    reads_any_strides = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return EagerImpl

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return EagerState

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 512]
