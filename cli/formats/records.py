"""Output lines in pagedgen's format, from finished sequences.

A request's line is made when all its samples have finished. ``id`` comes first (``--resume``
reads it from there); a request with ``n`` > 1 carries ``choices``; log-probabilities and the
user's own fields (``metadata``) appear only when the line has them.
"""

from __future__ import annotations

from typing import Any

from pagedgen.runtime.engine.sequence import FINISH_REASONS, REASONING_FINISH_REASONS
from pagedgen.runtime.output.outputs import CompletionOutput, RequestOutput, TokenLogprob


def record(out: RequestOutput) -> dict[str, Any]:
    """pagedgen's output line for one request."""
    req = out.request
    line: dict[str, Any] = {"id": req.id, "prompt": out.prompt,
                            "num_prompt_tokens": out.num_prompt_tokens}
    if out.prompt_token_logprobs is not None:
        line["prompt_logprobs"] = [None] + entries(out.prompt_token_logprobs)
    if out.n == 1:
        line.update(choice(out.outputs[0]))
    else:
        line["choices"] = [{"index": c.index, **choice(c)} for c in out.outputs]
    if req.metadata is not None:
        line["metadata"] = req.metadata
    return line


def choice(c: CompletionOutput) -> dict[str, Any]:
    out = {"text": c.text, "token_ids": c.token_ids, "num_output_tokens": c.num_output_tokens,
           "finish_reason": c.finish_reason}
    if c.reasoning_content is not None:  # a reasoning model's thinking, apart from its answer
        out["reasoning_content"] = c.reasoning_content
    if c.token_logprobs is not None:
        out["logprobs"] = entries(c.token_logprobs)
    return out


def error_record(req: Any) -> dict[str, Any]:
    """The line of a request that cannot run (``req.error``, naming its file and line)."""
    line: dict[str, Any] = {"id": req.id, "error": req.error}
    if req.metadata is not None:
        line["metadata"] = req.metadata
    return line


def is_complete(obj: dict[str, Any]) -> bool:
    """Whether a parsed output line is a whole pagedgen record (``--resume`` keeps those: an
    error record too)."""
    if "id" in obj and isinstance(obj.get("error"), str) and "prompt" not in obj:
        return True
    if "id" not in obj or not isinstance(obj.get("prompt"), str) \
            or not isinstance(obj.get("num_prompt_tokens"), int):
        return False
    choices = obj["choices"] if "choices" in obj else [obj]
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and isinstance(c.get("text"), str)
        and isinstance(c.get("token_ids"), list)
        and c.get("finish_reason") in FINISH_REASONS + REASONING_FINISH_REASONS
        for c in choices)


def entries(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """``{"token_id", "token", "logprob", "top": [[id, logprob], ...], "top_tokens": [...]}``
    per token; ``token`` and ``top_tokens`` are the tokens' text (their bytes as UTF-8, U+FFFD
    for part of a character, as OpenAI's lines give it)."""
    return [{"token_id": e.token_id, "token": e.token, "logprob": e.logprob, "top": e.top,
             "top_tokens": e.top_tokens} for e in logprobs]
