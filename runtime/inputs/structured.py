"""A line's output constraint: OpenAI's ``response_format`` or vLLM's ``structured_outputs``,
checked and put in canonical form (``StructuredOutput``); both input formats read it.

    "response_format": {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    "response_format": {"type": "json_object"}          (any JSON object)
    "response_format": {"type": "text"}                 (no constraint)
    "structured_outputs": {"json": {...} | "..."}       (a JSON schema, or its text)
    "structured_outputs": {"regex": "..."} | {"choice": ["a", "b"]} | {"grammar": "EBNF"}
                          | {"json_object": true}, with "disable_any_whitespace": false to let
                          JSON put any whitespace between its tokens

Whether it compiles is checked against the model's tokenizer before the model loads
(``cli/generate/runs.py``).
"""

from __future__ import annotations

import json
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import StructuredOutput
from pagedgen.runtime.inputs.request import Request, near_miss

FIELDS = ("response_format", "structured_outputs")
_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace",)
# vLLM's earlier request fields for the same constraints: refused with the field to write
# (a pagedgen line would otherwise keep them as metadata and run unconstrained)
OLD_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}


def set_structured(req: Request, obj: dict, where: str, prefix: str = "") -> None:
    """The constraint of line (or body) ``obj``, if any, into ``req``'s sampling overrides;
    ``prefix`` names where the fields are ("body " for OpenAI lines)."""
    old = next((name for name in OLD_FIELDS if obj.get(name) is not None), None)
    if old is not None:
        raise PagedgenError(f"{where}: {prefix}'{old}' is vLLM's earlier field; write "
                            f"{prefix}\"structured_outputs\": {{\"{OLD_FIELDS[old]}\": ...}}")
    given = {}
    if obj.get("response_format") is not None:
        c = _response_format(obj["response_format"], where, f"{prefix}'response_format'")
        if c is not None:
            given["response_format"] = c
    if obj.get("structured_outputs") is not None:
        given["structured_outputs"] = _structured_outputs(obj["structured_outputs"], where,
                                                          f"{prefix}'structured_outputs'")
    if len(given) > 1:
        raise PagedgenError(f"{where}: give one constraint: {prefix}'response_format' or "
                            f"{prefix}'structured_outputs', not both")
    if given:
        if req.overrides is None:
            req.overrides = {}
        req.overrides["structured"] = next(iter(given.values()))


def _response_format(value: Any, where: str, label: str) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise PagedgenError(f"{where}: {label} must be an object with a \"type\"")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind != "json_schema":
        raise PagedgenError(f"{where}: {label} type must be \"json_schema\", \"json_object\" or "
                            f"\"text\", not {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise PagedgenError(f"{where}: {label} needs \"json_schema\": {{\"name\": ..., "
                            "\"schema\": {...}}")
    return json_schema(spec["schema"], f"{where}: {label} json_schema.schema")


def _structured_outputs(value: Any, where: str, label: str) -> StructuredOutput:
    if not isinstance(value, dict):
        raise PagedgenError(f"{where}: {label} must be an object with one of "
                            f"{', '.join(_KEYS)}")
    for key in value:
        if key not in (*_KEYS, *_OPTIONS):
            hint = near_miss(key, {*_KEYS, *_OPTIONS})
            raise PagedgenError(f"{where}: {label}: unknown key {key!r}" + (
                f" (did you mean {hint!r}?)" if hint else f"; known: {', '.join(_KEYS)}, "
                                                          f"{', '.join(_OPTIONS)}"))
    keys = [k for k in _KEYS if value.get(k) is not None]
    if len(keys) != 1:
        raise PagedgenError(f"{where}: {label} needs exactly one of {', '.join(_KEYS)} (got "
                            f"{', '.join(keys) or 'none'})")
    key, v = keys[0], value[keys[0]]
    loose = value.get("disable_any_whitespace")
    if loose is not None and not isinstance(loose, bool):
        raise PagedgenError(f"{where}: {label} disable_any_whitespace must be true or false")
    any_ws = loose is False
    if key == "json":
        return json_schema(v, f"{where}: {label} json", any_ws)
    if key == "json_object":
        if v is not True:
            raise PagedgenError(f"{where}: {label} json_object must be true")
        return StructuredOutput("json_object", "", any_ws)
    if key == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise PagedgenError(f"{where}: {label} choice must be a non-empty list of "
                                "non-empty strings")
        return StructuredOutput("choice", json.dumps(v, ensure_ascii=False))
    if not isinstance(v, str) or not v:
        raise PagedgenError(f"{where}: {label} {key} must be a non-empty string")
    return StructuredOutput(key, v)


def schema_file(path: str) -> StructuredOutput:
    """``--json-schema PATH``: the run's default constraint, from a JSON schema file."""
    try:
        text = open(path, encoding="utf-8-sig").read()  # a leading byte-order mark skipped
    except OSError as e:
        raise PagedgenError(f"--json-schema {path}: {e.strerror or e}")
    return json_schema(text, f"--json-schema {path}")


def json_schema(schema: Any, what: str, any_whitespace: bool = False) -> StructuredOutput:
    """A JSON schema, given as an object or as its text, as a constraint; ``what`` names it
    in errors."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise PagedgenError(f"{what}: not JSON: {e}")
    if not isinstance(schema, dict):
        raise PagedgenError(f"{what}: a JSON schema is an object")
    return StructuredOutput("json", _schema_text(schema), any_whitespace)


def _schema_text(schema: dict) -> str:
    """A schema's compact text (its key order kept: properties are written in it); equal
    schemas compile once."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
