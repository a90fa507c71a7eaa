"""The model runner: owns the model, the KV cache and the attention backend; runs one step.

Per step it builds input ids, positions and attention metadata (prefill tokens first, then
decode tokens), lets the backend plan once (its typed metadata), runs the model (or replays a
CUDA graph), lets the sequences' logits processors change their rows, and samples the
sequences whose last token was computed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagedgen.attention.backend import AttentionBackend, plan_groups
from pagedgen.attention.metadata import AttentionMetadata, AttentionMetadataBuilder, ScheduledSeq
from pagedgen.errors import PagedgenError
from pagedgen.profiling import scope
from pagedgen.runtime.collectives import parallel
from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.cpu_load import default_threads
from pagedgen.runtime.engine.kv_groups import group_backends, plan_layout
from pagedgen.runtime.engine.scheduler import ScheduledBatch
from pagedgen.runtime.engine.sequence import PENDING_TOKEN, Sequence
from pagedgen.runtime.engine.stats import DecodeReads
from pagedgen.runtime.engine.step import StepHandle
from pagedgen.runtime.hardware import host_cores
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.attention import PagedAttention
from pagedgen.runtime.models import registry
from pagedgen.runtime.models.loader import ModelSource, build_model, model_quantization
from pagedgen.runtime.models.multimodal import ImagePrompter
from pagedgen.runtime.sampling import logprobs
from pagedgen.runtime.sampling.logprobs import Logprobs
from pagedgen.runtime.sampling.step import finish_sampling, plan_sampling
from pagedgen.runtime.worker import batch_invariant, memory_plan
from pagedgen.runtime.worker.cuda_graphs import CudaGraphRunner
from pagedgen.runtime.worker.decode_advance import DecodeAdvancer
from pagedgen.runtime.worker.kv_memory import KVMemory
from pagedgen.runtime.worker.piecewise_graphs import MAX_TOKENS, PiecewiseGraphs
from pagedgen.runtime.worker.recurrent_slots import RecurrentSlots, bind_recurrent
from pagedgen.runtime.worker.step_images import ImageEncoder
from pagedgen.transfer import to_device

log = logging.getLogger(__name__)  # -v: start-up phases, the KV cache


class ModelRunner:
    def __init__(self, config: EngineConfig, src: ModelSource) -> None:
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cpu":  # the cores this process gets, not those others use
            torch.set_num_threads(config.threads or default_threads(host_cores()))
        elif config.threads:
            torch.set_num_threads(config.threads)
        self.dtype = config.torch_dtype(self.device)
        self.kv_dtype = config.cache_dtype(self.dtype)
        hf = src.hf_config
        self.tp = parallel.current()
        if self.tp.size != config.tensor_parallel_size:
            raise PagedgenError(f"tensor_parallel_size is {config.tensor_parallel_size} but this "
                                f"process is one of {self.tp.size} ranks (-tp N starts its own "
                                f"workers)")
        self.tp.expert_parallel = config.expert_parallel
        try:
            model_cls = registry.model_class(hf)
            self.specs = model_cls.layer_specs(hf, self.tp.size)
            state_specs = model_cls.state_specs(hf, self.tp.size)
        except ValueError as e:  # a size the model's heads do not divide
            raise PagedgenError(f"{src.name}: {e}")
        # KV groups by layer kind (window layers hold their window's pages only), one pool
        self.layout = plan_layout(self.specs, config.kv_cache_groups)
        # each group's backend (auto: the best that runs its layers); the slabs take the
        # layout of ``backend``
        self.backend: type[AttentionBackend]
        self.backend, self.group_backends = group_backends(
            self.specs, self.layout, config.backend, self.device, self.dtype, self.kv_dtype,
            src.name)
        self.block_size = self.backend.resolve_block_size(config.block_size)  # tokens per page
        for b in set(self.group_backends):  # the others read any page size; say if not
            b.resolve_block_size(self.block_size)
        self.kv = KVMemory(self.backend, self.specs, self.layout, self.block_size,
                           self.kv_dtype, self.device, self.group_backends)
        self.context_len = config.context_limit(hf)  # the model's (or --max-model-len)
        self.max_model_len = self.context_len  # lowered below to what the KV cache holds
        # Seconds each start-up phase took (the summary's start-up breakdown).
        self.startup_phases: dict[str, float] = {}
        t = time.perf_counter()
        self.tp.enable_one_shot(self.dtype, self.device)
        self.quant = model_quantization(src, config.quantization)
        self.model = build_model(src, config.load_format, self.dtype, self.device, config.seed,
                                 self.tp, self.quant, memory_plan.asked_kv_cache(
                                     config, self.kv))
        self.model.setup_rotary(self.max_model_len, self.device)
        t = self._phase("model", t)
        self.fused_kernels = (config.fused_kernels
                              and fused_ops.unavailable_reason(self.device) is None)
        self.model.use_fused_kernels(self.fused_kernels)
        if not config.batch_invariant:  # -tp: each all-reduce in the RMSNorm after it (the
            # mode's stay apart: one kernel's sum, add and norm rounds less than one GPU's)
            self.model.defer_all_reduces()
        # a backend state per KV group (its own plans and graph buffers over its page tables)
        self.attn_states = [b.get_state_cls()(
            b, [self.specs[i] for i in g.layers], self.block_size, self.dtype,
            self.kv_dtype, self.device) for b, g in zip(self.group_backends, self.layout.groups)]
        self.attn_state = self.attn_states[0]
        group_of = self.layout.group_of()
        self.model.bind_attention([self.group_backends[group_of[i]].get_impl_cls()(
            s, self.attn_states[group_of[i]]) for i, s in enumerate(self.specs)])
        for layer, g in zip(self._attention_layers(), group_of):
            layer.kv_group = g
        self.images = ImageEncoder(self.model, ImagePrompter.of(src), self.device,
                                   config.max_num_batched_tokens) \
            if getattr(self.model, "takes_images", False) else None
        # linear-attention layers: a state slot a sequence, before the KV cache takes the rest
        self.max_num_seqs = config.max_num_seqs
        self.recurrent: RecurrentSlots | None = None
        if state_specs:
            self.recurrent = bind_recurrent(self.model, state_specs, config.max_num_seqs,
                                            self.dtype, self.device, config.batch_invariant)
            self.max_num_seqs = self.recurrent.max_num_seqs
        if config.batch_invariant:
            batch_invariant.apply(self)
        # Kernels that compile at first use compile now, before memory profiling and capture.
        for state in self.attn_states:
            state.warmup(self.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        t = self._phase("attention", t)
        # Decode steps whose sequences share prefix pages attend them once (cascade attention).
        self.builder = AttentionMetadataBuilder(
            self.block_size, self.device,
            cascade=config.cascade_attention and all(s.supports_cascade
                                                     for s in self.attn_states),
            max_levels=min(s.max_cascade_levels for s in self.attn_states),
            mixed=config.cascade_mixed_steps and all(s.supports_mixed_cascade
                                                     for s in self.attn_states))
        try:
            self.num_blocks = self.tp.min(memory_plan.num_blocks(self), self.device)
        except torch.OutOfMemoryError:
            raise PagedgenError(
                f"out of GPU memory in the memory profile's forward of "
                f"{config.max_num_batched_tokens:,} tokens: lower "
                f"{config.named('max_num_batched_tokens')} (or "
                f"{config.named('gpu_memory_utilization')})") from None
        t = self._phase("memory_profile", t)
        self.decode_reads = DecodeReads(self.block_bytes() // self.block_size * self.tp.size)
        if self.num_blocks < 2:
            size = (f"{self.kv.page_bytes() / 2**20:.2f} MiB each, "
                    f"{2 * self.kv.page_bytes() / 2**20:.2f} MiB for 2")
            asked = memory_plan.asked_kv_cache(config, self.kv)
            if asked is not None:  # the user sized it
                raise PagedgenError(f"{asked[1]} holds {self.num_blocks} KV-cache block(s) "
                                    f"of {self.block_size} tokens ({size}); it needs at "
                                    "least 2")
            raise PagedgenError(
                f"the KV cache has room for {self.num_blocks} block(s) of {self.block_size} "
                f"tokens ({size}) and needs at least 2: give --kv-cache-memory or "
                "--num-blocks, or free device memory")
        # The last block is never handed out: CUDA-graph padding rows write into it.
        self.scratch_block = self.num_blocks - 1
        self.max_model_len = min(self.max_model_len, self.kv.context_cap(self.num_blocks))
        try:
            self.kv_caches = self.kv.allocate(self.num_blocks)
        except torch.OutOfMemoryError:
            raise PagedgenError(
                f"out of GPU memory allocating {self.kv_cache_bytes() / 2**30:.2f} GiB of KV "
                f"cache: lower {config.named('kv_cache_memory')}, "
                f"{config.named('num_blocks')} or {config.named('gpu_memory_utilization')}"
            ) from None
        log.info("KV cache: %d pages of %d tokens, %.2f GiB (%s, %s); backend %s",
                 self.num_blocks, self.block_size, self.kv_cache_bytes() / 2**30,
                 str(self.kv_dtype).removeprefix("torch."), self.layout.note or
                 f"{len(self.layout.groups)} KV group(s)", self.backend_name)
        t = self._phase("kv_cache", t)
        self.last_sampled: list[Sequence] = []  # the last sampling step's sequences
        self.last_tokens: torch.Tensor | None = None  # and their tokens, on the device
        # what the sampler consults beyond each sequence (set by the engine: ``sampling_hooks``)
        self.processors_enabled = False  # the engine makes sequences with logits processors
        self.grammars = None  # the engine's compiled constraints, once a request has one
        self.eos_ids: set[int] = set()  # EOS ids min_tokens holds back
        self.host_time_s = {"decode": 0.0, "prefill": 0.0}  # metadata preparation + planning
        self.host_steps = {"decode": 0, "prefill": 0}
        self.advancer = DecodeAdvancer(self.block_size, self.scratch_block, self.device) \
            if config.advance_decode_on_device else None
        self.graphs: CudaGraphRunner | None = None
        if all(b.supports_cuda_graphs for b in self.group_backends) \
                and self.device.type == "cuda" \
                and not config.enforce_eager and (self.recurrent is None
                                                  or self.recurrent.kernels.scan != "torch"):
            self.graphs = CudaGraphRunner(
                self.model, self.attn_states, self.kv_caches, self.max_num_seqs,
                self.max_model_len, self.block_size, self.scratch_block, self.device,
                None if self.recurrent is None else self.recurrent.scratch_slot)
            try:
                self.graphs.capture()
            except torch.OutOfMemoryError:
                raise PagedgenError(
                    f"out of GPU memory capturing CUDA graphs for up to {self.max_num_seqs:,} "
                    f"sequences: lower {config.named('max_num_seqs')}, "
                    f"{config.named('kv_cache_memory')} or "
                    f"{config.named('gpu_memory_utilization')}, or give --enforce-eager"
                ) from None
            self._phase("cuda_graphs", t)
        # why steps with prefills run eagerly although mixed_step_graphs: true asked otherwise
        self.piecewise_off: str | None = None
        self.piecewise = self._piecewise_graphs()

    def _piecewise_graphs(self) -> PiecewiseGraphs | None:
        """Graphs for steps with prefills (captured per bucket when first needed), where decode
        steps have graphs; not under -tp (its all-reduces are not captured piecewise yet)."""
        asked = self.config.mixed_step_graphs
        if asked is False:
            return None
        layers = self._attention_layers()
        why = None
        if self.graphs is None:
            why = "no CUDA graphs in this run"
        elif self.tp.size > 1:
            why = "not under -tp yet"
        elif self.recurrent is not None:
            why = "not with linear-attention layers yet"
        elif getattr(self.model, "kv_shared_layers", 0):  # they attend outside the pieces' cuts
            why = "not with layers that read another layer's K/V yet"
        elif len(layers) != len(self.kv_caches):
            why = "the model's attention layers do not match its KV caches"
        if why:
            self.piecewise_off = why if asked else None  # the default says nothing
            return None
        return PiecewiseGraphs(self.model, layers, self.kv_caches,
                               min(MAX_TOKENS, self.config.max_num_batched_tokens),
                               self.scratch_block * self.block_size, self.device, self.dtype,
                               pool=self.graphs.pool)

    def _phase(self, name: str, since: float) -> float:
        """Record start-up phase ``name`` as ending now (after the device is idle); returns
        now, the next phase's start."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.startup_phases[name] = now - since
        log.info("start-up: %s %.2f s", name.replace("_", " "), now - since)
        return now

    @property
    def backend_name(self) -> str:
        """The backend, or where KV groups run two, each with the attention layers it runs
        (``flash-attn (50 layers) + triton (10 layers)``)."""
        layers = {self.backend.name: 0}  # the slabs' backend first
        for b, g in zip(self.group_backends, self.layout.groups):
            layers[b.name] = layers.get(b.name, 0) + len(g.layers)
        if len(layers) == 1:
            return self.backend.name
        return " + ".join(f"{name} ({n} layers)" for name, n in layers.items())

    @property
    def cascade_steps(self) -> int:
        """Decode steps that attended groups' shared pages once (grouped cascade decode)."""
        return self.decode_reads.cascade_steps

    def host_ms_per_step(self, kind: str = "decode") -> float:
        """Mean host time (metadata preparation + planning) per step of ``kind``, in ms."""
        return 1000 * self.host_time_s[kind] / max(1, self.host_steps[kind])

    def sampling_hooks(self, *, processors: bool | None = None, grammars: Any = None,
                       eos_ids: set[int] | None = None) -> None:
        """The engine's side of sampling, each as given: whether sequences carry logits
        processors, the run's compiled grammars, the EOS ids ``min_tokens`` holds back."""
        if processors is not None:
            self.processors_enabled = processors
        if grammars is not None:
            self.grammars = grammars
        if eos_ids is not None:
            self.eos_ids = eos_ids

    # ---- KV cache ---------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes one block of tokens takes across all layers."""
        return self.kv.block_bytes()

    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv.page_bytes()

    def _attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.model.modules() if isinstance(m, PagedAttention)]

    @property
    def scratch_slot(self) -> int | None:
        """The recurrent-state slot padding rows use (models with linear attention)."""
        return None if self.recurrent is None else self.recurrent.scratch_slot

    def plan(self, md: AttentionMetadata, graph_batch_size: int | None = None
              ) -> AttentionMetadata:
        """Each KV group's backend plan of a step (``plan_groups``)."""
        return plan_groups(self.attn_states, md, graph_batch_size)

    # ---- one step -----------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata]:
        """Input ids, positions and attention metadata for a step (prefills first)."""
        if self.advancer is not None and not batch.prefills:
            advanced = self.advancer.advance(batch.decodes)
            if advanced is not None:
                return advanced
        ids_t, pos_t, md = self._build(batch)
        if self.advancer is not None:
            if batch.prefills:
                self.advancer.forget()
            else:
                self.advancer.remember(batch.decodes, pos_t, md)
        return ids_t, pos_t, md

    def _build(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                     AttentionMetadata]:
        """Everything from the sequences' CPU state. A decode's token that the step in
        flight is still sampling (``PENDING_TOKEN`` on the host) is taken from that step's
        tokens on the device, so a step with prefills launches before the last one's tokens
        reach the host, as a decode step does (prefill chunks' tokens must be known)."""
        ids: list[int] = []
        pos: list[int] = []
        prefills, decodes = [], []
        pending: list[tuple[int, Sequence]] = []  # (row, sequence) of placeholder ids
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n) if seq.mm is None \
                else seq.mm.rope_positions(start, start + n)[0].tolist()
            prefills.append(ScheduledSeq(seq.block_table, start, n, seq.state_slot))
        for seq in batch.decodes:
            if seq.token_ids[-1] == PENDING_TOKEN:
                pending.append((len(ids), seq))
            ids.append(seq.token_ids[-1])
            pos.append(seq.num_tokens - 1 + (0 if seq.mm is None else seq.mm.delta))
            decodes.append(ScheduledSeq(seq.block_table, seq.num_tokens - 1, 1, seq.state_slot))
        md = self.builder.build(prefills, decodes)
        if self.images is not None:  # image tokens' embeddings, M-RoPE positions
            self.images.attach(md, batch.prefills, pos[len(pos) - len(decodes):])
        if len(self.layout.groups) > 1:  # each further group over its own page tables
            seqs = [s for s, _ in batch.prefills] + batch.decodes
            md.kv_groups = [self.builder.build_group(md, [s.group_tables[k] for s in seqs])
                            for k in range(len(self.layout.groups) - 1)]
        ids_t = to_device(ids, torch.long, self.device)
        if pending:
            self._fill_pending(ids_t, pending)
        return ids_t, to_device(pos, torch.long, self.device), md

    def _fill_pending(self, ids: torch.Tensor, pending: list[tuple[int, Sequence]]) -> None:
        """Copy the last step's sampled tokens (on the device) into the rows of ``ids``
        that hold its placeholders."""
        if self.last_tokens is None:
            raise RuntimeError("a step's input has a pending token but no step is in flight")
        last = {id(s): i for i, s in enumerate(self.last_sampled)}
        try:
            src = [last[id(seq)] for _, seq in pending]
        except KeyError:
            raise RuntimeError("a pending token was not sampled by the step in flight")
        rows = to_device([[r for r, _ in pending], src], torch.long, self.device)
        ids[rows[0]] = self.last_tokens[rows[1]].to(ids.dtype)

    def reset_counters(self) -> None:
        """Start the summary's host-time, decode-read and graph counters afresh."""
        self.host_time_s = dict.fromkeys(self.host_time_s, 0.0)
        self.host_steps = dict.fromkeys(self.host_steps, 0)
        self.decode_reads = DecodeReads(self.decode_reads.token_bytes)
        if self.images is not None:
            self.images.reset_counts()
        if self.piecewise is not None:
            self.piecewise.steps = 0
        if self.graphs is not None:  # graphs captured from here on count for the next run
            g = self.graphs
            g.run_captures, g.run_capture_s, g.run_warmups = 0, 0.0, 0

    def abandon_steps(self) -> None:
        """Forget the steps launched so far (their requests are dropped), once the device has
        finished them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_tokens, self.last_sampled = None, []
        if self.advancer is not None:
            self.advancer.forget()

    def can_advance(self, decodes: list[Sequence]) -> bool:
        """Whether a decode step of ``decodes`` can take its inputs from the device (so it may
        launch before the previous step's tokens reach the host)."""
        return self.advancer is not None and self.advancer.can_advance(decodes)

    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Queue one step on the device (``forward``, then ``sample``); the handle's
        ``result()`` waits for its tokens."""
        return self.sample(self.forward(batch))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> StepHandle:
        """Queue a step's forward pass and the logits of the rows it samples; ``sample``
        queues their sampling (the host may do other work in between)."""
        t0 = time.perf_counter()
        ids, pos, md = self.prepare(batch)
        kind = "prefill" if batch.prefills else "decode"
        self.decode_reads.count(md)
        graph_bs, graph_key, pieces = None, None, False
        if self.graphs is not None and self.graphs.can_run(md):
            graph_bs, graph_key = self.graphs.prepare(ids, pos, md)  # copy inputs in, plan
        else:
            md = self.plan(md)
            pieces = self.piecewise is not None and self.piecewise.can_run(md)
        self.host_time_s[kind] += time.perf_counter() - t0
        self.host_steps[kind] += 1
        with scope("forward"):
            if graph_bs is not None:
                hidden = self.graphs.replay(graph_bs, md.num_decodes, graph_key)
            elif pieces:
                hidden = self.piecewise.run(ids, pos, md)
            else:
                hidden = self.model(ids, pos, self.kv_caches, md)
        if batch.block_copies:  # forked samples' copies of the last prompt block, now written
            self.backend.copy_blocks(self.kv.slabs, to_device(batch.block_copies, torch.int64,
                                                               self.device))
        if batch.state_copies:  # and of their parent's recurrent state
            self.recurrent.states.copy(to_device(batch.state_copies, torch.int64, self.device))
        # the last token of every sequence whose uncomputed tokens all ran this step (and of
        # the samples forked from it: the same row)
        rows, sampling, scored, prompt_lps = [], [], [], []
        qsl = 0
        for seq, n in batch.prefills:
            if seq.prompt_logprobs is not None:
                lp = self._prompt_logprobs(seq, n, hidden[qsl:qsl + n])
                if lp is not None:
                    prompt_lps.append((seq, lp))
            qsl += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                if seq.params.max_tokens == 0:
                    scored.append(seq)
                    continue
                for s in (seq, *batch.forked.get(seq, ())):
                    rows.append(qsl - 1)
                    sampling.append(s)
        rows += range(qsl, qsl + len(batch.decodes))
        sampling += batch.decodes
        handle = StepHandle(sampling, None, None, prompt_logprobs=prompt_lps, scored=scored,
                            decode_only=not batch.prefills)
        if sampling:
            if rows == list(range(rows[0], rows[0] + len(rows))):
                picked = hidden[rows[0]:rows[0] + len(rows)]
            else:
                picked = hidden[to_device(rows, torch.long, self.device)]
            # in the model's dtype: sampling upcasts only what needs it (a [rows, vocab]
            # float32 copy a step saved where greedy rows or the fused sampler take them)
            handle.logits = self.model.compute_logits(picked, float32=False)
        return handle

    @torch.inference_mode()
    def plan_sampling(self, handle: StepHandle) -> None:
        """Read the sampling sequences for a step ``forward`` queued (their controls and
        processors queue on its logits): the engine may then add this step's placeholders
        to them before ``sample``."""
        if handle.logits is not None and handle.plan is None:
            handle.plan = plan_sampling(handle.logits, handle.sampling, self.device,
                                        self.processors_enabled, self.eos_ids, self.grammars)

    @torch.inference_mode()
    def sample(self, handle: StepHandle) -> StepHandle:
        """Queue the sampling of a step ``forward`` queued, and its tokens' copy to the host."""
        if handle.logits is not None:
            self.plan_sampling(handle)
            out = finish_sampling(handle.plan, self.device, self.tp, self.grammars,
                                  None if self.fused_kernels else False)
            # verify's: as sampled (controls and masks applied), in float32 or the model's dtype
            self.last_logits, self.last_sampled = handle.plan.logits, handle.sampling
            handle.logits = handle.plan = None
            self.last_tokens = out.tokens  # on the device: the next step's pending inputs
            handle.tokens, handle.logprobs = out.host_tokens(), out.logprobs
            handle.logprob_rows = out.logprob_rows
            if self.advancer is not None and handle.decode_only:
                self.advancer.sampled(out.tokens)
        if self.device.type != "cuda":
            return handle
        if handle.tokens is not None:
            handle.tokens = handle.tokens.to("cpu", non_blocking=True)  # into pinned memory
        if handle.logprobs is not None:
            handle.logprobs = handle.logprobs.to_host()
        handle.prompt_logprobs = [(seq, lp.to_host()) for seq, lp in handle.prompt_logprobs]
        handle.event = torch.cuda.Event()
        handle.event.record()
        return handle

    def _prompt_logprobs(self, seq: Sequence, n: int, hidden: torch.Tensor) -> Logprobs | None:
        """Log-probabilities of the prompt tokens this chunk predicts (position ``p`` predicts
        token ``p + 1``), skipping those recorded before (a sequence recomputed after a
        preemption); ``hidden`` holds the chunk's rows."""
        start = seq.num_computed_tokens
        first = max(start, len(seq.prompt_logprobs))
        end = min(start + n, seq.num_prompt_tokens - 1)
        if first >= end:
            return None
        targets = to_device(seq.token_ids[first + 1:end + 1], torch.long, self.device)
        with scope("logprobs"):
            return logprobs.of_hidden(hidden[first - start:end - start], targets,
                                      seq.params.prompt_logprobs, self.model.compute_logits)
