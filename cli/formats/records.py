"""Output lines in pagedgen's format, from finished sequences.

A request's line is made when all its samples have finished. ``id`` comes first (``--resume``
reads it from there); a request with ``n`` > 1 carries ``choices``; log-probabilities and the
user's own fields (``metadata``) appear only when the line has them.
"""

from __future__ import annotations

from typing import Any

from pagedgen.runtime.engine.sequence import FINISH_REASONS, Sequence


def record(engine, samples: list[Sequence]) -> dict[str, Any]:
    """pagedgen's output line for one request."""
    first = samples[0]
    req = first.request
    line: dict[str, Any] = {
        "id": req.id,
        "prompt": req.prompt if req.prompt is not None
        else engine.tokenizer.decode(first.prompt_token_ids),
        "num_prompt_tokens": first.num_prompt_tokens}
    if first.prompt_logprobs is not None:
        line["prompt_logprobs"] = [None] + entries(first.prompt_token_ids[1:],
                                                   first.prompt_logprobs, engine.tokenizer)
    if first.samples is None:
        line.update(choice(engine, first))
    else:
        line["choices"] = [{"index": s.sample_index, **choice(engine, s)} for s in samples]
    if req.metadata is not None:
        line["metadata"] = req.metadata
    return line


def choice(engine, seq: Sequence) -> dict[str, Any]:
    out = {"text": engine.output_text(seq), "token_ids": seq.output_token_ids,
           "num_output_tokens": seq.num_output_tokens, "finish_reason": seq.finish_reason}
    if seq.logprobs is not None:
        out["logprobs"] = entries(seq.output_token_ids, seq.logprobs, engine.tokenizer)
    return out


def is_complete(obj: dict[str, Any]) -> bool:
    """Whether a parsed output line is a whole pagedgen record (``--resume`` keeps those)."""
    if "id" not in obj or not isinstance(obj.get("prompt"), str) \
            or not isinstance(obj.get("num_prompt_tokens"), int):
        return False
    choices = obj["choices"] if "choices" in obj else [obj]
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and isinstance(c.get("text"), str)
        and isinstance(c.get("token_ids"), list) and c.get("finish_reason") in FINISH_REASONS
        for c in choices)


def entries(token_ids: list[int], logprobs: list, tokenizer=None) -> list[dict[str, Any]]:
    """``{"token_id", "token", "logprob", "top": [[id, logprob], ...], "top_tokens": [...]}``
    per token; ``token`` and ``top_tokens`` are the tokens' text (their bytes as UTF-8, U+FFFD
    for part of a character, as OpenAI's lines give it), where there is a ``tokenizer``."""
    if tokenizer is None:
        return [{"token_id": t, "logprob": lp, "top": top}
                for t, (lp, top) in zip(token_ids, logprobs)]

    def text(t: int) -> str:
        return token_text(tokenizer, t)

    return [{"token_id": t, "token": text(t), "logprob": lp, "top": top,
             "top_tokens": [text(i) for i, _ in top]}
            for t, (lp, top) in zip(token_ids, logprobs)]


def token_text(tokenizer, token_id: int) -> str:
    """One token's text: its bytes as UTF-8, U+FFFD for a part of a character."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
