"""The package's version, where its own data lie (the built-in run profiles), and where it
keeps what it saves on a machine (kernel plans, converted tokenizers)."""

import os
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
PROFILES_DIR = PACKAGE_DIR / "profiles"


def cache_file(name: str) -> Path:
    """``name`` under pagedgen's cache: ``$XDG_CACHE_HOME/pagedgen/``, else ``~/.cache/``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedgen" / name
