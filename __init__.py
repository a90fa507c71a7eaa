"""pagedgen: offline batch LLM generation and attention profiling over a paged KV cache.

The command line is ``pagedgen`` (``cli/``); the Python API is ``pagedgen.LLM`` (``runtime/api.py``,
imported at first use: ``import pagedgen`` alone loads no torch).
"""

from pagedgen.meta import PACKAGE_DIR, PROFILES_DIR, __version__

__all__ = ["LLM", "PACKAGE_DIR", "PROFILES_DIR", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedgen.runtime.api import LLM

        return LLM
    if name == "SamplingParams":
        from pagedgen.runtime.inputs.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pagedgen' has no attribute {name!r}")
