"""Structured output: each constrained sample's tokens kept inside a grammar (a JSON schema,
any JSON, a regex, a choice of strings or an EBNF grammar), with xgrammar.

``Grammars`` compiles constraints for one tokenizer and vocabulary, once per distinct
constraint (distinct constraints compile in parallel threads); each sample gets its own
``GrammarState`` (an xgrammar matcher and how many of the sample's tokens it has taken).
Every step, ``apply`` brings the constrained rows' matchers up to their sequences' tokens,
fills their token bitmasks on the host (one multi-threaded call for the batch), sends them to
the device, puts them in their rows there and sets the logits of the tokens the grammar
forbids to -inf, for those rows only: unconstrained rows pay nothing. ``prefetch`` does the
same ahead of time in a worker thread: the engine hands it each launched step's tokens, and
the next step's masks are filled while the engine schedules and launches that step (``apply``
then takes them, and fills only rows the worker could not: new sequences, changed batches).
The worker makes few calls into xgrammar (one fill, a few parallel accepts) and keeps each
sample's end and refusals itself: each call gives up the GIL, and taking it back waits for
the engine thread's Python.

Log-probabilities of constrained rows are those of the masked distribution (before any
temperature), as the sampler sees it. A matcher that has accepted its stop token has ended:
its row is left alone (the engine has already finished the sample). A token the grammar
refused (only if every token was masked, which a grammar cannot cause) stops its matcher
for good: ``GrammarState.rejected`` counts it in the summary.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import torch

from pagedgen.attention.ops.transfer import to_device
from pagedgen.runtime.config import StructuredOutput

PART = 32  # states a worker part takes tokens for and fills masks of, at least
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \([^)]*\) is false: )?")


def _xgr():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - a core dependency
        raise ValueError("structured output needs xgrammar: pip install xgrammar")
    return xgrammar


def _message(e: Exception) -> str:
    """xgrammar's error as one line, without its C++ source position."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CPP_PREFIX.sub("", text)


def tokenizer_info(tokenizer: Any, vocab_size: int):
    """xgrammar's view of ``tokenizer`` over the model's ``vocab_size`` logits (ids beyond the
    tokenizer's own are never allowed); its stop tokens are the tokenizer's EOS ids."""
    xgr = _xgr()
    stop = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "tok", None)  # HFTokenizer: transformers' tokenizer
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
    # a byte tokenizer (the presets): each id's bytes; special ids have none
    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stop)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One sample's matcher, how many of its output tokens it has taken, and whether it has
    ended (taken a stop token) or refused a token. Both are kept here rather than asked of
    the matcher: every call into xgrammar lets go of the GIL, and taking it back waits for
    the engine thread's Python (up to the 5 ms switch interval) while masks fill ahead."""

    __slots__ = ("matcher", "accepted", "rejected", "ended", "mask")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accepted = 0
        self.rejected = False
        self.ended = False
        self.mask: tuple[Any, int] | None = None  # (host masks as numpy, row): the last applied

    def allows(self, token: int) -> bool:
        """Whether the last mask applied to this sample's logits allows ``token`` (what its
        matcher would answer, without a call into it)."""
        if self.mask is None:
            return True
        masks, row = self.mask
        return bool(int(masks[row, token >> 5]) >> (token & 31) & 1)

    def took(self, token: int, accepted: bool, stop: frozenset[int]) -> None:
        """Record that the matcher was given ``token`` and whether it accepted it."""
        self.accepted += 1
        if not accepted:
            self.rejected = True
        elif token in stop:
            self.ended = True

    def catch_up(self, tokens: Sequence[int], stop: frozenset[int]) -> None:
        """Take the tokens after those already taken (all must be known: >= 0)."""
        for i in range(self.accepted, len(tokens)):
            t = tokens[i]
            if t < 0:
                raise RuntimeError("a grammar's step ran before its sequence's tokens were known")
            if not self.active:
                self.accepted = len(tokens)
                return
            self.took(t, self.matcher.accept_token(t), stop)

    @property
    def active(self) -> bool:
        return not (self.rejected or self.ended)


class Grammars:
    """Constraints compiled for one tokenizer and vocabulary, each once."""

    def __init__(self, tokenizer: Any, vocab_size: int, threads: int | None = None) -> None:
        xgr = _xgr()
        threads = threads or min(16, os.cpu_count() or 1)
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.stop = frozenset(tokenizer.eos_token_ids)  # the matchers' stop tokens
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._threads = threads
        self._parts = ThreadPoolExecutor(threads, thread_name_prefix="grammar-part") \
            if threads > 1 else None
        self._compiled: dict[StructuredOutput, Any] = {}
        self._lock = threading.Lock()
        self.samples = 0  # matchers made
        self.mask_time_s = 0.0  # host time filling masks in the sampling step
        self.wait_s = 0.0  # host time waiting there for the worker's masks
        self.worker_s = 0.0  # the worker's time taking tokens and filling masks
        self.accept_s = 0.0  # of which its parts' threads accepted (summed over parts)
        self.fill_s = 0.0  # and filled masks (summed over parts)
        self.prefetched_rows = 0  # row-steps whose mask the worker filled
        self.words = (vocab_size + 31) // 32
        self.pin = torch.cuda.is_available()  # masks in pinned memory go to the GPU async
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending: Future | None = None
        self.masked_rows = 0  # row-steps masked
        self.rejected = 0  # samples whose matcher refused a token (then left unconstrained)

    def summary(self) -> dict[str, float | int]:
        """The run summary's structured-output fields."""
        return {"structured_samples": self.samples, "grammar_mask_s": self.mask_time_s,
                "grammar_wait_s": self.wait_s, "grammar_worker_s": self.worker_s,
                "grammar_accept_s": self.accept_s, "grammar_fill_s": self.fill_s,
                "grammar_masked_rows": self.masked_rows,
                "grammar_prefetched_rows": self.prefetched_rows,
                "grammar_rejected_samples": self.rejected}

    def reset_counters(self) -> None:
        """Zero the summary's timers and row counts."""
        self.mask_time_s = self.wait_s = self.worker_s = self.accept_s = self.fill_s = 0.0
        self.masked_rows = self.prefetched_rows = 0

    def compile(self, c: StructuredOutput) -> Any:
        """``c`` compiled (cached); ValueError with xgrammar's reason when it does not."""
        with self._lock:
            hit = self._compiled.get(c)
        if hit is not None:
            return hit
        cc = self.compiler
        try:
            if c.kind == "json":
                g = cc.compile_json_schema(c.spec, any_whitespace=c.any_whitespace)
            elif c.kind == "json_object":  # any object, as OpenAI's JSON mode
                g = cc.compile_json_schema('{"type": "object"}', strict_mode=False,
                                           any_whitespace=c.any_whitespace)
            elif c.kind == "regex":
                g = cc.compile_regex(c.spec)
            elif c.kind == "choice":
                g = cc.compile_grammar(choice_grammar(json.loads(c.spec)))
            else:
                g = cc.compile_grammar(c.spec)
        except Exception as e:  # xgrammar raises RuntimeError (and others) for bad input
            raise ValueError(f"{_KIND_NAMES[c.kind]} does not compile: {_message(e)}")
        with self._lock:
            self._compiled[c] = g
        return g

    def compile_all(self, constraints: Iterable[StructuredOutput]
                    ) -> dict[StructuredOutput, str]:
        """Compile every distinct constraint in parallel; the ones that fail, with why."""
        todo = list(dict.fromkeys(constraints))
        errors: dict[StructuredOutput, str] = {}

        def one(c: StructuredOutput) -> None:
            try:
                self.compile(c)
            except ValueError as e:
                errors[c] = str(e)

        with ThreadPoolExecutor(max_workers=min(8, max(1, len(todo)))) as pool:
            list(pool.map(one, todo))
        return errors

    def state(self, c: StructuredOutput) -> GrammarState:
        """A fresh matcher for one sample of a request constrained by ``c``."""
        self.samples += 1
        return GrammarState(_xgr().GrammarMatcher(self.compile(c)))

    def prefetch(self, rows: Sequence[tuple[GrammarState | None, int]], tokens: torch.Tensor,
                 event: Any) -> None:
        """Start filling the next step's masks in a worker thread: once ``event`` (the
        launched step's, or None) has completed, each (state or None, output index), one per
        row of ``tokens`` (the step's, on the host), takes its token and its next mask is
        filled. The engine's own work for the next step (scheduling, launching its forward
        pass) runs meanwhile: xgrammar leaves the GIL while it works. ``apply`` takes the
        masks of the states whose sequences are where the worker left them."""
        self._join()
        n = sum(state is not None and state.active for state, _ in rows)
        if n:  # the worker's buffer is made here: torch calls let go of the GIL too
            out = torch.empty((n, self.words), dtype=torch.int32, pin_memory=self.pin)
            self._pending = self._worker.submit(self._fill_ahead, list(rows), tokens, event,
                                                out, out.numpy())

    def _fill_ahead(self, rows, tokens, event, bitmask: torch.Tensor, view: Any
                    ) -> tuple[dict[int, tuple[int, int]], torch.Tensor]:
        """The worker: each row's state takes its token and its next mask is filled into
        ``bitmask`` (row: its place among the states that took a token), in parts of at
        least ``PART`` states on the part threads, each accepting then filling its own
        (xgrammar's accept is serial; both let go of the GIL): a part's masks fill while
        other parts still accept. No torch call (each lets go of the GIL, and taking it back
        waits on the engine thread)."""
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        toks = tokens.tolist()
        single, next_tokens = [], []
        for (state, i), t in zip(rows, toks):
            if state is not None and state.active and state.accepted == i and t >= 0:
                single.append(state)
                next_tokens.append(t)
        allowed = [s.allows(t) for s, t in zip(single, next_tokens)]
        parts = min(len(single) // PART, self._threads) if self._parts is not None else 1
        if parts < 2:
            done = [self._accept_and_fill(single, next_tokens, allowed, 0, len(single),
                                          bitmask, self._batch)]
        else:
            cuts = [len(single) * k // parts for k in range(parts + 1)]
            filler = _xgr().BatchGrammarMatcher
            per_part = max(1, self._threads // parts)
            done = list(self._parts.map(
                lambda a, b: self._accept_and_fill(single, next_tokens, allowed, a, b, bitmask,
                                                   _local_filler(filler, per_part)),
                cuts[:-1], cuts[1:]))
        for accept_s, fill_s, rejected in done:
            self.accept_s += accept_s
            self.fill_s += fill_s
            self.rejected += rejected
        live = {}
        for j, s in enumerate(single):
            if s.active:
                s.mask = (view, j)
                live[id(s)] = (j, s.accepted)
        self.worker_s += time.perf_counter() - t0
        return live, bitmask

    def _accept_and_fill(self, states: list[GrammarState], tokens: list[int],
                         allowed: list[bool], a: int, b: int, bitmask: torch.Tensor,
                         filler: Any) -> tuple[float, float, int]:
        """States ``a:b`` take their tokens, and the live ones' masks go to their rows of
        ``bitmask``; returns the seconds each took and how many tokens were refused."""
        t0 = time.perf_counter()
        _accept_tokens([s.matcher for s in states[a:b]], tokens[a:b])
        live = []
        for j in range(a, b):
            states[j].took(tokens[j], allowed[j], self.stop)
            if states[j].active:
                live.append(j)
        t1 = time.perf_counter()
        if live:
            filler.batch_fill_next_token_bitmask([states[j].matcher for j in live], bitmask,
                                                 live)
        return t1 - t0, time.perf_counter() - t1, b - a - sum(allowed[a:b])

    @property
    def filling(self) -> bool:
        """Whether the worker is still filling the next step's masks."""
        return self._pending is not None and not self._pending.done()

    def _join(self) -> tuple[dict[int, tuple[int, int]], torch.Tensor | None]:
        """The masks the worker filled ({id(state): (row, tokens taken)}, rows), after it."""
        if self._pending is None:
            return {}, None
        t0 = time.perf_counter()
        done, self._pending = self._pending.result(), None
        self.wait_s += time.perf_counter() - t0
        return done

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState,
                                                                 Sequence[int]]]) -> None:
        """Mask ``logits`` [batch, vocab] (float32, on its device) in place for each
        (row, state, the row's output tokens so far): the worker's masks where it filled
        them, the others filled here."""
        ahead, pre = self._join()
        t0 = time.perf_counter()
        batch, device = logits.shape[0], logits.device
        src, dst, todo = [], [], []
        for row, state, tokens in rows:
            hit = ahead.get(id(state))
            if hit is not None and hit[1] == len(tokens) == state.accepted:
                src.append(hit[0])
                dst.append(row)
            else:
                todo.append((row, state, tokens))
        self._catch_up(todo)
        live = [(row, state) for row, state, _ in todo if state.active]
        if not live and not src:
            return
        here = None
        if live:  # rows the worker could not fill (new sequences, changed batches)
            here = torch.empty((len(live), self.words), dtype=torch.int32, pin_memory=self.pin)
            self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in live], here)
            view = here.numpy()
            for j, (_, state) in enumerate(live):
                state.mask = (view, j)
        if not live and pre.shape[0] == batch and src == dst == list(range(batch)):
            bitmask = pre.to(device, non_blocking=True)  # the worker's rows are this step's
        else:  # the rows are put in place on the device; uncovered rows allow every token
            bitmask = torch.full((batch, self.words), -1, dtype=torch.int32, device=device)
            if src:
                at = to_device([dst, src], torch.long, device)
                bitmask[at[0]] = pre.to(device, non_blocking=True)[at[1]]
            if live:
                at = to_device([r for r, _ in live], torch.long, device)
                bitmask[at] = here.to(device, non_blocking=True)
        self.mask_time_s += time.perf_counter() - t0
        self.masked_rows += len(live) + len(src)
        self.prefetched_rows += len(src)
        _xgr().apply_token_bitmask_inplace(logits, bitmask,
                                           vocab_size=min(self.vocab_size, logits.shape[1]))

    def _catch_up(self, rows) -> None:
        """Each state takes its sequence's new tokens: the common one new token each in one
        call, any others one by one."""
        single, tokens = [], []
        for _, state, toks in rows:
            n = len(toks) - state.accepted
            if n == 1 and state.active and toks[-1] >= 0:
                single.append(state)
                tokens.append(toks[-1])
            elif n:
                was = state.rejected
                state.catch_up(toks, self.stop)
                self.rejected += state.rejected and not was
        if single:  # the worker is idle here: reading the answers back costs no waits
            ok = self._batch.batch_accept_token([s.matcher for s in single], tokens)
            for state, token, accepted in zip(single, tokens, ok):
                state.took(token, accepted, self.stop)
                self.rejected += not accepted


_LOCAL = threading.local()


def _local_filler(cls: Any, threads: int) -> Any:
    """This thread's xgrammar batch matcher with ``threads`` fill threads (made once)."""
    fillers = _LOCAL.__dict__.setdefault("fillers", {})
    if threads not in fillers:
        fillers[threads] = cls(max_threads=threads)
    return fillers[threads]


def _accept_tokens(matchers: list[Any], tokens: list[int]) -> None:
    """Each matcher takes its token, in one call. xgrammar's public ``batch_accept_token``
    reads its answers back one element at a time, a GIL hand-off each (256 a step, each
    waiting on the engine thread); the binding under it returns them unread."""
    if not matchers:
        return
    core = getattr(getattr(_xgr(), "matcher", None), "_core", None)
    batch = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if batch is None:  # another xgrammar: the public call
        _xgr().BatchGrammarMatcher.batch_accept_token(matchers, tokens)
    else:
        batch([m._handle for m in matchers], tokens, False)


_KIND_NAMES = {"json": "the JSON schema", "json_object": "the JSON grammar",
               "regex": "the regex", "choice": "the choice", "grammar": "the grammar"}
