"""`pagedgen verify`'s results: a row per check, a report per backend, and their table."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def max_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference, and that relative to the reference's largest value
    (what every row's worst figures are made of)."""
    err = (got - ref).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-6)


@dataclass
class Row:
    kind: str  # "kernel" | "model"
    group: str
    cases: int
    worst_abs: float
    worst_rel: float
    tol: float
    passed: bool
    detail: str = ""
    seconds: float = 0.0  # its tasks' time in the processes that ran them, compiles included


@dataclass
class BackendReport:
    backend: str
    status: str  # "checked" | "skipped" | "reference"
    reason: str = ""
    rows: list[Row] = field(default_factory=list)
    reference: str = "eager"  # what the rows are checked against (the table's title)
    # checks left out because the model does not use what they check: (check, why)
    not_checked: list[tuple[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)


def render(reports: list[BackendReport], console: Console) -> None:
    for rep in reports:
        if rep.status != "checked":
            console.print(f"[bold]{rep.backend}[/]: {rep.status} — {escape(rep.reason)}")
            continue
        t = Table(title=f"{rep.backend} vs {rep.reference}", title_justify="left")
        for col in ("check", "cases", "worst abs err", "worst rel err", "tolerance", "result",
                    "time", "notes"):
            t.add_column(col, justify="left" if col in ("check", "notes") else "right")
        for r in rep.rows:
            t.add_row(r.group, str(r.cases), f"{r.worst_abs:.2e}", f"{r.worst_rel:.2e}",
                      f"{r.tol:.0e}{' rel' if r.kind == 'model' else ''}",
                      "[green]pass[/]" if r.passed else "[bold red]FAIL[/]",
                      f"{r.seconds:.1f} s", escape(r.detail))
        console.print(t)
        for check, why in rep.not_checked:
            console.print(f"  not checked: {escape(check)} — {escape(why)}", highlight=False)
