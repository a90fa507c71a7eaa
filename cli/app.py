"""The `pagedgen` Typer app: generate, backends, verify, profile, bench (``cli/main.py`` runs
it)."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from pagedgen import envs
from pagedgen.cli.bench.command import bench
from pagedgen.cli.common import cli_errors, out_console
from pagedgen.cli.generate.command import generate
from pagedgen.cli.profile.command import profile
from pagedgen.cli.verify.command import verify

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Offline batch LLM generation and attention profiling over a paged KV "
                       "cache.")


def _version(value: bool) -> None:
    if value:
        from pagedgen.meta import __version__

        typer.echo(f"pagedgen {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", "-V", callback=_version,
                                       is_eager=True, help="Print the version and exit.")
          ) -> None:
    """Offline batch LLM generation and attention profiling over a paged KV cache."""


@app.command()
@cli_errors
def backends(device: str | None = typer.Option(
        None, help="auto, cpu, cuda or cuda:N [default: auto]."),
        model: str | None = typer.Option(
            None, help="Also show the KV groups of this model (a preset, checkpoint directory, "
                       "GGUF file or Hub id) and the backend auto runs each on.")) -> None:
    """List the attention backends and whether each runs here (and why not), and the
    environment variables pagedgen reads."""
    from pagedgen.attention.registry import backend_status, get_backend
    from pagedgen.runtime.config import EngineConfig

    dev = EngineConfig(device=device or "auto").torch_device()
    table = Table(title=f"attention backends on {dev}", title_justify="left")
    for col in ("backend", "available", "notes", "cannot run layers with"):
        table.add_column(col)
    for s in backend_status(dev):
        table.add_row(s.name, "[green]yes[/]" if s.available else "[red]no[/]", escape(s.reason),
                      escape(s.lacks or "-"))
    out = out_console()
    out.print(table)
    out.print(f"auto → {get_backend('auto', dev).name}")
    if model:
        out.print(_model_groups(model, dev))
    env = Table(title="environment variables (none is needed; each overrides a choice)",
                title_justify="left")
    for col in ("variable", "now", "meaning", "unset"):
        env.add_column(col, overflow="fold")
    for var in envs.ALL:
        env.add_row(var.name, escape(var.get() or "-"), escape(var.meaning),
                    escape(var.default))
    out.print(env)


def _model_groups(model: str, dev) -> Table:
    """The model's KV groups (kind, layers, KV shape) and the backend ``auto`` runs each on."""
    from pagedgen.runtime.engine.kv_groups import group_backends, model_layout

    specs, layout, dtype, kv_dtype = model_layout(model, dev)
    _, chosen = group_backends(specs, layout, "auto", dev, dtype, kv_dtype, model)
    table = Table(title=f"{model}: KV groups and auto's backend for each on {dev}",
                  title_justify="left", caption=layout.note)
    for col in ("group", "attends to", "layers", "KV heads x head size", "backend"):
        table.add_column(col)
    for i, (g, b) in enumerate(zip(layout.groups, chosen)):
        kinds = sorted({f"{specs[j].num_kv_heads} x {specs[j].head_size}" for j in g.layers})
        table.add_row(str(i), "every token" if g.window is None else f"last {g.window:,}",
                      str(len(g.layers)), ", ".join(kinds), b.name)
    return table


app.command()(generate)
app.command()(verify)
app.command("profile")(profile)
app.command("bench")(bench)
