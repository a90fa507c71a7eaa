"""From a model name to a ready model: resolve the source, build the modules, load weights.

A model is a local Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer
files), a GGUF file (llama.cpp's format: config, tokenizer and weights in one file,
``gguf_file.py``), a model shipped in a Python package (``gguf_file.PACKAGED``), or a preset: a
run profile in profiles/ whose ``model.config`` holds a Hugging Face config (real shapes, dummy
weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedgen.errors import PagedgenError, first_line
from pagedgen.runtime import hardware
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import copy_shard, full_shape, shard_map
from pagedgen.runtime.layers.moe.layer import FusedMoE
from pagedgen.runtime.models import gguf_file, hub, registry
from pagedgen.runtime.models.harmony import harmony_chat
from pagedgen.runtime.models.hf_config import ModelConfig, check_heads, model_config
from pagedgen.runtime.models.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    MissingTokenizer,
    Tokenizer,
)
from pagedgen.runtime.models.weights import FiniteChecked
from pagedgen.runtime.profiles import list_profiles, load_profile
from pagedgen.runtime.quantization.config import QuantConfig
from pagedgen.runtime.quantization.registry import check_device, checkpoint_tensors, quant_config
from pagedgen.runtime.quantization.unquantized import Unquantized


@dataclass
class ModelSource:
    name: str
    hf_config: ModelConfig  # the Hugging Face config's fields, family defaults filled in
    checkpoint: Path | None  # a directory, a .gguf file, or None for presets (dummy weights)
    tokenizer_kind: str  # "hf" | "gguf" | "byte" | "none" (a GGUF file without one)


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # a checkpoint folder's weights


def resolve_model(name: str) -> ModelSource:
    """A checkpoint directory, a GGUF file, a packaged model's name, a Hugging Face Hub id
    (``org/name``, ``org/name@revision``, ``org/name/file.gguf``: ``hub.py``), a preset name,
    or a profile file with a model config."""
    if not str(name).strip():
        raise PagedgenError("--model is empty: give a checkpoint directory, a .gguf file or a "
                            "preset")
    path = Path(name).expanduser()
    # a local file or folder wins over a packaged model of the same name
    packaged = None if path.exists() else gguf_file.packaged_path(name)
    if packaged is not None or (path.suffix == ".gguf" and path.is_file()):
        return _gguf_source(packaged or path, name)
    repo, _, revision = str(name).partition("@")
    if not path.exists() and hub.is_hub_id(repo):  # org/name[@revision]: the Hub
        src = resolve_model(str(hub.download(repo, revision or None)))
        return dataclasses.replace(src, name=str(name))
    if path.suffix == ".gguf":
        raise PagedgenError(f"{path}: no such GGUF file")
    if path.suffix in WEIGHT_FILES:  # a checkpoint's weights: its folder is the model
        if not path.is_file():
            raise PagedgenError(f"{path}: no such weights file (--model takes a checkpoint's "
                                "folder, a .gguf file, a Hub id or a preset)")
        config = "" if (path.parent / "config.json").is_file() else \
            ", which needs the checkpoint's config.json beside it"
        raise PagedgenError(f"{path} is a weights file: --model takes its folder "
                            f"({path.parent}{config})")
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise PagedgenError(f"model directory {path} has no config.json")
        try:
            fields = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise PagedgenError(f"{file}: cannot read the config: {str(e).splitlines()[0]}")
        if not isinstance(fields, dict):
            raise PagedgenError(f"{file}: cannot read the config: not a JSON object")
        return ModelSource(str(path), model_config(fields, str(file)), path, "hf")
    if path.suffix not in (".yaml", ".yml") and ("/" in name or name.startswith(".")):
        raise PagedgenError(f"model directory {path} does not exist")
    try:
        profile = load_profile(name)
    except PagedgenError:
        raise PagedgenError(f"model '{name}' is neither a checkpoint directory, a .gguf file "
                            f"nor a preset (presets: "
                            f"{', '.join(presets() + list(gguf_file.PACKAGED))})") from None
    model = profile.get("model") or {}
    if not isinstance(model, dict) or "config" not in model:
        if isinstance(model, dict) and model.get("name"):
            return resolve_model(model["name"])
        raise PagedgenError(f"{profile['_path']}: has no model config to use as a preset")
    if not isinstance(model["config"], dict):
        raise PagedgenError(f"{profile['_path']}: model.config must be a mapping")
    line = (profile.get("_lines") or {}).get("model.config")
    where = f"{profile['_path']}{f':{line}' if line else ''}: model.config"
    cfg = model_config({"model_type": "llama", **model["config"]}, where)
    check_heads(cfg, where)
    return ModelSource(model.get("name", Path(profile["_path"]).stem), cfg, None,
                       model.get("tokenizer", "byte"))


def _gguf_source(path: Path, name: str) -> ModelSource:
    reader = gguf_file.open_reader(path)
    cfg = model_config(gguf_file.config_fields(reader, path), str(path))
    return ModelSource(name, cfg, path, "gguf" if gguf_file.has_tokenizer(reader) else "none")


def presets() -> list[str]:
    out = []
    for p in list_profiles():
        model = load_profile(p).get("model")
        if isinstance(model, dict) and "config" in model:
            out.append(p)
    return out


def load_tokenizer(src: ModelSource) -> Tokenizer:
    if src.tokenizer_kind == "byte":
        if src.hf_config.vocab_size < ByteTokenizer.vocab_size:
            raise PagedgenError(f"preset '{src.name}' has vocab_size {src.hf_config.vocab_size} "
                                f"< {ByteTokenizer.vocab_size} needed by the byte tokenizer")
        return ByteTokenizer()
    eos = getattr(src.hf_config, "eos_token_id", None)
    if src.tokenizer_kind == "gguf":
        tok = HFTokenizer(src.checkpoint.parent, eos, gguf_file=src.checkpoint.name)
    else:
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if src.tokenizer_kind == "none" or not any((src.checkpoint / f).is_file()
                                                   for f in files):
            return MissingTokenizer(src.checkpoint, eos)
        tok = HFTokenizer(src.checkpoint, eos)
    if getattr(src.hf_config, "model_type", None) == "gpt_oss":  # harmony, by OpenAI's library
        tok.use_renderer(*harmony_chat(tok.ordinary_tokens()))
    return tok


def weights_format(src: ModelSource, load_format: str) -> str:
    """"safetensors", "gguf" or "dummy" for ``load_format`` (auto: the checkpoint's own);
    fails now (before tokenizing and loading) when a checkpoint has no weight files."""
    gguf = src.checkpoint is not None and src.checkpoint.suffix == ".gguf"
    if load_format == "auto":
        load_format = "dummy" if src.checkpoint is None else "gguf" if gguf else "safetensors"
    if load_format not in ("safetensors", "gguf", "dummy"):
        raise PagedgenError(f"unknown load format '{load_format}'; use auto, safetensors, gguf "
                            "or dummy")
    if load_format != "dummy" and src.checkpoint is None:
        raise PagedgenError(f"preset '{src.name}' has no weights; use --load-format dummy")
    if load_format != "dummy" and (load_format == "gguf") != gguf:
        raise PagedgenError(f"{src.checkpoint}: is not a {load_format} checkpoint; use "
                            "--load-format auto")
    if load_format == "safetensors":
        _safetensors_files(src.checkpoint)
    return load_format


def build_model(src: ModelSource, load_format: str, dtype: torch.dtype, device: torch.device,
                seed: int = 0, tp: TensorParallel | None = None,
                quant: QuantConfig | None = None,
                kv_cache: tuple[int, str] | None = None) -> registry.CausalLM:
    """Build the modules (this rank's shard under tensor parallelism) on ``device`` in
    ``dtype`` (linear layers as ``quant`` says: ``model_quantization``) and fill them from the
    checkpoint or at random. ``kv_cache``: (bytes, the option that asks for them) of a KV cache
    sized by an option, which must fit beside the weights."""
    load_format = weights_format(src, load_format)
    check_device(quant, device)
    check_heads(src.hf_config, src.name)
    default_dtype = torch.get_default_dtype()
    try:  # build on the meta device in the target dtype, then allocate once on the device
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = registry.model_class(src.hf_config)(src.hf_config, tp, quant)
    except ValueError as e:  # a shape the tensor-parallel size does not divide
        raise PagedgenError(f"{src.name}: {e}")
    except (ArithmeticError, AssertionError, IndexError, KeyError, RuntimeError,
            TypeError) as e:  # shapes on the meta device: the config's values do not fit
        raise PagedgenError(f"{src.name}: its config cannot be built: {type(e).__name__}: "
                            f"{first_line(e, '')}")
    finally:
        torch.set_default_dtype(default_dtype)
    check_fits(model, device, src.name, tp, kv_cache)
    _allocate(model, device)
    if load_format == "dummy":
        _init_dummy(model, seed, dtype)
    elif load_format == "gguf":
        try:
            model.load_weights((name, FiniteChecked(t)) for name, t in
                               gguf_file.iter_tensors(src.checkpoint, src.hf_config))
        except ValueError as e:
            raise PagedgenError(f"{src.checkpoint}: {e}")
    else:
        files = _safetensors_files(src.checkpoint)
        where = [src.checkpoint]  # the file being read, for errors
        try:
            model.load_weights(checkpoint_tensors(quant, _iter_safetensors(files, where)))
        except ValueError as e:
            raise PagedgenError(f"{where[0]}: {e}")
    for module in model.modules():  # weights into their method's form, kernels planned
        method = getattr(module, "quant_method", None)
        try:
            if method is not None:
                method.process_weights_after_loading(module)
            if isinstance(module, FusedMoE):
                module.plan_kernels()
        except ValueError as e:
            raise PagedgenError(str(e))
    for module in model.modules():  # projections of one input as one GEMM, in their final form
        if hasattr(module, "merge_projections"):
            module.merge_projections()
    return model.eval()


def model_quantization(src: ModelSource, requested: str | None) -> QuantConfig | None:
    """The model's quantization (the checkpoint's, or ``requested`` applied at load)."""
    where = str(src.checkpoint / "config.json") if src.checkpoint is not None \
        and src.checkpoint.is_dir() else src.name
    return quant_config(src.hf_config, requested, where)


def check_fits(model: torch.nn.Module, device: torch.device, name: str,
               tp: TensorParallel | None = None,
               kv_cache: tuple[int, str] | None = None) -> None:
    """A one-line error, before any allocation, when the model's weights (built on the meta
    device: this rank's shard, in the run's dtype and quantization; every rank's on a CPU)
    exceed the memory free on ``device``; otherwise a CPU run of a large preset is killed by
    the OOM killer a while later, and a GPU run stops with CUDA's out-of-memory traceback."""
    # parameters() and buffers() each name a shared tensor (a tied embedding) once
    need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    ranks = tp.size if tp is not None else 1
    if device.type == "cpu":  # a CPU run's ranks share this machine
        need *= ranks
    free = hardware.available_memory(device)
    kv, option = kv_cache or (0, "")
    if device.type == "cpu":
        kv *= ranks
    if free is None or need + kv <= free:
        return

    def size(n: int) -> str:
        return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    if kv and need <= free:
        where = "this machine" if device.type == "cpu" else str(device)
        raise PagedgenError(f"{option} asks for {size(kv)} of KV cache; {where} has "
                            f"{size(free - need)} free beside {name}'s weights: give less")

    shard = "" if ranks == 1 else f" ({ranks} tensor-parallel ranks)" if device.type == "cpu" \
        else " (this rank's shard)"
    if device.type == "cpu":
        where, hint = "this machine", "run it on a GPU (--device cuda) or choose a smaller model"
    else:
        where, hint = str(device), ("shard it over more GPUs (-tp N), quantize it "
                                    "(--quantization fp8) or choose a smaller model")
    raise PagedgenError(f"{name} needs {size(need)} for its weights{shard} and {where} has "
                        f"{size(free)} free: {hint}")


def _allocate(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized memory on ``device``. Not
    ``Module.to_empty``: its ``empty_like`` of a meta tensor runs torch's Python reference,
    which imports sympy (2.5 s of start-up on the GPU machine)."""
    new: dict[int, torch.Tensor] = {}  # a tensor shared by two modules stays shared
    for module in model.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None:
                continue
            if id(t) not in new:
                data = torch.empty(t.shape, dtype=t.dtype, device=device)
                new[id(t)] = torch.nn.Parameter(data, t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else data
            (module._parameters if name in module._parameters else module._buffers)[name] = \
                new[id(t)]


# Dummy weights are drawn as a checkpoint stores them: in bfloat16, whatever the run's dtype,
# so a float32 run holds exactly the bfloat16 run's weights (verify's float32 reference).
DUMMY_STORAGE_DTYPE = torch.bfloat16


def _init_dummy(model: torch.nn.Module, seed: int, dtype: torch.dtype) -> None:
    """Random weights of the right shapes (like vLLM's dummy format), reproducible by seed and
    the same in every dtype (``DUMMY_STORAGE_DTYPE``). A sharded parameter takes its part of
    the tensor the unsharded model would draw, so every tensor-parallel size runs the same
    model; a quantized layer gets the tensor the dense model would draw (in ``dtype``),
    quantized as a checkpoint's would be. Norm weights, and the parameters whose names end as
    the model's ``DUMMY_ONES`` say, are ones."""
    gens: dict[torch.device, torch.Generator] = {}

    def draw(shape: torch.Size, device: torch.device) -> torch.Tensor:
        gen = gens.setdefault(device, torch.Generator(device).manual_seed(seed))
        return torch.empty(shape, dtype=torch.float32, device=device).normal_(
            0.0, 0.02, generator=gen).to(DUMMY_STORAGE_DTYPE)

    shards = shard_map(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            prefix, _, attr = name.rpartition(".")
            layer = modules[prefix]
            method = getattr(layer, "quant_method", None)
            if method is not None and not isinstance(method, Unquantized):
                if attr == "weight":
                    _load_parts(layer, draw(full_shape(p, shards.get(name)), p.device).to(dtype))
                elif attr == "bias":
                    p.zero_()
            elif hasattr(layer, "load_drawn") and (getattr(layer, "expert_parallel", False)
                                                   or layer.method.quantized):
                if attr in layer.DRAWN:  # quantized or expert-parallel experts: drawn whole,
                    # stored as a checkpoint's are (this rank's experts)
                    layer.load_drawn(attr, draw(layer.drawn_shape(attr), p.device).to(dtype))
                elif name.endswith("bias"):
                    p.zero_()
            elif "norm" in name or name.endswith(getattr(model, "DUMMY_ONES", ())):
                p.fill_(1.0)  # norms, and the scales a family names (drawn, they would
                # shrink every layer's output to nothing)
            elif name.endswith("bias"):
                p.zero_()
            else:
                full = draw(full_shape(p, shards.get(name)), p.device)
                if full.shape == p.shape:
                    p.copy_(full)
                else:
                    copy_shard(p, shards[name], full)
                del full


def _load_parts(layer: torch.nn.Module, full: torch.Tensor) -> None:
    """A drawn unsharded (fused) weight into ``layer``, part by part, through its method."""
    dim, segs = layer.shards["weight"]
    if dim == 1:
        layer.quant_method.load(layer, "weight", segs[0].key, full)
        return
    base = 0
    for s in segs:
        layer.quant_method.load(layer, "weight", s.key, full.narrow(0, base, s.full))
        base += s.full


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PagedgenError(f"{index}: cannot read the weight index: {e}")
        files = [path / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PagedgenError(f"{index}: names {len(absent)} file(s) that are not there, "
                                f"e.g. {absent[0]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PagedgenError(f"model directory {path} has no *.safetensors weights")
    return files


FINGERPRINT_HEAD, FINGERPRINT_TAIL = 1 << 20, 1 << 16  # bytes of each file read


def weights_fingerprint(src: ModelSource, load_format: str = "auto") -> str | None:
    """A digest of what a checkpoint holds (None for a preset): per file (its config, its
    tokenizer's, its weights unless ``load_format`` draws dummy ones) the name, the size, the
    first MiB (a safetensors or GGUF file's header and index of tensors) and the last 64 KiB.
    Cheap on a checkpoint of any size, and new weights under the same path (a fine-tune
    saved over another) change it; the resume record keeps it."""
    if src.checkpoint is None:
        return None
    path = src.checkpoint
    if path.is_file():  # a GGUF file: config, tokenizer and weights in one
        files = [path]
    else:
        files = [path / n for n in ("config.json", "tokenizer.json", "tokenizer_config.json",
                                    "tokenizer.model", "generation_config.json")
                 if (path / n).is_file()]
        if weights_format(src, load_format) != "dummy":
            files += _safetensors_files(path)
    h = hashlib.sha256()
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(FINGERPRINT_HEAD)
                fh.seek(max(len(head), size - FINGERPRINT_TAIL))
                tail = fh.read()
        except OSError as e:
            raise PagedgenError(f"{f}: cannot read it: {e.strerror or e}")
        h.update(f"{f.name}\0{size}\0".encode() + head + b"\0" + tail)
    return h.hexdigest()[:16]


def _iter_safetensors(files: list[Path], where: list[Path]):
    """(name, lazy slice) of every checkpoint tensor: the model reads the rows it holds.
    ``where[0]`` is kept at the file being read; a file safetensors cannot read (truncated,
    not safetensors) is a PagedgenError naming it."""
    from safetensors import SafetensorError, safe_open

    for f in files:
        where[0] = f
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, FiniteChecked(st.get_slice(name))
        except (SafetensorError, OSError) as e:
            raise PagedgenError(f"{f}: cannot read the weights: {str(e).splitlines()[0]} "
                                "(truncated or not a safetensors file?)")
