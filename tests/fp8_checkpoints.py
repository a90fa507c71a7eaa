"""FP8 checkpoints for the tests, written from a dense one in each published format, and the
dense checkpoint of exactly the weights they hold (dequantized) to compare against."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")  # the last three: Mixtral's experts

# format name → (config.json quantization_config, how weights are scaled)
FORMATS = {
    "hf-block": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}, "block"),
    "hf-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor"),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                                    "symmetric": True, "dynamic": False},
                        "input_activations": {"type": "float", "num_bits": 8,
                                              "strategy": "token", "dynamic": True}}},
                    "ignore": ["lm_head"]}, "channel"),
    "ct-tensor-static": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                          "config_groups": {"group_0": {
                              "targets": ["Linear"],
                              "weights": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                          "symmetric": True, "dynamic": False},
                              "input_activations": {"type": "float", "num_bits": 8,
                                                    "strategy": "tensor", "dynamic": False}}},
                          "ignore": ["lm_head"]}, "tensor"),
}


def quantize_blocks(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and [ceil(rows/br), ceil(cols/bc)] scales, one per block (edge blocks
    partial)."""
    r, c = w.shape
    gr, gc = math.ceil(r / br), math.ceil(c / bc)
    padded = torch.zeros(gr * br, gc * bc)
    padded[:r, :c] = w.float()
    blocks = padded.view(gr, br, gc, bc)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale = scale.clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(E4M3)
    return q.view(gr * br, gc * bc)[:r, :c].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    s = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:q.shape[0], :q.shape[1]]
    return q.float() * s


def quantize(w: torch.Tensor, how: str, block: tuple[int, int] = (128, 128)
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale tensor as the checkpoint holds it, the dequantized weight)."""
    if how == "block":
        q, s = quantize_blocks(w, *block)
        return q, s, dequantize_blocks(q, s, *block)
    if how == "channel":
        s = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    else:
        s = (w.float().abs().amax() / 448.0).clamp(min=1e-12).reshape(1)
    q = (w.float() / s).clamp(-448, 448).to(E4M3)
    return q, s, q.float() * s


def write_fp8(dense: Path, out: Path, fmt: str, block: tuple[int, int] = (128, 128),
              input_scale: float = 0.05) -> Path:
    """``out``: ``dense`` with its linear weights in FP8 format ``fmt``; ``out-dequantized``:
    the same weights dequantized, as a plain checkpoint. Returns ``out``."""
    qcfg, how = FORMATS[fmt]
    qcfg = json.loads(json.dumps(qcfg))
    if how == "block":
        if fmt.startswith("hf"):
            qcfg["weight_block_size"] = list(block)
        else:
            qcfg["config_groups"]["group_0"]["weights"]["block_structure"] = list(block)
    ref = out.with_name(out.name + "-dequantized")
    for d in (out, ref):
        shutil.copytree(dense, d, dirs_exist_ok=True)
    tensors = {}
    for f in dense.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    quant, deq = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in LINEARS:
            q, s, d = quantize(t, how, block)
            quant[name] = q
            scale_name = "weight_scale_inv" if how == "block" and fmt.startswith("hf") \
                else "weight_scale"
            quant[name.replace(".weight", "." + scale_name)] = s
            if qcfg.get("activation_scheme") == "static" or fmt.endswith("static"):
                quant[name.replace(".weight", ".input_scale")] = torch.tensor([input_scale])
            deq[name] = d.to(t.dtype)
        else:
            quant[name] = deq[name] = t
    for d in (out, ref):
        for f in d.glob("*.safetensors"):
            f.unlink()
        (d / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(quant, str(out / "model.safetensors"))
    save_file(deq, str(ref / "model.safetensors"))
    cfg = json.loads((dense / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    return out
