"""Grouped cascade decode: pages shared by groups of a step's decodes are attended once per
group, with all its queries, and each decode attends its own pages apart; the parts are merged
by their log-sum-exp (as FlashInfer's multi-level cascade and the Hydragen paper compute it).

Without it, each of B decodes re-reads every page it shares with others: with ``n`` = 8 samples
of a 1,024-token prompt, each sample reads the prompt's KV every step. With it, a group's pages
are read once by a prefill-shaped kernel whose queries are the group's decodes (one non-causal
sequence). Which decodes share what is :mod:`attention.cascade_layout`'s: groups in levels,
each level's groups contiguous in one sorted order of the decodes.

This module turns a layout into device tensors every cascade-capable backend reads
(:class:`CascadeInputs`, fresh for an eager step or copied into a CUDA graph's static buffers)
and merges the parts (:func:`merge`). Per level, the sorted decodes are cut into segments: each
group one segment over its pages, the decodes between groups filler segments over no keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedgen import envs
from pagedgen.attention.cascade_layout import CascadeLayout
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.transfer import to_device


@dataclass
class CascadeInputs:
    """A cascade step's device tensors (B decode rows; L levels; S segments per level).

    * ``order`` [B] int64: the decode row at each sorted position (gather the queries with it);
      ``pos`` [B] int32: each row's sorted position.
    * ``cu_q`` [L, S + 1] int32: where each level's segments start among the sorted queries;
      ``kv_lens`` [L, S] int32: the keys each segment attends; ``tables`` [L, S, width] int32:
      their pages; ``member`` [L, B] int32 (by sorted position): 1 where a group holds the row.
    * ``suffix_pages`` [B] int32: pages the row's groups attend; ``suffix_tables`` [B, width]
      and ``suffix_lens`` [B]: the row's own pages and tokens after them (at least its newest;
      CUDA-graph padding rows attend their one scratch token).
    * ``max_q``: the most queries of a segment (a CUDA graph's batch size: fixed).
    """

    order: torch.Tensor
    pos: torch.Tensor
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    tables: torch.Tensor
    member: torch.Tensor
    suffix_pages: torch.Tensor
    suffix_tables: torch.Tensor
    suffix_lens: torch.Tensor
    max_q: int
    suffix_lens_cpu: list[int]
    # per level, each group's segment index and rows (host; the last segment is always empty)
    segments: list[list[tuple[int, int]]]
    layout: CascadeLayout | None = None  # the layout these hold (static buffers: the last one)

    @property
    def num_levels(self) -> int:
        return self.cu_q.shape[0]

    @classmethod
    def for_step(cls, md: AttentionMetadata) -> CascadeInputs:
        """Fresh tensors for an eager decode step with layout ``md.cascade``."""
        lay, dev = md.cascade, md.block_tables.device
        per_layout = lay._device_inputs.get(dev)
        if per_layout is None:
            rows = len(lay.order)
            width = max(g.page_hi - g.page_lo for level in lay.levels for g in level)
            per_layout = _layout_tensors(lay, rows, rows, lay.segments(), width, dev)
            lay._device_inputs[dev] = per_layout
        *tensors, segments = per_layout
        x = cls(*tensors, torch.empty_like(md.block_tables), torch.empty_like(md.seq_lens),
                max(g.rows for level in lay.levels for g in level), [], segments, lay)
        return x._suffixes(md)

    @classmethod
    def static(cls, batch_size: int, levels: int, segments: int, width: int,
               device: torch.device) -> CascadeInputs:
        """Buffers a CUDA graph of ``batch_size`` decodes, ``levels`` levels and ``segments``
        segments a level captures (every row in one filler until :meth:`fill`)."""
        i32, b = torch.int32, batch_size
        cu_q = torch.full((levels, segments + 1), b, dtype=i32, device=device)
        cu_q[:, 0] = 0
        return cls(torch.arange(b, device=device), torch.arange(b, dtype=i32, device=device),
                   cu_q, torch.zeros(levels, segments, dtype=i32, device=device),
                   torch.zeros(levels, segments, width, dtype=i32, device=device),
                   torch.zeros(levels, b, dtype=i32, device=device),
                   torch.zeros(b, dtype=i32, device=device),
                   torch.zeros(b, width, dtype=i32, device=device),
                   torch.ones(b, dtype=i32, device=device), b, [1] * b, [[]] * levels)

    def fill(self, md: AttentionMetadata) -> CascadeInputs:
        """Copy a step's layout into these static buffers (outside any graph); returns self.
        ``md`` is padded to the buffers' batch size; its real rows are the layout's."""
        lay = md.cascade
        if self.layout is not lay:  # a new layout: its groups; the same: only the suffixes
            b, segs, width = self.order.shape[0], self.kv_lens.shape[1], self.tables.shape[2]
            *tensors, self.segments = _layout_tensors(lay, len(lay.order), b, segs, width,
                                                      self.order.device)
            for dst, src in zip((self.order, self.pos, self.cu_q, self.kv_lens, self.tables,
                                 self.member, self.suffix_pages), tensors):
                dst.copy_(src)
            self.layout = lay
        return self._suffixes(md)

    def _suffixes(self, md: AttentionMetadata) -> CascadeInputs:
        """Each row's own pages and tokens after its groups' (from this step's tables)."""
        tables, width = md.block_tables, md.block_tables.shape[1]
        cols = torch.arange(width, device=tables.device)[None, :] + self.suffix_pages[:, None]
        self.suffix_tables[:, :width].copy_(tables.gather(1, cols.clamp_(max=width - 1)))
        tokens = self.suffix_pages * md.block_size
        torch.sub(md.seq_lens, tokens, out=self.suffix_lens).clamp_(min=1)
        pages = md.cascade.suffix_pages
        self.suffix_lens_cpu = [max(1, n - (pages[r] if r < len(pages) else 0) * md.block_size)
                                for r, n in enumerate(md.seq_lens_cpu)]
        return self


def _layout_tensors(lay: CascadeLayout, n: int, b: int, segs: int, width: int,
                    dev: torch.device) -> tuple:
    """A layout of ``n`` decode rows as tensors for ``b`` rows (rows ``n:b``: padding, in no
    group), ``segs`` (at least ``lay.segments()``) segments a level and tables ``width`` pages
    wide, built on the host
    and uploaded once; and each level's groups as (segment, rows)."""
    order = lay.order + list(range(n, b))
    pos = [0] * b
    for k, r in enumerate(order):
        pos[r] = k
    levels = lay.num_levels
    cu_q = [[0] * (segs + 1) for _ in range(levels)]
    kv_lens = [[0] * segs for _ in range(levels)]
    member = [[0] * b for _ in range(levels)]
    tables = [[[0] * width for _ in range(segs)] for _ in range(levels)]
    segments: list[list[tuple[int, int]]] = [[] for _ in range(levels)]
    for li, level in enumerate(lay.levels):
        s, at = 0, 0
        for g in level:
            if g.start > at:  # the rows before this group: a filler segment
                s += 1
                cu_q[li][s] = g.start
            tables[li][s][:len(g.pages)] = g.pages
            kv_lens[li][s] = len(g.pages) * lay.block_size
            for k in range(g.start, g.end):
                member[li][k] = 1
            segments[li].append((s, g.rows))
            s += 1
            cu_q[li][s] = at = g.end
        if s + 2 > segs:  # a trailing filler and an empty segment must follow
            raise ValueError(f"a cascade level needs {s + 2} segments, the buffers hold {segs}")
        for t in range(s + 1, segs + 1):  # trailing fillers and empty segments
            cu_q[li][t] = b
    i32 = torch.int32
    return (to_device(order, torch.int64, dev), to_device(pos, i32, dev), to_device(cu_q, i32, dev),
            to_device(kv_lens, i32, dev), to_device(tables, i32, dev), to_device(member, i32, dev),
            to_device(lay.suffix_pages + [0] * (b - n), i32, dev), segments)


# heads a program of the merge kernel takes (when they divide the heads): 256 decodes x 32
# heads merged in 4.9 µs with 4, 7.5 µs with 1 on an H200 (benchmarks/cascade_kernels.py)
MERGE_HEADS = int(envs.CASCADE_MERGE_HEADS.get() or 4)


class CascadeBuffers:
    """A backend state's cascade inputs: static ones per CUDA graph (batch size, levels,
    segments a level), fresh ones for eager steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.by_graph: dict[tuple[int, int, int], CascadeInputs] = {}

    def allocate(self, batch_size: int, levels: int, segments: int, max_num_pages: int) -> None:
        """For a cascade graph of ``batch_size`` decodes, ``levels`` levels and ``segments``
        segments a level."""
        self.by_graph[batch_size, levels, segments] = CascadeInputs.static(
            batch_size, levels, segments, max_num_pages // batch_size, self.device)

    def inputs(self, md: AttentionMetadata, graph_batch_size: int | None) -> CascadeInputs:
        """The step's tensors: into the graph's buffers (``md.cascade_segments`` a level), or
        fresh for an eager step; of its decode rows (a step may carry prefills before them)."""
        if md.num_prefills:
            md = md.decode_metadata
        if graph_batch_size is None:
            return CascadeInputs.for_step(md)
        key = graph_batch_size, md.cascade.num_levels, md.cascade_segments
        return self.by_graph[key].fill(md)


def merge(out: torch.Tensor, suffix: torch.Tensor, suffix_lse: torch.Tensor,
          levels: torch.Tensor, levels_lse: torch.Tensor, x: CascadeInputs) -> torch.Tensor:
    """Attention over the union of disjoint key sets into ``out`` [B, H, D]: each row's own
    part(s) ``suffix`` [splits, B, H, D] with natural-log log-sum-exp ``suffix_lse`` [splits, B,
    H], and the levels' ``levels`` [L, B, H, D] / ``levels_lse`` [L, B, H] by sorted position
    (counted where ``x.member`` says the row is in a group). Any strides."""
    from pagedgen.attention.ops import triton_kernels as tk

    b, h, d = out.shape
    splits, num_levels = suffix.shape[0], levels.shape[0]
    hb = MERGE_HEADS if h % MERGE_HEADS == 0 else 1
    tk.cascade_merge_kernel[(b, h // hb)](
        out, suffix, suffix_lse, levels, levels_lse, x.member, x.pos,
        out.stride(0), out.stride(1), *suffix.stride()[:3], *suffix_lse.stride(),
        *levels.stride()[:3], *levels_lse.stride(), x.member.stride(0), splits, num_levels,
        D=d, SP=_pow2(splits), LP=_pow2(num_levels), HB=hb)
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
