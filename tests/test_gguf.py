"""GGUF checkpoints: tiny ones written from Hugging Face checkpoints (names, llama.cpp's q/k row
order, quantized types, -tp slices), and bad files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_models import write_gguf, write_tokenizer_gguf
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import copy_shard, shard_map
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models.loader import build_model, resolve_model

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 80))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {kind: make_checkpoint(kind, d / kind) for kind in ("llama", "qwen2", "qwen3")}


def run(model: str, params: SamplingParams = GREEDY) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy outputs, and the logits of the last step."""
    eng = Engine(EngineConfig(model=model, device="cpu", backend="sdpa", dtype="float32",
                              max_num_seqs=4))
    seqs = eng.generate(PROMPTS, params)
    return [s.output_token_ids for s in seqs], eng.runner.last_logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_an_f32_gguf_is_the_checkpoint_it_was_written_from(ckpts, tmp_path, kind):
    """Names, llama.cpp's q/k row order (llama) or none (Qwen), tied embeddings and the config
    from the metadata: the same logits, to the bit."""
    gguf = write_gguf(ckpts[kind], tmp_path / f"{kind}.gguf")
    src = resolve_model(str(gguf))
    ref = resolve_model(str(ckpts[kind])).hf_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "tie_word_embeddings", "eos_token_id"):
        assert getattr(src.hf_config, key) == getattr(ref, key), key
    assert src.hf_config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)  # a float32
    tokens, logits = run(str(gguf))
    ref_tokens, ref_logits = run(str(ckpts[kind]))
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 3e-2),
                                       ("Q5_1", 0.1), ("Q4_0", 0.3)])
def test_quantized_ggufs_dequantize_close_to_the_weights(ckpts, tmp_path, qtype, tol):
    gguf = write_gguf(ckpts["llama"], tmp_path / f"{qtype}.gguf", qtype)
    first = SamplingParams(max_tokens=1, temperature=0.0)  # the prompts' logits
    _, logits = run(str(gguf), first)
    _, ref = run(str(ckpts["llama"]), first)
    assert float((logits - ref).abs().max() / ref.abs().max()) < tol


def test_k_quant_rows_read_alone_equal_the_whole_tensor(tmp_path):
    """Q4_K, Q5_K and Q6_K blocks (256 values along a row): a rank's rows, dequantized alone,
    are those rows of the whole tensor, in Hugging Face's shape."""
    import gguf
    from gguf.quants import dequantize

    from pagedgen.runtime.models.gguf_file import GGUFTensor, open_reader

    rng = np.random.default_rng(0)
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        q = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[q]
        raw = rng.integers(0, 256, (6, 2 * size), dtype=np.uint8)  # 6 rows of 512 values
        if name != "Q6_K":  # keep the f16 scales finite: d and dmin are a row block's first bytes
            raw.reshape(6, 2, size)[:, :, :4] = np.frombuffer(
                np.float16([0.01, 0.001]).tobytes(), np.uint8)
        else:  # Q6_K's f16 scale is its last 2 bytes
            raw.reshape(6, 2, size)[:, :, -2:] = np.frombuffer(np.float16([0.01]).tobytes(),
                                                                np.uint8)
        w.add_tensor(name, raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for t in open_reader(path).tensors:
        whole = dequantize(t.data, t.tensor_type)
        x = GGUFTensor(t, path)
        assert x.get_shape() == [6, 512] and np.isfinite(whole).all()
        assert torch.equal(x[:], torch.from_numpy(whole))
        assert torch.equal(x[(slice(2, 5),)], torch.from_numpy(whole[2:5]))
        assert torch.equal(x[(slice(None), slice(256, 512))], torch.from_numpy(whole[:, 256:]))


def test_each_tensor_parallel_rank_loads_its_slices_of_a_gguf(ckpts, tmp_path):
    gguf = write_gguf(ckpts["llama"], tmp_path / "llama.gguf", "Q8_0")
    src = resolve_model(str(gguf))
    full = dict(build_model(src, "auto", torch.float32, torch.device("cpu")).named_parameters())
    for rank in range(2):
        model = build_model(src, "auto", torch.float32, torch.device("cpu"),
                            tp=TensorParallel(rank, 2))
        shards = shard_map(model)
        for name, p in model.named_parameters():
            want = torch.empty_like(p)
            if name in shards:
                copy_shard(want, shards[name], full[name])
            else:
                want = full[name]
            assert torch.equal(p, want), (rank, name)


def test_generate_takes_a_gguf_file_and_refuses_bad_ones(ckpts, tmp_path):
    gguf = write_gguf(ckpts["llama"], tmp_path / "ok.gguf")
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [1, 5, 9]}) + "\n")
    runner = CliRunner()

    def invoke(model: Path, *extra) -> str:
        res = runner.invoke(app, ["generate", *STOP, str(src), "--device", "cpu",
                                  "--max-tokens", "3", "--model", str(model), "-o",
                                  str(tmp_path / "o.jsonl"),
                                  *extra])
        return f"{res.exit_code} {res.output.strip()}"

    assert invoke(gguf).startswith("0 ")
    (tmp_path / "o.jsonl").unlink()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[:50_000])
    gpt2 = write_gguf(ckpts["llama"], tmp_path / "gpt2.gguf", arch="gpt2")
    moe = write_gguf(ckpts["llama"], tmp_path / "moe.gguf", experts=8)
    iq = tmp_path / "iq.gguf"
    data = bytearray(gguf.read_bytes())
    pos = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight") + 4 + 2 * 8
    data[pos:pos + 4] = (20).to_bytes(4, "little")  # its type: IQ4_NL
    iq.write_bytes(bytes(data))
    for model, message in [
            (truncated, "truncated.gguf: not a readable GGUF file"),
            (gpt2, "GGUF architecture 'gpt2' is not supported (supported: llama, qwen2, qwen3)"),
            (moe, "llama.expert_count: mixture-of-experts GGUF files are not supported"),
            (iq, "tensor 'blk.0.attn_q.weight' is of GGUF type IQ4_NL, which pagedgen cannot"),
            (tmp_path / "none.gguf", "none.gguf: no such GGUF file")]:
        out = invoke(model)
        assert out.startswith("1 error: ") and message in out.replace("\n", ""), out
        assert len(out.splitlines()) <= 3 and "Traceback" not in out
        assert not (tmp_path / "o.jsonl").exists()  # nothing written
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")  # text, and no tokenizer in the file
    out = invoke(gguf)
    assert out.startswith("1 error: ") and "has no tokenizer" in out.replace("\n", ""), out


def test_a_gguf_tokenizer_is_converted_once_then_loaded_from_its_saved_files(tmp_path,
                                                                              monkeypatch):
    """transformers converts a GGUF file's tokenizer from its metadata (seconds for a real
    vocabulary); the conversion is saved, and the next run's tokenizer (not converted again)
    encodes, renders chats and decodes as the converted one. A changed file is converted
    again."""
    from transformers import AutoTokenizer

    from pagedgen.runtime.models import tokenizer as tk

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "t.gguf")
    tk._auto_tokenizer.cache_clear()
    try:
        fresh = tk.HFTokenizer(tmp_path, None, gguf_file=path.name)
        saved = tk.converted_tokenizer_dir(path)
        assert (saved / "tokenizer_config.json").is_file()
        tk._auto_tokenizer.cache_clear()
        convert = AutoTokenizer.from_pretrained

        def no_conversion(name, *args, **kw):
            assert "gguf_file" not in kw, "converted again"
            return convert(name, *args, **kw)

        monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
        again = tk.HFTokenizer(tmp_path, None, gguf_file=path.name)
        texts = ["the then", "h\u00e9llo\nthe end <|end|>", ""]
        assert again.encode_batch(texts) == fresh.encode_batch(texts) == [
            [116, 257, 258, 110], [104, 195, 169, 108, 108, 111, 10, 116, 257, 32, 101, 110, 100,
                                  32, 259], []]  # bytes, merges, and the end token whole
        chats = [[{"role": "user", "content": "the"}, {"role": "assistant", "content": "hi"}]]
        assert again.apply_chat_template_batch(chats) == fresh.apply_chat_template_batch(chats)
        ids = list(range(260))
        assert again.decode(ids, skip_special_tokens=False) == fresh.decode(
            ids, skip_special_tokens=False)
        assert again.eos_token_ids == fresh.eos_token_ids == {259}
        monkeypatch.setattr(AutoTokenizer, "from_pretrained", convert)
        write_tokenizer_gguf(path, merges=("Ġ t", "h e"))
        assert tk.converted_tokenizer_dir(path) != saved
    finally:
        tk._auto_tokenizer.cache_clear()
