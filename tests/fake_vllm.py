"""A stand-in ``vllm`` package for the tests of vLLM as a peer (found as
``$PAGEDGEN_VLLM_SITE``): its ``SamplingParams`` and outputs, with each test's own ``LLM``
class and ``TokensPrompt``."""

from __future__ import annotations

from pathlib import Path

OUTPUTS = '''
import json, os
__version__ = "0.0.fake"
class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens
class _Output:
    def __init__(self, ids):
        self.token_ids = ids
class _Result:
    def __init__(self, ids):
        self.outputs = [_Output(ids)]
'''


def fake_vllm_site(folder: Path, llm_class: str, inputs: str) -> Path:
    """A site folder at ``folder`` holding ``vllm`` with ``llm_class`` (the source of its
    ``LLM``) beside the shared outputs, and ``vllm.inputs`` from ``inputs``."""
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "__init__.py").write_text(OUTPUTS + llm_class)
    (folder / "vllm" / "inputs.py").write_text(inputs)
    return folder
