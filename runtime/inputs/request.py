"""One input line as a request, and the field rules both input formats share (pagedgen's own
lines and OpenAI batch lines): prompt kinds, sampling fields, users' own fields."""

from __future__ import annotations

import dataclasses
import json
from array import array
from dataclasses import dataclass
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import SamplingParams, type_error

# a line's sampling fields, each with its type in words for errors (the field's type itself is
# SamplingParams's, checked by pydantic: ``config.type_error``); null means "not set"
SAMPLING_FIELDS: dict[str, str] = {
    "max_tokens": "an integer",
    "temperature": "a number",
    "top_p": "a number",
    "top_k": "an integer",
    "seed": "an integer",
    "stop": "a string or a list of strings",
    "ignore_eos": "true or false",
    "n": "an integer",
    "logprobs": "an integer",
    "prompt_logprobs": "an integer",
    "presence_penalty": "a number",
    "frequency_penalty": "a number",
    "repetition_penalty": "a number",
    "min_p": "a number",
    "logit_bias": "an object of token id: bias",
    "min_tokens": "an integer",
    "stop_token_ids": "a list of integers",
    "bad_words": "a list of strings",
    "include_stop_str_in_output": "true or false",
    "skip_special_tokens": "true or false",
    "spaces_between_special_tokens": "true or false",
}


BAD_LINE_CHOICES = ("error", "stop")


@dataclass(frozen=True)
class InputOptions:
    """How lines are read: which fields hold the prompt, and what happens to other fields."""

    prompt_field: str = "prompt"
    messages_field: str = "messages"
    strict_fields: bool = False  # unknown fields are errors instead of output metadata
    served_model_name: str | None = None  # OpenAI lines' body "model" must equal it
    # the run names a reasoning parser: it splits OpenAI /v1/completions bodies' outputs too
    completions_reasoning: bool = False
    # a line that cannot run: "error" (an error record in its place, the run goes on:
    # `generate`'s default) or "stop" (the first one ends the run before anything loads)
    on_bad_line: str = "stop"

    def __post_init__(self) -> None:
        if self.on_bad_line not in BAD_LINE_CHOICES:
            raise PagedgenError(f"--on-bad-line {self.on_bad_line}: choose "
                                f"{' or '.join(BAD_LINE_CHOICES)}")
        for option, name in (("--prompt-field", self.prompt_field),
                             ("--messages-field", self.messages_field)):
            if not name or name == "prompt_token_ids" or name == "id" \
                    or name in SAMPLING_FIELDS:
                raise PagedgenError(f"{option} must name a field of its own, not {name!r}")
        if self.prompt_field == self.messages_field:
            raise PagedgenError(f"--prompt-field and --messages-field both name "
                                f"{self.prompt_field!r}: a field holds a text prompt or "
                                "messages, not both")

    @property
    def prompt_fields(self) -> dict[str, str]:
        """A pagedgen line's prompt fields (as these options name them) and their kinds."""
        return {self.prompt_field: "prompt", "prompt_token_ids": "prompt_token_ids",
                self.messages_field: "messages"}


@dataclass(slots=True)
class Request:
    """One input line. ``prompt_token_ids`` holds the tokenized prompt once the file's prompts
    are tokenized, whatever the line gave."""

    index: int  # position among the file's requests
    line: int  # 1-based line number
    id: Any  # pagedgen lines: "id" (default: index); OpenAI lines: "custom_id"
    prompt: str | None = None
    prompt_token_ids: array | None = None
    messages: list[dict] | None = None
    overrides: dict[str, Any] | None = None  # per-line sampling fields
    metadata: Any = None  # the user's own fields, carried into the output line
    # chat lines: more chat-template variables (``chat_template_kwargs``, ``reasoning_effort``)
    template_kwargs: dict[str, Any] | None = None
    # a sampling field's name as the line gave it, where it differs ({"logprobs": "body
    # 'top_logprobs'"}): range errors name what the user wrote
    labels: dict[str, str] | None = None
    endpoint: str | None = None  # OpenAI lines: "chat" or "completions"
    model: str | None = None  # OpenAI lines: the body's "model"
    source: int = 0  # which of the input's files holds the line
    error: str | None = None  # why the line cannot run (``--on-bad-line error``: its record)
    images: list[Any] | None = None  # its images' URLs, paths or PIL images, in order
    mm: Any = None  # and what the engine made of them (``Engine.prompt_images``)

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """The line's sampling settings (``defaults`` itself when the line sets none)."""
        if not self.overrides:
            return defaults
        values = dict(self.overrides)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        return dataclasses.replace(defaults, **values)


def set_prompt(req: Request, kind: str, value: Any, where: str, label: str) -> None:
    """``kind``: "prompt" (text), "prompt_token_ids" or "messages"; ``label`` names the field
    as the user wrote it."""
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise PagedgenError(f"{where}: {label} must be a non-empty string")
        req.prompt = value
    elif kind == "prompt_token_ids":
        req.prompt_token_ids = token_ids(value, where, label)
    else:
        if not isinstance(value, list) or not value:
            raise PagedgenError(f"{where}: {label} must be a non-empty list of "
                                "{\"role\": str, \"content\": str} objects")
        images: list[str] = []
        value = [_content(m, where, f"{label}[{i}]", images) for i, m in enumerate(value)]
        for i, m in enumerate(value):
            _check_message(m, where, f"{label}[{i}]")
        req.messages, req.images = value, images or None


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def set_template_kwargs(req: Request, value: Any, where: str, label: str) -> None:
    """A chat line's extra chat-template variables (vLLM's ``chat_template_kwargs``: Qwen3's
    ``enable_thinking``, gpt-oss's ``reasoning_effort``); null sets none."""
    if value is None:
        return
    if req.messages is None:
        raise PagedgenError(f"{where}: {label} applies to chat ('messages') prompts only")
    if not isinstance(value, dict):
        raise PagedgenError(f"{where}: {label} must be an object of template variables")
    effort = value.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise PagedgenError(f"{where}: {label}: reasoning_effort must be one of "
                            f"{', '.join(REASONING_EFFORTS)} (got {effort!r})")
    req.template_kwargs = {**(req.template_kwargs or {}), **value}


CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message")  # vLLM's chat fields


def set_chat_options(req: Request, obj: dict, where: str, prefix: str = "") -> None:
    """A chat line's ``add_generation_prompt`` (default true: the assistant's turn opened
    after the messages) and ``continue_final_message`` (default false: true continues the last
    message, left open, as a prefilled answer), into its template variables."""
    given = {k: obj[k] for k in CHAT_OPTIONS if obj.get(k) is not None}
    if not given:
        return
    if req.messages is None:
        raise PagedgenError(f"{where}: {prefix}'{next(iter(given))}' applies to chat "
                            "('messages') prompts only")
    for key, value in given.items():
        if not isinstance(value, bool):
            raise PagedgenError(f"{where}: {prefix}'{key}' must be true or false")
    if given.get("continue_final_message") and given.get("add_generation_prompt"):
        raise PagedgenError(f"{where}: {prefix}'continue_final_message' continues the last "
                            "message and 'add_generation_prompt' opens a new one: give one")
    req.template_kwargs = {**(req.template_kwargs or {}), **given}


def _check_message(m: Any, where: str, label: str) -> None:
    """One chat message: a {"role": str, "content": str} object; a tool call or a tool's
    result is named as such (pagedgen runs no tools), any other fault by what is wrong."""
    if not isinstance(m, dict):
        raise PagedgenError(f"{where}: {label} must be a {{\"role\": str, \"content\": str}} "
                            f"object, not {type(m).__name__}")
    if m.get("tool_calls") or m.get("role") == "tool" or m.get("function_call"):
        raise PagedgenError(f"{where}: {label} is a tool call or a tool's result: pagedgen "
                            "runs no tools (its chats are text messages)")
    if not isinstance(m.get("role"), str):
        raise PagedgenError(f"{where}: {label} needs a 'role' string")
    if not isinstance(m.get("content"), (str, list)):  # a list: parts with an image
        raise PagedgenError(f"{where}: {label}: 'content' must be a string (or text and "
                            f"image parts), not {json.dumps(m.get('content'))[:40]}")


def _content(message: Any, where: str, label: str, images: list[str]) -> Any:
    """A message whose content is a list of parts (OpenAI's form): its text parts joined by
    newlines where it has no image; with images, its parts as the chat template reads them
    (``{"type": "text", "text": ...}``, ``{"type": "image"}``) and each image's URL or path
    added to ``images`` (``image_url`` parts, OpenAI's; ``image`` and ``image_pil`` parts,
    vLLM's, which may hold a PIL image in the Python API)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for j, part in enumerate(message["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "image", "image_pil"):
            ref = part.get(kind)
            ref = ref.get("url") if isinstance(ref, dict) else ref
            if not (isinstance(ref, str) and ref or hasattr(ref, "convert")):  # or PIL's
                raise PagedgenError(f"{where}: {label}: content part {j}: an {kind} part "
                                    f"needs a URL or path ({'{'}\"{kind}\": "
                                    f"{'{'}\"url\": ...{'}'}{'}'})")
            images.append(ref)
            parts.append({"type": "image"})
        else:
            raise PagedgenError(f"{where}: {label}: content part {j}: only text and image "
                                f"parts are supported, not {kind!r}")
    if all(p["type"] == "text" for p in parts):
        return {**message, "content": "\n".join(p["text"] for p in parts)}
    return {**message, "content": parts}


def set_images(req: Request, value: Any, where: str, label: str) -> None:
    """vLLM's ``multi_modal_data``: ``{"image": one or a list}`` (URLs, paths, PIL images),
    one per image placeholder of the prompt, in order; null sets none."""
    if value is None:
        return
    images = value.get("image") if isinstance(value, dict) and set(value) <= {"image"} \
        else None
    images = images if isinstance(images, list) else [images] if images is not None else None
    if not images or not all(isinstance(i, str) and i or hasattr(i, "convert")
                             for i in images):
        raise PagedgenError(f"{where}: {label} must be {{\"image\": an image or a list of "
                            "them} (URLs, paths, PIL images)")
    if req.images:
        raise PagedgenError(f"{where}: give images as content parts or as {label}, not both")
    req.images = images


def token_ids(value: Any, where: str, label: str) -> array:
    """A JSON list of token ids as ``array('i')``; the type check runs in C (``map(type)``), not
    a Python loop per token."""
    if isinstance(value, list) and value and set(map(type, value)) == {int}:
        try:
            return array("i", value)
        except OverflowError:
            raise PagedgenError(f"{where}: a token id in {label} is out of range")
    raise PagedgenError(f"{where}: {label} must be a non-empty list of integers")


def set_sampling(req: Request, name: str, value: Any, where: str, label: str | None = None) -> None:
    """Type-check one sampling field (``name`` as in ``SAMPLING_FIELDS``); null leaves it unset.
    Ranges are checked with the line's other fields (``check_sampling``)."""
    if value is None:
        return
    label = label or f"'{name}'"
    if isinstance(value, float) and value.is_integer() and SAMPLING_FIELDS[name] == "an integer":
        value = int(value)  # 100.0: an integer column with gaps, as pandas writes it
    if name == "logit_bias" and isinstance(value, dict):
        value = _logit_bias(value, where, label)  # its keys are strings in JSON
    as_field = [value] if name == "stop" and isinstance(value, str) else value
    if type_error(SamplingParams, name, as_field):
        raise PagedgenError(f"{where}: {label} must be {SAMPLING_FIELDS[name]}")
    if req.overrides is None:
        req.overrides = {}
    req.overrides[name] = value
    if label != f"'{name}'":
        req.labels = {**(req.labels or {}), name: label}


def _logit_bias(value: dict, where: str, label: str) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) as ``{id: bias}``."""
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 11):
            raise PagedgenError(f"{where}: {label} keys must be token ids, not {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise PagedgenError(f"{where}: {label} values must be numbers, not {bias!r}")
        out[int(key)] = float(bias)
    return out


def check_sampling(req: Request, where: str) -> None:
    """The line's sampling fields together (ranges, combinations)."""
    if req.overrides:
        try:
            req.sampling(SamplingParams()).validate()
        except ValueError as e:
            field, _, rest = str(e).partition(" ")
            label = (req.labels or {}).get(field)
            raise PagedgenError(f"{where}: {f'{label} {rest}' if label else e}")


def user_fields(obj: dict, known: set[str] | frozenset[str], where: str,
                opts: InputOptions) -> Any:
    """The line's fields pagedgen does not know, as the output's ``metadata`` (with the line's
    own ``metadata`` field, carried as it is); None when there are none. A name one edit away
    from a known field is an error with a hint; so is any unknown field with --strict-fields."""
    extra = {k: v for k, v in obj.items() if k not in known}
    for name in extra:
        hint = near_miss(name, known)
        if hint:
            raise PagedgenError(f"{where}: unknown field '{name}' (did you mean '{hint}'? "
                                "a field of your own can go under \"metadata\")")
        if opts.strict_fields:
            raise PagedgenError(f"{where}: unknown field '{name}' (--strict-fields)")
    if "metadata" not in obj:
        return extra or None
    given = obj["metadata"]
    if not extra:
        return given
    if not isinstance(given, dict):
        raise PagedgenError(f"{where}: 'metadata' must be an object when the line has other "
                            f"fields of its own ({', '.join(map(repr, extra))})")
    both = sorted(set(given) & set(extra))
    if both:
        raise PagedgenError(f"{where}: field '{both[0]}' is both on the line and in 'metadata'")
    return {**given, **extra}


def near_miss(name: str, known: set[str] | frozenset[str]) -> str | None:
    """The known field ``name`` is a typo of (one edit apart, or differing in case only),
    among names of 4 characters or more (a short field like ``idx`` is the user's own)."""
    if len(name) < 4:
        return None
    for k in sorted(known):
        if len(k) >= 4 and (name.lower() == k or _one_edit(name, k)):
            return k
    return None


def _one_edit(a: str, b: str) -> bool:
    """Whether one insertion, deletion, substitution or swap of neighbours turns ``a`` into
    ``b``."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = 0
    while i < len(short) and short[i] == long[i]:
        i += 1
    return short[i:] == long[i + 1:]
