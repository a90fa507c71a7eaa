"""Reading the prompt JSONL file: one request per line, every error named by file and line.

Built for files of millions of lines: the file is streamed, a request keeps its token ids as
an ``array('i')`` (4 bytes a token, not a Python int object each), and prompts are tokenized in
batches (one call into the fast tokenizer per batch).
"""

from __future__ import annotations

import dataclasses
import json
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import SamplingParams

# field -> (accepted JSON types, description for errors)
_SAMPLING_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "max_tokens": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "top_k": ((int,), "an integer"),
    "seed": ((int,), "an integer"),
    "stop": ((str, list), "a string or a list of strings"),
    "ignore_eos": ((bool,), "true or false"),
    "n": ((int,), "an integer"),
}
_PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
_KNOWN_FIELDS = frozenset(_PROMPT_FIELDS) | frozenset(_SAMPLING_FIELDS) | {"id"}
TOKENIZE_BATCH = 1024  # prompts per call into the tokenizer


@dataclass(slots=True)
class Request:
    """One JSONL line. ``prompt_token_ids`` holds the tokenized prompt once
    :func:`tokenize_requests` has run, whatever the line gave."""

    index: int  # position among the file's requests
    line: int  # 1-based line number
    id: Any
    prompt: str | None = None
    prompt_token_ids: array | None = None
    messages: list[dict] | None = None
    overrides: dict[str, Any] | None = None  # per-line sampling fields

    def where(self, path: Path) -> str:
        return f"{path}:{self.line}"

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """The line's sampling settings (``defaults`` itself when the line sets none)."""
        if not self.overrides:
            return defaults
        values = dict(self.overrides)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        return dataclasses.replace(defaults, **values)


@dataclass
class RequestFile:
    """A validated prompt file: its requests in input order, and each id's index."""

    path: Path
    requests: list[Request]
    index_of: dict[Any, int]  # request id (str or int) -> index

    def __len__(self) -> int:
        return len(self.requests)


def read_requests(path: Path, progress: Callable[[int], None] | None = None) -> RequestFile:
    """Parse and validate every line up front, so bad input fails before any work is done.
    ``progress(bytes_read)`` is called every few thousand lines."""
    if not path.is_file():
        raise PagedgenError(f"{path}: no such file")
    requests: list[Request] = []
    index_of: dict[Any, int] = {}  # ids are str or int (never bool), so 1 and "1" differ
    nbytes = 0
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
                req = _parse(obj, len(requests), lineno, where)
                first = index_of.setdefault(req.id, req.index)
                if first != req.index:
                    raise PagedgenError(f"{where}: duplicate id {req.id!r} (first on line "
                                        f"{requests[first].line})")
                requests.append(req)
    except UnicodeDecodeError as e:
        raise PagedgenError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason})")
    if progress is not None:
        progress(nbytes)
    if not requests:
        raise PagedgenError(f"{path}: no requests (the file is empty)")
    return RequestFile(path, requests, index_of)


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
                raise PagedgenError(f"{batch[0].where(rf.path)}: {e}")
            for r, ids in zip(batch, out):
                r.prompt_token_ids = array("i", ids)
            done += len(batch)
            if progress is not None:
                progress(done)


def check_requests(rf: RequestFile, check: Callable[[Request], None]) -> None:
    """``check`` every request; its ValueError becomes a ``file:line:`` error."""
    for r in rf.requests:
        try:
            check(r)
        except ValueError as e:
            raise PagedgenError(f"{r.where(rf.path)}: {e}")


def _parse(obj: Any, index: int, lineno: int, where: str) -> Request:
    if not isinstance(obj, dict):
        raise PagedgenError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in _KNOWN_FIELDS:
            raise PagedgenError(f"{where}: unknown field '{sorted(set(obj) - _KNOWN_FIELDS)[0]}'")
    given = [k for k in _PROMPT_FIELDS if k in obj]
    if len(given) != 1:
        raise PagedgenError(f"{where}: need exactly one of 'prompt', 'prompt_token_ids', "
                            f"'messages' (got {', '.join(given) or 'none'})")
    rid = obj.get("id", index)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise PagedgenError(f"{where}: 'id' must be a string or an integer")
    req = Request(index=index, line=lineno, id=rid)
    kind = given[0]
    value = obj[kind]
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise PagedgenError(f"{where}: 'prompt' must be a non-empty string")
        req.prompt = value
    elif kind == "prompt_token_ids":
        req.prompt_token_ids = _token_ids(value, where)
    else:
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in value):
            raise PagedgenError(f"{where}: 'messages' must be a non-empty list of "
                                "{\"role\": str, \"content\": str} objects")
        req.messages = value
    for name, (types, desc) in _SAMPLING_FIELDS.items():
        if name not in obj:
            continue
        v = obj[name]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise PagedgenError(f"{where}: '{name}' must be {desc}")
        if name == "stop" and isinstance(v, list) and not all(isinstance(s, str) and s for s in v):
            raise PagedgenError(f"{where}: 'stop' must be a string or a list of strings")
        if req.overrides is None:
            req.overrides = {}
        req.overrides[name] = v
    if req.overrides:
        try:
            req.sampling(SamplingParams()).validate()
        except ValueError as e:
            raise PagedgenError(f"{where}: {e}")
    return req


def _token_ids(value: Any, where: str) -> array:
    """A JSON list of token ids as ``array('i')``; the type check runs in C (``map(type)``), not
    a Python loop per token."""
    if isinstance(value, list) and value and set(map(type, value)) == {int}:
        try:
            return array("i", value)
        except OverflowError:
            raise PagedgenError(f"{where}: a token id in 'prompt_token_ids' is out of range")
    raise PagedgenError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
