"""Reading the prompt JSONL file: one request per line, every error named by file and line.

Built for files of millions of lines: the file is streamed, a request keeps its token ids as
an ``array('i')`` (4 bytes a token, not a Python int object each), and prompts are tokenized in
batches (one call into the fast tokenizer per batch).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pagedgen.cli import openai_batch
from pagedgen.cli.request import (SAMPLING_FIELDS, InputOptions, Request, check_sampling,
                                  set_prompt, set_sampling, user_fields)
from pagedgen.errors import PagedgenError

TOKENIZE_BATCH = 1024  # prompts per call into the tokenizer


@dataclass
class RequestFile:
    """Validated prompt files: their requests in input order, and each id's index."""

    paths: list[Path]
    requests: list[Request]
    index_of: dict[Any, int]  # request id (str or int) -> index
    format: str = "pagedgen"  # or "openai" (OpenAI batch lines; ids are their custom_id)

    def __len__(self) -> int:
        return len(self.requests)

    def where(self, r: Request) -> str:
        """``file:line`` of a request, for errors."""
        return f"{self.paths[r.source]}:{r.line}"


def input_files(spec: str) -> list[Path]:
    """The JSONL files of ``spec``: a file, a directory (its ``*.jsonl``, sorted) or a glob
    pattern (its matches, sorted)."""
    path = Path(spec)
    if any(c in spec for c in "*?["):
        files = sorted(p for p in Path(path.anchor or ".").glob(
            str(path.relative_to(path.anchor)) if path.anchor else spec) if p.is_file())
        if not files:
            raise PagedgenError(f"{spec}: no file matches")
        return files
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise PagedgenError(f"{spec}: a directory without .jsonl files")
        return files
    if not path.is_file():
        raise PagedgenError(f"{spec}: no such file")
    return [path]


def read_requests(paths: Path | list[Path], progress: Callable[[int], None] | None = None,
                  options: InputOptions = InputOptions()) -> RequestFile:
    """Parse and validate every line of ``paths`` (in order) up front, so bad input fails
    before any work is done. The first line decides the format: an OpenAI batch line
    (``custom_id``, ``body``) or pagedgen's own. ``progress(bytes_read)`` is called every few
    thousand lines."""
    paths = [paths] if isinstance(paths, Path) else paths
    for path in paths:
        if not path.is_file():
            raise PagedgenError(f"{path}: no such file")
    requests: list[Request] = []
    index_of: dict[Any, int] = {}  # ids are str or int (never bool), so 1 and "1" differ
    nbytes = 0
    fmt = None
    parse = parse_line
    for source, path in enumerate(paths):
        nbytes, fmt, parse = _read_file(paths, source, requests, index_of, nbytes, fmt, parse,
                                        progress, options)
    if progress is not None:
        progress(nbytes)
    if not requests:
        raise PagedgenError(f"{paths[0] if len(paths) == 1 else 'the input'}: no requests "
                            "(the file is empty)")
    return RequestFile(paths, requests, index_of, fmt)


def _read_file(paths: list[Path], source: int, requests: list[Request],
               index_of: dict[Any, int], nbytes: int, fmt: str | None, parse, progress,
               options: InputOptions):
    """Append the requests of ``paths[source]``; returns the running byte count, the format
    and the line parser (both set by the input's first line)."""
    path = paths[source]
    lineno = 0
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, raw in enumerate(f, start=1):
                nbytes += len(raw)
                if progress is not None and lineno % 4096 == 0:
                    progress(nbytes)
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise PagedgenError(f"{where}: invalid JSON: {e.msg} (column {e.colno})")
                if fmt is None:
                    fmt = "openai" if openai_batch.is_batch_line(obj) else "pagedgen"
                    if fmt == "openai":
                        parse = openai_batch.parse_line
                        _check_openai_options(options)
                req = parse(obj, len(requests), lineno, where, options)
                req.source = source
                first = index_of.setdefault(req.id, req.index)
                if first != req.index:
                    prev = requests[first]
                    at = f"line {prev.line}" if prev.source == source \
                        else f"{paths[prev.source]}:{prev.line}"
                    raise PagedgenError(f"{where}: duplicate id {req.id!r} (first on {at})")
                requests.append(req)
    except UnicodeDecodeError as e:
        raise PagedgenError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason})")
    return nbytes, fmt, parse


def _check_openai_options(options: InputOptions) -> None:
    if options.prompt_field != "prompt" or options.messages_field != "messages":
        raise PagedgenError("--prompt-field and --messages-field do not apply to OpenAI batch "
                            "files (their prompt is in \"body\")")


def tokenize_requests(rf: RequestFile, tokenizer,
                      progress: Callable[[int], None] | None = None) -> None:
    """Give every request its prompt's token ids (``array('i')``), tokenizing text and chat
    prompts in batches of ``TOKENIZE_BATCH``; ``progress(requests_done)`` after each."""
    done = sum(r.prompt is None and r.messages is None for r in rf.requests)
    for kind in ("prompt", "messages"):
        reqs = [r for r in rf.requests if getattr(r, kind) is not None]
        for i in range(0, len(reqs), TOKENIZE_BATCH):
            batch = reqs[i:i + TOKENIZE_BATCH]
            try:
                if kind == "prompt":
                    out = tokenizer.encode_batch([r.prompt for r in batch])
                else:
                    out = tokenizer.apply_chat_template_batch([r.messages for r in batch])
            except (ValueError, PagedgenError) as e:
                raise PagedgenError(f"{rf.where(batch[0])}: {e}")
            for r, ids in zip(batch, out):
                r.prompt_token_ids = array("i", ids)
            done += len(batch)
            if progress is not None:
                progress(done)


def check_requests(rf: RequestFile, check: Callable[[Request], None],
                   requests: list[Request] | None = None) -> None:
    """``check`` every request (or ``requests`` of ``rf``); its ValueError becomes a
    ``file:line:`` error."""
    for r in rf.requests if requests is None else requests:
        try:
            check(r)
        except ValueError as e:
            raise PagedgenError(f"{rf.where(r)}: {e}")


def parse_line(obj: Any, index: int, lineno: int, where: str, opts: InputOptions) -> Request:
    """A pagedgen line: one prompt field, optional ``id`` and sampling fields; other fields
    become the output's ``metadata``."""
    if not isinstance(obj, dict):
        raise PagedgenError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = {opts.prompt_field: "prompt", "prompt_token_ids": "prompt_token_ids",
             opts.messages_field: "messages"}
    known = {*kinds, *SAMPLING_FIELDS, "id", "metadata"}
    given = [k for k in kinds if k in obj]
    if len(given) != 1:
        raise PagedgenError(f"{where}: need exactly one of "
                            f"{', '.join(repr(k) for k in kinds)} "
                            f"(got {', '.join(given) or 'none'})")
    rid = obj.get("id", index)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise PagedgenError(f"{where}: 'id' must be a string or an integer")
    req = Request(index=index, line=lineno, id=rid)
    req.metadata = user_fields(obj, known, where, opts)
    set_prompt(req, kinds[given[0]], obj[given[0]], where, f"'{given[0]}'")
    for name in SAMPLING_FIELDS:
        if name in obj:
            set_sampling(req, name, obj[name], where)
    check_sampling(req, where)
    return req
