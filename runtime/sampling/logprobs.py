"""Log-probabilities of chosen tokens and of their top alternatives, computed on the device.

They are ``log_softmax`` of the model's float32 logits as the sampling controls, logits
processors and structured-output masks leave them (a constrained row's are those of its masked
distribution), before temperature, min-p, top-k and top-p. Only the rows that asked are computed:
a step whose requests ask for none does no extra work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# (logprob of the token, [[token id, logprob], ...] of the top k alternatives, best first,
# the token's rank in the vocabulary: 1 + the tokens of a higher logprob)
Entry = tuple[float, list[list], int]
ROWS_PER_PASS = 512  # prompt rows per logits pass: [512, vocab] float32 at a time


@dataclass
class Logprobs:
    """Per row: the target token's log-probability, the top ``k`` (id, log-probability) and
    the target's rank."""

    chosen: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, k] int64
    top_lps: torch.Tensor  # [R, k] float32
    rank: torch.Tensor  # [R] int64

    def to_host(self) -> Logprobs:
        """Non-blocking copies (read them once the step's event has completed)."""
        return Logprobs(*(getattr(self, f).to("cpu", non_blocking=True) for f in FIELDS))

    def entries(self, ks: list[int]) -> list[Entry]:
        """One entry per row, keeping ``ks[row]`` of the top alternatives."""
        chosen, ids, lps = self.chosen.tolist(), self.top_ids.tolist(), self.top_lps.tolist()
        return [(c, [[i, lp] for i, lp in zip(ids[r][:k], lps[r][:k])], rank)
                for r, (c, k, rank) in enumerate(zip(chosen, ks, self.rank.tolist()))]


FIELDS = tuple(f.name for f in fields(Logprobs))


def compute(logits: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs:
    """``logits`` [R, V], ``targets`` [R] → log-probabilities of the targets and the top ``k``.
    ``logit - logsumexp`` of the few values needed: no [R, V] log-softmax is written."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    top, top_ids = logits.topk(k, dim=-1)
    target = logits.gather(1, targets[:, None])
    return Logprobs((target - lse)[:, 0], top_ids, top - lse, (logits > target).sum(-1) + 1)


def of_hidden(hidden: torch.Tensor, targets: torch.Tensor, k: int, compute_logits) -> Logprobs:
    """Like :func:`compute` from hidden states, ``ROWS_PER_PASS`` rows at a time (a prompt of
    thousands of tokens never holds all its logits at once)."""
    parts = [compute(compute_logits(hidden[i:i + ROWS_PER_PASS]),
                     targets[i:i + ROWS_PER_PASS], k)
             for i in range(0, hidden.shape[0], ROWS_PER_PASS)]
    if len(parts) == 1:
        return parts[0]
    return Logprobs(*(torch.cat([getattr(p, f) for p in parts]) for f in FIELDS))
