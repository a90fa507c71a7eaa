"""Reading the prompt JSONL file: one request per line, every error named by file and line."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
}
_PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


@dataclass
class Request:
    """One JSONL line."""

    index: int  # position among the file's requests
    line: int  # 1-based line number
    id: Any
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def where(self, path: Path) -> str:
        return f"{path}:{self.line}"

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        import dataclasses

        values = dict(self.overrides)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        return dataclasses.replace(defaults, **values)


def read_requests(path: Path) -> list[Request]:
    """Parse and validate every line up front, so bad input fails before any work is done."""
    if not path.is_file():
        raise PagedgenError(f"{path}: no such file")
    requests: list[Request] = []
    seen: dict[Any, int] = {}
    with path.open(encoding="utf-8") as f:
        try:
            lines = list(enumerate(f, start=1))
        except UnicodeDecodeError as e:
            raise PagedgenError(f"{path}: not UTF-8 text ({e.reason})")
    for lineno, raw in lines:
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PagedgenError(f"{where}: invalid JSON: {e.msg} (column {e.colno})")
        req = _parse(obj, len(requests), lineno, where)
        key = json.dumps(req.id)
        if key in seen:
            raise PagedgenError(f"{where}: duplicate id {req.id!r} (first on line {seen[key]})")
        seen[key] = lineno
        requests.append(req)
    if not requests:
        raise PagedgenError(f"{path}: no requests (the file is empty)")
    return requests


def _parse(obj: Any, index: int, lineno: int, where: str) -> Request:
    if not isinstance(obj, dict):
        raise PagedgenError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - set(_PROMPT_FIELDS) - set(_SAMPLING_FIELDS) - {"id"}
    if unknown:
        raise PagedgenError(f"{where}: unknown field '{sorted(unknown)[0]}'")
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
        if (not isinstance(value, list) or not value
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise PagedgenError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
        req.prompt_token_ids = value
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
        req.overrides[name] = v
    try:
        req.sampling(SamplingParams()).validate()
    except ValueError as e:
        raise PagedgenError(f"{where}: {e}")
    return req
