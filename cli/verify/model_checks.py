"""Model-level checks: the tiny (or given) model's greedy decode through a backend against the
eager backend's, step by step; with the prefix cache serving a prompt's first pages; sharded
over ranks (``-tp``) against one.

Tolerances live in ``MODEL_TOL`` below; docs/VERIFY.md explains them.
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import torch

from pagedgen.cli.verify.report import Row, max_error
from pagedgen.runtime.drivers import data_parallel
from pagedgen.runtime.sampling.processors import LogitsProcessor

# Max logit difference relative to the largest reference logit, per model-level step.
MODEL_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# Or, below float32: a backend's error against the float32 run, at most this many times the
# eager backend's own in the same dtype (``judge``).
NOISE_FACTOR = 2.0


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


class Recorder(LogitsProcessor):
    """Teacher forcing for the checks: keeps each row's logits as the model gave them and,
    given the tokens to follow, leaves only the next of them to sample, so every run of a
    check sees the same contexts and every step is compared (a free run stops being
    comparable at its first argmax flip, often step 0 on a deep model's flat logits)."""

    def __init__(self, key: int, logits: dict, forced: list[int] | None) -> None:
        self.key, self.logits, self.forced = key, logits, forced

    def __call__(self, output_token_ids, row: torch.Tensor) -> None:
        pos = len(output_token_ids)
        self.logits[(self.key, pos)] = row.to("cpu", torch.float32, copy=True)
        if self.forced is not None:
            token = self.forced[pos]
            row.fill_(float("-inf"))
            row[token] = 0.0


def trace(engine, prompts: list[list[int]], steps: int,
          forced: list[list[int]] | None = None) -> Trace:
    """Greedy generation of ``prompts`` (following ``forced``'s tokens, one list a prompt,
    when given): the float32 logits each output position was sampled from, by (prompt index,
    position), and the output tokens."""
    from pagedgen.runtime.config import SamplingParams

    logits: dict[tuple[int, int], torch.Tensor] = {}
    # the engine's factory and switch (what Engine(processor_factory=...) sets): the
    # checks trace engines they did not make
    engine.set_processor_factory(lambda i, params, sample: [
        Recorder(i, logits, None if forced is None else forced[i])])
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params, request=i) for i, p in enumerate(prompts)]
    engine.run()
    return logits, [list(s.output_token_ids) for s in seqs]


def trace_worker(config, prompts: list[list[int]], steps: int,
                 forced: list[list[int]] | None, inbox):
    """``trace`` on an engine built in a worker process (every tensor-parallel rank runs it;
    rank 0's trace is sent, as numpy arrays: tensors do not outlive a worker)."""
    from pagedgen.runtime.engine.engine import Engine

    logits, outputs = trace(Engine(config), prompts, steps, forced)
    yield {k: v.numpy() for k, v in logits.items()}, outputs


def compare(ref: Trace, got: Trace, tol: float, label: str) -> Row:
    """Logits at every position where both runs had produced the same tokens so far, and the
    greedy agreement."""
    worst_abs = worst_rel = 0.0
    first = None
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        for pos in range(min(len(a), len(b))):
            err, rel = max_error(torch.as_tensor(got[0][(i, pos)]), ref[0][(i, pos)])
            worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
            if a[pos] != b[pos]:  # contexts differ from here on: no longer comparable
                first = pos if first is None else min(first, pos)
                break
    total = sum(len(a) for a in got[1])
    same = sum(x == y for a, b in zip(got[1], ref[1]) for x, y in zip(a, b))
    detail = (f"greedy agreement {same}/{total}; "
              + (f"first divergence at step {first}" if first is not None else "no divergence"))
    return Row("model", label, total, worst_abs, worst_rel, tol, worst_rel <= tol, detail)


def difference(got: Trace, ref: Trace) -> tuple[float, float, int]:
    """Two traces along the same tokens: the largest logit difference, absolute and relative
    to the reference's largest logit at its position, and the positions whose argmax agree."""
    worst_abs = worst_rel = 0.0
    agree = 0
    for key, lb in ref[0].items():
        la = torch.as_tensor(got[0][key])
        err, rel = max_error(la, lb)
        worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
        agree += int(la.argmax() == lb.argmax())
    return worst_abs, worst_rel, agree


def judge(got: Trace, base: Trace, ref32: Trace | None, tol: float, label: str,
          wants_float32: bool = False) -> Row:
    """``got`` against ``base`` (eager in the same dtype) within ``tol``; or, where a float32
    reference ran, within ``NOISE_FACTOR`` times the error ``base`` itself has against it:
    a backend may round no worse than the model in its dtype does (FlashAttention's test rule;
    a deep model's flat random logits move more than ``tol`` under rounding alone).
    ``wants_float32``: a check below float32, which says so when that run did not fit."""
    worst_abs, worst_rel, agree = difference(got, base)
    passed = worst_rel <= tol
    detail = f"argmax agreement {agree}/{len(base[0])}"
    if ref32 is not None:
        err, noise = difference(got, ref32)[1], difference(base, ref32)[1]
        detail += f"; against float32 {err:.2e}, eager's own {noise:.2e}"
        if not passed and err <= NOISE_FACTOR * noise:
            passed = True
            detail += f" (within {NOISE_FACTOR:g}x: the model's own rounding)"
    elif wants_float32:
        detail += f"; {NO_FLOAT32}"
    return Row("model", label, len(base[0]), worst_abs, worst_rel, tol, passed, detail)


NO_FLOAT32 = "no float32 run: the model does not fit in device memory in float32"


@functools.lru_cache(maxsize=2)
def references(model: str, dtype: str, device: str, steps: int, seed: int
               ) -> tuple[Trace, Trace | None]:
    """The eager traces a backend's model check is judged by: in the check's dtype, and (for a
    dtype below float32) the float32 run on the same weights, whose greedy tokens every run
    follows (None when it does not fit: ``NO_FLOAT32``, then eager's own tokens). Made once
    per process (a ``--model-only`` run checks every backend here)."""
    from pagedgen.runtime.engine.engine import Engine

    prompts = model_prompts(seed)
    dev = torch.device(device)
    cfg = model_config("eager", model, dtype, dev, seed, False)
    if cfg.torch_dtype(dev) == torch.float32:
        return trace(Engine(cfg), prompts, steps), None
    ref32 = float32_trace(dataclasses.replace(cfg, dtype="float32"), prompts, steps)
    return trace(Engine(cfg), prompts, steps, ref32 and ref32[1]), ref32


def float32_trace(cfg, prompts: list[list[int]], steps: int) -> Trace | None:
    """``trace`` of the eager float32 engine ``cfg`` makes, or None when it runs out of device
    memory (a model that fits only in its own dtype); its memory is freed either way."""
    from pagedgen.runtime.engine.engine import Engine

    try:
        return trace(Engine(cfg), prompts, steps)
    except torch.OutOfMemoryError:
        return None
    finally:
        gc.collect()  # the float32 engine's memory, before the next model is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_model(backend_name: str, model: str, dtype: str, device: torch.device, steps: int,
                seed: int, graphs: bool) -> Row:
    """The same prompts through the model with the backend and with eager, along the same
    tokens."""
    from pagedgen.runtime.engine.engine import Engine

    base, ref32 = references(model, dtype, str(device), steps, seed)
    eng = Engine(model_config(backend_name, model, dtype, device, seed, graphs))
    label = f"model {eng.src.name} {str(eng.dtype).removeprefix('torch.')}, " \
            f"CUDA graphs {'on' if graphs else 'off'}" + \
        (f", on {eng.backend_name}" if eng.backend_name != backend_name else "")
    got = trace(eng, model_prompts(seed), steps, (ref32 or base)[1])
    return judge(got, base, ref32, MODEL_TOL[eng.dtype], label, eng.dtype != torch.float32)


def check_tensor_parallel(backend_name: str, model: str, dtype: str, device: torch.device,
                          steps: int, seed: int, tp: int, graphs: bool) -> Row:
    """The model sharded over ``tp`` ranks (worker processes, NCCL on GPUs 0..tp-1 or gloo on
    the CPU) with the backend, against one process running eager attention, along the same
    tokens (``judge``)."""
    from pagedgen.runtime.models.loader import resolve_model

    base, ref32 = references(model, dtype, str(device), steps, seed)
    cfg = model_config(backend_name, model, dtype, device, seed, graphs, tp)
    got = data_parallel.run_on_ranks(trace_worker, (cfg, model_prompts(seed), steps,
                                                    (ref32 or base)[1]), cfg)
    got = ({k: torch.as_tensor(v) for k, v in got[0].items()}, got[1])
    label = f"tensor parallel {tp} ({resolve_model(model).name}, CUDA graphs " \
            f"{'on' if graphs else 'off'}) vs 1 rank eager"
    dt = cfg.torch_dtype(device)
    return judge(got, base, ref32, MODEL_TOL[dt], label, dt != torch.float32)


def prefix_cache_unused(model: str) -> str | None:
    """Why ``model``'s runs use no prefix cache (so no check of it applies), or None."""
    from pagedgen.runtime.models import registry
    from pagedgen.runtime.models.loader import resolve_model

    src = resolve_model(model)
    if registry.model_class(src.hf_config).state_specs(src.hf_config, 1):
        return (f"{src.name} has linear-attention layers, whose state a prefix's cached pages "
                "do not hold: its runs cache no prefixes")
    return None


def check_prefix_cache(backend_name: str, model: str, dtype: str, device: torch.device,
                       steps: int, seed: int, page_size: int) -> Row:
    """A prompt whose first blocks come from the prefix cache against an uncached run of the
    same prompt on the same backend, along the same tokens (``judge``: the uncached run is
    the base). The shared prefix ends mid-block (2.5 pages), so the cached run recomputes the
    prefix's last half page on top of two cached pages."""
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine

    cfg = EngineConfig(model=model, device=str(device), dtype=dtype, load_format="dummy",
                       seed=seed, backend=backend_name, block_size=page_size, num_blocks=64,
                       max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=8 * page_size,
                       async_scheduling=False)
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (5 * page_size // 2,), generator=g).tolist()
    warm, prompt = (prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 13))
    uncached = dataclasses.replace(cfg, prefix_caching=False)
    below = cfg.torch_dtype(device) != torch.float32
    ref32 = float32_trace(dataclasses.replace(uncached, backend="eager", dtype="float32"),
                          [prompt], steps) if below else None
    fresh = trace(Engine(uncached), [prompt], steps, ref32 and ref32[1])
    cached_engine = Engine(cfg)
    cached_engine.generate([warm], SamplingParams(max_tokens=1, ignore_eos=True))
    cached = trace(cached_engine, [prompt], steps, (ref32 or fresh)[1])
    hit = cached_engine.stats.prefix_hit_tokens  # the warm-up prompt found nothing cached
    row = judge(cached, fresh, ref32, MODEL_TOL[cached_engine.dtype],
                f"prefix-cached prefill, page {page_size}", below)
    row.passed = row.passed and hit == 2 * page_size
    row.detail = f"{hit} of {len(prompt)} prompt tokens from the cache; {row.detail}"
    return row
