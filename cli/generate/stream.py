"""Lines into the output file as they finish, with progress bars; what an interrupted run says."""

from __future__ import annotations

import time
from collections.abc import Iterable

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from pagedgen.cli.common import console
from pagedgen.cli.formats.output import OutputWriter, ShardWriter, StreamWriter
from pagedgen.errors import PagedgenError

Writer = OutputWriter | ShardWriter | StreamWriter
# Each batch of finished requests: their (input index, JSON text) lines and the output tokens
# of the run so far.
Batches = Iterable[tuple[list[tuple[int, str]], int]]


def stream_output(writer: Writer, total: int, batches: Batches, quiet: bool,
                  images: dict[int, int] | None = None) -> tuple[float, float]:
    """Write each batch of ``batches`` as it comes (one write each), with a progress bar (live
    tok/s; with ``images``, each input index's image count, the images of the finished
    requests too) on a terminal. Ctrl-C or an error keeps what was written. Returns (start,
    wall seconds)."""
    start = time.perf_counter()
    written = images_done = 0
    images_all = sum(images.values()) if images else 0
    progress = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[images]}{task.fields[tokens]:,} tokens out, "
                                   "{task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console, transient=quiet,
                        disable=not console.is_terminal)  # a log gets the summary

    def images_text() -> str:
        return f"{images_done:,}/{images_all:,} images, " if images_all else ""
    try:
        with progress:
            task = progress.add_task("gen", total=total, tokens=0, rate=0.0,
                                     images=images_text())
            for lines, tokens in batches:
                writer.write_lines(lines)
                written += len(lines)
                if images_all:
                    images_done += sum(images.get(i, 0) for i, _ in lines)
                progress.update(task, advance=len(lines), tokens=tokens, images=images_text(),
                                rate=tokens / max(time.perf_counter() - start, 1e-9))
    except BaseException:
        close_quietly(writer)  # Ctrl-C or an error: keep what was written
        raise
    wall = time.perf_counter() - start
    writer.close()
    if written < total:  # never silently: the file lacks lines that --resume can still make
        raise PagedgenError(f"{total - written} of {total} requests ended without an output "
                            "line (an internal error; please report it): the others are "
                            "written; --resume runs the missing ones")
    return start, wall


def startup_progress(quiet: bool) -> Progress:
    """Bars for reading and tokenizing the input (gone when done; a terminal only)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
                    disable=quiet or not console.is_terminal)


def close_quietly(writer: Writer) -> None:
    """Close after an error or a signal, lines left in completion order (``--resume`` puts
    them in order); the error in flight is the one to show."""
    try:
        writer.close(reorder=False)
    except PagedgenError:
        pass


def interrupted(e: BaseException, writer: Writer | None,
                total: int) -> None:
    """Ctrl-C (exit code 130), SIGTERM (143) or SIGHUP (129) at any phase: one line saying
    what is kept."""
    what = "interrupted" if isinstance(e, KeyboardInterrupt) else e.words
    code = 130 if isinstance(e, KeyboardInterrupt) else e.exit_code
    if writer is None or writer.num_done == 0:
        console.print(f"[yellow]{what}:[/] no completions were written", highlight=False,
                      soft_wrap=True)
    else:
        close_quietly(writer)
        console.print(f"[yellow]{what}:[/] {escape(writer.resume_hint(total))}",
                      highlight=False, soft_wrap=True)
    raise typer.Exit(code)
