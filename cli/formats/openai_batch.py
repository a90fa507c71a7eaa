"""OpenAI Batch API files: request lines in, batch output lines out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``). Its
output line is ``{"custom_id", "id", "response": {"status_code": 200, "request_id", "body"},
"error": null}`` with a ``chat.completion`` or ``text_completion`` body, as OpenAI writes it
(``custom_id`` first, so ``--resume`` reads it without parsing the line). Every line is
validated before the run starts, so error lines are never written.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pagedgen.cli.formats.records import entries
from pagedgen.errors import PagedgenError
from pagedgen.runtime.engine.sequence import FINISH_REASONS, REASONING_FINISH_REASONS
from pagedgen.runtime.inputs import structured
from pagedgen.runtime.inputs.request import (
    CHAT_OPTIONS,
    InputOptions,
    Request,
    check_sampling,
    near_miss,
    set_chat_options,
    set_prompt,
    set_sampling,
    set_template_kwargs,
    token_ids,
    user_fields,
)
from pagedgen.runtime.output.outputs import CompletionOutput, RequestOutput

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_LINE_FIELDS = {"custom_id", "method", "url", "body", "metadata"}
# body field -> our sampling field (top_k, ignore_eos and prompt_logprobs as vLLM takes them)
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
             "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
             "seed": "seed", "top_k": "top_k", "ignore_eos": "ignore_eos",
             "prompt_logprobs": "prompt_logprobs", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
             # vLLM's extra body fields
             **{f: f for f in ("repetition_penalty", "min_p", "min_tokens", "stop_token_ids",
                               "bad_words", "include_stop_str_in_output",
                               "skip_special_tokens", "spaces_between_special_tokens")}}
_IGNORED = {"model", "user", "store", "metadata", "service_tier"}  # nothing to do with them here
_DEFAULT_ONLY = {"stream": (False,), "echo": (False,), "best_of": (1,), "suffix": ("",),
                 "stream_options": ()}  # accepted at these values (or null) only
_BODY_FIELDS = {"chat": {"messages", "logprobs", "top_logprobs", "reasoning_effort",
                         "chat_template_kwargs", *CHAT_OPTIONS},
                "completions": {"prompt", "logprobs"}}


def is_batch_line(obj: Any, prompt_fields: Iterable[str]) -> bool:
    """Whether a line is an OpenAI batch line: a ``custom_id`` with a ``body`` or ``url``, or
    (its ``custom_id`` missing) an object ``body`` with a ``url`` and none of pagedgen's
    ``prompt_fields`` (its lines may carry any other field as metadata)."""
    if not isinstance(obj, dict):
        return False
    if "custom_id" in obj:
        return "body" in obj or "url" in obj
    return isinstance(obj.get("body"), dict) and "url" in obj \
        and not any(f in obj for f in prompt_fields)


def parse_line(obj: Any, index: int, lineno: int, where: str, opts: InputOptions) -> Request:
    if not isinstance(obj, dict):
        raise PagedgenError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise PagedgenError(f"{where}: 'custom_id' must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise PagedgenError(f"{where}: 'method' must be \"POST\"")
    endpoint = ENDPOINTS.get(obj.get("url"))
    if endpoint is None:
        raise PagedgenError(f"{where}: 'url' must be one of {', '.join(ENDPOINTS)} "
                            f"(got {obj.get('url')!r})")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise PagedgenError(f"{where}: 'body' must be an object")
    req = Request(index=index, line=lineno, id=cid, endpoint=endpoint)
    req.metadata = user_fields(obj, _LINE_FIELDS, where, opts)
    _check_body_fields(body, endpoint, where)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise PagedgenError(f"{where}: body 'model' must be a string")
    if opts.served_model_name is not None and model != opts.served_model_name:
        raise PagedgenError(f"{where}: body 'model' is {model!r}; this run serves "
                            f"{opts.served_model_name!r} (--served-model-name)")
    req.model = model
    if endpoint == "chat":
        set_prompt(req, "messages", _messages(body.get("messages"), where), where,
                   "body 'messages'")
        set_template_kwargs(req, body.get("chat_template_kwargs"), where,
                            "body 'chat_template_kwargs'")
        if body.get("reasoning_effort") is not None:  # OpenAI's field: a template variable
            set_template_kwargs(req, {"reasoning_effort": body["reasoning_effort"]}, where,
                                "body")
        set_chat_options(req, body, where, "body ")
    else:
        _set_completion_prompt(req, body.get("prompt"), where)
        if not opts.completions_reasoning:  # as vLLM: no reasoning parser on completions
            req.overrides = {**(req.overrides or {}), "reasoning": False}
    if "max_tokens" in body and "max_completion_tokens" in body \
            and body["max_tokens"] != body["max_completion_tokens"]:
        raise PagedgenError(f"{where}: body 'max_tokens' and 'max_completion_tokens' differ")
    for name, ours in _SAMPLING.items():
        if name in body:
            set_sampling(req, ours, body[name], where, f"body '{name}'")
    _set_logprobs(req, body, endpoint, where)
    structured.set_structured(req, body, where, "body ")
    check_sampling(req, where)
    return req


def _check_body_fields(body: dict, endpoint: str, where: str) -> None:
    known = {*_SAMPLING, *_IGNORED, *_DEFAULT_ONLY, *_BODY_FIELDS[endpoint], *structured.FIELDS,
             *structured.OLD_FIELDS}  # the old ones: refused with their new name
    for name, value in body.items():
        if name in _DEFAULT_ONLY and value is not None and value not in _DEFAULT_ONLY[name]:
            raise PagedgenError(f"{where}: body '{name}' = {value!r} is not supported")
        if name in known:
            continue
        other = next((url for url, e in ENDPOINTS.items() if name in _BODY_FIELDS[e]), None)
        if other is not None:
            raise PagedgenError(f"{where}: body '{name}' belongs to {other} requests")
        hint = near_miss(name, known)
        raise PagedgenError(f"{where}: body '{name}' " + (
            f"is unknown (did you mean '{hint}'?)" if hint else "is not supported by pagedgen"))


def _messages(value: Any, where: str) -> Any:
    """Chat messages with the ``developer`` role as ``system``, for the chat template
    (``set_prompt`` joins text content parts and refuses others)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        return value  # set_prompt names the problem
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in value]


def _set_completion_prompt(req: Request, prompt: Any, where: str) -> None:
    """A text prompt or a list of token ids (a one-element list of either also works; more
    prompts per line do not: write one line each)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise PagedgenError(f"{where}: body 'prompt' holds {len(prompt)} prompts; write one "
                            "line per prompt")
    if isinstance(prompt, list):
        req.prompt_token_ids = token_ids(prompt, where, "body 'prompt'")
    else:
        set_prompt(req, "prompt", prompt, where, "body 'prompt'")


def _set_logprobs(req: Request, body: dict, endpoint: str, where: str) -> None:
    """Chat: ``logprobs`` true with ``top_logprobs`` alternatives; completions: ``logprobs`` is
    the number of alternatives."""
    lp = body.get("logprobs")
    if endpoint == "completions":
        set_sampling(req, "logprobs", lp, where, "body 'logprobs'")
        return
    top = body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise PagedgenError(f"{where}: body 'logprobs' must be true or false")
    if top is not None and not lp:
        raise PagedgenError(f"{where}: body 'top_logprobs' needs 'logprobs': true")
    if lp:
        set_sampling(req, "logprobs", 0 if top is None else top, where, "body 'top_logprobs'")


# ---- output ---------------------------------------------------------------------------------

def record(out: RequestOutput, model: str = "") -> dict[str, Any]:
    """The batch output line for one request (all its samples finished); ``model``: the name
    to report when the request's body named none (the served name, else the model's)."""
    req = out.request
    chat = req.endpoint == "chat"
    body: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{req.index}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": req.model or model,
        "choices": [_chat_choice(c) if chat else _completion_choice(c) for c in out.outputs],
        "usage": {"prompt_tokens": out.num_prompt_tokens,
                  "completion_tokens": out.num_output_tokens,
                  "total_tokens": out.num_prompt_tokens + out.num_output_tokens}}
    if out.prompt_token_logprobs is not None:  # vLLM's extension
        body["prompt_logprobs"] = [None] + entries(out.prompt_token_logprobs)
    line = {"custom_id": req.id, "id": f"batch_req_{req.index}",
            "response": {"status_code": 200, "request_id": f"req_{req.index}", "body": body},
            "error": None}
    if req.metadata is not None:
        line["metadata"] = req.metadata
    return line


def error_record(req: Any) -> dict[str, Any]:
    """The batch output line of a request that cannot run (``req.error``), as OpenAI's batch
    API writes a failed line: no response, an error with a code and a message."""
    return {"custom_id": req.id, "id": f"batch_req_{req.index}", "response": None,
            "error": {"code": "invalid_request", "message": req.error}}


def is_complete(obj: dict[str, Any]) -> bool:
    """Whether a parsed output line is a whole batch output record (``--resume`` keeps those:
    an error record too)."""
    error = obj.get("error")
    if obj.get("response") is None and isinstance(error, dict):
        return isinstance(obj.get("custom_id"), str) and isinstance(error.get("message"), str)
    response = obj.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    return (isinstance(obj.get("custom_id"), str) and obj.get("error") is None
            and isinstance(body, dict) and isinstance(body.get("choices"), list)
            and bool(body["choices"]) and all(isinstance(c, dict) and c.get("finish_reason")
                                              in FINISH_REASONS for c in body["choices"]))


def _chat_choice(c: CompletionOutput) -> dict[str, Any]:
    logprobs = None
    if c.token_logprobs is not None:
        def item(b: bytes, lp: float) -> dict[str, Any]:
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp,
                    "bytes": list(b)}

        logprobs = {"content": [{**item(e.token_bytes, e.logprob), "top_logprobs": [
            item(b, lp) for b, (_, lp) in zip(e.top_bytes, e.top)]} for e in c.token_logprobs],
                    "refusal": None}
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.reasoning_content is not None:  # vLLM's field; no answer began: content null
        message["reasoning_content"] = c.reasoning_content
        if c.finish_reason in REASONING_FINISH_REASONS:
            message["content"] = None
    return {"index": c.index, "message": message, "logprobs": logprobs,
            "finish_reason": _openai_reason(c.finish_reason)}


def _openai_reason(reason: str) -> str:
    """OpenAI's finish reasons: a sample that ended in its reasoning is "stop" or "length"
    there (its message's content null says the rest)."""
    return reason.removesuffix("_in_reasoning")


def _completion_choice(c: CompletionOutput) -> dict[str, Any]:
    logprobs = None
    if c.token_logprobs is not None:
        tokens = [e.token for e in c.token_logprobs]
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        logprobs = {"tokens": tokens, "token_logprobs": [e.logprob for e in c.token_logprobs],
                    "top_logprobs": [dict(zip(e.top_tokens, (lp for _, lp in e.top)))
                                     for e in c.token_logprobs],
                    "text_offset": offsets}
    out = {"index": c.index, "text": c.text, "logprobs": logprobs,
           "finish_reason": _openai_reason(c.finish_reason)}
    if c.reasoning_content is not None:
        out["reasoning_content"] = c.reasoning_content
    return out
