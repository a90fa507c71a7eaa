"""Import FlashAttention-4 without the part of its dependencies it never runs.

FA4 (``flash_attn.cute``) uses quack's layout, copy, SM90 and compile helpers. quack's package
``__init__`` (0.6.x) also imports its RMSNorm, softmax and cross-entropy kernels, whose autotuner
is decorated with ``torch.compiler.disable``, which imports ``torch._dynamo``: 6.6 s of FA4's
11.7 s import on the H100 machine (``python -X importtime``, warm). :func:`import_quack_lean`
runs the rest of that ``__init__`` (``quack.dsl``, whose import patches CuTe's tensor classes,
and the ptxas patch) and resolves those four names at first access instead, as the package's
own attributes, so ``from quack import rmsnorm`` still works.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys

# quack versions whose __init__ is exactly: __version__, import quack.dsl, the ptxas patch
# under CUTE_DSL_PTXAS_PATH, then these four from-imports. Any other version imports as it is.
LEAN_VERSIONS = ("0.6.3", "0.6.5")
LAZY_NAMES = {"rmsnorm": "quack.rmsnorm", "softmax": "quack.softmax",
              "cross_entropy": "quack.cross_entropy", "RoundingMode": "quack.rounding"}


def import_quack_lean() -> bool:
    """Import quack with its four kernel entry points deferred to first use. Returns whether it
    did (False: quack already imported, absent, or a version whose ``__init__`` differs)."""
    if "quack" in sys.modules:
        return False
    spec = importlib.util.find_spec("quack")
    try:
        version = importlib.metadata.version("quack-kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    if spec is None or spec.submodule_search_locations is None or version not in LEAN_VERSIONS:
        return False
    package = importlib.util.module_from_spec(spec)  # its __path__, without running __init__
    package.__version__ = version
    package.__all__ = list(LAZY_NAMES)

    def __getattr__(name: str):
        if name not in LAZY_NAMES:
            raise AttributeError(f"module 'quack' has no attribute {name!r}")
        value = getattr(importlib.import_module(LAZY_NAMES[name]), name)
        setattr(package, name, value)  # as the from-import in quack's __init__ binds it
        return value

    package.__getattr__ = __getattr__
    sys.modules["quack"] = package
    try:
        importlib.import_module("quack.dsl")
        if os.environ.get("CUTE_DSL_PTXAS_PATH") is not None:
            importlib.import_module("quack.dsl.cute_dsl_ptxas").patch()
    except BaseException:
        for name in [m for m in sys.modules if m == "quack" or m.startswith("quack.")]:
            del sys.modules[name]
        raise
    return True


def import_fa4():
    """``flash_attn.cute``, its compiled kernels kept on disk for the next run, quack lean."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    import_quack_lean()  # without torch._dynamo
    return importlib.import_module("flash_attn.cute")
