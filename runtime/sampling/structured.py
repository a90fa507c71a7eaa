"""Structured output: each constrained sample's tokens kept inside a grammar (a JSON schema,
any JSON, a regex, a choice of strings or an EBNF grammar), with xgrammar.

``Grammars`` compiles constraints for one tokenizer and vocabulary, once per distinct
constraint (distinct constraints compile in parallel threads); each sample gets its own
``GrammarState``, whose xgrammar matcher lives in the grammar pool (``grammar_pool.py``:
worker processes with CUDA, inline without). The engine hands ``prefetch`` each launched
step's sampled rows and calls ``tokens_known`` once that step's tokens are on the host: the
pool's workers then take them and fill the next step's masks into a shared host buffer
while the GPU runs the next forward pass. ``apply``, in the sampling step, waits for them
(and catches up any state the pool is behind on), copies the buffer to the device, puts
each row's mask in place there and sets the logits of the tokens the grammar forbids to
-inf, for the constrained rows only: unconstrained rows pay nothing.

Log-probabilities of constrained rows are those of the masked distribution (before any
temperature), as the sampler sees it. A matcher that has accepted its stop token has ended:
its row is left alone (the engine has already finished the sample). A constraint whose very
first mask allows no token (a regex that matches no string, say) fails to compile, before the
run. A sample whose matcher reaches a place where its mask allows no token (no text completes
the grammar from there: ``GrammarState.dead_at``) ends there with ``finish_reason``
``"unsatisfiable"``, counted in the summary; the token its last row sampled is dropped; so does
a sample whose grammar's tokens its ``bad_words`` (or a logits processor) all forbid
(``sampling/step.py``). A token the grammar refused stops its matcher for good:
``GrammarState.rejected`` counts it in the summary.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from pagedgen import envs
from pagedgen.errors import PagedgenError, first_line
from pagedgen.runtime.config import StructuredOutput
from pagedgen.runtime.hardware import host_cores
from pagedgen.runtime.sampling.grammar_pool import GrammarPool
from pagedgen.runtime.sampling.json_schema import unenforced, unsatisfiable
from pagedgen.transfer import to_device

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \([^)]*\) is false: )?")


def _xgr():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - a core dependency
        raise ValueError("structured output needs xgrammar: pip install xgrammar")
    return xgrammar


def _message(e: Exception) -> str:
    """xgrammar's error as one line, without its C++ source position."""
    text = first_line(e)
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
    """An EBNF grammar whose sentences are exactly ``choices``, as a trie: choices that share
    a prefix share its rule, so 100,000 choices compile in seconds where their plain
    alternation takes minutes. A chain of single children is one literal."""
    root: dict = {}
    for c in choices:
        node = root
        for ch in c:
            node = node.setdefault(ch, {})
        node[None] = None  # a choice ends here
    rules: list[tuple[str, dict]] = [("root", root)]
    lines = []
    for name, node in rules:  # grows as it goes: one rule per branching node
        alts = []
        for ch, child in node.items():
            if ch is None:
                alts.append('""')
                continue
            text = ch
            while len(child) == 1 and None not in child:
                (ch2, child), = child.items()
                text += ch2
            literal = json.dumps(text, ensure_ascii=False)
            if list(child) == [None]:
                alts.append(literal)
            else:
                rules.append((f"c{len(rules)}", child))
                alts.append(f"{literal} {rules[-1][0]}")
        lines.append(f"{name} ::= " + " | ".join(alts))
    return "\n".join(lines)


class GrammarState:
    """One sample's place in the grammar pool: its constraint's key, its matcher's slot (None
    until its first token), how many of its output tokens went to the matcher, and whether the
    matcher has ended (taken a stop token) or refused a token, as of the pool's last answer.

    ``start``: the output index of the first token the grammar constrains: 0, or for a
    reasoning model the answer's first token, None while the sample still reasons (its rows
    are left alone then, but for ``opener``: a token also allowed beside the grammar's first
    mask, as ``<think>`` where the first token decides whether the sample reasons)."""

    __slots__ = ("key", "slot", "accepted", "ended", "rejected", "dead_at", "start", "opener")

    def __init__(self, key: int) -> None:
        self.key = key
        self.slot: int | None = None
        self.accepted = 0
        self.ended = False
        self.rejected = False
        self.dead_at: int | None = None  # the grammar's token index no token can take
        self.start: int | None = 0
        self.opener: int | None = None

    @property
    def dead_index(self) -> int | None:
        """The output index no token can take, once known."""
        return None if self.dead_at is None else (self.start or 0) + self.dead_at

    @property
    def active(self) -> bool:
        return not (self.rejected or self.ended or self.dead_at is not None)


def default_workers() -> int:
    """Grammar worker processes: ``PAGEDGEN_GRAMMAR_WORKERS``, else 0 (inline) without CUDA
    and, with it, one for each two of this rank's cores past the engine's two, 1 to 8."""
    env = envs.GRAMMAR_WORKERS.get()
    if env is not None:
        if not env.isdigit():
            raise PagedgenError(f"PAGEDGEN_GRAMMAR_WORKERS={env!r}: give a count, 0 for inline")
        return int(env)
    if not torch.cuda.is_available():
        return 0
    return min(8, max(1, (host_cores() - 2) // 2))


class Grammars:
    """Constraints compiled for one tokenizer and vocabulary, each once, and the pool of the
    samples' matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, threads: int | None = None,
                 workers: int | None = None) -> None:
        xgr = _xgr()
        cores = host_cores()
        workers = default_workers() if workers is None else workers
        threads = threads or max(1, min(16, cores) // max(1, workers))
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.stop = frozenset(tokenizer.eos_token_ids)  # the matchers' stop tokens
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=min(16, cores))
        self._compiled: dict[StructuredOutput, Any] = {}
        self._keys: dict[StructuredOutput, int] = {}
        self._by_key: list[Any] = []
        self._initial: dict[tuple[int, str], torch.Tensor] = {}  # first masks, per device
        self._lock = threading.Lock()
        self.words = (vocab_size + 31) // 32
        self._pool_args = (workers, threads)
        self.pool = self._new_pool()
        self._ready: list[tuple[list, torch.Tensor, Any]] = []  # steps whose tokens are due
        self._copied: Any = None  # the last mask copy to the device (an event)
        self.samples = 0  # states made
        self.mask_time_s = 0.0  # host time putting masks on the logits in the sampling step
        self.masked_rows = 0  # row-steps masked
        self.prefetched_rows = 0  # of which the pool had filled ahead

    def _new_pool(self) -> GrammarPool:
        return GrammarPool(self.info, self.stop, self.words, self._by_key.__getitem__,
                           *self._pool_args, pin=torch.cuda.is_available())

    def restart_pool(self) -> None:
        """Drop every sample's matcher: the pool's workers stop and a new pool starts (the
        engine's requests were dropped, perhaps by an interrupt between a message to a
        worker and its answer); compiled grammars stay."""
        self.pool.close()
        self.pool = self._new_pool()
        self._ready.clear()
        self._copied = None

    @property
    def rejected(self) -> int:
        """Samples whose matcher refused a token (then left unconstrained)."""
        return self.pool.rejected

    def summary(self) -> dict[str, float | int]:
        """The run summary's structured-output fields."""
        p = self.pool
        return {"structured_samples": self.samples, "grammar_workers": p.workers,
                "grammar_mask_s": self.mask_time_s, "grammar_wait_s": p.wait_s,
                "grammar_worker_s": p.worker_s, "grammar_accept_s": p.accept_s,
                "grammar_fill_s": p.fill_s, "grammar_masked_rows": self.masked_rows,
                "grammar_prefetched_rows": self.prefetched_rows,
                "grammar_rejected_samples": self.rejected,
                "grammar_unsatisfiable_samples": p.dead_ends}

    def dead_end(self) -> None:
        """Count a sample whose grammar's tokens its other controls (bad words, a processor)
        all forbade: it ended ``unsatisfiable`` too."""
        self.pool.dead_ends += 1

    def reset_counters(self) -> None:
        """Zero the summary's timers and row counts."""
        p = self.pool
        self.mask_time_s = p.wait_s = p.worker_s = p.accept_s = p.fill_s = 0.0
        self.masked_rows = self.prefetched_rows = 0

    def compile(self, c: StructuredOutput) -> Any:
        """``c`` compiled (cached); ValueError with xgrammar's reason when it does not."""
        with self._lock:
            hit = self._compiled.get(c)
        if hit is not None:
            return hit
        cc = self.compiler
        if c.kind == "json":
            schema = json.loads(c.spec)
            why = unsatisfiable(schema)
            if why:
                raise ValueError(f"{_KIND_NAMES[c.kind]} asks for {why}: no output could "
                                 "meet it")
            why = unenforced(schema)
            if why:
                raise ValueError(f"{_KIND_NAMES[c.kind]} asks for {why}, which xgrammar does "
                                 "not enforce: remove it (outputs could break it)")
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
        first = torch.empty((1, self.words), dtype=torch.int32)
        _xgr().GrammarMatcher(g).fill_next_token_bitmask(first)
        if not bool(first.any()):
            raise ValueError(f"{_KIND_NAMES[c.kind]} matches no text this tokenizer can write "
                             "(not even its first token), so no output could meet it")
        with self._lock:
            self._compiled[c] = g
        return g

    def compile_all(self, constraints: Iterable[StructuredOutput],
                    done: Callable[[int], None] | None = None) -> dict[StructuredOutput, str]:
        """Compile every distinct constraint, up to 8 at a time; the ones that fail, with
        why. ``done(n)`` hears how many have compiled. The threads are daemons: an
        interrupted run does not wait for a long compile to end."""
        todo = list(dict.fromkeys(constraints))
        errors: dict[StructuredOutput, str] = {}
        queue = iter(todo)
        lock = threading.Lock()
        count = [0]

        def work() -> None:
            while True:
                with lock:
                    c = next(queue, None)
                if c is None:
                    return
                try:
                    self.compile(c)
                except ValueError as e:
                    errors[c] = str(e)
                with lock:
                    count[0] += 1
                    if done is not None:
                        done(count[0])

        threads = [threading.Thread(target=work, daemon=True, name="grammar-compile")
                   for _ in range(min(8, max(1, len(todo))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    def state(self, c: StructuredOutput) -> GrammarState:
        """A fresh state for one sample of a request constrained by ``c``."""
        g = self.compile(c)
        self.samples += 1
        if c not in self._keys:
            self._keys[c] = len(self._by_key)
            self._by_key.append(g)
        return GrammarState(self._keys[c])

    def release(self, state: GrammarState) -> None:
        """``state``'s sample has finished: its matcher's slot is the pool's again."""
        self.pool.release(state)
        state.ended = True

    @property
    def filling(self) -> bool:
        """Whether the pool is still taking tokens and filling masks for the next step."""
        return self.pool.busy

    def prefetch(self, rows: Sequence[tuple[GrammarState | None, int]], tokens: torch.Tensor,
                 event: Any) -> None:
        """A launched step's sampled rows: (state or None, output index), one per row of
        ``tokens`` (on the host once ``event``, the step's, has completed). ``tokens_known``
        (or the next ``apply``) gives them to the pool, which fills the next masks."""
        if any(state is not None and state.active for state, _ in rows):
            self._ready.append((list(rows), tokens, event))

    def tokens_known(self, wait: bool = False) -> None:
        """Give the pool the tokens of every prefetched step that has completed (with
        ``wait``, of every one) and send them: the masks fill while the GPU runs on."""
        gave = False
        while self._ready:
            rows, tokens, event = self._ready[0]
            if event is not None and not wait and not event.query():
                break
            if event is not None:
                event.synchronize()
            self._ready.pop(0)
            for (state, i), t in zip(rows, tokens.tolist()):
                if state is not None and state.active and state.start is not None \
                        and state.start + state.accepted == i and t >= 0:
                    self._give(state, [t])
                    gave = True
        if gave:
            self.pool.send()

    def _give(self, state: GrammarState, tokens: list[int]) -> None:
        if self._copied is not None:  # no worker writes a buffer the device still reads
            self._copied.synchronize()
            self._copied = None
        self.pool.give(state, tokens)

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState,
                                                                 Sequence[int]]]) -> None:
        """Mask ``logits`` [batch, vocab] (float32, on its device) in place for each (row,
        state, the row's output tokens so far): the pool's masks, filled ahead where it
        could, a grammar's first mask for samples with no token yet."""
        self.tokens_known(wait=True)
        self.pool.join()
        t0 = time.perf_counter()
        behind = False
        rows = [(row, state, tokens[state.start:]) if state.start is not None
                else (row, state, None) for row, state, tokens in rows]
        for _, state, tokens in rows:
            if state.active and tokens is not None and len(tokens) > state.accepted:
                if min(tokens[state.accepted:]) < 0:
                    raise RuntimeError("a grammar's step ran before its sequence's tokens "
                                       "were known")
                self._give(state, list(tokens[state.accepted:]))
                behind = True
        if behind:  # rows the pool could not fill ahead: new sequences, changed batches
            self.pool.send()
            self.pool.join()
        slots, first, openers = [], [], []
        for row, state, tokens in rows:
            if not state.active or (tokens is None and state.opener is None):
                continue  # ended, or still reasoning: unconstrained
            if state.accepted:
                slots.append((row, state.slot))
            else:
                first.append((row, state.key))
                if tokens is None:
                    openers.append((len(first) - 1, state.opener))
        if not slots and not first:
            return
        batch, device = logits.shape[0], logits.device
        bitmask = torch.full((batch, self.words), -1, dtype=torch.int32, device=device)
        if slots:
            hi = max(s for _, s in slots) + 1
            at = to_device([[r for r, _ in slots], [s for _, s in slots]], torch.long, device)
            bitmask[at[0]] = self.pool.masks[:hi].to(device, non_blocking=True)[at[1]]
            if device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        if first:
            at = to_device([r for r, _ in first], torch.long, device)
            masks = torch.stack([self._first_mask(k, device) for _, k in first])
            for i, token in openers:  # the grammar's first tokens, or the reasoning's opener
                masks[i, token // 32] |= _bit(token % 32)
            bitmask[at] = masks
        self.mask_time_s += time.perf_counter() - t0
        self.masked_rows += len(slots) + len(first)
        self.prefetched_rows += len(slots) if not behind else 0
        _xgr().apply_token_bitmask_inplace(logits, bitmask,
                                           vocab_size=min(self.vocab_size, logits.shape[1]))

    def _first_mask(self, key: int, device: torch.device) -> torch.Tensor:
        """The mask before a grammar's first token (the same for every sample), on ``device``."""
        hit = self._initial.get((key, str(device)))
        if hit is None:
            mask = torch.empty((1, self.words), dtype=torch.int32)
            _xgr().GrammarMatcher(self._by_key[key]).fill_next_token_bitmask(mask)
            hit = self._initial[(key, str(device))] = mask[0].to(device)
        return hit


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 bitmask word, as a signed value."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


_KIND_NAMES = {"json": "the JSON schema", "json_object": "the JSON grammar",
               "regex": "the regex", "choice": "the choice", "grammar": "the grammar"}
