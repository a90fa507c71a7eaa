"""Structured output: each constrained sample's tokens kept inside a grammar (a JSON schema,
any JSON, a regex, a choice of strings or an EBNF grammar), with xgrammar.

``Grammars`` compiles constraints for one tokenizer and vocabulary, once per distinct
constraint (distinct constraints compile in parallel threads); each sample gets its own
``GrammarState`` (an xgrammar matcher and how many of the sample's tokens it has taken).
Every step, ``apply`` brings the constrained rows' matchers up to their sequences' tokens,
fills their token bitmasks on the host (one multi-threaded call for the batch), sends them to
the device and sets the logits of the tokens the grammar forbids to -inf, for those rows only:
unconstrained rows pay nothing. The engine calls it after the step's forward pass has been
queued, so the host fills masks while the device runs the model.

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
from concurrent.futures import ThreadPoolExecutor
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
        self.mask_time_s = 0.0  # host time filling masks
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

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState,
                                                                 Sequence[int]]]) -> None:
        """Mask ``logits`` [batch, vocab] (float32, on its device) in place for each
        (row, state, the row's output tokens so far)."""
        t0 = time.perf_counter()
        live = []
        for row, state, tokens in rows:
            was = state.rejected
            state.catch_up(tokens)
            self.rejected += state.rejected and not was
            if state.active:
                live.append((row, state))
        if not live:
            return
        xgr = _xgr()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((logits.shape[0], words), dtype=torch.int32,
                              pin_memory=logits.is_cuda)
        idx = [r for r, _ in live]
        self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in live], bitmask, idx)
        self.mask_time_s += time.perf_counter() - t0
        self.masked_rows += len(live)
        if logits.shape[1] > self.vocab_size:  # padded logits: ids past the vocabulary never
            logits[idx, self.vocab_size:] = float("-inf")
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=min(self.vocab_size, logits.shape[1]),
                                        indices=idx)


_KIND_NAMES = {"json": "the JSON schema", "json_object": "the JSON grammar",
               "regex": "the regex", "choice": "the choice", "grammar": "the grammar"}
