"""A run's settings from what the user gave: a profile (named, or implied by a preset
``--model``) and options or the API's keyword arguments, every value checked before anything
loads, each setting remembering where it came from so that messages name it. The commands
(``cli/``) and the Python API (``runtime/api.py``) share it."""

from __future__ import annotations

from pathlib import Path

from pagedgen.errors import PagedgenError


def engine_and_sampling(profile: str | None, model: str | None, engine_overrides: dict,
                        sampling_overrides: dict, keywords: bool = False,
                        revision: str | None = None):
    """Profile (explicit, or implied by a preset --model, or the default) + command-line
    options (``keywords``: the Python API's keyword arguments), every value checked (types,
    ranges, names) before anything loads; the engine config keeps where each setting came
    from (``EngineConfig.origin``), so messages name what the user gave. ``revision``: a Hub
    id's branch, tag or commit (``--revision``), as ``org/name@revision``."""
    from pagedgen.attention.registry import backend_names
    from pagedgen.meta import PROFILES_DIR
    from pagedgen.runtime.config import DEFAULT_MODEL
    from pagedgen.runtime.profiles import (
        apply_fields,
        configs_from_profile,
        list_profiles,
        load_profile,
    )

    if revision is not None:
        model = with_revision(model, revision, "keyword revision" if keywords else "--revision")
    name = profile
    # a preset's name implies its profile, unless a local folder or file has that name: the
    # model the run uses is that checkpoint, with no preset's engine or sampling settings
    if name is None and (model is None or (model in list_profiles()
                                           and not Path(model).expanduser().exists())):
        name = model or DEFAULT_MODEL
    prof = load_profile(name) if name else None
    engine, sampling = configs_from_profile(prof)  # checks the profile's own values
    if model is not None:
        engine.model = model
    given = {k: v for k, v in engine_overrides.items() if v is not None}
    engine = apply_fields(engine, given, "options")
    sampling = apply_fields(sampling, {k: v for k, v in sampling_overrides.items()
                                       if v is not None}, "options")
    # where each engine field was set, for errors: a profile's line, else the option
    lines = (prof or {}).get("_lines") or {}
    where = prof and (f"profile {Path(prof['_path']).stem}"
                      if Path(prof["_path"]).parent == PROFILES_DIR else prof["_path"])
    origin = {k[7:]: f"{where}:{line}: {k}" for k, line in lines.items()
              if k.startswith("engine.")}
    origin.update({k: f"keyword {k}" if keywords else "--" + k.replace("_", "-")
                   for k in given})
    engine.origin = origin
    engine.validate()
    if engine.backend != "auto" and engine.backend not in backend_names():
        raise PagedgenError(f"unknown backend '{engine.backend}'; choose auto or one of "
                            f"{', '.join(backend_names())} (`pagedgen backends` says which "
                            "run here)")
    try:
        sampling.validate()
    except ValueError as e:
        raise PagedgenError(f"options: {e}")
    return engine, sampling, prof


def with_revision(model: str | None, revision: str, named: str) -> str:
    """``model`` (a Hub id) at ``revision``: ``org/name@revision``."""
    from pagedgen.runtime.models import hub

    if not revision.strip():
        raise PagedgenError(f"{named} is empty: give a branch, a tag or a commit")
    if model is None or not hub.is_hub_id(model.partition("@")[0]):
        raise PagedgenError(f"{named} applies to a Hugging Face Hub id (--model org/name), "
                            f"not {model or 'the default preset'}")
    if "@" in model:
        raise PagedgenError(f"{named} {revision} and --model {model} both name a revision; "
                            "give one")
    return f"{model}@{revision}"
