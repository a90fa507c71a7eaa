"""Tiny GGUF files for the tests, written from a Hugging Face checkpoint the way llama.cpp's
converter writes them: its tensor names, its q/k row order for the llama architecture, the
config in the metadata, each weight in a chosen GGUF type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, *mid, leaf = hf.split(".")
        return f"blk.{i}.{NAMES['.'.join(mid)]}.{leaf}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its convert script's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf(ckpt: Path, out: Path, qtype: str = "F32", arch: str | None = None,
               drop: tuple[str, ...] = (), experts: int = 0) -> Path:
    """``ckpt`` (a safetensors checkpoint directory) as GGUF file ``out``; 2-D weights in
    ``qtype`` (norms stay F32); ``arch`` overrides the architecture; tensors in ``drop`` are
    left out; ``experts``: an expert count in the metadata (as llama.cpp writes Mixtral)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    arch = arch or cfg["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    if experts:
        w.add_expert_count(experts)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    q = gguf.GGMLQuantizationType[qtype]
    for name, t in sorted(load_file(str(ckpt / "model.safetensors")).items()):
        if name in drop:
            continue
        t = t.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            t = permute(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute(t, kv)
        if t.ndim == 2 and qtype != "F32":
            w.add_tensor(gguf_name(name), quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_tokenizer_gguf(out: Path, merges: tuple[str, ...] = ("Ġ t", "h e", "Ġt he")) -> Path:
    """A GGUF file holding only a tokenizer as llama.cpp writes one: byte-level BPE over the
    256 bytes and ``merges``, an end token (id 256 + len(merges)) and a chat template."""
    import gguf

    from pagedgen.runtime.models.tokenizer import byte_level_table

    char_of = {b: c for c, b in byte_level_table().items()}
    tokens = [*(char_of[b] for b in range(256)), *(m.replace(" ", "") for m in merges),
              "<|end|>"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(list(merges))
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                        "{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
