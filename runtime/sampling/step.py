"""One step's sampling, from the logits of the rows that sample to their tokens: the rows'
sampling controls (``controls.py``) and logits processors, the seeded sampler (rank 0's tokens
on every rank under -tp), and the log-probabilities of the rows that ask for them. Sequences
are read for their ``params``, ``seed``, ``num_output_tokens``, ``output_token_ids``,
``prompt_token_ids``, ``bad_words_ids``, ``controlled``, ``logits_processors``, ``grammar``
and ``is_finished``. The grammar masks come last: nothing before them can put a forbidden
token back. A row they leave no token at all (the grammar's tokens all forbidden by
``bad_words`` or a processor) reads -1 on the host: its sample ends ``unsatisfiable``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.profiling import scope
from pagedgen.runtime.sampling import controls, logprobs, processors
from pagedgen.runtime.sampling.logprobs import Logprobs
from pagedgen.runtime.sampling.sampler import SamplingBatch, sample
from pagedgen.runtime.sampling.structured import Grammars
from pagedgen.transfer import to_device


@dataclass
class Sampled:
    tokens: torch.Tensor  # [rows] on the device
    logprobs: Logprobs | None = None  # of the rows at ``logprob_rows``
    logprob_rows: list[int] = field(default_factory=list)
    # [rows] bool on the device, in steps with grammar rows: the rows whose every token was
    # forbidden (the grammar's mask and the controls together allow none)
    dead: torch.Tensor | None = None

    def host_tokens(self) -> torch.Tensor:
        """The tokens as the host reads them: -1 in a dead row (its sample cannot go on; the
        device's tokens stay valid ids for the next step's input)."""
        return self.tokens if self.dead is None else torch.where(self.dead, -1, self.tokens)


@dataclass
class SamplingPlan:
    """A step's sampling with the sequences read: controls and processors queued on
    ``logits``, the grammar rows and the sampler's settings taken, so the engine may change
    the sequences (this step's placeholders) before ``finish`` masks and samples."""

    logits: torch.Tensor
    grammar_rows: list[tuple[int, Any, list[int]]]
    batch: SamplingBatch
    logprob_rows: list[int]
    top_logprobs: int


def plan_sampling(logits: torch.Tensor, seqs: Sequence[Any], device: torch.device,
                  with_processors: bool, eos_ids: set[int] = frozenset(),
                  grammars: Grammars | None = None) -> SamplingPlan:
    """Everything of a step's sampling that reads ``seqs`` (one row of ``logits`` each, in
    float32 or the model's dtype: upcast here when controls, processors or grammars will
    change them, else where the sampler needs it); ``with_processors``: whether any sequence
    may have processors; ``eos_ids``: the tokens ``min_tokens`` holds back; ``grammars``: the
    run's compiled constraints (None: no sequence has one)."""
    controlled = any(s.controlled for s in seqs)
    processed = [(i, s.logits_processors, s.output_token_ids)
                 for i, s in enumerate(seqs) if s.logits_processors] if with_processors else []
    grammar_rows = []
    if grammars is not None:  # the tokens so far, as they are now
        grammar_rows = [(i, s.grammar, list(s.output_token_ids)) for i, s in enumerate(seqs)
                        if s.grammar is not None and not s.is_finished]
    if controlled or processed or grammar_rows:  # what changes logits works on float32 ones
        logits = logits.float()
    if controlled:
        with scope("sampling_controls"):
            controls.apply(logits, seqs, eos_ids)
    if processed:
        with scope("logits_processors"):
            processors.apply(logits, processed)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    return SamplingPlan(logits, grammar_rows, sampling_batch(seqs, device, controlled), rows,
                        max((seqs[r].params.logprobs for r in rows), default=0))


def finish_sampling(plan: SamplingPlan, device: torch.device, tp,
                    grammars: Grammars | None = None, fused: bool | None = None) -> Sampled:
    """The planned step's grammar masks (the last change to the logits: nothing before them
    can put a forbidden token back), its tokens and the log-probabilities asked for; ``tp``:
    the tensor-parallel group whose rank 0 decides; ``fused``: the one-kernel sampler (None:
    where it runs)."""
    logits = plan.logits
    dead = None
    if plan.grammar_rows:
        with scope("structured_output"):
            grammars.apply(logits, plan.grammar_rows)
            # a grammar's mask beside bad_words (or a processor) may leave no token at all
            dead = torch.isneginf(logits).all(-1)
    with scope("sampling"):
        # every rank has the same logits; rank 0's tokens keep the ranks in lockstep
        out = Sampled(tp.broadcast(sample(logits, plan.batch, fused)), dead=dead)
    out.logprob_rows = rows = plan.logprob_rows
    if rows:
        with scope("logprobs"):
            if len(rows) == logits.shape[0]:
                out.logprobs = logprobs.compute(logits, out.tokens, plan.top_logprobs)
            else:
                idx = to_device(rows, torch.long, device)
                out.logprobs = logprobs.compute(logits[idx], out.tokens[idx], plan.top_logprobs)
    return out


def sampling_batch(seqs: Sequence[Any], device: torch.device,
                   controlled: bool = True) -> SamplingBatch:
    """``controlled``: whether a row may have min_p (else it is not read)."""
    p = [s.params for s in seqs]
    return SamplingBatch.build([x.temperature for x in p], [x.top_k for x in p],
                               [x.top_p for x in p], [s.seed for s in seqs],
                               [s.num_output_tokens for s in seqs], device,
                               [x.min_p for x in p] if controlled else None)
