"""Run profiles: ``profiles/NAME.yaml`` (or any YAML file) with up to four sections::

    model:    {name: tiny, tokenizer: byte, config: {model_type: llama, ...}}   # or name: /ckpt/dir
    engine:   {dtype: bfloat16, block_size: 16, load_format: dummy, ...}        # EngineConfig
    sampling: {max_tokens: 64, temperature: 0.0, ...}                           # SamplingParams
    workload: {...}                                                             # for `profile`

A profile whose ``model`` has a Hugging Face ``config`` is also a preset (dummy weights). Every
error names the file and the line of the field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from pagedgen.meta import PROFILES_DIR
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams, type_error


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_file: str) -> dict[str, Any]:
    """A profile by name (profiles/NAME.yaml) or by path; returns its parsed sections, with
    ``_path`` (the file) and ``_lines`` (``{"section.field": line}``, for errors)."""
    path = Path(name_or_file)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PROFILES_DIR / f"{name_or_file}.yaml"
    if not path.is_file():
        raise PagedgenError(f"profile '{name_or_file}' not found; "
                            f"built-in profiles: {', '.join(list_profiles())}")
    try:
        loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else {}
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}" if mark is not None else ""
        raise PagedgenError(f"{path}{at}: invalid YAML: {e.problem or e.context}")
    except (yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError) as e:
        raise PagedgenError(f"{path}: invalid YAML: {str(e).splitlines()[0] if str(e) else e}")
    if not isinstance(data, dict):
        raise PagedgenError(f"{path}: a profile must be a mapping of sections")
    unknown = set(data) - {"description", "model", "engine", "sampling", "workload"}
    if unknown:
        raise PagedgenError(f"{path}: unknown section(s) {sorted(unknown)}")
    for section in ("engine", "sampling", "workload"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise PagedgenError(f"{path}{_line_of(node, section)}: '{section}' must be a "
                                "mapping of fields")
    data["_path"] = str(path)
    data["_lines"] = _field_lines(node)
    return data


def _field_lines(node: yaml.Node) -> dict[str, int]:
    """``{"section": line, "section.field": line}`` of a profile's keys (1-based)."""
    lines: dict[str, int] = {}
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        lines[str(key.value)] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            for k, _ in value.value:
                lines[f"{key.value}.{k.value}"] = k.start_mark.line + 1
    return lines


def _line_of(node: yaml.Node, key: str) -> str:
    line = _field_lines(node).get(key)
    return f":{line}" if line else ""


def apply_fields(obj: Any, values: dict[str, Any], where: str,
                 lines: dict[str, int] | None = None) -> Any:
    """Return a copy of dataclass ``obj`` with ``values`` set, rejecting unknown field names
    and values of the wrong type (``where``: the file, or "options"; ``lines``: the line of
    each field, ``where`` then ending in ``:LINE``)."""
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in values.items():
        at = f"{where}:{lines[name]}" if lines and name in lines else where
        if name not in names:
            raise PagedgenError(f"{at}: unknown field '{name}'; known: {', '.join(sorted(names))}")
        why = type_error(obj, name, value)
        if why:
            raise PagedgenError(f"{at}: {name} {why}")
    return dataclasses.replace(obj, **values)


def configs_from_profile(profile: dict[str, Any] | None) -> tuple[EngineConfig, SamplingParams]:
    """EngineConfig and SamplingParams with a profile's fields applied over the defaults."""
    engine, sampling = EngineConfig(), SamplingParams()
    if not profile:
        return engine, sampling
    where = profile.get("_path", "profile")
    lines = profile.get("_lines") or {}
    engine = apply_fields(engine, profile.get("engine") or {}, where,
                          _section_lines(lines, "engine"))
    sampling = apply_fields(sampling, profile.get("sampling") or {}, where,
                            _section_lines(lines, "sampling"))
    try:
        sampling.validate()
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        line = lines.get(f"sampling.{field}")
        raise PagedgenError(f"{where}{f':{line}' if line else ''}: sampling: {e}")
    model = profile.get("model")
    if isinstance(model, dict) and model.get("name"):
        engine.model = model["name"] if "config" not in model else where
    elif isinstance(model, str):
        engine.model = model
    return engine, sampling


def _section_lines(lines: dict[str, int], section: str) -> dict[str, int]:
    return {k[len(section) + 1:]: v for k, v in lines.items() if k.startswith(section + ".")}
