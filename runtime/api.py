"""The Python API, in vLLM's shape: ``pagedgen.LLM``::

    from pagedgen import LLM, SamplingParams
    llm = LLM(model="tiny")                     # a preset, Hub id, checkpoint directory or .gguf
    outs = llm.generate(["Hello", "The capital of France is"], max_tokens=16, temperature=0)
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].outputs  # RequestOutput
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95))  # vLLM's way
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))

A vLLM offline script runs with its import line changed: ``SamplingParams`` (vLLM's fields and
defaults, runtime/inputs/sampling_params.py: an object is a request's whole sampling), ``generate``,
``chat``, ``get_tokenizer``, ``get_default_sampling_params``, ``use_tqdm``, and outputs with
vLLM's field names (``request_id``, ``outputs[i].logprobs`` as dicts of ``Logprob`` by token
id, ``cumulative_logprob``, ``stop_reason``, ``metrics``).

Prompts are strings, lists of token ids, or request dicts with the fields of a JSONL line
(``prompt`` | ``prompt_token_ids`` | ``messages``, sampling fields, ``structured_outputs`` ...),
read and checked by the same code as the command's input (``runtime/inputs``): a bad one is a
``PagedgenError`` naming its position before anything runs. Sampling settings given as keyword
arguments (or ``sampling_params``: one dict for all, or one per prompt) apply where a request
sets none; a ``SamplingParams`` (or one per prompt) sets every field. The engine is built once
and reused by every ``generate``; requests run batched exactly as ``pagedgen generate`` runs a
file's lines.

One ``LLM`` runs one call at a time: calls from several threads wait their turn, and each
returns exactly its own requests. A call that ends early (Ctrl-C, an error) drops its
requests from the engine (``Engine.abort``), so the next call starts on an idle engine.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime import clock
from pagedgen.runtime.drivers.driver import LocalDriver, checked_request
from pagedgen.runtime.inputs import structured
from pagedgen.runtime.inputs.parse import (
    RequestFile,
    check_requests,
    check_text_settings,
    parse_line,
    tokenize_requests,
)
from pagedgen.runtime.inputs.request import (
    CHAT_OPTIONS,
    SAMPLING_FIELDS,
    InputOptions,
    check_sampling,
    set_chat_options,
    set_sampling,
)
from pagedgen.runtime.inputs.sampling_params import SamplingParams
from pagedgen.runtime.inputs.settings import engine_and_sampling
from pagedgen.runtime.output.outputs import RequestOutput

Prompt = str | Sequence[int] | dict[str, Any]
Sampling = dict[str, Any] | SamplingParams


class LLM:
    """An engine in this process. ``model``: a preset (default ``tiny``), a checkpoint
    directory, a GGUF file or a Hub id (``revision``: its branch, tag or commit, as vLLM's
    keyword); ``profile``: a run profile; ``engine_options``: EngineConfig
    fields as ``pagedgen generate``'s options name them (``backend``, ``device``, ``dtype``,
    ``quantization``, ``max_num_seqs``, ``kv_cache_memory``, ...)."""

    def __init__(self, model: str | None = None, profile: str | None = None,
                 revision: str | None = None, _named_as_options: bool = False,
                 **engine_options: Any) -> None:
        clock.mark()  # the summary's start-up counts from here
        # a command built on the API (``bench``) names settings as its options in errors
        cfg, self.defaults, _ = engine_and_sampling(profile, model, engine_options, {},
                                                    keywords=not _named_as_options,
                                                    revision=revision)
        self.options = InputOptions()
        self._driver = LocalDriver(cfg.with_step_limits(), self.defaults)
        self._driver.load()
        self.engine = self._driver.engine
        self._lock = threading.Lock()  # one call at a time
        self._owner: int | None = None  # the thread whose call holds it

    @property
    def chat_format(self) -> str | None:
        """How ``messages`` render where the model has a choice (gpt-oss: its harmony format
        by openai-harmony, or its chat template and why), else None."""
        return getattr(self.engine.tokenizer, "chat_format", None)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer: transformers' where the model has one, else pagedgen's own
        (a preset's bytes), both with ``encode`` and ``decode``."""
        tok = self.engine.tokenizer
        return getattr(tok, "tok", tok)

    def get_default_sampling_params(self) -> SamplingParams:
        """The run's sampling defaults (the preset's or profile's) as a ``SamplingParams``."""
        return SamplingParams.from_fields(asdict(self.defaults))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: Sampling | Sequence[Sampling] | None = None,
                 use_tqdm: bool = True, **sampling: Any) -> list[RequestOutput]:
        """Run every prompt; their outputs in the prompts' order. ``sampling_params``: the
        sampling of every prompt (a dict of fields, or a ``SamplingParams``) or of each (a
        list, one per prompt); keyword arguments (``max_tokens=16``, ``temperature=0``,
        ``n=4``, ``logprobs=2``, ``stop=[...]``, a constraint: ``structured_outputs={"json":
        schema}`` or ``response_format=...``; chats' ``continue_final_message`` or
        ``add_generation_prompt``) apply to every prompt; a request dict's own fields win.
        ``use_tqdm``: a progress bar of finished requests on a terminal's stderr."""
        if self._owner == threading.get_ident():
            raise PagedgenError("LLM.generate was called from inside a call of the same LLM "
                                "(a logits processor?); make a second LLM for that")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                return self._generate(prompts, sampling_params, sampling, use_tqdm)
            finally:
                self._owner = None

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: Sampling | Sequence[Sampling] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             **sampling: Any) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or several, rendered by
        the model's chat template; ``add_generation_prompt`` and ``continue_final_message``
        as keyword arguments. A template of one's own (``chat_template``) is refused."""
        if chat_template is not None:
            raise PagedgenError("chat_template: pagedgen renders the model's own chat template; "
                                "render the prompt yourself and pass it to generate")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise PagedgenError("messages: a conversation (a list of message dicts) or a list "
                                "of conversations")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        lines = [{"messages": c, **({"chat_template_kwargs": chat_template_kwargs}
                                     if chat_template_kwargs else {})} for c in convs]
        return self.generate(lines, sampling_params, use_tqdm, **sampling)

    def _generate(self, prompts: Prompt | Sequence[Prompt],
                  sampling_params: Sampling | Sequence[Sampling] | None,
                  sampling: dict[str, Any], use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (bytes, bytearray)):
            raise PagedgenError("prompts: bytes; decode them to a string first")
        try:
            items = [prompts] if _single(prompts) else list(prompts)
        except TypeError:  # None, a number: neither a prompt nor prompts
            raise PagedgenError("prompts: a prompt (a string, a list of token ids or a request "
                                f"dict) or a list of them, not {type(prompts).__name__}")
        if not items:
            return []
        per = [p.request_fields(self.engine.max_model_len) if isinstance(p, SamplingParams)
               else p for p in _per_prompt(sampling_params, len(items))]
        reqs = []
        for i, (item, extra) in enumerate(zip(items, per)):
            where = f"prompt {i}"
            line = _as_line(item, where)
            req = parse_line({**line, "id": line.get("id", i)}, i, i + 1, where, self.options)
            for name, value in {**sampling, **extra}.items():
                if name in structured.FIELDS:  # a constraint, unless the request has one
                    if "structured" not in (req.overrides or {}):
                        structured.set_structured(req, {name: value}, where)
                elif name in CHAT_OPTIONS:  # how chats render, unless the request says
                    if not set(CHAT_OPTIONS) & set(req.template_kwargs or {}):
                        set_chat_options(req, {name: value}, where)
                elif name not in (req.overrides or {}):
                    _set(req, name, value, where)
            reqs.append(req)
        rf = _Prompts(["prompts"], reqs, {r.id: r.index for r in reqs})
        eng = self.engine
        check_text_settings(rf, eng.tokenizer, self.defaults)
        tokenize_requests(rf, eng.tokenizer)
        vocab, limit = eng.src.hf_config.vocab_size, eng.max_model_len
        check_requests(rf, lambda r: checked_request(r, self.defaults, limit, vocab,
                                                     eng.config.max_num_seqs,
                                                     eng.config.named("max_num_seqs")))
        images = [r for r in rf.runnable() if r.images]
        self._driver.prepare(images)  # read and sized in threads
        check_requests(rf, self._driver.check, images)
        constraints = {c: r for r in reqs
                       if (c := (r.overrides or {}).get("structured")) is not None}
        if constraints:  # each compiled once, a bad one named before the run
            errors = eng.grammars.compile_all(constraints)
            if errors:
                c = min(errors, key=lambda c: constraints[c].index)
                raise PagedgenError(f"{rf.where(constraints[c])}: {errors[c]}")
        out: list[RequestOutput | None] = [None] * len(reqs)
        try:
            with _progress(use_tqdm and sys.stderr.isatty(), len(reqs)) as advance:
                for step in self._driver.outputs(reqs):
                    for index, result in step:
                        out[index] = result
                    advance(len(step))
        except BaseException:  # Ctrl-C, an error: this call's requests leave the engine
            eng.abort()
            raise
        return out  # type: ignore[return-value]


def _progress(show: bool, total: int):
    """A context giving ``advance(n)``: a rich progress bar of finished requests, or nothing."""
    if not show:
        return nullcontext(lambda n: None)
    from rich.progress import Progress

    class Bar:
        def __enter__(self):
            self.p = Progress(transient=True)
            self.p.start()
            task = self.p.add_task("requests", total=total)
            return lambda n: self.p.advance(task, n)

        def __exit__(self, *exc) -> None:
            self.p.stop()

    return Bar()


class _Prompts(RequestFile):
    """The prompts of one call, each named by its position in errors."""

    def where(self, r) -> str:
        return f"prompt {r.index}"


def _single(prompts: Any) -> bool:
    """Whether ``prompts`` is one prompt (a string, a dict, or a list of token ids)."""
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts)


def _as_line(item: Any, where: str) -> dict[str, Any]:
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, dict):
        return dict(item)
    if isinstance(item, (list, tuple)):
        return {"prompt_token_ids": list(item)}
    raise PagedgenError(f"{where}: a prompt is a string, a list of token ids or a request "
                        f"dict, not {type(item).__name__}")


def _per_prompt(params: Any, n: int) -> list[Sampling]:
    if params is None:
        return [{}] * n
    if isinstance(params, (dict, SamplingParams)):
        return [params] * n
    wanted = (f"sampling_params: one dict or SamplingParams for every prompt, or a list of {n} "
              "(one per prompt)")
    if not isinstance(params, (list, tuple)):
        raise PagedgenError(f"{wanted}, not {type(params).__name__}")
    if len(params) != n or not all(isinstance(p, (dict, SamplingParams)) for p in params):
        raise PagedgenError(wanted)
    return list(params)


def _set(req, name: str, value: Any, where: str) -> None:
    if name not in SAMPLING_FIELDS:
        raise PagedgenError(f"{where}: unknown sampling field '{name}'; known: "
                            f"{', '.join(SAMPLING_FIELDS)}")
    set_sampling(req, name, value, where)
    check_sampling(req, where)
