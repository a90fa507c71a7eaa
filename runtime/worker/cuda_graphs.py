"""CUDA graphs of decode steps: capture one per batch-size bucket, pad, re-plan, replay.

At start-up, for each bucket (1, 2, 4, 8, then steps of 8 to 64, of 16 to 256 and of 32 beyond,
up to ``max_num_seqs``; beyond ``STARTUP_CAPTURE_MAX`` rows the first step that needs it, as
below) the model's decode forward is captured over static buffers (input ids,
positions, slot mapping, sequence lengths, block tables) and the backend's graph buffers
(``AttentionState.make_graph_plan``). A decode-only step is padded to the next bucket (padding
rows write their K/V into a reserved scratch block), the backend re-plans into the captured
buffers (``AttentionState.build`` with the bucket), the inputs are copied in, and the graph is
replayed. The model runner decides which steps replay; the graphs capture the model's forward
only (sampling and logits processors run after, eagerly).

A model of several KV groups (runtime/engine/kv_groups.py) has static slot mappings and block
tables per group, and each group's backend state plans into graph buffers of its own.

A step whose decodes share prefix pages in groups (``metadata.cascade``, attention/cascade.py)
replays the bucket's cascade graph of as many levels (at most three) and segments a level
instead, captured the first time a step of that kind runs. Such a capture in the middle of a
run waits for nothing: recording a graph runs no kernel, so the step launched before it keeps
the GPU busy meanwhile (``torch.cuda.graph`` would synchronize and empty the allocator's cache
first), and whatever it writes into the static buffers queues behind that step. It warms
the bucket's kernels up eagerly only where the kernels can differ from a graph captured before:
the first graph of a cascade key for batch sizes of each remainder mod 16 (Triton specializes
integer arguments on divisibility by 16 and on 1; the rest of the forward was warmed up by the
bucket's plain graph at start-up); should a capture without one fail, it warms up and captures
again. Segments come in powers of two from
4 up to the bucket + 1 (:func:`cascade_segments`): a graph's varlen group call launches work
for every segment it holds, used or not (on an H200, FA4 over p's 32 groups: 71 µs a layer
with 257 segments, 45 µs with 32), so the key grows with the number of groups, by doubling.
"""

from __future__ import annotations

import bisect
import time

import torch
from torch import nn

from pagedgen.attention.backend import AttentionState, plan_groups
from pagedgen.attention.cascade_layout import CascadeLayout
from pagedgen.attention.metadata import AttentionMetadata

PLAIN = (0, 0)  # the graph key of plain decode steps: no cascade levels
# Plain graphs of more rows wait for the first step of that many decodes (vLLM captures none
# past 512 by default): a start-up pays only for batches most runs form; gpt-oss-120b's
# max_num_seqs of 1,024 captured 47 graphs at start-up in 16 s on an H100, 16 of them past 512.
STARTUP_CAPTURE_MAX = 512


def cascade_segments(layout: CascadeLayout, batch_size: int) -> int:
    """The segments a level of a cascade graph of ``batch_size`` decodes holds for ``layout``:
    the power of two from 4 at or above what it needs, at most the batch size + 1 (enough for
    any layout: a group holds at least 2 decodes)."""
    need, held = layout.segments(), 4
    while held < need:
        held *= 2
    return min(held, batch_size + 1)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a decode graph. Beyond 256 rows a step of 32: a GEMM's row tiles
    make padding there nearly free, and max_num_seqs 1,024 captures 47 graphs instead of 71."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) \
        + list(range(288, max_num_seqs + 32, 32))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class CudaGraphRunner:
    """Graphs of ``model``'s decode forward over ``kv_caches``, planned by ``attn_state`` (a
    list: one per KV group, group 0 first), for up to ``max_num_seqs`` sequences of up to
    ``max_model_len`` tokens in pages of ``block_size``; padding rows write into page
    ``scratch_block`` (of the pool every group shares)."""

    def __init__(self, model: nn.Module, attn_state: AttentionState | list[AttentionState],
                 kv_caches: list[torch.Tensor], max_num_seqs: int, max_model_len: int,
                 block_size: int, scratch_block: int, device: torch.device,
                 scratch_slot: int | None = None) -> None:
        self.attn_states = attn_state if isinstance(attn_state, list) else [attn_state]
        self.model, self.attn_state, self.kv_caches = model, self.attn_states[0], kv_caches
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scratch_block = scratch_block
        dev, n = device, self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        groups = len(self.attn_states)
        self.slot_mappings = [torch.full((n,), self.scratch_block * self.block_size,
                                         dtype=torch.long, device=dev) for _ in range(groups)]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.tables = [torch.full((n, self.max_blocks), self.scratch_block, dtype=torch.int32,
                                  device=dev) for _ in range(groups)]
        # linear-attention layers: each row's state slot (padding rows: the scratch slot)
        self.scratch_slot = scratch_slot
        self.state_slots = None if scratch_slot is None else torch.full(
            (n,), scratch_slot, dtype=torch.int32, device=dev)
        # by cascade (levels, segments a level; (0, 0): plain decode), then bucket
        self.graphs: dict[tuple[int, int], dict[int, torch.cuda.CUDAGraph]] = {PLAIN: {}}
        self.outputs: dict[tuple[int, int], dict[int, torch.Tensor]] = {PLAIN: {}}
        self.pool = None  # one memory pool for every graph (they never replay at once)
        self.stream: torch.cuda.Stream | None = None  # where graphs are recorded
        self.warm: set[tuple[tuple[int, int], int]] = set()  # (key, batch size mod 16, or 1)
        self.capture_time_s = 0.0
        self.memory_bytes = 0
        self.run_captures = 0  # graphs captured in the middle of a run...
        self.run_capture_s = 0.0  # ...and the host time they took
        self.run_warmups = 0  # ...of which warmed up first
        self.started = False  # start-up's captures are done

    def _metadata(self, bs: int, seq_lens: list[int], cascade: CascadeLayout | None = None,
                  cascade_segments: int = 0) -> AttentionMetadata:
        """Metadata over the static buffers for ``bs`` decodes (CPU fields for planning); the
        further KV groups' over theirs, in ``kv_groups``."""
        md = AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=bs,
            slot_mapping=self.slot_mappings[0][:bs],
            query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], context_lens=self.context_lens[:bs],
            block_tables=self.tables[0][:bs], block_size=self.block_size,
            seq_lens_cpu=seq_lens, query_lens_cpu=[1] * bs, cascade=cascade,
            cascade_segments=cascade_segments,
            state_slots=None if self.state_slots is None else self.state_slots[:bs])
        md.kv_groups = [md.over_pages(sm[:bs], t[:bs])
                        for sm, t in zip(self.slot_mappings[1:], self.tables[1:])]
        return md

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the plain decode graph of every bucket up to ``STARTUP_CAPTURE_MAX`` rows
        (at start-up), each warmed up first; larger ones wait for a step that needs them."""
        torch.cuda.synchronize(self.device)
        for bs in reversed(self.buckets):  # largest first, so smaller ones reuse its pool
            if bs <= STARTUP_CAPTURE_MAX:
                self._capture(bs, PLAIN, warm=True)
        torch.cuda.synchronize(self.device)
        self.started = True

    def _capture(self, bs: int, key: tuple[int, int], warm: bool = False) -> None:
        """Capture bucket ``bs``'s graph ``key`` over padding rows (scratch block only): a
        capture in the middle of a run must not write into any sequence's blocks. ``warm``:
        run the forward eagerly first (otherwise only where its kernels may be new)."""
        dev = self.device
        free_before = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        self._pad(0, bs)
        # page-table entries, not physical blocks: sequences share cached blocks
        levels, segments = key
        for g, state in enumerate(self.attn_states):  # cascade: group 0's pages only
            state.make_graph_plan(bs, bs * self.max_blocks, *((levels, segments) if g == 0
                                                              else (0, 0)))
        # a cascade graph captures over groups of nothing: every row its own suffix
        empty = CascadeLayout(list(range(bs)), [[] for _ in range(levels)], [0] * bs,
                              self.block_size) if levels else None
        md = plan_groups(self.attn_states, self._metadata(bs, [1] * bs, empty, segments), bs)
        args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, md)
        kind = (key, 1 if bs == 1 else 16 + bs % 16)
        warm = warm or kind not in self.warm
        if warm:
            self.model(*args)  # kernel selection, lazy init, compiles: outside the graph
        try:
            graph, out = self._record(args)
        except RuntimeError:
            if warm:
                raise
            warm = True  # a kernel the capture could not compile or load: warm up, again
            self.model(*args)
            graph, out = self._record(args)
        self.warm.add(kind)
        self.graphs.setdefault(key, {})[bs] = graph
        self.outputs.setdefault(key, {})[bs] = out
        dt = time.perf_counter() - t0
        self.capture_time_s += dt
        self.memory_bytes += max(0, free_before - torch.cuda.mem_get_info(dev)[0])
        if self.started or key != PLAIN:  # cascade graphs: always during a run
            self.run_captures += 1
            self.run_capture_s += dt
            self.run_warmups += warm

    def _record(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record the model's forward over ``args`` into a new graph of the shared pool, on
        the capture stream; nothing runs, so nothing waits."""
        args[3].forget_step_tensors()  # made by a warm-up: the graph makes its own
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(*(() if self.pool is None else (self.pool,)),
                                capture_error_mode="thread_local")
            try:
                out = self.model(*args)
            finally:
                graph.capture_end()
        self.pool = graph.pool()
        return graph, out

    def summary(self) -> dict[str, float]:
        """The summary's graph figures: capture time and memory, and the graphs captured
        during the run (cascade graphs, plain ones past ``STARTUP_CAPTURE_MAX``: count, host
        seconds, how many warmed up first)."""
        return {"graph_capture_s": self.capture_time_s, "graph_memory_bytes": self.memory_bytes,
                "graphs_captured_in_run": self.run_captures,
                "graph_capture_in_run_s": self.run_capture_s,
                "graph_warmups_in_run": self.run_warmups}

    def _pad(self, start: int, end: int) -> None:
        """Make rows ``start:end`` padding: one token in the scratch block."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        for sm, t in zip(self.slot_mappings, self.tables):
            sm[start:end].fill_(self.scratch_block * self.block_size)
            t[start:end].fill_(self.scratch_block)
        self.seq_lens[start:end].fill_(1)
        self.context_lens[start:end].zero_()
        if self.state_slots is not None:
            self.state_slots[start:end].fill_(self.scratch_slot)

    def can_run(self, md: AttentionMetadata) -> bool:
        return md.num_prefills == 0 and 0 < md.num_decodes <= self.max_bs

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
                ) -> tuple[int, tuple[int, int]]:
        """Copy a decode-only step into the static buffers of the next bucket, padded, and plan
        the backend into that bucket's buffers. Returns the bucket and the graph's cascade key
        (levels, segments a level)."""
        n = md.num_decodes
        bs = self.buckets[bisect.bisect_left(self.buckets, n)]
        key = (md.cascade_levels, cascade_segments(md.cascade, bs)) if md.cascade else PLAIN
        if bs not in self.graphs.get(key, {}):
            with torch.inference_mode():
                self._capture(bs, key)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        for g, (sm, t) in enumerate(zip(self.slot_mappings, self.tables)):
            group = md.group(g)
            sm[:n].copy_(group.slot_mapping)
            t[:n, :group.block_tables.shape[1]].copy_(group.block_tables)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.context_lens[:n].copy_(md.context_lens)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(md.state_slots)
        pad = bs - n
        if pad:
            self._pad(n, bs)
        graph_md = self._metadata(bs, md.seq_lens_cpu + [1] * pad, md.cascade, key[1])
        plan_groups(self.attn_states, graph_md, bs)  # plans into the captured buffers
        return bs, key

    def replay(self, bs: int, n: int, key: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """Run bucket ``bs``'s graph (its cascade graph ``key``: levels, segments a level);
        hidden states [n, hidden] of the real rows."""
        self.graphs[key][bs].replay()
        return self.outputs[key][bs][:n]
