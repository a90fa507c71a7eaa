"""The metadata of one step over the paged KV cache, common to every backend, and its builder.

A step is a flat batch of tokens: the prefills' tokens first (one or more new tokens each,
possibly with tokens already cached), then the decodes' (one new token each). The builder makes
the device tensors from the scheduled sequences once per step; each backend's state then turns
this common metadata into its own (``AttentionState.build``: a subclass with a typed plan).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.attention.cascade_layout import CascadeLayout, find_layout
from pagedgen.transfer import host_tensor, to_device, upload


@dataclass
class AttentionMetadata:
    """Per-step description of a flat token batch over the paged KV cache.

    Sequences ``0 .. num_prefills-1`` are prefills (one or more new tokens, possibly with
    ``context_lens`` tokens already cached); the rest are decodes (exactly one new token).
    Device tensors:

    * ``slot_mapping`` [num_tokens] int64: cache slot (block * block_size + offset) of each new
      token.
    * ``query_start_loc`` [num_seqs + 1] int32: where each sequence's new tokens start.
    * ``seq_lens`` [num_seqs] int32: cached + new tokens per sequence after this step.
    * ``context_lens`` [num_seqs] int32: tokens already cached before this step.
    * ``block_tables`` [num_seqs, max_blocks] int32: physical block of each logical block
      (0-padded).

    ``cascade``: which decodes share which leading pages, each group's pages to be attended
    once (attention/cascade_layout.py; its rows are the decode rows, after any prefills, and
    the decode view carries it); None: plain decode.
    ``cascade_segments``: in a CUDA graph's step, the segments a level its buffers hold (at
    least ``cascade.segments()``; 0 elsewhere).
    ``state_slots`` [num_seqs] int32: each sequence's slot of recurrent state (models with
    linear-attention layers: attention/recurrent/state.py); None for other models.
    ``kv_groups``: the step over each further KV group's pages (runtime/engine/kv_groups.py:
    window layers' own page tables): the same sequences and tokens, their own slot mapping and
    block tables, no cascade; a layer of group ``g`` attends with ``group(g)``.
    ``model_inputs``: what the model reads of a step beside token ids and positions, where
    there is more (a multimodal step's image embeddings and M-RoPE positions:
    runtime/models/multimodal.py's ``StepImages``); None otherwise.
    ``image_blocks``: the step's image blocks whose tokens see each other on the layers that
    say so (attention/image_blocks.py's ``ImageBlock``: prefill rows); None: none.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    cascade: CascadeLayout | None = None
    cascade_segments: int = 0
    state_slots: torch.Tensor | None = None
    model_inputs: Any = None
    image_blocks: list | None = None
    kv_groups: list[AttentionMetadata] = field(default_factory=list, repr=False)
    _prefill: AttentionMetadata | None = field(default=None, repr=False, compare=False)
    _decode: AttentionMetadata | None = field(default=None, repr=False, compare=False)
    _recurrent: tuple | None = field(default=None, repr=False, compare=False)

    def over_pages(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor
                   ) -> AttentionMetadata:
        """This step over another KV group's pages: its own slot mapping and block tables, no
        cascade (a window's pages differ per sequence), nothing derived from this one's."""
        return dataclasses.replace(self, slot_mapping=slot_mapping, block_tables=block_tables,
                                   cascade=None, cascade_segments=0, kv_groups=[],
                                   _prefill=None, _decode=None, _recurrent=None)

    def group(self, g: int) -> AttentionMetadata:
        """The step's metadata for KV group ``g`` (0: this one)."""
        return self if g == 0 else self.kv_groups[g - 1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def cascade_levels(self) -> int:
        """Levels of grouped cascade decode this step runs (0: none)."""
        return self.cascade.num_levels if self.cascade is not None else 0

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    def recurrent_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``state_slots``; has_state [num_seqs] int32: 1 where the sequence computed tokens
        before this step, so its slot holds its state; token → sequence [num_tokens] int32)
        for layers with recurrent state: made once a step, at the first such layer."""
        if self._recurrent is None:
            dev, n = self.context_lens.device, self.num_seqs
            seqs = torch.arange(n, dtype=torch.int32, device=dev)
            token_seq = seqs if self.num_prefills == 0 else torch.repeat_interleave(
                seqs, self.query_start_loc.diff(), output_size=self.num_tokens)
            self._recurrent = (self.state_slots, (self.context_lens > 0).to(torch.int32),
                               token_seq)
        return self._recurrent

    def forget_step_tensors(self) -> None:
        """Drop the tensors a forward made from this metadata (``recurrent_inputs``): a CUDA
        graph recorded over it after an eager warm-up must make its own, inside the graph,
        or it would read the warm-up's, freed once the capture is done."""
        self._recurrent = None

    @property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """A view of the prefill sequences only (None when there are none)."""
        if self.num_prefills == 0:
            return None
        if self._prefill is None:
            self._prefill = self._slice(0, self.num_prefills, 0, self.num_prefill_tokens)
        return self._prefill

    @property
    def decode_metadata(self) -> AttentionMetadata | None:
        """A view of the decode sequences only (None when there are none)."""
        if self.num_decodes == 0:
            return None
        if self._decode is None:
            self._decode = self._slice(self.num_prefills, self.num_seqs,
                                       self.num_prefill_tokens, self.num_tokens)
        return self._decode

    def _slice(self, s0: int, s1: int, t0: int, t1: int) -> AttentionMetadata:
        """Sequences ``s0:s1`` (tokens ``t0:t1``), as this metadata's own class (a backend's
        typed fields, such as its plan, carried along)."""
        is_prefill = s0 == 0 and self.num_prefills > 0
        return dataclasses.replace(
            self,
            num_prefills=s1 - s0 if is_prefill else 0,
            num_prefill_tokens=t1 - t0 if is_prefill else 0,
            num_decode_tokens=0 if is_prefill else t1 - t0,
            slot_mapping=self.slot_mapping[t0:t1],
            query_start_loc=self.query_start_loc[s0:s1 + 1] - t0,
            seq_lens=self.seq_lens[s0:s1],
            context_lens=self.context_lens[s0:s1],
            block_tables=self.block_tables[s0:s1],
            seq_lens_cpu=self.seq_lens_cpu[s0:s1],
            query_lens_cpu=self.query_lens_cpu[s0:s1],
            cascade=None if is_prefill else self.cascade,
            state_slots=None if self.state_slots is None else self.state_slots[s0:s1],
            image_blocks=self.image_blocks if is_prefill else None,
            kv_groups=[], _prefill=None, _decode=None, _recurrent=None,
        )

    def extend(self, cls: type[AttentionMetadata], **fields) -> AttentionMetadata:
        """This metadata as ``cls`` (a backend's subclass), with ``fields`` set."""
        common = {f.name: getattr(self, f.name) for f in dataclasses.fields(AttentionMetadata)
                  if f.init and not f.name.startswith("_")}
        return cls(**common, **fields)


@dataclass
class ScheduledSeq:
    """What the builder needs to know about one sequence in a step."""

    block_table: Sequence[int]
    num_context: int  # tokens already in the cache
    num_new: int  # tokens computed this step
    state_slot: int | None = None  # its recurrent-state slot (models with linear attention)


class AttentionMetadataBuilder:
    """Builds :class:`AttentionMetadata` for a step from its scheduled sequences (CPU → device).

    ``cascade``: find the groups of a decode-only step's decodes that share leading pages
    (``AttentionMetadata.cascade``); ``mixed``: also of the decodes of a step with prefills;
    ``max_levels``: how deep groups may nest.
    """

    def __init__(self, block_size: int, device: torch.device, cascade: bool = False,
                 max_levels: int = 3, mixed: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.cascade = cascade
        self.mixed = cascade and mixed
        self.max_levels = max_levels

    def build_group(self, md: AttentionMetadata, seqs: Sequence[Sequence[int]]
                    ) -> AttentionMetadata:
        """``md``'s step over another KV group's pages: ``seqs`` holds each sequence's table in
        that group (in ``md``'s order); the slot mapping and block tables are its own."""
        bs, slots = self.block_size, []
        for table, start, n in zip(seqs, (lo - q for lo, q in zip(md.seq_lens_cpu,
                                                                     md.query_lens_cpu)),
                                   md.query_lens_cpu):
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        width = max((len(t) for t in seqs), default=0)
        tables = host_tensor([list(t) + [0] * (width - len(t)) for t in seqs], torch.int32,
                             self.device).reshape(len(seqs), width)
        return md.over_pages(to_device(slots, torch.int64, self.device),
                             upload(tables, self.device))

    def build(self, prefills: Sequence[ScheduledSeq], decodes: Sequence[ScheduledSeq]
              ) -> AttentionMetadata:
        seqs = list(prefills) + list(decodes)
        bs = self.block_size
        slots: list[int] = []
        qsl = [0]
        for s in seqs:
            for pos in range(s.num_context, s.num_context + s.num_new):
                slots.append(s.block_table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + s.num_new)
        max_blocks = max((len(s.block_table) for s in seqs), default=0)
        tables = [list(s.block_table) + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        seq_lens = [s.num_context + s.num_new for s in seqs]
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(x, dtype, dev)

        num_prefill_tokens = sum(s.num_new for s in prefills)
        recurrent = bool(seqs) and seqs[0].state_slot is not None
        tables_cpu = host_tensor(tables, torch.int32, dev).reshape(len(seqs), max_blocks)
        layout = None
        if self.cascade and decodes and (self.mixed or not prefills):
            p = len(prefills)
            layout = find_layout(tables_cpu.numpy()[p:], seq_lens[p:], bs, self.max_levels)
        return AttentionMetadata(
            num_prefills=len(prefills),
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=qsl[-1] - num_prefill_tokens,
            slot_mapping=t(slots, torch.int64),
            query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            context_lens=t([s.num_context for s in seqs], torch.int32),
            block_tables=upload(tables_cpu, dev),
            block_size=bs,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=[s.num_new for s in seqs],
            cascade=layout,
            state_slots=t([s.state_slot for s in seqs], torch.int32) if recurrent else None,
        )
