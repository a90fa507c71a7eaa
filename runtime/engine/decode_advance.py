"""Advance a decode batch's metadata on the device (after vLLM's advance_step).

When a decode step runs exactly the sequences of the previous decode step, in the same order,
its inputs follow from the previous ones: input ids are the tokens just sampled (already on the
device), positions, sequence and context lengths grow by one, and the block tables change only
where a sequence crossed into a new block. Those few new entries are uploaded; the slot mapping
is then computed on the device. No per-sequence Python work beyond reading lengths remains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.transfer import to_device


@dataclass
class _DecodeBatch:
    seqs: list[Sequence]
    positions: torch.Tensor
    md: AttentionMetadata
    table_lens: list[int]
    next_ids: torch.Tensor | None = None


class DecodeAdvancer:
    def __init__(self, block_size: int, pad_block: int, device: torch.device) -> None:
        self.block_size = block_size
        self.pad_block = pad_block
        self.device = device
        self.last: _DecodeBatch | None = None
        self.num_advanced = 0

    def remember(self, seqs: list[Sequence], positions: torch.Tensor, md: AttentionMetadata
                 ) -> None:
        """Record a decode-only step that was built on the CPU."""
        self.last = _DecodeBatch(list(seqs), positions, md, [len(s.block_table) for s in seqs])

    def sampled(self, tokens: torch.Tensor) -> None:
        """The tokens just sampled for the remembered step, in its order (on the device)."""
        if self.last is not None:
            self.last.next_ids = tokens

    def forget(self) -> None:
        self.last = None

    def can_advance(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` are exactly the last decode step's, in order, with its tokens."""
        last = self.last
        return (last is not None and last.next_ids is not None and len(seqs) == len(last.seqs)
                and all(a is b for a, b in zip(seqs, last.seqs)))

    def advance(self, seqs: list[Sequence]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None:
        """Inputs for a decode step of ``seqs``, or None when they are not the last batch."""
        last = self.last
        if not self.can_advance(seqs):
            return None
        bs, old = self.block_size, last.md
        positions = last.positions + 1
        tables = old.block_tables
        grown = [(r, len(s.block_table)) for r, s in enumerate(seqs)
                 if len(s.block_table) != last.table_lens[r]]
        if grown:
            width = max(n for _, n in grown)
            if width > tables.shape[1]:
                pad = torch.full((tables.shape[0], width - tables.shape[1]), self.pad_block,
                                 dtype=tables.dtype, device=tables.device)
                tables = torch.cat([tables, pad], dim=1)
            else:
                tables = tables.clone()
            rows, cols, vals = [], [], []
            for r, n in grown:
                for c in range(last.table_lens[r], n):
                    rows.append(r)
                    cols.append(c)
                    vals.append(seqs[r].block_table[c])
            upload = to_device([rows, cols, vals], torch.int64, self.device)
            tables[upload[0], upload[1]] = upload[2].to(tables.dtype)
        slots = tables.gather(1, (positions // bs)[:, None]).squeeze(1).long() * bs + positions % bs
        md = AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=len(seqs),
            slot_mapping=slots, query_start_loc=old.query_start_loc, seq_lens=old.seq_lens + 1,
            context_lens=old.context_lens + 1, block_tables=tables, block_size=bs,
            seq_lens_cpu=[s.num_tokens for s in seqs], query_lens_cpu=old.query_lens_cpu,
            cascade=old.cascade,  # shared full pages never change
            state_slots=old.state_slots)  # nor do the sequences' state slots
        ids = last.next_ids
        self.num_advanced += 1
        self.last = _DecodeBatch(last.seqs, positions, md, [len(s.block_table) for s in seqs])
        return ids, positions, md
