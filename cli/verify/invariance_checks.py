"""`pagedgen verify --batch-invariance`: whether, in ``--batch-invariant`` mode, a request's
tokens and log-probabilities are bitwise what it gets run alone, whatever else the engine runs
(issue 97's checks, on the machine at hand).

A "needle" request (random ids, greedy, its token's log-probability at every step) runs alone
on a fresh engine: the reference. Then the same request
* inside random batches of 1 to 63 other requests, at a random place (prefix caching off);
* behind a cached prefix (another request sharing its first tokens ran first);
* split into other prefill chunks (``max_num_batched_tokens`` of 8 and 24 tokens);
* after a preemption (a KV cache too small for the batch: its tokens recomputed);
* sampled at temperature 1 with its own seed, alone and among others with theirs;
* on a GPU, eagerly (``enforce_eager``), alone and among others, against the decode steps'
  CUDA graphs of the reference.
Each row says how many runs gave the reference's exact tokens and log-probabilities, and the
largest log-probability difference along the tokens they share. Each check takes
``invariant=False`` to run the engine as it runs by default (the tests show the rows differ
then: the float32 sums of a matrix product follow the batch's rows).
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import torch

from pagedgen.cli.verify.report import BackendReport, Row
from pagedgen.cli.verify.runner import Check, single

NAME = "batch invariance"
NEEDLE = 48  # the needle's prompt tokens


def plan_invariance(device: torch.device, model: str, dtype: str, backend: str, cases: int,
                    steps: int, seed: int, quantization: str | None = None,
                    kv_cache_dtype: str = "auto") -> tuple[BackendReport, list[Check]]:
    """The report and its checks (each a task of its own; five, six on a GPU), in
    ``--batch-invariant`` mode (triton on a GPU, eager a row at a time on a CPU), or skipped
    with the mode's own reason where it cannot run (``batch_invariant.prepared``)."""
    from pagedgen.errors import PagedgenError
    from pagedgen.runtime.worker.batch_invariant import prepared

    options = {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    try:
        prepared(_config(device, model, dtype, backend, seed, options=options))
    except PagedgenError as e:
        return BackendReport(NAME, "skipped", str(e)), []
    args = (device, model, dtype, backend, steps, seed)
    q = {"options": options}
    checks = [Check([(partial(check_batches, **q), (*args, cases))], single),
              Check([(partial(check_prefix_cache, **q), args)], single),
              Check([(partial(check_chunks, **q), args)], single),
              Check([(partial(check_preemption, **q), args)], single),
              Check([(partial(check_seeded_sampling, **q), args)], single)]
    if device.type == "cuda":
        checks.append(Check([(partial(check_graphs, **q), (*args, cases))], single))
    return BackendReport(NAME, "checked", reference="the request run alone"), checks


def _config(device: torch.device, model: str, dtype: str, backend: str, seed: int,
            invariant: bool = True, options: dict[str, Any] | None = None, **kw: Any):
    """The checks' engine config (``options``: the run's own, e.g. its quantization; ``kw``:
    a check's)."""
    from pagedgen.runtime.config import EngineConfig

    base = dict(model=model, device=str(device), dtype=dtype, backend=backend, seed=seed,
                load_format="auto", max_num_seqs=64, max_num_batched_tokens=2048,
                max_model_len=512, num_blocks=1024, prefix_caching=False,
                batch_invariant=invariant)
    return EngineConfig(**{**base, **(options or {}), **kw})


def _needle(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(NEEDLE)]


def _run(eng: Any, prompts: list[list[int]], index: int, steps: int, sampled: bool = False
         ) -> tuple[list[int], list[float]]:
    """``prompts`` through ``eng`` at once; prompt ``index``'s tokens and their
    log-probabilities (greedy; ``sampled``: at temperature 1, each request its own seed)."""
    from pagedgen.runtime.config import SamplingParams

    seqs = [eng.add_request(p, SamplingParams(
        max_tokens=steps, ignore_eos=True, logprobs=0, temperature=1.0 if sampled else 0.0,
        seed=7 if i == index else 100 + i)) for i, p in enumerate(prompts)]
    eng.run()
    seq = seqs[index]
    return list(seq.output_token_ids), [float(e[0]) for e in seq.logprobs]


def _reference(args: tuple, invariant: bool, options: dict[str, Any] | None = None
               ) -> tuple[list[int], list[float], list[int], int]:
    """The needle alone on a fresh engine: (tokens, log-probabilities, needle, vocabulary)."""
    from pagedgen.runtime.engine.engine import Engine

    device, model, dtype, backend, steps, seed = args
    eng = Engine(_config(device, model, dtype, backend, seed, invariant, options))
    vocab = eng.src.hf_config.vocab_size
    needle = _needle(seed, vocab)
    return (*_run(eng, [needle], 0, steps), needle, vocab)


def _among_others(rng: random.Random, vocab: int, needle: list[int], most: int, longest: int
                  ) -> tuple[list[list[int]], int]:
    """The needle at a random place among 1 to ``most`` random prompts of 4 to ``longest - 1``
    tokens: (the prompts, the needle's index)."""
    others = [[rng.randrange(vocab) for _ in range(rng.randrange(4, longest))]
              for _ in range(rng.randrange(1, most + 1))]
    at = rng.randrange(len(others) + 1)
    return others[:at] + [needle] + others[at:], at


def _row(group: str, want: tuple[list[int], list[float]],
         runs: list[tuple[list[int], list[float]]], detail: str) -> Row:
    """How many ``runs`` equal ``want`` bit for bit, and the largest log-probability gap along
    the tokens each shares with it."""
    same = sum(r == want for r in runs)
    worst = 0.0
    for toks, lps in runs:
        shared = next((i for i, (a, b) in enumerate(zip(toks, want[0])) if a != b),
                      min(len(toks), len(want[0])))
        worst = max([worst] + [abs(a - b) for a, b in zip(lps[:shared], want[1][:shared])])
        if shared < len(want[0]):  # a token changed: as far as a difference can go
            worst = float("inf")
    return Row("model", group, len(runs), worst, worst, 0.0, same == len(runs),
               f"{same} of {len(runs)} bitwise as alone; {detail}")


def check_batches(device, model, dtype, backend, steps, seed, cases,
                  invariant: bool = True, most: int = 63,
                  options: dict[str, Any] | None = None) -> Row:
    """The needle among 1 to ``most`` random requests, at a random place, ``cases`` times."""
    from pagedgen.runtime.engine.engine import Engine

    args = (device, model, dtype, backend, steps, seed)
    toks, lps, needle, vocab = _reference(args, invariant, options)
    eng = Engine(_config(*args[:4], seed, invariant, options))
    rng = random.Random(seed + 1)
    runs, sizes = [], []
    for _ in range(cases):
        prompts, at = _among_others(rng, vocab, needle, most, 120)
        runs.append(_run(eng, prompts, at, steps))
        sizes.append(len(prompts))
    return _row("in random batches", (toks, lps), runs,
                f"batches of {min(sizes)}-{max(sizes)} requests")


def check_prefix_cache(device, model, dtype, backend, steps, seed,
                       invariant: bool = True,
                       options: dict[str, Any] | None = None) -> Row:
    """The needle behind a cached prefix: another request with its first 32 tokens first."""
    from pagedgen.runtime.engine.engine import Engine

    args = (device, model, dtype, backend, steps, seed)
    toks, lps, needle, vocab = _reference(args, invariant, options)
    eng = Engine(_config(*args[:4], seed, invariant, options,
                         prefix_caching=True))
    rng = random.Random(seed + 2)
    _run(eng, [needle[:32] + [rng.randrange(vocab) for _ in range(20)]], 0, 1)
    before = eng.stats.prefix_hit_tokens
    got = _run(eng, [needle], 0, steps)
    return _row("behind a cached prefix", (toks, lps), [got],
                f"{eng.stats.prefix_hit_tokens - before} prompt tokens from the cache")


def check_chunks(device, model, dtype, backend, steps, seed,
                 invariant: bool = True,
                 options: dict[str, Any] | None = None) -> Row:
    """The needle beside two others, its prompt in chunks of 8 and of 24 tokens."""
    from pagedgen.runtime.engine.engine import Engine

    args = (device, model, dtype, backend, steps, seed)
    toks, lps, needle, vocab = _reference(args, invariant, options)
    rng = random.Random(seed + 3)
    others = [[rng.randrange(vocab) for _ in range(30)] for _ in range(2)]
    runs = [_run(Engine(_config(*args[:4], seed, invariant, options,
                                max_num_batched_tokens=n, max_num_seqs=4)),
                 [others[0], needle, others[1]], 1, steps)
            for n in (8, 24)]
    return _row("in other prefill chunks", (toks, lps), runs, "chunks of 8 and 24 tokens")


def check_seeded_sampling(device, model, dtype, backend, steps, seed,
                          invariant: bool = True, trials: int = 2,
                          options: dict[str, Any] | None = None) -> Row:
    """The needle sampled at temperature 1 with its own seed, alone and among 1 to 15 others
    with theirs: the same draws."""
    from pagedgen.runtime.engine.engine import Engine

    args = (device, model, dtype, backend, steps, seed)
    eng = Engine(_config(*args[:4], seed, invariant, options))
    vocab = eng.src.hf_config.vocab_size
    needle = _needle(seed, vocab)
    want = _run(eng, [needle], 0, steps, sampled=True)
    rng = random.Random(seed + 5)
    runs = [_run(eng, *_among_others(rng, vocab, needle, 15, 60), steps, sampled=True)
            for _ in range(trials)]
    return _row("sampled with a seed", want, runs, "temperature 1, each request its seed")


def check_preemption(device, model, dtype, backend, steps, seed,
                     invariant: bool = True,
                     options: dict[str, Any] | None = None) -> Row:
    """The needle among six requests in pages of 8 that each grow by two pages more than the
    KV cache admitted them with: the scheduler preempts, the preempted recompute their tokens
    (the needle's first ``steps`` compared)."""
    from pagedgen.runtime.engine.engine import Engine

    args = (device, model, dtype, backend, steps, seed)
    toks, lps, needle, vocab = _reference(args, invariant, options)
    rng = random.Random(seed + 4)
    others = [[rng.randrange(vocab) for _ in range(NEEDLE)] for _ in range(5)]
    bs, pages = 8, NEEDLE // 8
    eng = Engine(_config(*args[:4], seed, invariant, options,
                         block_size=bs, num_blocks=4 * (pages + 1) + 1))
    got = _run(eng, others[:3] + [needle] + others[3:], 3, steps + 2 * bs)
    return _row("after preemptions", (toks, lps), [(got[0][:steps], got[1][:steps])],
                f"{eng.stats.num_preemptions} preemptions")


def check_graphs(device, model, dtype, backend, steps, seed, cases,
                 invariant: bool = True,
                 options: dict[str, Any] | None = None) -> Row:
    """The needle run eagerly (no CUDA graphs), alone and among 1 to 15 others ``cases``
    times, against its decode steps replayed in the graphs of the reference (a GPU's)."""
    from pagedgen.runtime.engine.engine import Engine

    args = (device, model, dtype, backend, steps, seed)
    toks, lps, needle, vocab = _reference(args, invariant, options)
    eng = Engine(_config(*args[:4], seed, invariant, options,
                         enforce_eager=True))
    rng = random.Random(seed + 6)
    runs = [_run(eng, [needle], 0, steps)]
    runs += [_run(eng, *_among_others(rng, vocab, needle, 15, 60), steps) for _ in range(cases)]
    return _row("eagerly against CUDA graphs", (toks, lps), runs,
                "alone and in batches, no graphs")
