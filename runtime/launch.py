"""Worker processes on one host, one per GPU: started with ``spawn`` (each with only its own GPU
visible, so ``cuda`` means its GPU), their messages read from one queue, all stopped together
when one fails or the caller stops (Ctrl-C).

``target(*args, inbox)`` runs in each worker and yields messages; the caller sees ``(rank,
message)`` as they come, until every worker has finished, and can ``send`` a worker objects (its
``inbox.get()`` returns them), so workers may start (imports, model loads) before their work is
known. A worker's exception becomes a ``WorkerError`` naming the rank, and the other workers are
terminated.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable, Iterator


class WorkerError(RuntimeError):
    pass


def _main(target: Callable[..., Iterator[Any]], args: tuple, rank: int, q, inbox) -> None:
    try:
        for message in target(*args, inbox):
            q.put((rank, "data", message))
        q.put((rank, "done", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        last = traceback.extract_tb(e.__traceback__)[-1:] or None
        where = f" ({os.path.basename(last[0].filename)}:{last[0].lineno})" if last else ""
        q.put((rank, "error", f"{type(e).__name__}: {e}{where}"))


class Workers:
    """``with Workers(target, [args per rank], gpus) as w: for rank, msg in w.messages(): ...``;
    ``gpus[rank]`` is the GPU index a worker sees (None: keep the parent's visibility)."""

    def __init__(self, target: Callable[..., Iterator[Any]], args: list[tuple],
                 gpus: list[int | None]) -> None:
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in args]
        self.procs = []
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for rank, (a, gpu) in enumerate(zip(args, gpus)):
                if gpu is not None:  # a spawned child takes the environment at start
                    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
                p = ctx.Process(target=_main, args=(target, a, rank, self.queue,
                                                    self.inboxes[rank]), daemon=True)
                p.start()
                self.procs.append(p)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def send(self, rank: int, obj: Any) -> None:
        self.inboxes[rank].put(obj)

    def messages(self) -> Iterator[tuple[int, Any]]:
        running = set(range(len(self.procs)))
        while running:
            try:
                rank, kind, message = self.queue.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r in running if not self.procs[r].is_alive()]
                if dead and self.queue.empty():
                    raise WorkerError(f"worker {dead[0]} died (exit code "
                                      f"{self.procs[dead[0]].exitcode})")
                continue
            if kind == "data":
                yield rank, message
            elif kind == "done":
                running.discard(rank)
            else:
                raise WorkerError(f"worker {rank}: {message}")

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
