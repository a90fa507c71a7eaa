"""A batch of requests, from a file's lines or the Python API's prompts: a pagedgen line parsed
into a ``Request``, every request's prompt tokenized in batches, each checked, an error named by
where the request came from (``file:line``, or ``prompt i``). The command's file reader
(``cli/formats/reader.py``) and the API (``runtime/api.py``) share it."""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.requests import text_setting
from pagedgen.runtime.inputs import structured
from pagedgen.runtime.inputs.request import (
    CHAT_OPTIONS,
    SAMPLING_FIELDS,
    InputOptions,
    Request,
    check_sampling,
    set_chat_options,
    set_images,
    set_prompt,
    set_sampling,
    set_template_kwargs,
    user_fields,
)
from pagedgen.runtime.models.tokenizer import has_text

TOKENIZE_BATCH = 1024  # prompts per call into the tokenizer
# fields other tools read images from (Ollama's and llama.cpp's "images", SGLang's
# "image_data"): on a pagedgen line they would be metadata, and the prompt would run without
# its images
IMAGE_LOOKALIKES = ("images", "image", "image_url", "image_urls", "image_data")


@dataclass
class RequestFile:
    """Validated prompt files: their requests in input order, and each id's index."""

    names: list[str]  # each input's name, for errors
    requests: list[Request]
    index_of: dict[Any, int]  # request id (str or int) -> index
    format: str = "pagedgen"  # or "openai" (OpenAI batch lines; ids are their custom_id)
    sources: list = field(default_factory=list)  # the files read (cli/formats)
    fingerprint: str = ""  # sha256 of every input byte, in order (ties an output to its input)
    on_bad_line: str = "stop"  # InputOptions.on_bad_line: "error" records, "stop" raises

    def __len__(self) -> int:
        return len(self.requests)

    def fail(self, r: Request, message: str) -> None:
        """Request ``r`` cannot run (``message``, naming its file and line): a ``stop`` run
        ends here; an ``error`` run keeps the message for its record in the line's place."""
        if self.on_bad_line == "stop":
            raise PagedgenError(message)
        r.error = r.error or message

    def runnable(self, requests: list[Request] | None = None) -> list[Request]:
        """The requests (of ``requests``, default all) no stage has failed."""
        return [r for r in (self.requests if requests is None else requests) if r.error is None]

    def where(self, r: Request) -> str:
        """``file:line`` of a request, for errors."""
        return f"{self.names[r.source]}:{r.line}"


def tokenize_requests(rf: RequestFile, tokenizer,
                      progress: Callable[[int], None] | None = None) -> None:
    """Give every request its prompt's token ids (``array('i')``), tokenizing text and chat
    prompts in batches of ``TOKENIZE_BATCH``; ``progress(requests_done)`` after each."""
    done = sum(r.prompt is None and r.messages is None for r in rf.requests)
    groups: dict[tuple[str, str], list[Request]] = {}  # chats by their template variables
    for r in rf.requests:
        if r.error is not None:
            done += 1
        elif r.prompt is not None:
            groups.setdefault(("prompt", ""), []).append(r)
        elif r.messages is not None:
            key = json.dumps(r.template_kwargs, sort_keys=True) if r.template_kwargs else ""
            groups.setdefault(("messages", key), []).append(r)
    for (kind, _), reqs in groups.items():
        for i in range(0, len(reqs), TOKENIZE_BATCH):
            batch = reqs[i:i + TOKENIZE_BATCH]
            try:
                out = _tokenized(tokenizer, kind, batch)
            except (ValueError, PagedgenError) as e:
                if rf.on_bad_line == "stop" or len(batch) == 1:
                    rf.fail(batch[0], f"{rf.where(batch[0])}: {e}")
                    out = [None]
                else:  # which of the batch fails: each alone
                    out = []
                    for r in batch:
                        try:
                            out += _tokenized(tokenizer, kind, [r])
                        except (ValueError, PagedgenError) as e:
                            rf.fail(r, f"{rf.where(r)}: {e}")
                            out.append(None)
            for r, ids in zip(batch, out):
                if ids is not None:
                    r.prompt_token_ids = array("i", ids)
            done += len(batch)
            if progress is not None:
                progress(done)


def _tokenized(tokenizer, kind: str, batch: list[Request]) -> list[list[int]]:
    if kind == "prompt":
        return tokenizer.encode_batch([r.prompt for r in batch])
    return tokenizer.apply_chat_template_batch([r.messages for r in batch],
                                               batch[0].template_kwargs)


def check_text_settings(rf: RequestFile, tokenizer, defaults: SamplingParams) -> None:
    """Where ``tokenizer`` has no text (a checkpoint without tokenizer files), a request whose
    settings work on text (``requests.text_setting``) is a file:line error."""
    if has_text(tokenizer):
        return
    for r in rf.runnable():
        why = text_setting(r.sampling(defaults))
        if why is not None:
            rf.fail(r, f"{rf.where(r)}: {tokenizer.path} has no tokenizer; {why}")


def check_requests(rf: RequestFile, check: Callable[[Request], None],
                   requests: list[Request] | None = None) -> None:
    """``check`` every request (or ``requests`` of ``rf``) no stage has failed; its
    ValueError becomes a ``file:line:`` error (``RequestFile.fail``)."""
    for r in rf.runnable(requests):
        try:
            check(r)
        except ValueError as e:
            rf.fail(r, f"{rf.where(r)}: {e}")


def parse_line(obj: Any, index: int, lineno: int, where: str, opts: InputOptions) -> Request:
    """A pagedgen line: one prompt field, optional ``id`` and sampling fields; other fields
    become the output's ``metadata``."""
    if not isinstance(obj, dict):
        raise PagedgenError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = opts.prompt_fields
    known = {*kinds, *SAMPLING_FIELDS, *structured.FIELDS, *CHAT_OPTIONS, "id", "metadata",
             "chat_template_kwargs", "multi_modal_data"}
    given = [k for k in kinds if k in obj]
    if len(given) != 1:
        raise PagedgenError(f"{where}: need exactly one of "
                            f"{', '.join(repr(k) for k in kinds)} "
                            f"(got {', '.join(given) or 'none'})")
    rid = obj.get("id", index)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise PagedgenError(f"{where}: 'id' must be a string or an integer")
    req = Request(index=index, line=lineno, id=rid)
    for name in IMAGE_LOOKALIKES:
        if name in obj:
            raise PagedgenError(
                f"{where}: field '{name}' is not read as images: give them as a chat "
                "message's content parts ({\"type\": \"image_url\", \"image_url\": {\"url\": "
                "...}}) or as 'multi_modal_data' ({\"image\": ...}); a field of your own can "
                "go under \"metadata\"")
    req.metadata = user_fields(obj, known, where, opts)
    set_prompt(req, kinds[given[0]], obj[given[0]], where, f"'{given[0]}'")
    set_template_kwargs(req, obj.get("chat_template_kwargs"), where, "'chat_template_kwargs'")
    set_chat_options(req, obj, where)
    set_images(req, obj.get("multi_modal_data"), where, "'multi_modal_data'")
    for name in SAMPLING_FIELDS:
        if name in obj:
            set_sampling(req, name, obj[name], where)
    structured.set_structured(req, obj, where)
    check_sampling(req, where)
    return req
