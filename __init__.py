"""pagedgen: offline batch LLM generation and attention profiling over a paged KV cache."""

from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
PROFILES_DIR = PACKAGE_DIR / "profiles"
