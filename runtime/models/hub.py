"""Hugging Face Hub model ids (``--model Qwen/Qwen3-0.6B``): the files a run needs, from the
user's Hugging Face cache or downloaded into it, through ``huggingface_hub`` (``HF_TOKEN``,
``HF_HOME``, ``HF_HUB_OFFLINE`` and its progress bars as everywhere else).

A run needs a checkpoint's config, its tokenizer's files and its safetensors weights (or one
GGUF file: ``org/name/file.gguf``); other files (other formats' weights, READMEs, images) stay
on the Hub. Offline, or with the id not in the cache, it is a one-line error naming what is
missing and the command that downloads it.
"""

from __future__ import annotations

import re
from pathlib import Path

from pagedgen.errors import PagedgenError, first_line

# what a run reads of a checkpoint
NEEDED = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
          "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
          "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
          "chat_template.json"]
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as ``org/name`` (optionally ``/file.gguf``) and is no local path."""
    base, _, rest = str(name).partition("/")
    repo = f"{base}/{rest.split('/')[0]}" if rest else name
    return (_ID.fullmatch(repo) is not None and not Path(name).expanduser().exists()
            and not str(name).startswith((".", "/", "~"))
            and (rest.count("/") == 0 or (rest.count("/") == 1 and name.endswith(".gguf"))))


def download(name: str, revision: str | None = None) -> Path:
    """The local path of Hub model ``name`` at ``revision`` (a snapshot folder, or the GGUF
    file ``org/name/file.gguf`` names), fetched into the Hugging Face cache where missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    parts = name.split("/")
    repo, gguf = "/".join(parts[:2]), parts[2] if len(parts) == 3 else None
    at = f" at revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(repo, revision=revision,
                                        allow_patterns=[gguf] if gguf else NEEDED))
    except LocalEntryNotFoundError:
        raise PagedgenError(
            f"model '{name}'{at} is not in the Hugging Face cache and the Hub cannot be reached "
            f"here (HF_HUB_OFFLINE, or no network): download it where there is one with "
            f"`hf download {repo}{' ' + gguf if gguf else ''}"
            f"{' --revision ' + revision if revision else ''}`") from None
    except GatedRepoError:
        raise PagedgenError(f"model '{repo}' is gated: accept its terms on huggingface.co and "
                            "give a token (HF_TOKEN, or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise PagedgenError(f"model '{repo}' is not on the Hugging Face Hub (or it is private: "
                            "give a token, HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise PagedgenError(f"model '{repo}' has no revision '{revision}'") from None
    except (OSError, ValueError) as e:
        raise PagedgenError(f"model '{name}'{at}: cannot fetch it from the Hugging Face Hub: "
                            f"{first_line(e)}") from None
    if gguf:
        path = folder / gguf
        if not path.is_file():
            raise PagedgenError(f"model '{repo}' has no file '{gguf}'{at}")
        return path
    if not (folder / "config.json").is_file():
        raise PagedgenError(f"model '{repo}'{at} has no config.json: not a checkpoint pagedgen "
                            "reads (a GGUF repository: name its file, org/name/file.gguf)")
    return folder
