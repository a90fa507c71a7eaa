"""The engine: requests in, finished sequences out, one scheduled step at a time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.ordering import prefix_grouped
from pagedgen.runtime.engine.requests import check_request
from pagedgen.runtime.engine.scheduler import Scheduler
from pagedgen.runtime.engine.sequence import PENDING_TOKEN, Sequence
from pagedgen.runtime.engine.stats import StepStats
from pagedgen.runtime.models.loader import ModelSource, load_tokenizer, resolve_model
from pagedgen.runtime.models.multimodal import ImagePrompter, MultiModalPrompt
from pagedgen.runtime.models.tokenizer import Tokenizer
from pagedgen.runtime.output.output_stage import OutputStage
from pagedgen.runtime.output.outputs import RequestOutput
from pagedgen.runtime.output.report import run_summary
from pagedgen.runtime.sampling.controls import bad_words_ids
from pagedgen.runtime.sampling.processors import ProcessorFactory
from pagedgen.runtime.sampling.sampler import derive_seed
from pagedgen.runtime.sampling.structured import Grammars
from pagedgen.runtime.worker import batch_invariant, description, jit_monitor, measurement, warmup
from pagedgen.runtime.worker.model_runner import ModelRunner

RequestItem = tuple  # add_requests': (ids, sampling, handle, index[, ``prompt_images``'s])


class Engine:
    def __init__(self, config: EngineConfig, src: ModelSource | None = None,
                 tokenizer: Tokenizer | None = None,
                 processor_factory: ProcessorFactory | None = None,
                 grammars: Grammars | None = None) -> None:
        """``processor_factory(request, params, sample_index)``: the logits processors of each
        sample (``runtime/sampling/processors.py``); None: no request has any. ``grammars``:
        structured-output constraints already compiled for this model's tokenizer (made at
        the first constrained request otherwise)."""
        # checked: max_num_seqs within the tokens, both positive; as --batch-invariant runs it
        config = batch_invariant.prepared(config.with_step_limits())
        self.config = config
        self.src = src or resolve_model(config.model)
        self._tokenizer = tokenizer  # loaded at first use (runs on token ids need none)
        self._output: OutputStage | None = None
        startup = jit_monitor.install()  # Triton kernels made at start-up, then in the run
        self.runner = ModelRunner(config, self.src)
        self.jit_marks = [startup, jit_monitor.MONITOR.mark()]
        self.processor_factory = processor_factory
        self._grammars = grammars
        self.runner.sampling_hooks(processors=processor_factory is not None)
        recurrent = self.runner.recurrent
        if recurrent is not None and recurrent.max_num_seqs < config.max_num_seqs:  # did not fit
            self.config = config = dataclasses.replace(config, max_num_seqs=recurrent.max_num_seqs)
        self._new_queues()
        self.stats = StepStats()
        self._next_id = 0
        self._pending = None  # (StepHandle, placeholder indices) of the step in flight
        self._ahead = None  # the next step's batch, when scheduled before this one sampled
        self._sources: list[Iterator[RequestItem]] = []  # requests not yet made sequences
        # Sequences made ahead of admission: enough to fill max_num_seqs in the next step.
        self._lookahead = config.max_num_seqs
        warm = config.startup_warmup
        if warm or (warm is None and self.runner.device.type == "cuda"):
            t = time.perf_counter()
            warmup.warm_up(self)  # then counts afresh: jit_marks[1] moves past it
            self.runner.startup_phases["warmup"] = time.perf_counter() - t

    def _new_queues(self) -> None:
        """An empty scheduler over a block manager with every block and state slot free."""
        config, recurrent = self.config, self.runner.recurrent
        # no prefix caching with linear-attention layers: their state at a prefix's end is gone
        self.block_manager = BlockManager(
            self.runner.num_blocks - 1,  # -1: the scratch block
            self.runner.block_size, config.prefix_caching and recurrent is None,
            state_slots=0 if recurrent is None else config.max_num_seqs,
            windows=self.runner.layout.windows)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)

    def abort(self) -> int:
        """Drop every request queued or in flight (an interrupted or failed call's); how many.
        Then every block and state slot is free, the prefix cache empty (a step cut before
        its launch may have registered blocks never written), the matchers new."""
        pending = self._pending[0].sampling if self._pending is not None else []
        seqs = {id(s): s for s in (*self.scheduler.running, *self.scheduler.waiting, *pending)}
        dropped = len({id(s.samples) if s.samples else id(s) for s in seqs.values()})
        self.runner.abandon_steps()
        self._pending = self._ahead = None
        self._sources = []
        self._new_queues()
        if self._grammars is not None:
            self._grammars.restart_pool()
        return dropped

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.src)
        return self._tokenizer

    @property
    def output(self) -> OutputStage:
        """The stop rules and texts (made with the tokenizer, at first use)."""
        if self._output is None:
            runner = self.runner  # not the engine: no cycle keeps it alive past its run
            try:
                self._output = OutputStage(self.tokenizer, lambda: runner.max_model_len,
                                           self.config.reasoning_parser)
            except ValueError as e:  # a named reasoning parser this tokenizer cannot run
                raise PagedgenError(f"{self.config.named('reasoning_parser')}: {e}")
        return self._output

    @property
    def grammars(self) -> Grammars:
        """The run's structured-output constraints, compiled once each; the sampler masks the
        constrained rows with them."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.src.hf_config.vocab_size)
        self.runner.sampling_hooks(grammars=self._grammars)
        return self._grammars

    # ---- what callers read of the engine (not of its runner) ----------------------------

    @property
    def device(self):
        return self.runner.device

    @property
    def dtype(self):
        return self.runner.dtype

    @property
    def backend_name(self) -> str:
        return self.runner.backend_name

    @property
    def startup_phases(self) -> dict[str, float]:
        """Seconds each start-up phase took (model, attention, memory profile, KV cache)."""
        return self.runner.startup_phases

    def set_processor_factory(self, factory: ProcessorFactory | None) -> None:
        """Logits processors for the requests added from now on (``processors.py``)."""
        self.processor_factory = factory
        self.runner.sampling_hooks(processors=factory is not None)

    @property
    def grammars_used(self) -> Grammars | None:
        """The run's compiled constraints, if any request had one (none made here)."""
        return self._grammars

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request: Any = None, index: int | None = None,
                    images: MultiModalPrompt | None = None) -> Sequence:
        """Queue a request. Raises ValueError for a prompt the model cannot take.

        Without a seed in ``params`` the request's seed is derived from the run seed and
        ``index`` (its position in the input; default: arrival order), so reruns repeat it.
        With ``params.n`` > 1 the returned sequence is sample 0; ``seq.samples`` lists all
        ``n``, each seeded with ``derive_seed(seed, i)``. They share the prompt's K/V (and
        ``images``, the prompt's: ``prompt_images``).
        """
        self.check_request(prompt_token_ids, params)  # validates params too
        index = self._next_id if index is None else index
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + index
        ids = list(prompt_token_ids)
        now = time.perf_counter()
        bad_words = bad_words_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        if params.min_tokens:
            self.runner.sampling_hooks(eos_ids=self.tokenizer.eos_token_ids)  # min_tokens
        samples = []
        for i in range(params.n):
            samples.append(Sequence(self._next_id, ids, params, derive_seed(seed, i), request,
                                    arrival_time=now, sample_index=i,
                                    bad_words_ids=bad_words, mm=images))
            if self.processor_factory is not None:
                samples[-1].logits_processors = self.processor_factory(request, params, i)
            if params.structured is not None:
                samples[-1].grammar = self.grammars.state(params.structured)
            self._next_id += 1
        self.output.prepare(samples, params)  # stop strings: each sample's text as it comes
        seq = samples[0]
        if params.n > 1:
            seq.forks = samples[1:]
            for s in samples:
                s.samples = samples
        if images is not None:  # their pixels made ahead, in threads
            self.runner.images.prefetch(images)
        self.scheduler.add(seq)
        return seq

    def prompt_images(self, prompt_ids: list[int], images: list[Any], where: str = ""
                      ) -> tuple[list[int], MultiModalPrompt]:
        """``ImagePrompter.prompt`` on this model (the ids and ``add_request``'s images)."""
        enc = self.runner.images
        prompter = enc.prompter if enc else ImagePrompter.of(self.src, where)  # raises: no images
        return prompter.prompt(prompt_ids, images, where)

    def check_request(self, prompt_token_ids, params: SamplingParams) -> None:
        """``check_request`` against this engine: its context, which the KV cache may cut
        (then the error says how much cache there is and how to get more)."""
        r = self.runner
        memory = None
        if r.max_model_len < r.context_len:
            memory = (f"the KV cache holds {r.max_model_len:,} tokens of a sequence "
                      f"({r.num_blocks - 1} blocks of {r.block_size}, "
                      f"{r.kv_cache_bytes() / 2**30:.2f} GiB); give more "
                      "--kv-cache-memory or --num-blocks")
        check_request(prompt_token_ids, params, self.max_model_len,
                      self.src.hf_config.vocab_size, self.config.max_num_seqs, memory,
                      self.config.named("max_num_seqs"))

    def add_requests(self, items: Iterable[RequestItem]) -> None:
        """Queue requests lazily: each item becomes a sequence (``add_request``) only when the
        waiting queue runs short, so a million queued requests cost no more per step than a
        hundred. Items must already have passed ``check_request``. With ``prefix_grouping``
        (default), requests that share a prompt prefix are admitted together."""
        if self.config.prefix_grouping:
            items = prefix_grouped(items, lambda item: item[0])
        self._sources.append(iter(items))

    def _top_up(self) -> None:
        waiting = self.scheduler.waiting
        while self._sources and len(waiting) < self._lookahead:
            item = next(self._sources[0], None)
            if item is None:
                self._sources.pop(0)
                continue
            self.add_request(*item)  # ids, params, request, index[, images]

    def has_unfinished(self) -> bool:
        self._top_up()
        return (self.scheduler.has_unfinished() or self._pending is not None
                or self._ahead is not None)

    def step(self) -> list[Sequence]:
        """Schedule and run one step; returns the sequences that finished in it.

        With async scheduling (the default when decode inputs advance on the device), a decode
        step that continues the previous one is launched before the previous step's tokens
        reach the host: the host's bookkeeping for step N overlaps the GPU running step N+1.
        Sampled tokens enter as placeholders; sequences finish when their tokens are known.
        """
        self._top_up()
        if self.config.async_scheduling and self.runner.advancer is not None:
            return self._step_async()
        if not self.scheduler.has_unfinished():
            return []
        t0 = time.perf_counter()
        batch = self._schedule()
        handle = self.runner.launch(batch)
        self._computed(batch)
        placed = self._place(handle)
        self._prefetch_masks(handle, placed)
        finished = self._resolve(handle, placed)
        self._account(batch, t0)
        return finished

    def _step_async(self) -> list[Sequence]:
        pending, self._pending = self._pending, None
        batch, self._ahead = self._ahead, None  # scheduled while the last step's masks filled
        if batch is None:
            if not self.scheduler.has_unfinished():  # only the step in flight is left
                return self._resolve(*pending) if pending else []
            batch = self._schedule()
        t0 = time.perf_counter()
        finished = []
        if pending and not self._launches_ahead(batch):
            # the next step's inputs are built on the host: they need the real tokens first
            finished = self._resolve(*pending)
            pending = None
            batch.decodes = [s for s in batch.decodes if not s.is_finished]
            batch.prefills = [(s, n) for s, n in batch.prefills if not s.is_finished]
            if batch.is_empty:
                return finished
        handle = self.runner.forward(batch)
        if pending is not None and self._reads_tokens(
                batch.decodes + [s for s, _ in batch.prefills]):
            # sampling reads the tokens so far (a grammar, penalties, a processor): the last
            # step's are read now that this step's forward pass is queued
            finished += self._resolve(*pending)
            self.stats.overlapped_steps += 1
            pending = None
        self.runner.plan_sampling(handle)  # the sequences as they are before this step
        self._computed(batch)
        placed = self._place(handle)
        if self.config.schedule_during_mask_fill and self._grammars is not None \
                and handle.plan is not None and handle.plan.grammar_rows \
                and self._grammars.filling:
            # the sampling below waits for the worker's masks: the next step is scheduled
            # meanwhile (its inputs still come from this step's tokens, launched first).
            # Only for a step with grammar rows: its last step's tokens were read above, so no
            # sequence of the batch scheduled here can stop before it launches (the pool may
            # stay busy after a run's last constrained row: not a reason to schedule early)
            self._top_up()
            if self.scheduler.has_unfinished():
                self._ahead = self._schedule()
                self.stats.steps_scheduled_during_masks += 1
        self.runner.sample(handle)
        self._pending = (handle, placed)
        self._prefetch_masks(*self._pending)
        if pending:
            self.stats.overlapped_steps += 1
            finished += self._resolve(*pending)
        self._account(batch, t0)
        return finished

    def _launches_ahead(self, batch) -> bool:
        """Whether ``batch`` may launch before the step in flight's tokens are on the host:
        a decode step that continues it advances on the device; other steps are built on
        the host with that step's tokens copied into the decodes' rows on the device
        (``ModelRunner._build``), unless ``mixed_steps_ahead`` is off or a prefill chunk
        holds a token still in flight (a sequence preempted and readmitted at once)."""
        if not batch.prefills and self.runner.can_advance(batch.decodes):
            return True
        return self.config.mixed_steps_ahead and all(
            s.num_known_tokens >= s.num_computed_tokens + n for s, n in batch.prefills)

    def _prefetch_masks(self, handle, placed: list[int]) -> None:
        """Structured output: the grammar pool takes this step's tokens once they are known."""
        if self._grammars is not None and handle.tokens is not None:
            self._grammars.prefetch([(s.grammar, i) for s, i in zip(handle.sampling, placed)],
                                    handle.tokens, handle.event)

    def _reads_tokens(self, decodes: list[Sequence]) -> bool:
        """Whether sampling a sequence of these decodes reads its tokens: a grammar, a
        sampling control or a logits processor that does."""
        if any(s.grammar is not None or s.params.needs_token_history() for s in decodes):
            return True
        return self.processor_factory is not None and any(
            p.needs_tokens for s in decodes for p in s.logits_processors)

    def _schedule(self):
        if (batch := self.scheduler.schedule()).is_empty:
            raise RuntimeError("scheduler produced an empty step with requests pending")
        return batch

    def _computed(self, batch) -> None:
        """The launched step's tokens count as computed; full blocks among them not cached
        yet (decodes, chunks of sequences that waited on a token) join the prefix cache."""
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            self._cache_blocks(seq)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            if not seq.is_finished:  # it may have stopped while this step was launched
                self._cache_blocks(seq)

    def _cache_blocks(self, seq: Sequence) -> None:
        bm = self.block_manager
        if bm.prefix_caching and seq.num_computed_tokens // bm.block_size > seq.num_cached_blocks:
            bm.cache_blocks(seq, min(seq.num_computed_tokens, seq.num_known_tokens))

    def _account(self, batch, t0: float) -> None:
        self.stats.step_done(batch, self.block_manager, t0, time.perf_counter())

    def _place(self, handle) -> list[int]:
        """Append a placeholder token for each sequence the launched step samples; a sequence
        that reaches its length limit with it leaves the scheduler now (its token is still to
        come). Returns each placeholder's index in its sequence's output."""
        for seq in handle.scored:  # prompts scored without sampling (max_tokens 0): done
            self.scheduler.finish(seq)
        placed = []
        for seq in handle.sampling:
            if seq.is_finished:  # stopped at the last step's token (read during the launch)
                placed.append(seq.num_output_tokens)  # past its end: ``_resolve`` drops it
                continue
            seq.append_token(PENDING_TOKEN)
            placed.append(seq.num_output_tokens - 1)
            if self.output.at_length_limit(seq, seq.num_output_tokens):
                self.scheduler.finish(seq)
        return placed

    def _resolve(self, handle, placed: list[int]) -> list[Sequence]:
        """Fill a launched step's placeholders with its tokens (and log-probabilities) and
        apply the stop rules."""
        results = handle.result()
        if self._grammars is not None:  # the next masks fill from these tokens meanwhile
            self._grammars.tokens_known()
        now = time.perf_counter()
        finished = []
        for seq, entries in handle.prompt_results():
            seq.prompt_logprobs += entries
        for (seq, token, entry), i in zip(results, placed):
            if i >= seq.num_output_tokens or seq.output_token_ids[i] != PENDING_TOKEN:
                continue  # dropped: the sequence stopped at an earlier token
            if seq.finish_reason is None and (token < 0 or (
                    seq.grammar is not None and seq.grammar.dead_index is not None
                    and i >= seq.grammar.dead_index)):  # no token could continue it
                if token < 0 and seq.grammar is not None:
                    self._grammars.dead_end()
                finished.append(self._unsatisfiable(seq, i, now))
                continue
            seq.output_token_ids[i] = token
            seq.token_ids[seq.num_prompt_tokens + i] = token
            self.stats.tokens_generated += 1
            if entry is not None:  # entries come in output order, as the tokens do
                seq.logprobs.append(entry)
            self._cache_blocks(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.finish_reason is None and self.output.token(seq, token, i + 1):
                extra = seq.num_output_tokens - (i + 1)  # placeholders of later steps
                if extra:
                    del seq.output_token_ids[i + 1:], seq.token_ids[-extra:]
                self.scheduler.finish(seq)
            if seq.is_finished and i + 1 == seq.num_output_tokens:
                seq.finish_reason = seq.finish_reason or "length"
                seq.finish_time = now
                self.stats.record_finished(seq)
                finished.append(seq)
                if seq.grammar is not None:  # its matcher's slot is free again
                    self._grammars.release(seq.grammar)
        for seq in handle.scored:
            seq.finish_reason, seq.finish_time = "length", now
            self.stats.record_finished(seq)
            finished.append(seq)
        return finished

    def _unsatisfiable(self, seq: Sequence, i: int, now: float) -> Sequence:
        """End ``seq`` before its output token ``i``, for which its grammar (with its controls)
        allows no choice (that token and any placeholder after it dropped)."""
        extra = seq.num_output_tokens - i
        del seq.output_token_ids[i:], seq.token_ids[-extra:]
        seq.finish_reason, seq.finish_time = "unsatisfiable", now
        if not seq.is_finished:
            self.scheduler.finish(seq)
        self.stats.record_finished(seq)
        if seq.grammar is not None:
            self._grammars.release(seq.grammar)
        return seq

    def output_text(self, seq: Sequence) -> str:
        """A finished sample's text (``output_stage.py``)."""
        return self.output.text(seq)

    def request_output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of a request whose ``samples`` have all finished (``outputs.py``)."""
        return self.output.request_output(samples)

    def run(self, on_finish: Callable[[Sequence], None] | None = None,
            on_step: Callable[[list[Sequence]], None] | None = None) -> None:
        """Step until every queued request has finished."""
        while self.has_unfinished():
            finished = self.step()
            for seq in finished if on_finish else ():
                on_finish(seq)
            if on_step:
                on_step(finished)

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams) -> list[Sequence]:
        """Convenience: run token-id prompts to completion; returns sequences in input order."""
        seqs = [self.add_request(p, params) for p in prompts]
        self.run()
        return seqs

    def reset_prefix_cache(self, enabled: bool | None = None) -> None:
        """Forget every cached block and image embedding (between runs, none in flight);
        ``enabled``: caching."""
        if self.has_unfinished():
            raise RuntimeError("reset_prefix_cache with requests in flight")
        self.block_manager.reset_prefix_cache()
        if self.runner.images is not None:
            self.runner.images.forget()
        if enabled is not None:
            self.block_manager.prefix_caching = enabled

    def reset_stats(self) -> None:
        """Start the summary's counters afresh (between benchmark runs on one engine)."""
        self.stats = StepStats()
        self.jit_marks[1] = jit_monitor.MONITOR.mark()
        self.runner.reset_counters()
        if self._grammars is not None:
            self._grammars.reset_counters()

    def forget_requests(self) -> None:
        """Number requests from 0 again (after the start-up warm-up), none in flight."""
        if self.has_unfinished():
            raise RuntimeError("forget_requests with requests in flight")
        self._next_id = 0

    def describe(self, wall: float | None = None) -> dict[str, Any]:
        """The worker's read-only description of itself (``worker/description.py``)."""
        return description.describe(self.runner, self.block_manager.peak_held, wall)

    def measurement(self) -> measurement.Measurement:
        """What profile and the benchmarks measure the worker by (``worker/measurement.py``)."""
        return measurement.Measurement(self.runner, self.block_manager.peak_held,
                                       self.src.hf_config)

    def summary(self, wall: float, start: float, extra: dict | None = None) -> dict[str, Any]:
        """The run's figures since ``start`` (a ``time.perf_counter()``: ``report.py``)."""
        return run_summary(self, wall, start, extra)
