"""The `pagedgen` command line (Typer)."""
