"""Run profiles: ``profiles/NAME.yaml`` (or any YAML file) with up to four sections::

    model:    {name: tiny, tokenizer: byte, config: {model_type: llama, ...}}   # or name: /ckpt/dir
    engine:   {dtype: bfloat16, block_size: 16, load_format: dummy, ...}        # EngineConfig
    sampling: {max_tokens: 64, temperature: 0.0, ...}                           # SamplingParams
    workload: {...}                                                             # for `profile`

A profile whose ``model`` has a Hugging Face ``config`` is also a preset (dummy weights). A
profile is checked as strictly as options: an unknown section or field, a value of the wrong
type and a key given twice (at any depth) are errors naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from pagedgen.errors import PagedgenError, first_line
from pagedgen.meta import PROFILES_DIR
from pagedgen.runtime.config import EngineConfig, SamplingParams, type_error

SECTIONS = ("description", "model", "engine", "sampling", "workload")
MODEL_FIELDS = ("name", "tokenizer", "config")
PRESET_TOKENIZERS = ("byte", "none")  # a preset has no tokenizer files


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error at its line (the
    plain loader keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"'{key}' is given twice (first at line {seen[key]})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


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
        loader = _UniqueKeys(path.read_text(encoding="utf-8"))
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
        raise PagedgenError(f"{path}: invalid YAML: {first_line(e, '')}")
    if not isinstance(data, dict):
        raise PagedgenError(f"{path}: a profile must be a mapping of sections")
    for section in data:
        if section not in SECTIONS:
            raise PagedgenError(f"{path}{_line_of(node, str(section))}: unknown section "
                                f"'{section}'{_hint(str(section), SECTIONS)}; sections: "
                                f"{', '.join(SECTIONS)}")
    for section in ("engine", "sampling", "workload"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise PagedgenError(f"{path}{_line_of(node, section)}: '{section}' must be a "
                                "mapping of fields")
    _check_model(data.get("model"), path, _field_lines(node))
    data["_path"] = str(path)
    data["_lines"] = _field_lines(node)
    return data


def _check_model(model: Any, path: Path, lines: dict[str, int]) -> None:
    """A profile's ``model``: a name (a checkpoint or preset), or a mapping of ``name``,
    ``tokenizer`` (a preset's: byte or none) and ``config`` (a Hugging Face config)."""
    at = f"{path}:{lines['model']}" if "model" in lines else str(path)
    if model is None or isinstance(model, str):
        return
    if not isinstance(model, dict):
        raise PagedgenError(f"{at}: 'model' must be a name (a checkpoint or a preset) or a "
                            f"mapping of {', '.join(MODEL_FIELDS)}, not {type(model).__name__}")
    for key, value in model.items():
        at = f"{path}:{lines.get(f'model.{key}', lines.get('model', '?'))}"
        if key not in MODEL_FIELDS:
            raise PagedgenError(f"{at}: unknown field 'model.{key}'"
                                f"{_hint(str(key), MODEL_FIELDS)}; known: "
                                f"{', '.join(MODEL_FIELDS)}")
        if key == "name" and not (isinstance(value, str) and value.strip()):
            raise PagedgenError(f"{at}: model.name must be a non-empty string")
        if key == "config" and not isinstance(value, dict):
            raise PagedgenError(f"{at}: model.config must be a mapping (a Hugging Face "
                                "config's fields)")
        if key == "tokenizer" and value not in PRESET_TOKENIZERS:
            raise PagedgenError(f"{at}: model.tokenizer must be one of "
                                f"{', '.join(PRESET_TOKENIZERS)} (a preset's; a checkpoint "
                                f"brings its own), not {value!r}")
    if "tokenizer" in model and "config" not in model:
        raise PagedgenError(f"{path}:{lines.get('model.tokenizer')}: model.tokenizer is a "
                            "preset's (with model.config); a checkpoint brings its own")


def _hint(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


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
    names = {f.name for f in dataclasses.fields(obj) if f.metadata.get("setting", True)}
    for name, value in values.items():
        at = f"{where}:{lines[name]}" if lines and name in lines else where
        if name not in names:
            raise PagedgenError(f"{at}: unknown field '{name}'{_hint(str(name), names)}; "
                                f"known: {', '.join(sorted(names))}")
        why = type_error(type(obj), name, value)
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
