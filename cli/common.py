"""What every `pagedgen` command shares: consoles, one-line errors, run settings from options."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from pagedgen.errors import PagedgenError, Terminated

console = Console(stderr=True)


def out_console() -> Console:
    """Console for results on stdout; 160 columns when piped, so that wide tables (verify,
    profile) stay readable in logs (the generate summary is 100 wide on its own)."""
    c = Console()
    return c if c.is_terminal else Console(width=160)


def set_verbosity(verbose: int, quiet: bool) -> None:
    """``-v`` (INFO: start-up phases, the backend, the KV cache, graphs) or ``-vv`` (DEBUG)
    from pagedgen's loggers onto stderr; ``--quiet``: errors only (no progress bars, notes or
    summary; a run's one-line error still prints)."""
    log = logging.getLogger("pagedgen")
    if verbose and not log.handlers:
        from rich.logging import RichHandler
        log.addHandler(RichHandler(console=console, show_time=False, show_path=False,
                                   markup=False, rich_tracebacks=False))
    log.setLevel(logging.ERROR if quiet else logging.WARNING - 10 * min(verbose, 2))
    console.quiet = quiet


def cli_errors(fn: Callable) -> Callable:
    """Turn PagedgenError into a one-line message and exit code 1 (no traceback); Ctrl-C and
    SIGTERM into one line and exit codes 130 and 143 (a command that writes files says what
    it kept before this)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        set_verbosity(0, False)  # each command as it sets it (in-process callers run several)
        try:
            return fn(*args, **kwargs)
        except PagedgenError as e:
            console.quiet = False  # --quiet keeps errors
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False,
                          soft_wrap=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]", soft_wrap=True)
            raise typer.Exit(130)
        except Terminated as e:
            console.print(f"[yellow]{e.words}[/]")
            raise typer.Exit(e.exit_code)

    return wrapper


def engine_and_sampling(profile: Optional[str], model: Optional[str], engine_overrides: dict,
                        sampling_overrides: dict, keywords: bool = False,
                        revision: Optional[str] = None):
    """Profile (explicit, or implied by a preset --model, or the default) + command-line
    options (``keywords``: the Python API's keyword arguments), every value checked (types,
    ranges, names) before anything loads; the engine config keeps where each setting came
    from (``EngineConfig.origin``), so messages name what the user gave. ``revision``: a Hub
    id's branch, tag or commit (``--revision``), as ``org/name@revision``."""
    from pagedgen.meta import PROFILES_DIR
    from pagedgen.attention.registry import backend_names
    from pagedgen.runtime.config import DEFAULT_MODEL
    from pagedgen.runtime.profiles import (apply_fields, configs_from_profile, list_profiles,
                                           load_profile)

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


def with_revision(model: Optional[str], revision: str, named: str) -> str:
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
