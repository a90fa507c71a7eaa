"""What `pagedgen profile` runs: the workload (batch sizes, prompt and output lengths), from a
profile's ``workload`` section and the options, and its prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import MAX_SEATS


@dataclass
class Workload:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    prompt_len: int = 64
    shared_prefix_len: int = 0  # leading tokens every prompt of a batch shares (prefix caching)
    output_len: int = 16  # caps the decode steps per batch size
    prompts: str | None = None  # a JSONL prompt file instead of random prompts
    warmup_steps: int = 2
    measured_steps: int = 8
    cuda_graphs: bool = True


def prompts_for(engine, wl: Workload, batch: int, seed: int) -> list[list[int]]:
    if wl.prompts:
        from pagedgen.cli.formats.reader import read_requests
        from pagedgen.runtime.inputs.parse import tokenize_requests
        rf = read_requests(Path(wl.prompts))
        tokenize_requests(rf, engine.tokenizer)
        ids = [list(r.prompt_token_ids) for r in rf.requests]
        return [ids[i % len(ids)] for i in range(batch)]
    g = torch.Generator().manual_seed(seed)
    vocab = min(256, engine.src.hf_config.vocab_size)
    shared = torch.randint(0, vocab, (min(wl.shared_prefix_len, wl.prompt_len),), generator=g)
    return [shared.tolist() + torch.randint(0, vocab, (wl.prompt_len - len(shared),),
                                            generator=g).tolist() for _ in range(batch)]


def workload_from(profile: dict | None, overrides: dict[str, Any]) -> Workload:
    from pagedgen.runtime.profiles import apply_fields

    profile = profile or {}
    lines = {k[len("workload."):]: v for k, v in (profile.get("_lines") or {}).items()
             if k.startswith("workload.")}
    wl = apply_fields(Workload(), profile.get("workload") or {},
                      profile.get("_path", "profile"), lines)
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(given.get("batch_sizes"), str):
        try:
            given["batch_sizes"] = [int(x) for x in given["batch_sizes"].split(",") if x]
        except ValueError:
            raise PagedgenError("--batch-sizes takes integers separated by commas, e.g. 1,8,64")
    wl = apply_fields(wl, given, "options")
    if not wl.batch_sizes or min(wl.batch_sizes) < 1:
        raise PagedgenError("batch sizes must be positive integers")
    if max(wl.batch_sizes) > MAX_SEATS:
        raise PagedgenError(f"batch size {max(wl.batch_sizes):,}: a step runs at most "
                            f"{MAX_SEATS:,} sequences")
    wl.batch_sizes = sorted(set(wl.batch_sizes))
    for name, low in (("measured_steps", 1), ("warmup_steps", 0), ("output_len", 3),
                      ("prompt_len", 1)):
        if getattr(wl, name) < low:
            raise PagedgenError(f"--{name.replace('_', '-')} must be >= {low}, not "
                                f"{getattr(wl, name)}")
    if not 0 <= wl.shared_prefix_len <= wl.prompt_len:
        raise PagedgenError(f"--shared-prefix-len must be in 0..{wl.prompt_len} (the prompt "
                            f"length), not {wl.shared_prefix_len}")
    if wl.prompts:  # read now, so a bad file fails before the model loads (file:line errors)
        from pagedgen.cli.formats.reader import read_requests
        read_requests(Path(wl.prompts))
    return wl
