"""A run's figures: counters the engine keeps per step and per finished sequence
(``StepStats``; ``Engine.summary`` reports them), and the command's start-up (``startup``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedgen.runtime import clock
from pagedgen.runtime.engine.sequence import Sequence


@dataclass
class StepStats:
    """Aggregated over a run: tokens and wall time per kind of step."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0  # steps with any prefill tokens (mixed steps count here)
    decode_time: float = 0.0  # decode-only steps
    decode_steps: int = 0
    decode_kv_tokens: int = 0  # cached tokens read by decode-only steps (for rooflines)
    overlapped_steps: int = 0  # launched before the previous step's tokens were read
    steps_scheduled_during_masks: int = 0  # while the last step waited for grammar masks
    num_steps: int = 0
    first_step_wall_time: float | None = None  # time.time() when the first step was launched
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0  # tokens of sequences admitted from scratch
    prefix_hit_tokens: int = 0  # of which the prefix cache held the K/V
    evicted_blocks: int = 0  # cached blocks evicted for new contents
    peak_blocks_used: int = 0  # most KV blocks referenced by sequences at once
    # finished requests (and samples), counted as they finish (nothing kept per request)
    requests_finished: int = 0  # a request counts when its first sample finishes
    samples_finished: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # of finished samples
    tokens_generated: int = 0  # every output token known so far (progress while decoding)
    first_token_time_sum: float = 0.0  # over the requests that got a token
    requests_with_first_token: int = 0
    tpot_sum: float = 0.0  # time per output token after the first, over requests with >1
    requests_with_tpot: int = 0

    def step_done(self, batch: Any, bm: Any, t0: float, now: float) -> None:
        """Count a step launched at ``t0`` (``time.perf_counter()``) and bookkept by ``now``:
        ``batch`` its ``ScheduledBatch``, ``bm`` the block manager after it."""
        if not self.num_steps:
            self.first_step_wall_time = time.time() - (now - t0)
        self.num_steps += 1
        self.num_preemptions += len(batch.preempted)
        self.prefix_queried_tokens += batch.prefix_queried_tokens
        self.prefix_hit_tokens += batch.prefix_hit_tokens
        self.evicted_blocks += batch.evicted_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, bm.num_blocks - bm.num_free_blocks)
        if batch.prefills:
            self.prefill_tokens += batch.num_prefill_tokens
            self.prefill_time += now - t0
        else:
            self.decode_time += now - t0
            self.decode_steps += 1
            self.decode_kv_tokens += sum(seq.num_tokens for seq in batch.decodes)
        self.decode_tokens += len(batch.decodes)

    def record_finished(self, seq: Sequence) -> None:
        self.samples_finished += 1
        if seq.sample_index == 0:
            self.requests_finished += 1
            self.prompt_tokens += seq.num_prompt_tokens
        self.output_tokens += seq.num_output_tokens
        if seq.first_token_time is not None:
            self.first_token_time_sum += seq.first_token_time
            self.requests_with_first_token += 1
            if seq.finish_time is not None and seq.num_output_tokens > 1:
                self.tpot_sum += (seq.finish_time - seq.first_token_time) / (
                    seq.num_output_tokens - 1)
                self.requests_with_tpot += 1


@dataclass
class DecodeReads:
    """The decode tokens' KV reads per step: what they read (groups' shared pages once per
    group, with grouped cascade decode) against what plain decode reads (every decode its whole
    context); ``token_bytes``: one token's K and V across the layers."""

    token_bytes: int
    steps: int = 0  # steps with decode tokens
    cascade_steps: int = 0
    cascade_mixed: int = 0  # of which steps with prefills
    groups: int = 0  # over the cascade steps
    levels: int = 0
    most_levels: int = 0
    tokens_read: int = 0
    tokens_plain: int = 0

    def count(self, md) -> None:
        """One step's ``AttentionMetadata``."""
        if md.num_decodes == 0:
            return
        plain = sum(md.seq_lens_cpu[md.num_prefills:])
        self.steps += 1
        self.tokens_plain += plain
        self.tokens_read += plain
        if md.cascade is not None:
            self.cascade_steps += 1
            self.cascade_mixed += md.num_prefills > 0
            self.groups += md.cascade.num_groups
            self.levels += md.cascade.num_levels
            self.most_levels = max(self.most_levels, md.cascade.num_levels)
            self.tokens_read -= md.cascade.saved_tokens

    def summary(self, since: DecodeReads | None = None) -> dict[str, float | int]:
        """The figures of the run (or of the steps after the copy ``since`` was taken)."""
        d = {k: getattr(self, k) - (getattr(since, k) if since else 0)
             for k in ("steps", "cascade_steps", "cascade_mixed", "groups", "levels",
                       "tokens_read", "tokens_plain")}
        per_step = self.token_bytes / max(1, d["steps"]) / 1e9
        return {"cascade_decode_steps": d["cascade_steps"],
                "cascade_steps_with_prefills": d["cascade_mixed"],
                "cascade_groups_per_step": d["groups"] / max(1, d["cascade_steps"]),
                "cascade_levels_per_step": d["levels"] / max(1, d["cascade_steps"]),
                "cascade_most_levels": self.most_levels,
                "decode_kv_read_gb_per_step": d["tokens_read"] * per_step,
                "decode_kv_plain_gb_per_step": d["tokens_plain"] * per_step}


def startup(first_step_wall_time: float | None, phases: dict[str, float] | None = None
            ) -> dict[str, Any]:
    """``{"startup_s": ...}``: from the run's beginning (``runtime/clock.py``: the command's
    first line or ``LLM()``; else this process's start) to the first step (``time.time()``
    then); empty where either is unknown. With the runner's start-up ``phases``, also their
    breakdown, led by what came before them (imports, reading and tokenizing the input)."""
    began = clock.started()
    age = process_age() if began is None else time.time() - began
    if age is None or first_step_wall_time is None:
        return {}
    total = age - (time.time() - first_step_wall_time)
    out: dict[str, Any] = {"startup_s": total}
    if phases:
        out["startup_breakdown_s"] = {"imports_and_input": total - sum(phases.values()),
                                      **phases}
    return out


def process_age() -> float | None:
    """Seconds since this process started, from ``/proc`` (Linux; else None)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def peak_memory_bytes(device: torch.device) -> int:
    """The run's peak memory: allocated on a CUDA device, the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
