"""The order queued requests are admitted in: requests whose prompts share a prefix together.

An offline batch knows its requests ahead, and its output is put back in input order at the
end, so the engine may admit them in any order. Admitted in input order, requests behind the
same document, few-shot block or system prompt can sit far apart: by the time the next one
comes, the prefix cache may have evicted their shared blocks (computed again), and the decodes
of a step share pages with few others (small cascade groups, little reuse in the GPU's cache).

``prefix_grouped`` moves each request next to the earlier ones it shares leading tokens with,
in blocks of ``GROUP_TOKENS``: the order is a walk of the prompts' prefix tree in which every
branch keeps the place of its first request, so requests that share nothing keep their input
order exactly, and so does a group's own order. It works on windows of ``WINDOW`` requests at
a time (a lazily read file stays lazy), and hashes only as deep as requests still share.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

GROUP_TOKENS = 64  # prompts are compared in blocks of this many tokens
MAX_DEPTH = 64  # blocks deep (4,096 tokens): sharing beyond changes little
WINDOW = 65_536  # requests grouped at a time


def prefix_grouped(items: Iterable[Any], ids: Callable[[Any], Sequence[int]],
                   window: int = WINDOW) -> Iterator[Any]:
    """``items`` (``ids(item)``: its prompt's token ids), each window of them in prefix-tree
    order (see the module docstring)."""
    it = iter(items)
    while chunk := list(islice(it, window)):
        # the walk allocates only small acyclic tuples and lists: with many long prompts alive,
        # the cyclic collector's passes over them would cost several times the walk itself
        collecting = gc.isenabled()
        gc.disable()
        try:
            ordered = _walk(chunk, [ids(x) for x in chunk], list(range(len(chunk))), 0)
        finally:
            if collecting:
                gc.enable()
        yield from ordered


def _walk(items: list[Any], prompts: list[Sequence[int]], members: list[int], depth: int
          ) -> list[Any]:
    """``members`` (indices into ``items``, in input order), which share their first ``depth``
    blocks, ordered: grouped by their next block, each group where its first member was."""
    if len(members) == 1 or depth == MAX_DEPTH:
        return [items[i] for i in members]
    lo, hi = depth * GROUP_TOKENS, (depth + 1) * GROUP_TOKENS
    # first by the block's first and last token (no copy); a prompt without a full next block
    # ends its branch: a group of its own, in place
    rough: dict[Any, list[int]] = {}
    for i in members:
        p = prompts[i]
        rough.setdefault((p[lo], p[hi - 1]) if len(p) >= hi else i, []).append(i)
    if len(rough) == len(members):  # nothing shared below here
        return [items[i] for i in members]
    groups: list[list[int]] = []
    for candidates in rough.values():
        if len(candidates) == 1:
            groups.append(candidates)
            continue
        exact: dict[tuple[int, ...], list[int]] = {}
        for i in candidates:
            exact.setdefault(tuple(prompts[i][lo:hi]), []).append(i)
        groups += exact.values()
    groups.sort(key=lambda g: g[0])  # each group where its first member was
    out: list[Any] = []
    for group in groups:
        out += _walk(items, prompts, group, depth + 1)
    return out
