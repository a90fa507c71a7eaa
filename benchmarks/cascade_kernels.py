"""Grouped cascade decode's kernels for one layer, on the decode batches of workloads p, d and q
(issue 34): where the attention time of a cascade step goes, and what the group level's call
costs in each shape FA4 can be given.

A layout is ``groups`` groups of ``rows`` decodes, each group sharing ``shared`` pages of 128
tokens, each decode then ``own`` tokens of its own (drawn uniformly, seeded): p = 32 x 8 over
8 pages (n = 8 samples of 1,024-token prompts), d = 1 x 256 over 12 pages (one 1,536-token
prefix), q = 64 x 4 over 8 pages (questions about 1,024-token documents). Llama-3-8B's heads
(32 / 8, head size 128), bf16. Each figure is one FA4 call per layer of ``--layers`` KV caches
(so the L2 cache does not hold a layer's KV from the call before), captured in a CUDA graph and
replayed; ``us`` is per call, ``GB_s`` the K/V bytes that call must read over its time.

The group level's variants: ``segments=b+1`` is what a CUDA graph of the engine captures today
(each group a segment, the rest empty segments up to the batch size + 1); ``segments=exact``
only the groups (what the graphs hold now: a power of two at or above it); ``tile RxK`` FA4's
tile; ``split=C`` cuts each group's pages into C runs attended by C copies of its queries in
the same call (more CTAs for few, long groups), merged by log-sum-exp afterwards. Then each
decode's own pages (FA4's decode, by tile), plain decode over all of a decode's pages, the
log-sum-exp merge kernel by heads a program, and the queries' gather into sorted order.

    python -m benchmarks.cascade_kernels --layouts p,d,q --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

PAGE, HQ, HKV, D = 128, 32, 8, 128
Tile = tuple[int, int] | None  # FA4's (query rows, keys); None: FA4's own choice
LAYOUTS = {  # groups, rows per group, shared pages, own tokens (lo, hi)
    "p": (32, 8, 8, (1, 256)),
    "d": (1, 256, 12, (129, 256)),
    "q": (64, 4, 8, (17, 96)),
}


class Layout:
    """Physical pages for a layout: each group's shared pages, then each row's own."""

    def __init__(self, name: str, seed: int = 0) -> None:
        groups, rows, shared, (lo, hi) = LAYOUTS[name]
        g = torch.Generator().manual_seed(seed)
        self.name, self.groups, self.rows, self.shared = name, groups, rows, shared
        self.b = groups * rows
        self.own = torch.randint(lo, hi + 1, (self.b,), generator=g).tolist()
        nxt = 0
        self.group_pages = []
        for _ in range(groups):
            self.group_pages.append(list(range(nxt, nxt + shared)))
            nxt += shared
        self.own_pages = []
        for n in self.own:
            k = -(-n // PAGE)
            self.own_pages.append(list(range(nxt, nxt + k)))
            nxt += k
        self.num_pages = nxt

    def group_inputs(self, split: int, segments: int | None, dev: torch.device) -> dict:
        """One FA4 call's inputs: queries gathered by ``index``, ``cu_q``, ``kv_lens``,
        ``tables``; ``split`` copies of each group's queries over runs of its pages;
        ``segments``: pad to this many segments (None: exact)."""
        cu, lens, tables, index = [0], [], [], []
        run = -(-self.shared // split)
        for c in range(split):
            for gi, pages in enumerate(self.group_pages):
                part = pages[c * run:(c + 1) * run]
                index += range(gi * self.rows, (gi + 1) * self.rows)
                cu.append(cu[-1] + self.rows)
                lens.append(len(part) * PAGE)
                tables.append(part + [0] * (run - len(part)))
        while segments is not None and len(lens) < segments:
            cu.append(cu[-1])
            lens.append(0)
            tables.append([0] * run)
        i32 = torch.int32
        return dict(index=torch.tensor(index, device=dev), cu_q=torch.tensor(cu, dtype=i32,
                    device=dev), kv_lens=torch.tensor(lens, dtype=i32, device=dev),
                    tables=torch.tensor(tables, dtype=i32, device=dev))

    def suffix_inputs(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in self.own_pages)
        tables = [p + [0] * (width - len(p)) for p in self.own_pages]
        return (torch.tensor(self.own, dtype=torch.int32, device=dev),
                torch.tensor(tables, dtype=torch.int32, device=dev))

    def group_bytes(self) -> int:
        return self.groups * self.shared * PAGE * HKV * D * 2 * 2

    def own_bytes(self) -> int:
        return sum(self.own) * HKV * D * 2 * 2


def timed(fns: list[Callable[[], None]], iters: int) -> float:
    """Microseconds per call of the fns (one per layer), replayed from a CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters / len(fns) * 1e6


def lse_merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of key sets from each part's [B, H, D] output and [B, H] lse."""
    lse = torch.stack([p[1] for p in parts])
    w = torch.softmax(torch.nan_to_num(lse, neginf=-1e30), 0)
    return sum(w[i][..., None] * p[0].float() for i, p in enumerate(parts))


def run_layout(lay: Layout, layers: int, iters: int, splits: list[int],
               group_tiles: list[Tile], suffix_tiles: list[Tile], merge_heads: list[int],
               dev: torch.device) -> list[dict]:
    from pagedgen.attention.fa4_import import import_quack_lean

    import_quack_lean()
    import flash_attn.cute as fa4

    fwd = fa4.interface._flash_attn_fwd
    torch.manual_seed(0)
    caches = [torch.randn(2, lay.num_pages, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
              for _ in range(layers)]
    q = torch.randn(lay.b, HQ, D, dtype=torch.bfloat16, device=dev)
    scale = D ** -0.5
    rows, results = [], {}

    def record(part: str, variant: str, us: float, nbytes: int) -> None:
        r = {"layout": lay.name, "part": part, "variant": variant, "us": round(us, 2),
             "GB_s": round(nbytes / us / 1e3, 1)}
        rows.append(r)
        print(json.dumps(r), flush=True)

    def group_call(x: dict, cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   max_q: int, tile: tuple[int, int] | None) -> Callable[[], None]:
        def f() -> None:
            qs = q.index_select(0, x["index"])
            fwd(qs, cache[0], cache[1], cu_seqlens_q=x["cu_q"], max_seqlen_q=max_q,
                seqused_k=x["kv_lens"], page_table=x["tables"], softmax_scale=scale,
                causal=False, return_lse=True, tile_mn=tile, out=out, lse=lse)
        return f

    def name_of(tile: tuple[int, int] | None) -> str:
        return "tile " + ("x".join(map(str, tile)) if tile else "fa4")

    variants = [("segments=b+1", 1, lay.b + 1, None), ("segments=exact", 1, None, None)]
    variants += [(f"segments=exact, {name_of(t)}", 1, None, t) for t in group_tiles if t]
    variants += [(f"split={c}", c, None, None) for c in splits]
    for name, split, segs, tile in variants:
        x = lay.group_inputs(split, segs, dev)
        n = x["index"].numel()
        outs = [torch.empty(n, HQ, D, dtype=q.dtype, device=dev) for _ in caches]
        lses = [torch.empty(HQ, n, dtype=torch.float32, device=dev) for _ in caches]
        fns = [group_call(x, c, o, s, lay.rows, tile) for c, o, s in zip(caches, outs, lses)]
        try:
            us = timed(fns, iters)
        except Exception as e:  # a tile FA4 cannot compile for this GPU
            print(json.dumps({"layout": lay.name, "variant": name, "error": str(e)[:200]}))
            continue
        record("group level", name, us, lay.group_bytes())
        # the layer-0 result by row (each copy's part merged), for the check below
        parts = [(outs[0][k * lay.b:(k + 1) * lay.b], lses[0][:, k * lay.b:(k + 1) * lay.b].T)
                 for k in range(split)]
        results[name] = lse_merge(parts)
    ref = results["segments=b+1"]
    for name, r in results.items():
        err = float((r - ref).abs().max())
        print(json.dumps({"layout": lay.name, "check": name, "max_abs_diff_vs_b+1": err}))
        assert err < 2e-2, (name, err)

    seq_lens, tables = lay.suffix_inputs(dev)
    for tile in suffix_tiles:
        outs = [torch.empty(lay.b, 1, HQ, D, dtype=q.dtype, device=dev) for _ in caches]

        def suffix(cache, out, tile=tile):
            return lambda: fwd(q.unsqueeze(1), cache[0], cache[1], seqused_k=seq_lens,
                               page_table=tables, softmax_scale=scale, causal=True,
                               window_size_left=None, window_size_right=None, num_splits=1,
                               return_lse=True, tile_mn=tile, out=out)
        try:
            us = timed([suffix(c, o) for c, o in zip(caches, outs)], iters)
        except Exception as e:
            print(json.dumps({"layout": lay.name, "variant": name_of(tile),
                              "error": str(e)[:200]}))
            continue
        record("own pages (decode)", name_of(tile), us, lay.own_bytes())
    # the log-sum-exp merge of one level and the own pages, by heads a program
    from types import SimpleNamespace

    from pagedgen.attention import cascade
    parts = torch.randn(2, lay.b, HQ, D, dtype=q.dtype, device=dev)
    lse = torch.randn(2, lay.b, HQ, dtype=torch.float32, device=dev)
    x = SimpleNamespace(member=torch.ones(1, lay.b, dtype=torch.int32, device=dev),
                        pos=torch.arange(lay.b, dtype=torch.int32, device=dev))
    out = torch.empty_like(q)
    for hb in merge_heads:
        cascade.MERGE_HEADS = hb
        us = timed([lambda: cascade.merge(out, parts[:1], lse[:1], parts[1:], lse[1:], x)],
                   iters * layers)
        record("merge", f"{hb} heads a program", us, 3 * parts[0].numel() * 2)
    idx = torch.randperm(lay.b, device=dev)
    us = timed([lambda: q.index_select(0, idx)], iters * layers)
    record("query gather", "index_select", us, 2 * q.numel() * 2)
    # plain decode: every row reads its group's pages and its own
    full = [lay.group_pages[r // lay.rows] + lay.own_pages[r] for r in range(lay.b)]
    width = max(map(len, full))
    ftab = torch.tensor([p + [0] * (width - len(p)) for p in full], dtype=torch.int32,
                        device=dev)
    flens = seq_lens + lay.shared * PAGE
    outs = [torch.empty(lay.b, 1, HQ, D, dtype=q.dtype, device=dev) for _ in caches]
    us = timed([lambda c=c, o=o: fwd(q.unsqueeze(1), c[0], c[1], seqused_k=flens,
                                     page_table=ftab, softmax_scale=scale, causal=True,
                                     window_size_left=None, window_size_right=None,
                                     num_splits=1, tile_mn=(64, 64), out=o)
                for c, o in zip(caches, outs)], iters)
    record("plain decode", "tile 64x64", us, lay.b * lay.shared * PAGE * HKV * D * 4
           + lay.own_bytes())
    return rows


def tiles(spec: str) -> list[Tile]:
    """"fa4,64x64" → [None, (64, 64)]."""
    return [None if t == "fa4" else tuple(int(v) for v in t.split("x")) for t in spec.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layouts", default="p,d,q")
    ap.add_argument("--splits", default="2")
    ap.add_argument("--group-tiles", default="fa4,64x64,64x128,128x64",
                    help="the group level's FA4 tiles (fa4: FA4's own), exact segments")
    ap.add_argument("--suffix-tiles", default="64x64,64x32,64x128,fa4")
    ap.add_argument("--merge-heads", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in args.layouts.split(","):
        rows += run_layout(Layout(name), args.layers, args.iters,
                           [int(c) for c in args.splits.split(",") if c],
                           tiles(args.group_tiles), tiles(args.suffix_tiles),
                           [int(h) for h in args.merge_heads.split(",")], dev)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
