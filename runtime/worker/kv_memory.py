"""The KV cache's memory: the tensors its layers write into, what a page costs, and how many
pages a sequence holds.

The pages of every KV group come from one pool (``kv_groups.py``, ``block_manager.py``), so a
page id is the same bytes everywhere: one page of each slab, a [pages, 2, page size, KV heads,
head size] tensor (``backend.get_kv_cache_shape``, of the slab's widest layer) that one layer of
each group writes, or a share of it (a layer of fewer KV heads or narrower heads: a view of its
share of every page). A group whose backend lays its cache out otherwise (flash-attn keeps K
and V apart) sees the slab through that backend's view, with the slab's strides (only backends
that read any strides share slabs with another: ``registry.backends_for_groups``). A model of
one group has a slab per layer, as before groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedgen import buffers
from pagedgen.attention.backend import AttentionBackend, LayerSpec
from pagedgen.runtime.engine.kv_groups import KVLayout


class KVMemory:
    """The slabs of ``layout`` for layers ``specs`` in pages of ``block_size`` tokens, laid out
    as ``backend`` lays a cache out; ``group_backends``: each group's, where they differ."""

    def __init__(self, backend: type[AttentionBackend], specs: Sequence[LayerSpec],
                 layout: KVLayout, block_size: int, dtype: torch.dtype,
                 device: torch.device,
                 group_backends: Sequence[type[AttentionBackend]] | None = None) -> None:
        self.backend, self.layout, self.specs = backend, layout, list(specs)
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.group_backends = list(group_backends or [backend] * len(layout.groups))
        self.layer_backends = [self.group_backends[g] for g in layout.group_of()]
        widest: dict[int, LayerSpec] = {}  # each slab's shape: its widest layer's
        for layer, slot in enumerate(layout.slots):
            s = specs[layer]
            if slot not in widest or s.num_kv_heads * s.head_size > \
                    widest[slot].num_kv_heads * widest[slot].head_size:
                widest[slot] = s
        self.slab_specs = [widest[j] for j in range(layout.num_slabs)]
        self.layer_bytes = [self._page(s) for s in specs]
        self.windows = [s.sliding_window for s in specs]
        self.slabs: list[torch.Tensor] = []

    def _page(self, s: LayerSpec) -> int:
        return math.prod(self.backend.get_kv_cache_shape(
            1, self.block_size, s.num_kv_heads, s.head_size)) * self.dtype.itemsize

    def page_bytes(self) -> int:
        """Bytes one page of the pool takes (a page of every slab)."""
        return sum(self._page(s) for s in self.slab_specs)

    def block_bytes(self) -> int:
        """Bytes one block of tokens takes across every layer (what a token costs where every
        layer holds it)."""
        return sum(self.layer_bytes)

    def read_bytes(self, context: int) -> float:
        """K/V bytes a decode of ``context`` tokens reads over every layer (a window layer: its
        window's)."""
        return sum(b / self.block_size * (context if w is None else min(context, w))
                   for b, w in zip(self.layer_bytes, self.windows))

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        """The slabs of ``num_blocks`` pages (zeros), and each attention layer's view: its
        slab, or its share of the slab in its backend's layout."""
        self.slabs = [buffers.zeros(self.backend.get_kv_cache_shape(
            num_blocks, self.block_size, s.num_kv_heads, s.head_size), self.dtype, self.device)
            for s in self.slab_specs]
        return [self._view(layer) for layer in range(len(self.specs))]

    def _view(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s cache: its share of its slab's pages, as its backend lays it out."""
        slot, s, backend = self.layout.slots[layer], self.specs[layer], self.layer_backends[layer]
        slab, (share, _) = self.slabs[slot], self.layout.share(layer)
        wide = self.slab_specs[slot]
        if backend is self.backend and (s.num_kv_heads, s.head_size) == \
                (wide.num_kv_heads, wide.head_size):
            return slab
        n = self.block_size * s.num_kv_heads * s.head_size  # one page's K (or V) of the layer
        pages = self.backend.blocks_view(slab).flatten(2)  # [pages, 2, page * heads * size]
        mine = pages[:, :, share * n:(share + 1) * n].unflatten(
            2, (self.block_size, s.num_kv_heads, s.head_size))
        return backend.from_blocks_view(mine)

    def free(self) -> None:
        self.slabs = []

    def seq_pages(self, tokens: int) -> int:
        """The most pages one sequence of ``tokens`` tokens holds over every group while it
        decodes (a window group: its window's; a prefill chunk holds more for a step, and the
        scheduler cuts a chunk to the pages free)."""
        bs, n = self.block_size, -(-tokens // self.block_size)
        for group in self.layout.groups[1:]:
            w = group.window
            n += -(-tokens // bs) if w is None else min(-(-tokens // bs), -(-w // bs) + 1)
        return n

    def context_cap(self, num_blocks: int) -> int:
        """The longest sequence ``num_blocks`` pages hold (one held back: the scratch block)."""
        lo, hi = 0, (num_blocks - 1) * self.block_size
        while lo < hi:  # the pages a sequence holds grow with its length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.seq_pages(mid) <= num_blocks - 1 else (lo, mid - 1)
        return lo

    def summary(self, num_blocks: int, peak_held: list[int]) -> dict:
        """The run summary's KV groups: each one's window, layers and the most tokens its
        pages held at once, beside the pool's pages and token slots."""
        groups = self.layout.describe()
        mixed = len(set(self.group_backends)) > 1
        for g, peak, backend in zip(groups, peak_held, self.group_backends):
            g["peak_tokens_held"] = peak * self.block_size
            if mixed:
                g["backend"] = backend.name
        out = {"kv_cache_blocks": num_blocks, "kv_cache_bytes": num_blocks * self.page_bytes(),
               "kv_cache_token_slots": num_blocks * self.block_size, "kv_groups": groups}
        if len(groups) > 1:  # the table's view: each group's most tokens at once
            out["kv_peak_tokens_held"] = {
                f"group {i} ({'full' if g['window'] is None else 'window ' + str(g['window'])}"
                f", {g['layers']} layers)": g["peak_tokens_held"] for i, g in enumerate(groups)}
        if self.layout.note:
            out["kv_groups_note"] = self.layout.note
        return out
