"""KV groups by layer kind: which attention layers share a page table, and which tensors hold
their pages.

A layer attends to every token so far (full attention) or to the last W positions (a sliding
window). Where a model mixes the two (gpt-oss 1:1 with W = 128; Gemma 2 1:1, Gemma 3 5:1), a
window layer needs the pages of its window only, not of every token: a group is a set of layers
of one kind, with one page table per sequence (``block_manager.py``), and a window group's
table lets its pages go as the window slides. Group 0 holds every token (the model's full
layers; in a model of windows only, its first window's layers, which then keep every page).

Every group takes its pages from one pool, so the memory goes where the running sequences need
it: a page id means the same bytes in every group. So groups hold equally many layers (the
fewest of any kind: a kind with more is split; its last group padded where the count does not
divide, as vLLM's hybrid KV cache manager does), and the K/V tensors are shared: layer ``j`` of
every group uses slab ``j`` (``KVLayout.slots``), a [pages, 2, page, KV heads, head size] tensor.
That needs one KV shape (heads and head size) for every layer; where layers differ (Gemma 4's
512-wide global heads), the groups are planned the same but every layer keeps a tensor of its
own, so a window group's pages save no memory yet (``KVLayout.note`` says so).

Hand-written: the grouping follows the design vLLM documents (docs/design/hybrid_kv_cache_manager)
in a few lines of our own; no library plans KV memory for another engine's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedgen.attention.backend import LayerSpec


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one page table: ``window`` None holds every token."""

    window: int | None
    layers: tuple[int, ...]  # attention-layer indices, in model order


@dataclass(frozen=True)
class KVLayout:
    """A model's KV groups (group 0 first), each attention layer's slab (its index within its
    group), how many slabs there are, and what the summary should say of it (why every layer
    is in one group, or why the groups save no memory), if anything."""

    groups: tuple[KVGroup, ...]
    slots: tuple[int, ...]
    num_slabs: int
    note: str | None = None

    @property
    def windows(self) -> list[int | None]:
        """Each group's window after group 0 (the block manager's ``windows``)."""
        return [g.window for g in self.groups[1:]]

    def group_of(self) -> list[int]:
        """Each attention layer's group."""
        out = [0] * len(self.slots)
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return out

    def describe(self) -> list[dict]:
        """The summary's view: each group's kind and layer count."""
        return [{"window": g.window, "layers": len(g.layers)} for g in self.groups]


def one_group(n: int, why: str | None = None) -> KVLayout:
    """Every layer in one group of full pages, each its own tensor (the layout before groups)."""
    return KVLayout((KVGroup(None, tuple(range(n))),), tuple(range(n)), n,
                    why and f"one group: {why}")


def plan_layout(specs: Sequence[LayerSpec], enabled: bool = True) -> KVLayout:
    """The KV groups of a model with these attention layers (``enabled`` False: one group)."""
    n = len(specs)
    kinds: dict[int | None, list[int]] = {}
    for i, s in enumerate(specs):
        kinds.setdefault(s.sliding_window, []).append(i)
    if len(kinds) < 2:
        return one_group(n)
    if not enabled:
        return one_group(n, "off (kv_cache_groups: false)")
    # group 0: full attention, else the widest window (its pages then all kept)
    order = sorted(kinds, key=lambda w: (w is not None, -(w or 0)))
    if len({(s.num_kv_heads, s.head_size) for s in specs}) > 1:  # a tensor per layer
        groups = [KVGroup(None if i == 0 else w, tuple(kinds[w])) for i, w in enumerate(order)]
        return KVLayout(tuple(groups), tuple(range(n)), n,
                        "its layers' KV shapes differ: every layer keeps a tensor of its own, "
                        "so the window groups' pages save no memory yet")
    size = min(len(layers) for layers in kinds.values())
    groups, slots = [], [0] * n
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), size):
            part = tuple(layers[start:start + size])
            groups.append(KVGroup(None if not groups else w, part))
            for j, layer in enumerate(part):
                slots[layer] = j
    return KVLayout(tuple(groups), tuple(slots), size)
