"""Advance a decode batch's metadata on the device (after vLLM's advance_step).

When a decode step runs exactly the sequences of the previous decode step, in the same order,
its inputs follow from the previous ones: input ids are the tokens just sampled (already on the
device), positions, sequence and context lengths grow by one, and the block tables change only
where a sequence crossed into a new block. Those few new entries are uploaded; the slot mapping
is then computed on the device. No per-sequence Python work beyond reading lengths remains.
A model of several KV groups advances each group's tables and slot mapping alike (a window
group's table grows as group 0's does; the entries it let go stay, stale, as on the host).
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
    table_lens: list[list[int]]  # per KV group, per sequence
    next_ids: torch.Tensor | None = None


def _table(seq: Sequence, g: int) -> list[int]:
    """``seq``'s page table in KV group ``g``."""
    return seq.block_table if g == 0 else seq.group_tables[g - 1]


def _lens(seqs: list[Sequence], groups: int) -> list[list[int]]:
    return [[len(_table(s, g)) for s in seqs] for g in range(groups)]


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
        self.last = _DecodeBatch(list(seqs), positions, md, _lens(seqs, 1 + len(md.kv_groups)))

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
        positions = last.positions + 1  # rotary positions (an image prompt's are offset)
        index = old.seq_lens.long()  # the new token's index in its sequence
        groups = [self._advance(seqs, g, old.group(g), last.table_lens[g], index)
                  for g in range(1 + len(old.kv_groups))]
        md = AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=len(seqs),
            slot_mapping=groups[0][1], query_start_loc=old.query_start_loc,
            seq_lens=old.seq_lens + 1, context_lens=old.context_lens + 1,
            block_tables=groups[0][0], block_size=bs,
            seq_lens_cpu=[s.num_tokens for s in seqs], query_lens_cpu=old.query_lens_cpu,
            cascade=old.cascade,  # shared full pages never change
            state_slots=old.state_slots)  # nor do the sequences' state slots
        md.kv_groups = [md.over_pages(sm, t) for t, sm in groups[1:]]
        ids = last.next_ids
        self.num_advanced += 1
        self.last = _DecodeBatch(last.seqs, positions, md, _lens(seqs, len(groups)))
        return ids, positions, md

    def _advance(self, seqs: list[Sequence], g: int, old: AttentionMetadata, lens: list[int],
                 index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``g``'s block tables with the entries its sequences grew by uploaded, and
        the slot mapping of the tokens at ``index`` in them."""
        bs, tables = self.block_size, old.block_tables
        grown = [(r, len(_table(s, g))) for r, s in enumerate(seqs)
                 if len(_table(s, g)) != lens[r]]
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
                table = _table(seqs[r], g)
                for c in range(lens[r], n):
                    rows.append(r)
                    cols.append(c)
                    vals.append(table[c])
            upload = to_device([rows, cols, vals], torch.int64, self.device)
            tables[upload[0], upload[1]] = upload[2].to(tables.dtype)
        slots = tables.gather(1, (index // bs)[:, None]).squeeze(1).long() * bs + index % bs
        return tables, slots
