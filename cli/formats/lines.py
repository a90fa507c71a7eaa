"""The output lines of each input format: how a finished request becomes one, and how
``--resume`` recognizes a whole one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pagedgen.cli.formats import openai_batch, records


def line_maker(fmt: str, model_name: str = "") -> Callable[..., dict[str, Any]]:
    """``record(request_output)`` for input format ``fmt`` ("pagedgen" or "openai"); a
    module-level function or a partial of one, so that worker processes can take it.
    ``model_name``: what OpenAI lines report when their body names no model."""
    if fmt == "openai":
        return functools.partial(openai_batch.record, model=model_name)
    return records.record


def error_line(fmt: str, req: Any) -> dict[str, Any]:
    """The error record of a request that cannot run (``req.error``) in format ``fmt``."""
    return (openai_batch if fmt == "openai" else records).error_record(req)


def line_check(fmt: str) -> tuple[Callable[[dict[str, Any]], bool], str]:
    """(whether a parsed line is a whole record, the field holding its request's id)."""
    if fmt == "openai":
        return openai_batch.is_complete, "custom_id"
    return records.is_complete, "id"
