"""What xgrammar leaves out of a JSON schema, found before a run (keywords it accepts and does
not enforce, uses of enforced ones it drops, what no document can be), and the one repair its
output needs (control characters a ``pattern`` lets into a string).

Hand-written: xgrammar compiles such schemas without a word, and the ``jsonschema`` library
validates documents, not what a grammar built from a schema would let through; each rule here
is checked against the installed xgrammar's matcher (tests/test_structured_output.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

# JSON-schema keywords xgrammar accepts and does not enforce (a document that breaks only the
# keyword passes its matcher: tests/test_structured_output.py checks that of the installed
# xgrammar). A schema asking for one fails to compile, as vLLM's xgrammar backend refuses it,
# rather than run outputs that may break it. So do the uses of enforced keywords it leaves
# out (``unenforced``): ``allOf`` of several schemas (it keeps a part of one), a length beside
# ``pattern`` or ``format``, ``multipleOf`` but by an integer on integers, and a ``required``
# name that ``properties`` does not list. A draft's ``$ref`` outside the schema is read as any
# value. (``minContains`` and ``maxContains`` mean nothing without ``contains``)
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "if", "then", "else", "dependentRequired",
                       "dependentSchemas", "not")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name → schema
_VALUES = ("const", "enum", "default", "examples")  # JSON values, not schemas


def _subschemas(schema: Any, where: str) -> Iterator[tuple[Any, str]]:
    """The schemas directly inside ``schema`` (a list's items, an object's keyword values, a
    name map's entries), each with where it sits; JSON values (``const``, ``enum``, ...) are
    not schemas."""
    if isinstance(schema, list):
        yield from ((s, f"{where}/{i}") for i, s in enumerate(schema))
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key in _VALUES:
                continue
            if key in _NAME_MAPS and isinstance(value, dict):
                yield from ((v, f"{where}/{key}/{n}") for n, v in value.items())
            else:
                yield value, f"{where}/{key}"


def unenforced(schema: Any, where: str = "#") -> str | None:
    """The first part of a JSON ``schema`` xgrammar would not enforce, and where, as
    "'uniqueItems' at #/properties/tags"; None if there is none."""
    if not isinstance(schema, dict):
        return next(filter(None, (unenforced(s, w) for s, w in _subschemas(schema, where))),
                    None)
    for key, value in schema.items():  # each keyword, then what it holds
        if key in UNENFORCED_KEYWORDS:
            return f"'{key}' at {where}"
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            return (f"'$ref' to {value!r} at {where} (outside the schema: put what it names "
                    "under \"$defs\")")
        use = _unenforced_use(schema, key, value)
        if use:
            return f"{use[0]} at {where}{use[1]}"
        found = next(filter(None, (unenforced(s, w)
                                   for s, w in _subschemas({key: value}, where))), None)
        if found:
            return found
    return None


def _unenforced_use(schema: dict, key: str, value: Any) -> tuple[str, str] | None:
    """Keyword ``key`` of ``schema`` where xgrammar leaves it out: (the use, a note after its
    place); else None."""
    if key == "allOf" and isinstance(value, list) and len(value) > 1:
        return f"'allOf' of {len(value)} schemas", " (merge them into one)"
    if key in ("minLength", "maxLength"):
        beside = next((k for k in ("pattern", "format") if k in schema), None)
        if beside:
            return f"'{key}' beside '{beside}'", ""
    if key == "multipleOf" and not (schema.get("type") == "integer" and type(value) is int):
        return f"'multipleOf' {value!r}", " (enforced by integers on integers only)"
    if key == "required" and isinstance(value, list):
        listed = schema.get("properties")
        missing = [n for n in value if not isinstance(listed, dict) or n not in listed]
        if missing:
            return f"'required' {missing[0]!r}", " (its 'properties' do not list it)"
    return None


def unsatisfiable(schema: Any, where: str = "#") -> str | None:
    """Where a JSON ``schema`` asks for what no document can be (an object that must hold a
    property its other keywords forbid), in words; None where none is found."""
    if isinstance(schema, dict):
        listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        closed = schema.get("additionalProperties") is False \
            and not schema.get("patternProperties")
        for name in schema.get("required") or []:
            if closed and name not in listed:
                return (f"an object at {where} that must hold {name!r}, which "
                        "'additionalProperties': false forbids")
    return next(filter(None, (unsatisfiable(s, w) for s, w in _subschemas(schema, where))),
                None)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)  # to its end if cut short
_CONTROLS = re.compile(r"[\x00-\x1f]")


def escape_json_controls(text: str) -> str:
    """``text`` (a JSON-constrained sample's) with each control character inside a string
    literal escaped (a tab as ``\\t``): a schema's ``pattern`` that names one (``\\t``,
    ``[\\x00-\\x1f]``) lets xgrammar write it raw, which JSON does not allow; escaped, the
    string's value is the one the pattern matched. (Outside strings JSON has no quotes, so
    each quote the scan meets opens one.)"""
    return _JSON_STRING.sub(lambda m: _CONTROLS.sub(lambda c: json.dumps(c.group())[1:-1],
                                                    m.group()), text)
