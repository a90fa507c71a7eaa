"""Grammar matchers away from the engine's thread: in worker processes, or inline.

Each constrained sample's xgrammar matcher lives in one place of a ``GrammarPool``: a slot,
which is also its row in the pool's host mask buffer. Every step the engine gives the pool
the tokens its samples took (``give``), ``send`` hands them to the matchers' owners, and
``join`` waits until each has taken its tokens and filled its slots' next masks into the
buffer, which the sampling step then copies to the device.

With ``workers`` > 0 the matchers live in that many worker processes (slot ``s`` in worker
``s % workers``; each a fresh interpreter, ``python -m`` this module, that imports nothing of
the caller's), the buffer in shared memory (pinned for the device copy where CUDA is up):
taking tokens and filling masks costs the engine's process no CPU and no GIL, and runs while
the GPU runs the next forward pass. With ``workers`` = 0 one ``MatcherTable`` does the same
work inline, in ``join``.

A slot is the pool's to reuse only after its sample is ``release``d and the workers have
answered the message that closes it: until then a worker may still write its mask.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedgen.errors import PagedgenError

ACTIVE, ENDED, REJECTED = 0, 1, 2  # a matcher after its tokens: still going, stopped, refused


@dataclass
class Work:
    """One message to a matcher table: a new mask buffer (the pool grew it), grammars it has
    not seen (as text in a process, compiled inline), slots opened (slot, grammar key), the
    tokens each slot's matcher takes, and slots closed (in that order)."""

    attach: tuple[str, tuple[int, int]] | None = None  # (file, shape) of the new buffer
    grammars: dict[int, Any] = field(default_factory=dict)
    closes: list[int] = field(default_factory=list)
    opens: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[tuple[int, list[int]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.attach is not None or bool(self.closes or self.opens or self.tokens)


class MatcherTable:
    """The matchers of one worker, by slot: takes their tokens and fills their next masks into
    ``masks`` [slots, words] (int32), the rows being the slots."""

    def __init__(self, info: Any, stop: frozenset[int], threads: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = info
        self.stop = stop
        self.masks: Any = None  # the pool's buffer (numpy): from ``attach``, or set inline
        self.grammars: dict[int, Any] = {}
        self.matchers: dict[int, Any] = {}
        self.filler = xgr.BatchGrammarMatcher(max_threads=threads)

    def run(self, work: Work) -> tuple[list[int], list[int], list[int], float, float]:
        """Do ``work``; returns the slots that ended, those that refused a token, those whose
        next mask allows no token (a dead end: no text can complete the grammar from here),
        and the seconds spent taking tokens and filling masks."""
        if work.attach is not None:
            path, shape = work.attach
            self.masks = np.memmap(path, dtype=np.int32, mode="r+", shape=shape)
        for key, g in work.grammars.items():
            self.grammars[key] = g if not isinstance(g, str) else \
                self._xgr.CompiledGrammar.deserialize_json(g, self.info)
        for slot, key in work.opens:  # a slot reopens only after its close was answered
            self.matchers[slot] = self._xgr.GrammarMatcher(self.grammars[key])
        t0 = time.perf_counter()
        ended, rejected, live = [], [], []
        for slot, tokens in work.tokens:
            m, status = self.matchers[slot], ACTIVE
            for t in tokens:
                if not m.accept_token(t):
                    status = REJECTED
                    break
                if t in self.stop:
                    status = ENDED
                    break
            if status == ACTIVE:
                live.append(slot)
            elif status == ENDED:
                ended.append(slot)
            else:
                rejected.append(slot)
        t1 = time.perf_counter()
        dead = []
        if live:
            self.filler.batch_fill_next_token_bitmask([self.matchers[s] for s in live],
                                                      self.masks, live)
            dead = [s for s in live if not self.masks[s].any()]
        for slot in work.closes:  # after the tokens: a sample may take its last ones and end
            self.matchers.pop(slot, None)
        return ended, rejected, dead, t1 - t0, time.perf_counter() - t1


def serve(conn_in: Connection, conn_out: Connection) -> None:
    """A worker process: set up from the first message (the file of the tokenizer info as
    JSON, stop tokens, fill threads), then run each message's work and answer, until None or
    the pipe closes."""
    import xgrammar as xgr

    try:
        info_path, stop, threads = conn_in.recv()
        with open(info_path) as f:
            info = f.read()
    except (EOFError, FileNotFoundError):  # the pool shut down before this worker started
        return
    table = MatcherTable(xgr.TokenizerInfo.deserialize_json(info), stop, threads)
    conn_out.send("ready")
    while True:
        try:
            work = conn_in.recv()
        except EOFError:
            return
        if work is None:
            return
        t0 = time.perf_counter()
        try:
            result = table.run(work)
        except Exception as e:  # noqa: BLE001 - sent back whole, raised in the engine
            conn_out.send(RuntimeError(f"grammar worker: {type(e).__name__}: {e}"))
            continue
        conn_out.send(result + (time.perf_counter() - t0,))


class GrammarPool:
    """Slots of matchers, in ``workers`` processes (0: inline), and their host mask buffer.

    ``source(key)`` gives the compiled grammar a state's key names; ``info`` is xgrammar's
    tokenizer info. States are the engine's ``GrammarState``: the pool reads and sets their
    ``key``, ``slot``, ``accepted``, ``ended``, ``rejected`` and ``dead_at``."""

    def __init__(self, info: Any, stop: frozenset[int], words: int, source: Callable[[int], Any],
                 workers: int, threads: int, pin: bool) -> None:
        self.words = words
        self.workers = workers
        self.pin = pin
        self._source = source
        self._texts: dict[int, str] = {}  # grammars serialized for the processes
        self._states: dict[int, Any] = {}  # slot -> its state
        self._free: list[int] = []
        self._closing: list[int] = []  # released; their close not yet sent
        self._freeing: list[int] = []  # close sent; free once answered
        self._next = 0  # slots handed out so far
        self._capacity = 0
        self.masks = torch.empty(0, words, dtype=torch.int32)
        n = max(1, workers)
        self._work = [Work() for _ in range(n)]
        self._busy = [False] * n
        self._known: list[set[int]] = [set() for _ in range(n)]
        self.accept_s = self.fill_s = self.worker_s = self.wait_s = 0.0
        self.rejected = 0  # states whose matcher refused a token
        self.dead_ends = 0  # states that reached a place no token can continue
        if workers == 0:
            self._table = MatcherTable(info, stop, threads)
            self._conns: list[Any] = []
            return
        # the tokenizer info (megabytes) in a file: the first message stays small, so sending
        # it does not wait for the worker to finish importing xgrammar
        fd, self._info_path = tempfile.mkstemp(prefix="pagedgen-grammar-info-", dir=_SHM)
        with os.fdopen(fd, "w") as f:
            f.write(info.serialize_json())
        self._conns, self._procs, self._booting = [], [], [True] * workers
        self._pinned = [0]  # the host address registered with CUDA (0: none)
        for _ in range(workers):  # stdin and stdout carry the messages; stderr is the run's
            p = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
            send = Connection(os.dup(p.stdin.fileno()), readable=False)
            recv = Connection(os.dup(p.stdout.fileno()), writable=False)
            p.stdin.close()
            p.stdout.close()
            send.send((self._info_path, stop, threads))
            self._conns.append((send, recv))
            self._procs.append(p)
        # at exit or when dropped: the workers stop, the buffer is unregistered before unmapped
        self._finalizer = weakref.finalize(self, _shut_down, self._conns, self._procs,
                                           self._pinned, self._info_path)

    @property
    def busy(self) -> bool:
        """Whether work has been sent that is not answered yet (inline: not yet run)."""
        return any(self._busy) or (self.workers == 0 and bool(self._work[0]))

    def give(self, state: Any, tokens: list[int]) -> None:
        """Queue ``tokens`` (the state's next ones) for its matcher, opening a slot at its first."""
        if state.slot is None:
            state.slot = self._open(state)
            w = self._owner(state.slot)
            self._work[w].opens.append((state.slot, state.key))
            if state.key not in self._known[w]:
                self._known[w].add(state.key)
                self._work[w].grammars[state.key] = self._grammar(state.key)
        self._work[self._owner(state.slot)].tokens.append((state.slot, tokens))
        state.accepted += len(tokens)

    def release(self, state: Any) -> None:
        """``state``'s sample is done: its slot closes (and is reused once that is answered)."""
        if state.slot is not None:
            self._states.pop(state.slot, None)
            self._closing.append(state.slot)
            state.slot = None

    def send(self) -> None:
        """Hand every queued message to its worker (inline: kept for ``join``)."""
        for slot in self._closing:
            self._work[self._owner(slot)].closes.append(slot)
        self._freeing += self._closing
        self._closing = []
        if self.workers == 0:
            return
        for w, work in enumerate(self._work):
            if work:
                if self._booting[w]:
                    self._recv(w)  # "ready": it has read the tokenizer info
                    self._booting[w] = False
                    if not any(self._booting):
                        Path(self._info_path).unlink(missing_ok=True)
                if self._busy[w]:
                    self._answer(w)
                try:
                    self._conns[w][0].send(work)
                except OSError:  # the pipe broke: it has died
                    raise self._dead(w)
                self._work[w], self._busy[w] = Work(), True

    def join(self) -> None:
        """Wait until every sent message is answered; update the states it touched."""
        t0 = time.perf_counter()
        if self.workers == 0:
            work, self._work[0] = self._work[0], Work()
            if work:
                t1 = time.perf_counter()
                self._done(self._table.run(work) + (time.perf_counter() - t1,))
        else:
            for w in range(self.workers):
                if self._busy[w]:
                    self._answer(w)
            self.wait_s += time.perf_counter() - t0
        self._free += self._freeing
        self._freeing = []

    def close(self) -> None:
        """Stop the workers and free the shared buffer."""
        if self.workers:
            self._finalizer()

    def _answer(self, w: int) -> None:
        self._done(self._recv(w))
        self._busy[w] = False

    def _recv(self, w: int) -> Any:
        try:
            reply = self._conns[w][1].recv()
        except (EOFError, OSError):
            raise self._dead(w)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _dead(self, w: int) -> PagedgenError:
        return PagedgenError(f"grammar worker {w} died (exit code "
                             f"{_exit_code(self._procs[w])}); structured output cannot go on "
                             "(PAGEDGEN_GRAMMAR_WORKERS=0 runs the grammars in this process)")

    def _done(self, reply: tuple) -> None:
        ended, rejected, dead, accept_s, fill_s, wall_s = reply
        for slot in ended:
            if (s := self._states.get(slot)) is not None:
                s.ended = True
        for slot in rejected:
            if (s := self._states.get(slot)) is not None:
                s.rejected = True
                self.rejected += 1
        for slot in dead:  # its next token (output index ``accepted``) has no valid choice
            if (s := self._states.get(slot)) is not None and s.dead_at is None:
                s.dead_at = s.accepted
                self.dead_ends += 1
        self.accept_s += accept_s
        self.fill_s += fill_s
        self.worker_s += wall_s

    def _owner(self, slot: int) -> int:
        return slot % self.workers if self.workers else 0

    def _grammar(self, key: int) -> Any:
        if self.workers == 0:
            return self._source(key)
        if key not in self._texts:
            self._texts[key] = self._source(key).serialize_json()
        return self._texts[key]

    def _open(self, state: Any) -> int:
        if not self._free and self._next == self._capacity:
            if self._closing or self._freeing:  # reclaim released slots first
                self.send()
                self.join()
            if not self._free:
                self._grow(max(64, 2 * self._capacity))
        slot = self._free.pop() if self._free else self._next
        if slot == self._next:
            self._next += 1
        self._states[slot] = state
        return slot

    def _grow(self, capacity: int) -> None:
        """A buffer of ``capacity`` slots, the current masks copied in (after every worker
        has answered: none writes the old one any more)."""
        if self.workers:
            self.send()
            self.join()
        shape = (capacity, self.words)
        path = None
        if self.workers:  # a file in shared memory, mapped here and in each worker
            fd, path = tempfile.mkstemp(prefix="pagedgen-grammar-masks-", dir=_SHM)
            os.ftruncate(fd, capacity * self.words * 4)
            masks = torch.frombuffer(mmap.mmap(fd, capacity * self.words * 4),
                                     dtype=torch.int32).view(shape)
            os.close(fd)
        else:
            masks = torch.empty(shape, dtype=torch.int32)
        masks[:self._capacity] = self.masks
        if self.pin and self.workers == 0:  # page-locked: copies to the device run async
            masks = masks.pin_memory()
        elif self.pin:
            _unregister(self._pinned)
            cudart = torch.cuda.cudart()
            if cudart.cudaHostRegister(masks.data_ptr(), masks.nbytes, 0) == 0:
                self._pinned[0] = masks.data_ptr()
            else:  # left pageable (copies then wait for it); the error is not the next op's
                cudart.cudaGetLastError()
        self.masks, self._capacity = masks, capacity
        if self.workers == 0:
            self._table.masks = masks.numpy()
            return
        for work in self._work:
            work.attach = (path, shape)
        try:
            self.send()
            self.join()
        finally:
            os.unlink(path)  # every worker has it mapped: the name is no longer needed


_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # None: the temp directory


def _unregister(pinned: list[int]) -> None:
    if pinned[0]:
        torch.cuda.cudart().cudaHostUnregister(pinned[0])
        pinned[0] = 0


def _exit_code(p: subprocess.Popen) -> int | None:
    try:
        return p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def _shut_down(conns: list[tuple[Connection, Connection]], procs: list[Any],
               pinned: list[int], info_path: str) -> None:
    _unregister(pinned)
    Path(info_path).unlink(missing_ok=True)
    for send, _ in conns:
        try:
            send.send(None)
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":  # a worker: messages on stdin, answers on stdout
    import signal

    from pagedgen.runtime.children import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's; stdin's end is ours
    die_with_parent()
    _out = os.dup(1)
    os.dup2(2, 1)  # anything printed goes to stderr, not into the answers
    serve(Connection(os.dup(0), writable=False), Connection(_out, readable=False))
