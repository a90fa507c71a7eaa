"""KV groups by layer kind: which attention layers share a page table, and which tensors hold
their pages.

A layer attends to every token so far (full attention) or to the last W positions (a sliding
window). Where a model mixes the two (gpt-oss 1:1 with W = 128; Gemma 2 1:1, Gemma 3 5:1), a
window layer needs the pages of its window only, not of every token: a group is a set of layers
of one kind, with one page table per sequence (``block_manager.py``), and a window group's
table lets its pages go as the window slides. Group 0 holds every token (the model's full
layers; in a model of windows only, its first window's layers, which then keep every page).

Every group takes its pages from one pool, so the memory goes where the running sequences need
it: a page id means the same bytes in every group. So groups hold equally many slabs (the
fewest of any kind: a kind with more is split; its last group padded where the count does not
divide, as vLLM's hybrid KV cache manager does), and the K/V tensors are shared: layer ``j`` of
every group uses slab ``j`` (``KVLayout.slots``), a [pages, 2, page, KV heads, head size] tensor
of the widest layer's shape. Where layers' KV shapes differ (Gemma 4: window layers of 16 KV
heads of 256, global ones of 4 of 512), a narrower kind shares a slab's page among layers
(``KVLayout.shares``: layer ``j`` of such a group takes share ``j // slabs`` of slab
``j % slabs``; Gemma 4's global layers two to a page), so every page id still means the same
bytes, the pages are of one byte size, and a window group's pages save memory whatever its
shape. Only widths that do not divide the widest fall back to a tensor per layer
(``KVLayout.note`` says so).

Hand-written: the grouping follows the design vLLM documents (docs/design/hybrid_kv_cache_manager)
in a few lines of our own; no library plans KV memory for another engine's kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedgen.attention.backend import AttentionBackend, LayerSpec
from pagedgen.attention.registry import backends_for_groups


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one page table: ``window`` None holds every token."""

    window: int | None
    layers: tuple[int, ...]  # attention-layer indices, in model order


@dataclass(frozen=True)
class KVLayout:
    """A model's KV groups (group 0 first), each attention layer's slab (its index within its
    group, modulo the slabs) and share of the slab's page (share, shares: 0, 1 where the layer
    is as wide as the slab), how many slabs there are, and what the summary should say of it
    (why every layer is in one group, or why the groups save no memory), if anything."""

    groups: tuple[KVGroup, ...]
    slots: tuple[int, ...]
    num_slabs: int
    note: str | None = None
    shares: tuple[tuple[int, int], ...] = ()

    def share(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s (share, shares) of its slab's page."""
        return self.shares[layer] if self.shares else (0, 1)

    @property
    def windows(self) -> list[int | None]:
        """Each group's window after group 0 (the block manager's ``windows``)."""
        return [g.window for g in self.groups[1:]]

    def fills(self, group: KVGroup) -> bool:
        """Whether ``group``'s layers fill their slabs' pages (each is as wide as its slab)."""
        return all(self.share(i)[1] == 1 for i in group.layers)

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
    kinds: dict[tuple[int | None, int, int], list[int]] = {}  # (window, KV heads, head size)
    for i, s in enumerate(specs):
        kinds.setdefault((s.sliding_window, s.num_kv_heads, s.head_size), []).append(i)
    if len({k[0] for k in kinds}) < 2:  # one window (or none): every page held anyway
        return one_group(n)
    if not enabled:
        return one_group(n, "off (kv_cache_groups: false)")
    # group 0: full attention (the widest such kind), else the widest window (its pages kept)
    order = sorted(kinds, key=lambda k: (k[0] is not None, -(k[0] or 0), -k[1] * k[2]))
    widest = max(k[1] * k[2] for k in kinds)
    if any(widest % (k[1] * k[2]) for k in kinds):  # a tensor per layer
        groups = [KVGroup(None if i == 0 else k[0], tuple(kinds[k]))
                  for i, k in enumerate(order)]
        return KVLayout(tuple(groups), tuple(range(n)), n,
                        "its layers' KV widths do not divide one another: every layer keeps a "
                        "tensor of its own, so the window groups' pages save no memory")
    per_page = {k: widest // (k[1] * k[2]) for k in kinds}  # layers sharing a slab's page
    size = min(-(-len(kinds[k]) // per_page[k]) for k in kinds)  # slabs
    groups, slots, shares = [], [0] * n, [(0, 1)] * n
    for k in order:
        layers, span = kinds[k], size * per_page[k]
        for start in range(0, len(layers), span):
            part = tuple(layers[start:start + span])
            groups.append(KVGroup(None if not groups else k[0], part))
            for j, layer in enumerate(part):
                slots[layer], shares[layer] = j % size, (j // size, per_page[k])
    return KVLayout(tuple(groups), tuple(slots), size, shares=tuple(shares))


def group_backends(specs: Sequence[LayerSpec], layout: KVLayout, name: str,
                   device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, model: str
                   ) -> tuple[type[AttentionBackend], list[type[AttentionBackend]]]:
    """The backend whose layout the slabs take, and each group's (``backends_for_groups``)."""
    return backends_for_groups(name, device, [[specs[i] for i in g.layers]
                                              for g in layout.groups],
                               dtype, kv_dtype, model, [layout.fills(g) for g in layout.groups])


def model_layout(model: str, device: torch.device, dtype: str = "auto"
                 ) -> tuple[list[LayerSpec], KVLayout, torch.dtype, torch.dtype]:
    """The attention layers and KV groups ``model`` (a preset, checkpoint or Hub id) plans at
    its defaults, with its query and KV dtypes on ``device``: what ``pagedgen backends
    --model`` and ``verify`` show, read from the config alone (no weights)."""
    from pagedgen.runtime.config import EngineConfig
    from pagedgen.runtime.models import registry
    from pagedgen.runtime.models.loader import resolve_model

    cfg = EngineConfig(model=model, dtype=dtype)
    hf = resolve_model(model).hf_config
    specs = registry.model_class(hf).layer_specs(hf, 1)
    t = cfg.torch_dtype(device)
    return specs, plan_layout(specs, cfg.kv_cache_groups), t, cfg.cache_dtype(t)
