"""A workload's schedule replayed on the engine's own scheduler and block manager, on a CPU with
no model: each step's decodes append a token and its prefills advance, as the engine does when
a step ends (greedy, ``ignore_eos``: every sample runs to its length). It counts steps,
preemptions and the prompt tokens computed again after them, for a KV cache of a given size, so
an admission or preemption rule is weighed in a second where a GPU run of the workload takes
minutes. It reproduces the GPU's counts: workload g on an H100 (213,408 token slots, pages of
16) ran 410 steps, 260 of them decodes only, with 164 preemptions; replayed, 410, 260 and 165.

    python -m benchmarks.schedule_replay --workload g --kv-cache-tokens 213408

The KV groups are the model's (``plan_layout`` over its family's layer specs); the sequences'
token ids are the workload's own, so prefix caching sees what a real run sees.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from benchmarks import common
from benchmarks.workloads import WORKLOADS
from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.kv_groups import plan_layout
from pagedgen.runtime.engine.scheduler import ScheduledBatch, Scheduler
from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.runtime.models import registry
from pagedgen.runtime.models.loader import resolve_model

StepHook = Callable[[Scheduler, ScheduledBatch, set], None]


def replay(scheduler: Scheduler, prompts: list[list[int]], outs: list[int],
           on_step: StepHook | None = None) -> dict[str, int]:
    """Run ``prompts`` (each to its ``outs`` tokens) through ``scheduler`` until every one is
    done; ``on_step(scheduler, batch, waiting_before)`` sees each step as scheduled."""
    for i, (p, n) in enumerate(zip(prompts, outs)):
        scheduler.add(Sequence(i, list(p), SamplingParams(max_tokens=n, temperature=0.0,
                                                         ignore_eos=True), 0))
    steps = decode_only = prefill_tokens = preemptions = 0
    max_steps = 10 * sum(len(p) + n for p, n in zip(prompts, outs))
    while scheduler.has_unfinished():
        if steps == max_steps:  # a sequence the cache cannot hold: preempted for ever
            raise RuntimeError(f"{steps:,} steps and not done: is the cache too small?")
        waiting = set(scheduler.waiting)
        batch = scheduler.schedule()
        if batch.is_empty:
            raise RuntimeError(f"step {steps}: nothing could be scheduled")
        if on_step:
            on_step(scheduler, batch, waiting)
        steps += 1
        preemptions += len(batch.preempted)
        prefill_tokens += batch.num_prefill_tokens
        decode_only += not batch.prefills
        for seq, k in batch.prefills:
            seq.num_computed_tokens += k
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(1)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            seq.append_token(1)
        for seq in [s for s in scheduler.running if s.num_output_tokens >= s.params.max_tokens]:
            scheduler.finish(seq)
    return {"steps": steps, "decode_only_steps": decode_only, "preemptions": preemptions,
            "prefill_tokens": prefill_tokens,
            "recomputed_tokens": prefill_tokens - sum(map(len, prompts)),
            "peak_blocks_held": list(scheduler.bm.peak_held)}


def workload_replay(name: str, kv_cache_tokens: int, block_size: int = 16,
                    max_num_seqs: int = 1024, max_num_batched_tokens: int = 16384,
                    prefix_caching: bool = True) -> dict[str, int]:
    """Workload ``name``'s schedule on a cache of ``kv_cache_tokens`` token slots."""
    w = WORKLOADS[name]
    cfg, _ = common.profile_configs(w.profile, device="cpu")
    src = resolve_model(cfg.model)
    specs = registry.model_class(src.hf_config).layer_specs(src.hf_config, 1)
    layout = plan_layout(specs, cfg.kv_cache_groups)
    prompts, outs = w.requests(src.hf_config.vocab_size)
    bm = BlockManager(kv_cache_tokens // block_size, block_size, prefix_caching,
                      windows=layout.windows)
    out = replay(Scheduler(bm, max_num_seqs, max_num_batched_tokens), prompts, outs)
    return {"workload": name, "kv_cache_tokens": kv_cache_tokens,
            "windows": layout.windows, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="g", choices=sorted(WORKLOADS))
    ap.add_argument("--kv-cache-tokens", type=int, nargs="+", default=[213408],
                    help="token slots of the cache (a GPU run's summary: kv_cache_token_slots)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    rows = [workload_replay(a.workload, n, a.block_size, a.max_num_seqs,
                            a.max_num_batched_tokens, not a.no_prefix_caching)
            for n in a.kv_cache_tokens]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
