"""Model-level checks: the tiny (or given) model's greedy decode through a backend against the
eager backend's, step by step; with the prefix cache serving a prompt's first pages; sharded
over ranks (``-tp``) against one.

Tolerances live in ``MODEL_TOL`` below; docs/VERIFY.md explains them.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedgen.cli.verify.report import Row
from pagedgen.runtime.distributed import data_parallel


# Max logit difference relative to the largest reference logit, per model-level step.
MODEL_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def model_config(backend_name: str, model: str, dtype: str, device: torch.device, seed: int,
                  graphs: bool, tp: int = 1):
    from pagedgen.runtime.config import EngineConfig

    return EngineConfig(model=model, device=str(device), dtype=dtype, load_format="auto",
                        seed=seed, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                        max_model_len=512, async_scheduling=False, backend=backend_name,
                        enforce_eager=not graphs, tensor_parallel_size=tp)


def model_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 15, 16, 17, 40, 100]  # around page boundaries, and a single token
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


Trace = tuple[dict[tuple[int, int], torch.Tensor], list[list[int]]]


def trace(engine, prompts: list[list[int]], steps: int) -> Trace:
    """Greedy generation of ``prompts``: the float32 logits each output position was sampled
    from, by (prompt index, position), and the output tokens."""
    from pagedgen.runtime.config import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    index = {s.seq_id: i for i, s in enumerate(seqs)}
    logits = {}
    while engine.has_unfinished():
        engine.step()
        for row, s in enumerate(engine.runner.last_sampled):
            logits[(index[s.seq_id], s.num_output_tokens - 1)] = \
                engine.runner.last_logits[row].float().cpu()
    return logits, [list(s.output_token_ids) for s in seqs]


def trace_worker(config, prompts: list[list[int]], steps: int, inbox):
    """``trace`` on an engine built in a worker process (every tensor-parallel rank runs it;
    rank 0's trace is sent, as numpy arrays: tensors do not outlive a worker)."""
    from pagedgen.runtime.engine.engine import Engine

    logits, outputs = trace(Engine(config), prompts, steps)
    yield {k: v.numpy() for k, v in logits.items()}, outputs


def compare(ref: Trace, got: Trace, tol: float, label: str) -> Row:
    """Logits at every position where both runs had produced the same tokens so far, and the
    greedy agreement."""
    worst_abs = worst_rel = 0.0
    first = None
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        for pos in range(min(len(a), len(b))):
            la, lb = torch.as_tensor(got[0][(i, pos)]), ref[0][(i, pos)]
            err = (la - lb).abs().max().item()
            worst_abs = max(worst_abs, err)
            worst_rel = max(worst_rel, err / max(lb.abs().max().item(), 1e-6))
            if a[pos] != b[pos]:  # contexts differ from here on: no longer comparable
                first = pos if first is None else min(first, pos)
                break
    total = sum(len(a) for a in got[1])
    same = sum(x == y for a, b in zip(got[1], ref[1]) for x, y in zip(a, b))
    detail = (f"greedy agreement {same}/{total}; "
              + (f"first divergence at step {first}" if first is not None else "no divergence"))
    return Row("model", label, total, worst_abs, worst_rel, tol, worst_rel <= tol, detail)


def check_model(backend_name: str, model: str, dtype: str, device: torch.device, steps: int,
                seed: int, graphs: bool) -> Row:
    """The same prompts through the model with the backend and with eager."""
    from pagedgen.runtime.engine.engine import Engine

    prompts = model_prompts(seed)
    ref = trace(Engine(model_config("eager", model, dtype, device, seed, False)), prompts, steps)
    eng = Engine(model_config(backend_name, model, dtype, device, seed, graphs))
    label = f"model {eng.src.name} {str(eng.runner.dtype).removeprefix('torch.')}, " \
            f"CUDA graphs {'on' if graphs else 'off'}"
    return compare(ref, trace(eng, prompts, steps), MODEL_TOL[eng.runner.dtype], label)


def check_tensor_parallel(backend_name: str, model: str, dtype: str, device: torch.device,
                          steps: int, seed: int, tp: int, graphs: bool) -> Row:
    """The model sharded over ``tp`` ranks (worker processes, NCCL on GPUs 0..tp-1 or gloo on
    the CPU) with the backend, against one process running eager attention."""
    from pagedgen.runtime.engine.engine import Engine

    prompts = model_prompts(seed)
    cfg = model_config(backend_name, model, dtype, device, seed, graphs, tp)
    got = data_parallel.run_on_ranks(trace_worker, (cfg, prompts, steps), cfg)
    ref_engine = Engine(model_config("eager", model, dtype, device, seed, False))
    ref = trace(ref_engine, prompts, steps)
    label = f"tensor parallel {tp} ({ref_engine.src.name}, CUDA graphs " \
            f"{'on' if graphs else 'off'}) vs 1 rank eager"
    return compare(ref, got, MODEL_TOL[ref_engine.runner.dtype], label)


def check_prefix_cache(backend_name: str, model: str, dtype: str, device: torch.device,
                       steps: int, seed: int, page_size: int) -> Row:
    """A prompt whose first blocks come from the prefix cache against an uncached run of the
    same prompt on the same backend. The shared prefix ends mid-block (2.5 pages), so the
    cached run recomputes the prefix's last half page on top of two cached pages."""
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine

    base = EngineConfig(model=model, device=str(device), dtype=dtype, load_format="dummy",
                        seed=seed, backend=backend_name, block_size=page_size, num_blocks=64,
                        max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=8 * page_size,
                        async_scheduling=False)
    cached = Engine(base)
    fresh = Engine(dataclasses.replace(base, prefix_caching=False))
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (5 * page_size // 2,), generator=g).tolist()
    warm, prompt = (prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 13))
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    cached.generate([warm], params)  # fills the cache with the prefix's two full pages
    a, b = cached.add_request(prompt, params), fresh.add_request(prompt, params)
    worst_abs = worst_rel = 0.0
    while fresh.has_unfinished():
        cached.step()
        fresh.step()
        if a.output_token_ids[:-1] != b.output_token_ids[:-1]:
            break  # contexts differ from here on
        la, lb = cached.runner.last_logits[0].float(), fresh.runner.last_logits[0].float()
        err = (la - lb).abs().max().item()
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / max(lb.abs().max().item(), 1e-6))
    hit = cached.stats.prefix_hit_tokens
    same = sum(x == y for x, y in zip(a.output_token_ids, b.output_token_ids))
    tol = MODEL_TOL[cached.runner.dtype]
    ok = worst_rel <= tol and hit == 2 * page_size
    return Row("model", f"prefix-cached prefill, page {page_size}", steps, worst_abs, worst_rel,
               tol, ok, f"{hit} of {len(prompt)} prompt tokens from the cache; greedy agreement "
                        f"{same}/{b.num_output_tokens}")
