"""Benchmarks of the installed pagedgen (GPU for most), run from the repository's root as
``python -m benchmarks.NAME``; results in ``benchmarks/results/`` and BENCHMARKS.md."""
