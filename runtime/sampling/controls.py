"""Sampling controls on the device, for the whole batch at once, with vLLM's meanings.

Applied to the float32 logits of a step after the model (and any logits processors) and before
the sampler, in vLLM's order:

1. ``min_tokens``: while a sample has fewer output tokens, its EOS and ``stop_token_ids`` are
   banned (-inf).
2. ``logit_bias``: added to the named tokens' logits.
3. ``bad_words``: each word tokenized as vLLM does (as it is, and after a space); a word of one
   token is banned always, a longer one's last token when the output ends with the others.
4. Penalties: ``repetition_penalty`` over the tokens of the prompt and the output (a positive
   logit divided by it, a negative one multiplied), then ``frequency_penalty`` x each token's
   count in the output and ``presence_penalty`` for each token present, subtracted.

(``min_p`` belongs to the sampler, after the temperature: ``sampler.py``.) Rows without
controls pay nothing; a step whose rows have none does no work. The rows' token ids go to the
device once per step as one padded tensor; counts are a scatter over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedgen.transfer import to_device


def apply(logits: torch.Tensor, seqs: Sequence[Any], eos_ids: set[int]) -> None:
    """Apply the rows' controls to ``logits`` [rows, vocab] in place. Sequences are read for
    ``params``, ``num_output_tokens``, ``output_token_ids``, ``prompt_token_ids`` and
    ``bad_words_ids`` (the tokenized bad words, set when the request was added); call it only
    for a step where some sequence has controls (``Sequence.controlled``)."""
    vocab = logits.shape[1]
    device = logits.device
    ban_rows, ban_cols, bias_rows, bias_cols, bias_vals = [], [], [], [], []
    penalized = []
    for row, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            for t in (*eos_ids, *p.stop_token_ids):
                if t < vocab:
                    ban_rows.append(row)
                    ban_cols.append(t)
        for t, b in (p.logit_bias or {}).items():
            if t < vocab:
                bias_rows.append(row)
                bias_cols.append(t)
                bias_vals.append(b)
        for word in getattr(s, "bad_words_ids", ()):
            out = s.output_token_ids
            if word[-1] < vocab and (len(word) == 1 or (
                    len(out) >= len(word) - 1
                    and list(out[len(out) - len(word) + 1:]) == word[:-1])):
                ban_rows.append(row)
                ban_cols.append(word[-1])
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            penalized.append(row)
    if ban_rows:
        logits[to_device(ban_rows, torch.long, device),
               to_device(ban_cols, torch.long, device)] = float("-inf")
    if bias_rows:
        logits.index_put_((to_device(bias_rows, torch.long, device),
                           to_device(bias_cols, torch.long, device)),
                          to_device(bias_vals, torch.float32, device), accumulate=True)
    if penalized:
        _penalize(logits, [seqs[r] for r in penalized], penalized)


def _token_counts(lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab] float32 counts of each list's tokens (one padded upload, one
    scatter; padding goes to an extra column that is dropped)."""
    width = max((len(x) for x in lists), default=0)
    flat = [t for x in lists for t in (*x, *([vocab] * (width - len(x))))]
    ids = to_device(flat, torch.long, device).view(len(lists), width)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _penalize(logits: torch.Tensor, seqs: list[Any], rows: list[int]) -> None:
    vocab, device = logits.shape[1], logits.device
    idx = to_device(rows, torch.long, device)
    x = logits[idx]
    out_counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)
    rep = [s.params.repetition_penalty for s in seqs]
    if any(r != 1.0 for r in rep):
        seen = _token_counts([s.prompt_token_ids for s in seqs], vocab, device) > 0
        seen |= out_counts > 0
        r = to_device(rep, torch.float32, device)[:, None].expand_as(x)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    freq = to_device([s.params.frequency_penalty for s in seqs], torch.float32, device)
    pres = to_device([s.params.presence_penalty for s in seqs], torch.float32, device)
    x = x - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).float()
    logits[idx] = x


def bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as vLLM finds them: the word as it is, and after a space when
    that gives other tokens of the same count (a word inside a text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced):
            if ids and ids not in out and (ids is plain or (
                    len(ids) == len(plain) and ids[0] != plain[0])):
                out.append(ids)
    return out
