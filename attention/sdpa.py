"""The sdpa backend: torch.nn.functional.scaled_dot_product_attention over the paged cache.

Prefills of fresh prompts (nothing cached yet) of similar lengths run as one padded batch over
the step's own K/V; other prefills run one sequence at a time on its gathered K/V (causal,
offset by its cached context); decodes run as one batch over K/V gathered through the block
tables and padded, with a length mask. A layer with sinks attends one more key of value zero
whose logit is the head's sink (an additive mask gives it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedgen.attention.backend import AttentionBackend, AttentionImpl
from pagedgen.attention.eager import attention_mask
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.kv_cache import gather_kv, gather_kv_batch, write_kv


class SdpaImpl(AttentionImpl):
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        if (pre := metadata.prefill_metadata) is not None:
            self._prefill(q, k, v, kv_cache, pre, out)
        if (dec := metadata.decode_metadata) is not None:
            t0 = metadata.num_prefill_tokens
            out[t0:] = self._decode(q[t0:], kv_cache, dec)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """q [.., Hq, n, D], k/v [.., Hkv, L, D]; ``mask`` [.., n, L] (boolean, broadcast)."""
        if self.sinks is not None:
            q, k, v, mask = self._with_sink(q, k, v, mask, causal)
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.spec.scale, enable_gqa=True)

    def _with_sink(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool):
        """A zero key and value after the last, and an additive mask whose last column is each
        head's sink logit (the sink's score: q·0 + sink)."""
        n, length = q.shape[-2], k.shape[-2]
        if mask is None:
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device)
            if causal:
                mask = mask.tril(length - n)
        lead = torch.broadcast_shapes(mask.shape[:-2], q.shape[:-2])  # [.., Hq]
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf")).expand(*lead, n, length)
        sink = self.sinks.to(q.dtype)[:, None, None].expand(*lead, n, 1)
        zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
        return (q, torch.cat([k, zero], -2), torch.cat([v, zero], -2),
                torch.cat([bias, sink], -1))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 md: AttentionMetadata, out: torch.Tensor) -> None:
        qsl = [0]
        for n in md.query_lens_cpu:
            qsl.append(qsl[-1] + n)
        fresh = [i for i, (n, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu))
                 if n == seq_len]
        lens = [md.query_lens_cpu[i] for i in fresh]
        if len(fresh) > 1 and self.spec.sliding_window is None \
                and len(fresh) * max(lens) <= 2 * sum(lens):  # padding at most doubles the work
            self._prefill_fresh(q, k, v, [qsl[i] for i in fresh], lens, out)
            rest = sorted(set(range(md.num_seqs)) - set(fresh))
        else:
            rest = range(md.num_seqs)
        for i in rest:
            seq_len = md.seq_lens_cpu[i]
            q_i = q[qsl[i]:qsl[i + 1]].transpose(0, 1)  # [Hq, n, D]
            n = q_i.shape[1]
            k_i, v_i = gather_kv(kv_cache, md.block_tables[i], seq_len)
            mask = None
            simple_causal = n == seq_len and self.spec.sliding_window is None
            if not simple_causal:
                mask = attention_mask(torch.arange(seq_len - n, seq_len, device=q.device),
                                      torch.arange(seq_len, device=q.device), self.spec)
            o = self._sdpa(q_i, k_i.transpose(0, 1), v_i.transpose(0, 1), mask, simple_causal)
            out[qsl[i]:qsl[i + 1]] = o.transpose(0, 1)

    def _prefill_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       starts: list[int], lens: list[int], out: torch.Tensor) -> None:
        """Whole prompts (their K/V are this step's k, v) as one padded causal batch."""
        dev, width = q.device, max(lens)
        pos = torch.arange(width, device=dev)
        n = torch.tensor(lens, device=dev)[:, None]
        valid = pos[None, :] < n  # [B, width]
        rows = torch.tensor(starts, device=dev)[:, None] + torch.minimum(pos[None, :], n - 1)
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # causal, real keys
        o = self._sdpa(q[rows].transpose(1, 2), k[rows].transpose(1, 2), v[rows].transpose(1, 2),
                       mask[:, None], False)  # [B, Hq, width, D]
        out[rows[valid]] = o.transpose(1, 2)[valid]

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
                ) -> torch.Tensor:
        k, v = gather_kv_batch(kv_cache, md.block_tables)  # [B, L, Hkv, D]
        k_pos = torch.arange(k.shape[1], device=q.device)
        last = (md.seq_lens - 1).long()[:, None]
        mask = k_pos[None, :] <= last
        if self.spec.sliding_window is not None:
            mask &= k_pos[None, :] > last - self.spec.sliding_window
        o = self._sdpa(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                       mask[:, None, None, :], False)  # [B, Hq, 1, D]
        return o[:, :, 0, :]


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    supports_sliding_window = True
    supports_sinks = True
    reads_any_strides = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return SdpaImpl

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 512]
