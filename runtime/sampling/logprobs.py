"""Log-probabilities of chosen tokens and of their top alternatives, computed on the device.

They are ``log_softmax`` of the model's float32 logits as the sampling controls, logits
processors and structured-output masks leave them (a constrained row's are those of its masked
distribution), before temperature, min-p, top-k and top-p. Only the rows that asked are computed:
a step whose requests ask for none does no extra work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pagedgen.runtime.quantization.invariant_gemm import by_rows

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - a torch without Triton
    HAVE_TRITON = False

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


if HAVE_TRITON:
    @triton.jit
    def _row_lse_kernel(X, Out, V, stride, BLOCK: tl.constexpr):
        """Row ``pid``'s log-sum-exp: a running max and sum per lane over its blocks in order,
        then the lanes combined (masked -inf values add nothing; a row of -inf gives -inf)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            x = tl.load(X + row * stride + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
            new = tl.maximum(m, x)
            alive = new > float("-inf")
            s = tl.where(alive, s * tl.exp(m - new) + tl.exp(x - new), 0.0)
            m = new
        top = tl.max(m, 0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), 0)
        tl.store(Out + row, tl.where(top > float("-inf"), top + tl.log(total), top))


def row_logsumexp(x: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """``log(sum(exp(x)))`` of each row of float32 ``x`` [R, V], as [R, 1]. On CUDA one
    program a row sums its blocks in one order, so a row's value is its own whatever the row
    count (torch's reduction spreads a row over several blocks when there are few rows: its
    order, and a log-probability's last bits, would follow the batch; ``--batch-invariant``
    found it). Elsewhere torch's a row at a time (a CPU's reduction over [R, V] also splits
    its rows by the row count: 6 of 171 rows moved in their last bit over 2-19 rows of 49,152;
    ``kernel``: the Triton kernel anyway, interpreted: tests)."""
    if not ((x.is_cuda if kernel is None else kernel) and HAVE_TRITON) or not x.numel():
        return by_rows(torch.logsumexp, x, -1, True)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _row_lse_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=1024)
    return out


def compute(logits: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs:
    """``logits`` [R, V], ``targets`` [R] → log-probabilities of the targets and the top ``k``.
    ``logit - logsumexp`` of the few values needed: no [R, V] log-softmax is written; a row's
    figures follow that row alone (``row_logsumexp``)."""
    logits = logits.float()
    lse = row_logsumexp(logits)
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
