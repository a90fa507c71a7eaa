"""The logits-processor hook: per-sample processors change their rows before sampling, with
async scheduling kept where a processor does not read its tokens."""

from __future__ import annotations

import torch

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.sequence import PENDING_TOKEN
from pagedgen.runtime.sampling.processors import LogitsProcessor

PROMPTS = [[256, 72, 101, 108], [256, 87, 111], [256, 1, 2, 3, 4, 5], [256, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class NoRepeats(LogitsProcessor):
    """Never the same token twice in a sample: it reads the tokens sampled so far."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def __call__(self, output_token_ids, logits: torch.Tensor) -> None:
        self.seen.append(list(output_token_ids))
        if output_token_ids:
            logits[list(output_token_ids)] = float("-inf")


class Ban(LogitsProcessor):
    """Never these tokens: a fixed mask that needs no tokens."""

    needs_tokens = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __call__(self, output_token_ids, logits: torch.Tensor) -> None:
        logits[self.tokens] = float("-inf")


def run(factory=None, n: int = 1) -> tuple[list[list[int]], Engine]:
    eng = Engine(EngineConfig(device="cpu", backend="sdpa", load_format="dummy", block_size=4,
                              max_num_seqs=8), processor_factory=factory)
    params = SamplingParams(**{**vars(GREEDY), "n": n})
    seqs = [eng.add_request(p, params, request=i) for i, p in enumerate(PROMPTS)]
    eng.run()
    outs = [s.output_token_ids for seq in seqs for s in (seq.samples or [seq])]
    return outs, eng


def test_no_processor_changes_nothing_and_steps_still_launch_ahead():
    plain, eng = run()
    same, eng2 = run(lambda request, params, i: [])
    assert same == plain
    assert eng2.stats.overlapped_steps == eng.stats.overlapped_steps > 0


def test_a_processor_that_reads_tokens_sees_them_all_and_applies():
    plain, _ = run()
    made: list[NoRepeats] = []

    def factory(request, params, i):
        made.append(NoRepeats())
        return [made[-1]]

    outs, eng = run(factory, n=2)
    assert len(made) == len(outs) == 2 * len(PROMPTS)  # one per sample
    for out, proc in zip(outs, made):
        assert len(set(out)) == len(out)  # applied: no token twice
        assert all(PENDING_TOKEN not in seen for seen in proc.seen)  # real tokens, in order
        assert [len(s) for s in proc.seen] == list(range(len(out)))
    assert any(len(set(p)) < len(p) for p in plain)  # the dummy model does repeat itself
    # steps still launch ahead: the last step's tokens are read before this one samples
    assert eng.stats.overlapped_steps > 0


def test_a_fixed_mask_keeps_async_scheduling_and_only_its_rows_change():
    plain, eng = run()
    banned = sorted({t for out in plain[:2] for t in out})

    def factory(request, params, i):  # the first two prompts only
        return [Ban(banned)] if request in (0, 1) else []

    outs, eng2 = run(factory)
    assert not set(banned) & {t for out in outs[:2] for t in out}
    assert outs[2:] == plain[2:]
    assert eng2.stats.overlapped_steps > 0
