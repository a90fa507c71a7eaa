"""Structured output: each constrained sample's tokens kept inside a grammar (a JSON schema,
any JSON, a regex, a choice of strings or an EBNF grammar), with xgrammar.

``Grammars`` compiles constraints for one tokenizer and vocabulary, once per distinct
constraint (distinct constraints compile in parallel threads); each sample gets its own
``GrammarState`` (an xgrammar matcher and how many of the sample's tokens it has taken).
Every step, ``apply`` brings the constrained rows' matchers up to their sequences' tokens,
fills their token bitmasks on the host (one multi-threaded call for the batch), sends them to
the device and sets the logits of the tokens the grammar forbids to -inf, for those rows only:
unconstrained rows pay nothing. ``prefetch`` does the same ahead of time in a worker thread:
the engine hands it each launched step's tokens, and the next step's masks are filled while
the engine schedules and launches that step (``apply`` then takes them, and fills only rows
the worker could not: new sequences, changed batches).

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

from pagedgen.runtime.config import StructuredOutput

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
    """One sample's matcher and how many of its output tokens it has taken."""

    __slots__ = ("matcher", "accepted", "rejected")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accepted = 0
        self.rejected = False

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Take the tokens after those already taken (all must be known: >= 0)."""
        for i in range(self.accepted, len(tokens)):
            t = tokens[i]
            if t < 0:
                raise RuntimeError("a grammar's step ran before its sequence's tokens were known")
            if self.rejected or self.matcher.is_terminated():
                self.accepted = len(tokens)
                return
            if not self.matcher.accept_token(t):
                self.rejected = True
            self.accepted += 1

    @property
    def active(self) -> bool:
        return not self.rejected and not self.matcher.is_terminated()


class Grammars:
    """Constraints compiled for one tokenizer and vocabulary, each once."""

    def __init__(self, tokenizer: Any, vocab_size: int, threads: int | None = None) -> None:
        xgr = _xgr()
        threads = threads or min(8, os.cpu_count() or 1)
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._compiled: dict[StructuredOutput, Any] = {}
        self._lock = threading.Lock()
        self.samples = 0  # matchers made
        self.mask_time_s = 0.0  # host time filling masks in the sampling step
        self.wait_s = 0.0  # host time waiting there for the worker's masks
        self.prefetched_rows = 0  # row-steps whose mask the worker filled
        self.words = (vocab_size + 31) // 32
        self.pin = torch.cuda.is_available()  # masks in pinned memory go to the GPU async
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending: Future | None = None
        self.masked_rows = 0  # row-steps masked
        self.rejected = 0  # samples whose matcher refused a token (then left unconstrained)

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
        filled. The engine's
        own work for the next step (scheduling, launching its forward pass) runs meanwhile:
        xgrammar leaves the GIL while it fills. ``apply`` takes the masks of the states whose
        sequences are where the worker left them."""
        self._join()
        if any(state is not None for state, _ in rows):
            self._pending = self._worker.submit(self._fill_ahead, list(rows), tokens, event)

    def _fill_ahead(self, rows, tokens, event) -> tuple[dict[int, int], torch.Tensor]:
        if event is not None:
            event.synchronize()
        toks = tokens.tolist()
        single, next_tokens = [], []
        for (state, i), t in zip(rows, toks):
            if state is not None and state.active and state.accepted == i and t >= 0:
                single.append(state)
                next_tokens.append(t)
        self._accept(single, next_tokens)
        live = [s for s in single if s.active]
        bitmask = torch.empty((max(len(live), 1), self.words), dtype=torch.int32,
                              pin_memory=self.pin)
        if live:
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in live], bitmask)
        return {id(s): (j, s.accepted) for j, s in enumerate(live)}, bitmask

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
        batch = logits.shape[0]
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
        if not live and pre.shape[0] == batch and src == dst == list(range(batch)):
            bitmask = pre  # the worker's rows are this step's rows: use them as they are
        else:
            bitmask = torch.empty((batch, self.words), dtype=torch.int32,
                                  pin_memory=self.pin)
            if src:
                bitmask[dst] = pre[src]
            if live:
                self._batch.batch_fill_next_token_bitmask(
                    [s.matcher for _, s in live], bitmask, [r for r, _ in live])
            covered = set(dst) | {r for r, _ in live}
            if len(covered) < batch:  # other rows allow every token: the mask covers all
                # rows, so no row-index list goes to the device (a pageable copy waits)
                bitmask[sorted(set(range(batch)) - covered)] = -1
        self.mask_time_s += time.perf_counter() - t0
        self.masked_rows += len(live) + len(src)
        self.prefetched_rows += len(src)
        _xgr().apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True),
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
                state.catch_up(toks)
                self.rejected += state.rejected and not was
        self._accept(single, tokens)

    def _accept(self, states: list[GrammarState], tokens: list[int]) -> None:
        if not states:
            return
        ok = self._batch.batch_accept_token([s.matcher for s in states], tokens)
        for state, accepted in zip(states, ok):
            state.accepted += 1
            if not accepted:
                state.rejected = True
                self.rejected += 1


_KIND_NAMES = {"json": "the JSON schema", "json_object": "the JSON grammar",
               "regex": "the regex", "choice": "the choice", "grammar": "the grammar"}
