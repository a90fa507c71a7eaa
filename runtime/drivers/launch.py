"""Worker processes on one host: started with ``spawn`` (GPU workers) or ``forkserver`` (CPU
workers, where the platform has it: torch is imported once, in the server, not in every
worker), their messages read from one queue, all stopped together when one fails or the
caller stops (Ctrl-C).

A worker is a group of ``tp`` processes (tensor-parallel ranks; one process when ``tp`` is 1),
each seeing only its group's GPUs (so ``cuda`` means its own GPU) and joined into one
``torch.distributed`` group (``parallel.py``) before its code runs. ``target(*args, inbox)``
runs in every process of a group and yields messages; the caller sees rank 0's as ``(worker,
message)`` as they come, until every worker has finished, and can ``send`` a worker objects
(each of its processes' ``inbox.get()`` returns them), so workers may start (imports, model
loads) before their work is known. An exception in any process becomes a ``WorkerError``
naming it, and every other process is terminated.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.children import die_with_parent
from pagedgen.runtime.hardware import HOST_PROCESSES


class WorkerError(RuntimeError):
    pass


def _main(target: Callable[..., Iterator[Any]], args: tuple, proc: int, q, inbox,
          tp: tuple[int, int, str, bool], env: dict[str, str] | None, caller: int) -> None:
    die_with_parent(caller)
    if env is not None:  # a forkserver's child: the caller's environment now, not the server's
        os.environ.clear()
        os.environ.update(env)
    tp_rank, tp_size, init_method, on_gpu = tp
    try:
        if tp_size > 1:
            from pagedgen.runtime.collectives import parallel
            parallel.init(tp_rank, tp_size, init_method, tp_rank if on_gpu else None)
        for message in target(*args, inbox):
            if tp_rank == 0:  # the other ranks compute the same results: one reports
                q.put((proc, "data", message))
        q.put((proc, "done", None))
    except PagedgenError as e:  # the user's mistake, said as the parent would say it
        q.put((proc, "error", str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        last = traceback.extract_tb(e.__traceback__)[-1:] or None
        where = f" ({os.path.basename(last[0].filename)}:{last[0].lineno})" if last else ""
        q.put((proc, "error", f"{type(e).__name__}: {e}{where}"))


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method(gpus: list[list[int] | None]) -> str:
    """``forkserver`` where every worker runs on the CPU and the platform has it: its server
    imports torch once and forks each worker from there (a ``spawn`` costs every worker a
    torch import of seconds). ``spawn`` for GPU workers, which start no faster forked from
    a server that imported torch, and where there is no forkserver."""
    if all(g is None for g in gpus) and "forkserver" in mp.get_all_start_methods():
        return "forkserver"
    return "spawn"


class Workers:
    """``with Workers(target, [args per worker], gpus, tp) as w: for i, msg in w.messages():``;
    ``gpus[i]`` lists the ``tp`` GPUs worker ``i`` runs on (None: the CPU, ranks joined over
    gloo, with the parent's GPU visibility)."""

    def __init__(self, target: Callable[..., Iterator[Any]], args: list[tuple],
                 gpus: list[list[int] | None], tp: int = 1) -> None:
        ctx = mp.get_context(start_method(gpus))
        forked = ctx.get_start_method() == "forkserver"
        if forked:  # for the server's first start
            ctx.set_forkserver_preload([__name__])
        self.tp = tp
        self.queue = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(len(args) * tp)]
        self.procs = []
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        shares = os.environ.get(HOST_PROCESSES)
        os.environ[HOST_PROCESSES] = str(len(args) * tp)  # their share of the cores
        try:
            for worker, (a, group) in enumerate(zip(args, gpus)):
                if group is not None:  # a spawned child takes the environment at start
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, group))
                init_method = f"tcp://127.0.0.1:{free_port()}"
                for r in range(tp):
                    proc = worker * tp + r
                    p = ctx.Process(target=_main, args=(
                        target, a, proc, self.queue, self.inboxes[proc],
                        (r, tp, init_method, group is not None),
                        dict(os.environ) if forked else None, os.getpid()), daemon=True)
                    p.start()
                    self.procs.append(p)
        finally:
            for name, value in (("CUDA_VISIBLE_DEVICES", saved), (HOST_PROCESSES, shares)):
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def send(self, worker: int, obj: Any) -> None:
        for proc in range(worker * self.tp, (worker + 1) * self.tp):
            self.inboxes[proc].put(obj)

    def _name(self, proc: int) -> str:
        worker, rank = divmod(proc, self.tp)
        return f"worker {worker}" + (f" (tensor-parallel rank {rank})" if self.tp > 1 else "")

    def messages(self) -> Iterator[tuple[int, Any]]:
        running = set(range(len(self.procs)))
        while running:
            try:
                proc, kind, message = self.queue.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r in running if not self.procs[r].is_alive()]
                if dead and self.queue.empty():
                    raise WorkerError(f"{self._name(dead[0])} died (exit code "
                                      f"{self.procs[dead[0]].exitcode})")
                continue
            if kind == "data":
                yield proc // self.tp, message
            elif kind == "done":
                running.discard(proc)
            else:
                raise WorkerError(f"{self._name(proc)}: {message}")

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
