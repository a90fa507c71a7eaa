"""Tiny random Hugging Face checkpoints (written with save_pretrained) for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_checkpoint(kind: str, path: Path, with_tokenizer: bool = False, **overrides) -> Path:
    """``overrides`` replace fields of the shared config (e.g. ``num_key_value_heads=1``)."""
    import transformers as tf

    COMMON = {**globals()["COMMON"], **overrides}
    torch.manual_seed({"llama": 0, "mistral": 1, "qwen2": 2, "qwen3": 3, "gemma2": 4,
                       "gemma3_text": 5, "phi3": 6, "qwen3_moe": 7, "mixtral": 8,
                       "qwen2_moe": 9, "qwen3_5_text": 10, "qwen3_5_moe_text": 11,
                       "qwen3_next": 12, "gpt_oss": 13, "gemma4_text": 14}[kind])
    # hybrid: three Gated DeltaNet layers, then a gated full-attention one (a quarter rotates)
    hybrid = dict(COMMON, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    hybrid.update(overrides)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)
    if kind == "llama":
        cfg = tf.LlamaConfig(**COMMON, head_dim=32, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":  # a short sliding window so the tests cross it
        cfg = tf.MistralConfig(**COMMON, head_dim=32, sliding_window=12)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "gemma2":  # a short window on every other layer, soft-caps that bite
        cfg = tf.Gemma2Config(**COMMON, head_dim=64, sliding_window=12, query_pre_attn_scalar=48,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3_text":  # local layers on their own rope base, global ones scaled
        cfg = tf.Gemma3TextConfig(**COMMON, head_dim=64, sliding_window=12,
                                  query_pre_attn_scalar=48, rope_parameters={
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1e6}},
                                  layer_types=["sliding_attention", "full_attention"])
        model = tf.Gemma3ForCausalLM(cfg)
    elif kind == "phi3":  # fused qkv and gate_up tensors in the checkpoint, a window
        cfg = tf.Phi3Config(**{**COMMON, "hidden_size": 256}, sliding_window=12)
        model = tf.Phi3ForCausalLM(cfg)
    elif kind == "qwen3_moe":  # 8 experts, 3 per token, a dense layer among the sparse ones
        cfg = tf.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=64,
                                moe_intermediate_size=48, num_experts=8,
                                num_experts_per_tok=3, norm_topk_prob=True,
                                mlp_only_layers=[1])
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen2_moe":  # 8 experts, 3 per token, a shared expert, a dense layer
        cfg = tf.Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 3}, moe_intermediate_size=48,
                                shared_expert_intermediate_size=64, num_experts=8,
                                num_experts_per_tok=3, norm_topk_prob=False,
                                mlp_only_layers=[1])
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif kind == "mixtral":  # 4 experts, 2 per token, a window
        cfg = tf.MixtralConfig(**{**COMMON, "intermediate_size": 64}, head_dim=64,
                               num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=12)
        model = tf.MixtralForCausalLM(cfg)
    elif kind == "qwen3_5_text":
        cfg = tf.Qwen3_5TextConfig(**hybrid)
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif kind == "qwen3_5_moe_text":  # 4 experts, 2 per token, a shared expert, every layer
        del hybrid["intermediate_size"]
        cfg = tf.Qwen3_5MoeTextConfig(**hybrid, **experts)
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif kind == "qwen3_next":  # projections fused per key-head group; a dense layer
        cfg = tf.Qwen3NextConfig(**hybrid, **experts, mlp_only_layers=[1])
        model = tf.Qwen3NextForCausalLM(cfg)
    elif kind == "gpt_oss":  # 4 experts, 2 per token, a short window on every other layer,
        # a SwiGLU clamp that bites
        cfg = tf.GptOssConfig(**{"head_dim": 32, **COMMON, "intermediate_size": 64,
                                 "num_hidden_layers": 3},
                              num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=12, swiglu_limit=0.2)
        model = tf.GptOssForCausalLM(cfg)
    elif kind == "gemma4_text":  # local layers of heads of 64, global ones of 512 with a KV
        # head of their own; a short window, a soft cap that bites (overrides: the variants)
        fields = dict(COMMON, num_hidden_layers=6, head_dim=64, global_head_dim=512,
                      sliding_window=12, final_logit_softcapping=5.0,
                      hidden_size_per_layer_input=0,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
        cfg = tf.Gemma4TextConfig(**{**fields, **overrides})
        model = tf.Gemma4ForCausalLM(cfg)
        with torch.no_grad():  # each layer's output scale and the router's away from 1
            for name, t in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                    t.add_(torch.randn_like(t) * 0.1)
    else:
        cfg = tf.Qwen3Config(**COMMON, head_dim=64, tie_word_embeddings=True)
        model = tf.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # make every weight matter (HF zero-inits biases, ones norms)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("A_log"):  # slow decays: a linear layer's state must last
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.1).log())
            elif name.endswith("sinks"):  # each sink a real share of its softmax
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        save_tokenizer(path, cfg.vocab_size)
    return path


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer built in code, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 4)]
    words[4:30] = list("abcdefghijklmnopqrstuvwxyz")
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}a{% endif %}")
    fast.save_pretrained(path)


def save_image_tokenizer(path: Path, special: list[str], image_part: str) -> dict[str, int]:
    """A word-level tokenizer holding ``special`` tokens, with a chat template that writes
    ``image_part`` for each image part; returns the special tokens' ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + list("abcdefghijklmnopqrstuvwxyz") + special
    words += [f"w{i}" for i in range(320 - len(words))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=special)
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }} {% if m['content'] is string %}"
        "{{ m['content'] }} {% else %}{% for p in m['content'] %}"
        "{% if p['type'] in ('image', 'image_url') %}" + image_part + " "
        "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}a{% endif %}")
    fast.save_pretrained(path)
    return {t: words.index(t) for t in special}


def hf_vision(path: Path) -> tuple:
    """transformers' model (float32, on the CPU), tokenizer and image processor of the
    multimodal checkpoint at ``path``."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def make_vision_checkpoint(path: Path) -> Path:
    """A random Qwen3.5 multimodal checkpoint (``qwen3_5``: the hybrid language model and a
    two-block vision tower) with a word-level tokenizer holding the image tokens, a chat
    template that writes one ``<|image_pad|>`` per image part, and Qwen2-VL's image processor
    (patches of 16, merged 2 x 2, images scaled to at most 128 x 128 pixels)."""
    import transformers as tf

    ids = save_image_tokenizer(path, ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                      "<|video_pad|>"],
                               "<|vision_start|><|image_pad|><|vision_end|>")
    tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                             min_pixels=32 * 32, max_pixels=128 * 128).save_pretrained(path)
    cfg = tf.Qwen3_5Config(
        text_config=dict(COMMON, num_hidden_layers=4, head_dim=64, hidden_size=64,
                         intermediate_size=128, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, rope_parameters={
                             "rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                             "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=16),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], video_token_id=ids["<|video_pad|>"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(15)
    model = tf.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # make every weight matter (HF zero-inits biases, ones norms)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.1).log())
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_gemma4_vision_checkpoint(path: Path, bidirectional: bool = True,
                                  vision: dict | None = None, **text) -> Path:
    """A random Gemma 4 multimodal checkpoint (``gemma4``: a six-layer language model of
    windows of 8 and per-layer inputs, a two-layer vision tower of patches of 8 pooled 2 x 2)
    with a word-level tokenizer holding the image tokens, a chat template that writes one
    ``<|image|>`` per image part, and Gemma 4's image processor (at most 70 soft tokens an
    image). ``bidirectional``: the published configs' ``use_bidirectional_attention:
    "vision"`` (an image's tokens see each other on the window layers); ``vision``, ``text``:
    more tower and language-model fields (heads of 64 for GPU kernels; a tower that
    standardizes and clips, whose statistics and bounds are drawn)."""
    import transformers as tf

    ids = save_image_tokenizer(path, ["<|image|>", "<|image>", "<image|>", "<|video|>"],
                               "<|image|>")
    tf.Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=70,
                               pooling_kernel_size=2).save_pretrained(path)
    text = {**COMMON, "num_hidden_layers": 6, "head_dim": 32, "global_head_dim": 64,
            "hidden_size": 64, "intermediate_size": 128, "sliding_window": 8,
            "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 320,
            "final_logit_softcapping": 5.0,
            "use_bidirectional_attention": "vision" if bidirectional else None, **text}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                  pooling_kernel_size=2, patch_size=8, position_embedding_size=64,
                  **(vision or {}))
    cfg = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          image_token_id=ids["<|image|>"], boi_token_id=ids["<|image>"],
                          eoi_token_id=ids["<image|>"], video_token_id=ids["<|video|>"],
                          tie_word_embeddings=True)
    torch.manual_seed(16)
    model = tf.Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # make every weight matter (HF ones norms and scalars)
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if "norm" in name or name.endswith("layer_scalar"):
                t.add_(torch.randn_like(t) * 0.1)
            elif name.endswith(("std_bias", "std_scale")):
                t.copy_(torch.randn_like(t) * 0.1 + name.endswith("std_scale"))
            elif name.endswith(("_min", "_max")):  # clipping bounds that bite
                t.fill_(-0.5 if name.endswith("_min") else 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def pack_mxfp4(checkpoint: Path, root: Path) -> tuple[Path, Path]:
    """A tiny gpt-oss ``checkpoint`` with its experts packed to MXFP4 as the published ones are
    (``*_blocks``, ``*_scales``, ``quant_method: mxfp4``) at ``root/mxfp4``, and the same
    values dequantized as a bf16-layout checkpoint at ``root/ref`` (transformers' reference)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4
    path = root / "mxfp4"
    shutil.copytree(checkpoint, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows_last = tensors.pop(name)  # [E, in, out] → MXFP4 of [E, out, in]
        blocks, scales = mxfp4.quantize(rows_last.transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(cfg))
    ref = root / "ref"
    shutil.copytree(checkpoint, ref)
    dense = {n: (mxfp4.dequantize(t, tensors[n.replace("_blocks", "_scales")], torch.float32)
                 .transpose(1, 2).contiguous() if n.endswith("_blocks") else t)
             for n, t in tensors.items() if not n.endswith("_scales")}
    save_file({n.removesuffix("_blocks"): t for n, t in dense.items()},
              str(ref / "model.safetensors"))
    return path, ref
