"""A warm-up at start-up: a few short requests through the engine's own steps (prefills
alone; prefills beside decodes, whose rows then start at an odd offset; decodes alone, at
falling batch sizes), so that the kernel variants, autotuning and piecewise graphs a run's first
steps would make are made before the run and not inside it, where a fresh machine's first run
pays for them (``jit_monitor`` counts what is still made there). Nothing is special-cased: the
steps are the scheduler's, the kernels the run's (the caller's logits processors are not
asked for these requests). Then the engine forgets it: its counters, prefix cache and request
numbering start afresh.

On by default on CUDA (``EngineConfig.startup_warmup``); a CPU run compiles nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

from pagedgen.runtime.config import SamplingParams


class Engine(Protocol):
    """What the warm-up uses of ``engine.Engine`` (which imports this module)."""

    src: Any
    max_model_len: int
    processor_factory: Any

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...
    def step(self) -> list: ...
    def has_unfinished(self) -> bool: ...
    def reset_stats(self) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    def forget_requests(self) -> None: ...
    def set_processor_factory(self, factory: Any) -> None: ...


# (prompt lengths, new tokens) of the two waves: the second arrives after the first's prefill,
# whose longest prompt then decodes over more keys than one split of the decode kernel takes
FIRST = ((5, 17, 300), 6)
SECOND = ((3, 9, 33, 130, 250), 3)


def prompts(lengths: tuple[int, ...], vocab: int, longest: int) -> list[list[int]]:
    """Token ids for prompts of ``lengths`` (cut to ``longest``), distinct from the first
    token on, so no prompt is a cached prefix of another."""
    return [[(7 + 31 * i + j) % vocab for j in range(min(n, longest))]
            for i, n in enumerate(lengths)]


def warm_up(engine: Engine) -> int:
    """Run the warm-up's requests to their end on ``engine`` and reset what they counted;
    returns the steps it took."""
    vocab = engine.src.hf_config.vocab_size
    steps = 0
    factory = engine.processor_factory  # the caller's, for its own requests only
    engine.set_processor_factory(None)
    for lengths, new in (FIRST, SECOND):
        params = SamplingParams(max_tokens=new, ignore_eos=True)
        longest = max(1, engine.max_model_len - new)
        for ids in prompts(lengths, vocab, longest):
            engine.add_request(ids, params)
        engine.step()  # the first wave's prefills; then the second's beside its decodes
        steps += 1
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine.reset_stats()
    engine.reset_prefix_cache()
    engine.forget_requests()
    engine.set_processor_factory(factory)
    return steps
