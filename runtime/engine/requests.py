"""Whether a request can run on an engine: checked before it is queued (and, by the CLI, before
the model loads), so a bad line is a one-line error rather than a failed run."""

from __future__ import annotations

from pagedgen.runtime.config import SamplingParams


def check_request(prompt_token_ids, params: SamplingParams, max_model_len: int,
                  vocab_size: int, max_num_seqs: int | None, memory: str | None = None,
                  max_num_seqs_named: str = "--max-num-seqs") -> None:
    """Raise ValueError when a request cannot run: its prompt (a list or array of ids) is empty,
    has no room for an output token within ``max_model_len`` or holds an id outside the
    vocabulary, or its ``n`` samples need more sequences than ``max_num_seqs`` (None: the
    engine's own, checked when the request reaches it; ``max_num_seqs_named``: where that was
    set). ``memory``:
    why ``max_model_len`` is below the model's context, when the KV cache cut it."""
    params.validate()  # the line's fields over the run's defaults (e.g. ignore_eos)
    if not len(prompt_token_ids):
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids):,} tokens; " + (
            memory or f"the model's context is {max_model_len:,} tokens"))
    lo, hi = min(prompt_token_ids), max(prompt_token_ids)  # C loops, not a Python scan
    if lo < 0 or hi >= vocab_size:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")
    if max_num_seqs is not None and params.n > max_num_seqs:
        raise ValueError(f"n = {params.n} samples run as {params.n} sequences at once; "
                         f"{max_num_seqs_named} is {max_num_seqs}")


def text_setting(params: SamplingParams) -> str | None:
    """Why ``params`` need a tokenizer (a setting that works on text, and what to use
    instead), or None where they do not."""
    if params.stop:
        return "'stop' strings match text: use 'stop_token_ids'"
    if params.bad_words:
        return "'bad_words' are text: use 'logit_bias' on their token ids"
    if params.structured is not None:
        return "structured output constrains text"
    return None
