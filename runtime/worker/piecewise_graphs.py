"""CUDA graphs for steps that carry prefill chunks: the model's forward in pieces between its
attention calls, captured per token-count bucket; attention runs eagerly between the pieces.

A step with prefills has shapes that vary in ways a graph cannot hold (how many sequences,
their query and context lengths), but only attention sees them: every other kernel (norms,
projections, rotary, the MLP) sees a token count. So the step's tokens are padded to a bucket
(multiples of 64), and that bucket's forward is captured as L + 1 graphs cut at the L attention
calls. At the cut, the piece before writes the new K/V into the cache (``AttentionImpl.write_kv``
over a static slot mapping whose padding rows point into the scratch block, as decode graphs'
do) and copies q, k and v into static buffers; the next piece reads the attention output from a
static buffer. A replay runs piece 0, then per layer the backend's ``attend`` over the step's
real rows (its own metadata, planned once per step as in eager steps), then the next piece.
Padding rows carry token 0 at position 0. A model of several KV groups has a static slot mapping
per group (each layer writes through its group's: ``PagedAttention.kv_group``) and attends with
its group's metadata.

Without graphs, an eager step's host time (~35 ms for the 8B preset's 32 layers: ~330 launches
through Python) exceeded its GPU time at up to about 1,000 tokens on an H200, so those steps
left the GPU idle; larger steps are GPU-bound, and padding would only add to them. A bucket is
captured the first time a step needs it (warmed up once eagerly first), in the decode graphs'
memory pool (they never replay at once). On a device without graphs (and in the CPU tests)
``run`` takes the same pieces and attention in one eager pass through the same buffers.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch
from torch import nn

from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.errors import first_line
from pagedgen.profiling import scope

MAX_TOKENS = 1024  # larger steps run eagerly: their GPU time exceeds the host's
STEP = 64


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts steps are padded to: multiples of 64 up to ``max_tokens`` (and it)."""
    return sorted({s for s in range(STEP, max_tokens, STEP)} | {max_tokens})


class _Split:
    """What each attention layer does with its call while the runner holds the model: writes
    k, v into the cache at the static slots, copies q, k, v into the static buffers and returns
    the static output; ``cut`` (capture) ends the piece there and begins the next; ``attend``
    (a step run eagerly) runs the attention in between."""

    def __init__(self, cut: Callable[[], None] | None = None,
                 attend: Callable[[int], None] | None = None) -> None:
        self.cut, self.attend = cut, attend

    def __call__(self, runner: PiecewiseGraphs, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        qb, kb, vb, out = runner.buffers(layer)
        n = q.shape[0]
        slots = runner.slot_mappings[runner.groups[layer]]
        runner.layers[layer].impl.write_kv(k, v, runner.kv_caches[layer], slots[:n])
        qb[:n].copy_(q)
        kb[:n].copy_(k)
        vb[:n].copy_(v)
        if self.cut is not None:
            self.cut()
        if self.attend is not None:
            self.attend(layer)
        return out[:n]


class PiecewiseGraphs:
    """Piecewise graphs of ``model``'s forward for steps of up to ``max_tokens`` tokens;
    ``attention_layers``: the model's ``PagedAttention`` modules in order, run over
    ``kv_caches``; padding rows write their K/V at slot ``scratch_slot``."""

    def __init__(self, model: nn.Module, attention_layers: list[nn.Module],
                 kv_caches: list[torch.Tensor], max_tokens: int, scratch_slot: int,
                 device: torch.device, dtype: torch.dtype, pool=None,
                 buckets: list[int] | None = None) -> None:
        self.model, self.layers, self.kv_caches = model, attention_layers, kv_caches
        self.device = device
        self.buckets = sorted(buckets) if buckets else token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.scratch_slot = scratch_slot
        self.groups = [getattr(layer, "kv_group", 0) for layer in attention_layers]
        self.slot_mappings = [torch.full((n,), scratch_slot, dtype=torch.long, device=device)
                              for _ in range(1 + max(self.groups, default=0))]
        # one set of q/k/v/output buffers per attention shape (layers run one at a time)
        self._buffers: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        for layer in attention_layers:
            s = layer.spec
            key = (s.num_heads, s.num_kv_heads, s.head_size)
            if key not in self._buffers:
                self._buffers[key] = tuple(
                    torch.zeros(n, h, s.head_size, dtype=dtype, device=device)
                    for h in (s.num_heads, s.num_kv_heads, s.num_kv_heads, s.num_heads))
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.capture_time_s = 0.0
        self.steps = 0  # steps run through the pieces (replayed, or inline)
        self.failed: dict[int, str] = {}  # buckets whose capture failed (they run inline)
        self._md: AttentionMetadata | None = None
        self._tokens = 0

    def buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        s = self.layers[layer].spec
        return self._buffers[(s.num_heads, s.num_kv_heads, s.head_size)]

    def can_run(self, md: AttentionMetadata) -> bool:
        """A step with prefills of at most ``max_tokens`` tokens, and no inputs beside ids
        and positions (a step with image tokens runs eagerly)."""
        return md.num_prefills > 0 and 0 < md.num_tokens <= self.max_tokens \
            and md.model_inputs is None

    def bucket(self, tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    # ---- running a step --------------------------------------------------------------------

    def _attend(self, layer: int) -> None:
        """Layer ``layer``'s attention over the step's real rows, into the static output."""
        qb, kb, vb, out = self.buffers(layer)
        n = self._tokens
        with scope("attention"):
            o = self.layers[layer].impl.attend_step(qb[:n], kb[:n], vb[:n], self.kv_caches[layer],
                                               self._md.group(self.groups[layer]))
        out[:n].copy_(o)

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
              ) -> int:
        """Copy the step's inputs into the static buffers, padded; returns its bucket."""
        n = input_ids.shape[0]
        tb = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        for g, slots in enumerate(self.slot_mappings):
            slots[:n].copy_(md.group(g).slot_mapping)
            slots[n:tb].fill_(self.scratch_slot)
        self.input_ids[n:tb].zero_()
        self.positions[n:tb].zero_()
        self._md, self._tokens = md, n
        return tb

    def _forward(self, tb: int, split: _Split) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            layer.split = (lambda q, k, v, _i=i: split(self, _i, q, k, v))
        try:
            return self.model(self.input_ids[:tb], self.positions[:tb], self.kv_caches, None)
        finally:
            for layer in self.layers:
                layer.split = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
            ) -> torch.Tensor:
        """Replay the step's bucket (captured now if it is new): hidden states [T, hidden]. A
        bucket whose capture fails (a kernel that synchronizes, say) runs inline from then on;
        so does every step on a device without graphs."""
        graphs = self.device.type == "cuda"
        n = input_ids.shape[0]
        tb = self._load(input_ids, positions, md)
        try:
            if graphs and tb not in self.pieces and tb not in self.failed:
                try:
                    self._capture(tb)
                except RuntimeError as e:
                    self.failed[tb] = first_line(e)
            self.steps += 1
            if not graphs or tb in self.failed:
                return self._forward(tb, _Split(attend=self._attend))[:n]
            pieces = self.pieces[tb]
            pieces[0].replay()
            for i in range(len(self.layers)):
                self._attend(i)
                pieces[i + 1].replay()
            return self.outputs[tb][:n]
        finally:
            self._md = None

    # ---- capture ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture(self, tb: int) -> None:
        """Warm bucket ``tb``'s kernels up on the step's inputs (its K/V written, no attention:
        the output buffers hold what they hold), then capture its pieces. Nothing waits for
        the GPU: recording runs no kernel (as the decode graphs' captures, cuda_graphs.py)."""
        t0 = time.perf_counter()
        self._forward(tb, _Split())
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        pieces: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            if self.pool is None:
                self.pool = graph.pool()
            pieces.append(graph)

        def cut() -> None:
            pieces[-1].capture_end()
            begin()

        with torch.cuda.stream(stream):
            begin()
            try:
                hidden = self._forward(tb, _Split(cut=cut))
            except BaseException:
                try:
                    pieces[-1].capture_end()
                except RuntimeError:
                    pass  # the capture was invalidated by the error
                raise
            pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pieces[tb], self.outputs[tb] = pieces, hidden
        self.capture_time_s += time.perf_counter() - t0
