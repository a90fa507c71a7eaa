"""Qwen3.5 and Qwen3-Next (issue 60): hybrid Gated DeltaNet linear attention beside gated full
attention, against transformers' own models (fp32, CPU; three linear layers to one full), and
the engine's recurrent state: chunked prefill at every chunk size, preemption and recompute,
``n`` samples forked from a prompt's state, resume, multimodal checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import make_checkpoint
from test_hf_equivalence import (
    check_greedy_with_preemption,
    check_logits,
    fused_kernels,
    hf_model,
    ids,
)

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.scheduler import ScheduledBatch
from pagedgen.runtime.output.report import run_summary

KINDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_checkpoint("qwen3_5_text", tmp_path_factory.mktemp("dense"),
                           with_tokenizer=True)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers(checkpoint, backend):
    """Prefill whole, and in chunks of 11 (the state carried from chunk to chunk)."""
    check_logits(checkpoint, backend)


@pytest.mark.kernels
def test_fused_kernels_match_transformers(checkpoint):
    """The norms, the q/k norms with partial rotary (one kernel), the gated norm and SwiGLU as
    the fused Triton kernels (on a CPU: in Triton's interpreter) give transformers' logits."""
    check_logits(checkpoint, "eager", chunks=(11,), setup=fused_kernels)


def test_greedy_generation_matches_transformers_through_preemption(checkpoint):
    """A cache small enough to preempt: a preempted sequence's slot is freed and its state
    rebuilt by the recompute."""
    check_greedy_with_preemption(checkpoint)


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                               block_size=8, num_blocks=32, max_num_seqs=4,
                               max_num_batched_tokens=64, **kw))


def test_prefill_in_chunks_of_every_size_gives_transformers_logits(dense):
    prompt = ids(21, seed=5)
    with torch.no_grad():
        want = hf_model(dense)(torch.tensor([prompt])).logits[0]
    eng = _engine(dense)
    runner, bm = eng.runner, eng.block_manager
    for chunk in range(1, len(prompt) + 1):
        seq = eng.add_request(prompt, SamplingParams(max_tokens=1))
        eng.scheduler.waiting.clear()
        got = []
        for start in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - start)
            bm.allocate(seq, start + n)
            ids_t, pos_t, md = runner.prepare(ScheduledBatch(prefills=[(seq, n)]))
            with torch.inference_mode():
                h = runner.model(ids_t, pos_t, runner.kv_caches, runner.plan(md))
                got.append(runner.model.compute_logits(h))
            seq.num_computed_tokens += n
        torch.testing.assert_close(torch.cat(got), want, atol=2e-4, rtol=1e-4, msg=str(chunk))
        bm.free(seq)
    assert len(bm.free_slots) == eng.config.max_num_seqs  # every slot back


def test_n_samples_fork_the_prompts_state(dense):
    """Greedy samples of one request all continue from the prompt's state: each equals the
    request run alone (a sample started from a zero state would not)."""
    prompt = ids(13, seed=2)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = _engine(dense).generate([prompt], greedy)[0].output_token_ids
    eng = _engine(dense)
    seqs = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0,
                                                 ignore_eos=True, n=3))
    assert [s.output_token_ids for s in seqs[0].samples] == [alone] * 3
    assert len(eng.block_manager.free_slots) == eng.config.max_num_seqs


def test_prefix_caching_is_off_and_the_summary_says_why(dense):
    eng = _engine(dense)
    eng.generate([ids(9)], SamplingParams(max_tokens=2))
    summary = run_summary(eng, 1.0, 0.0)
    assert not eng.block_manager.prefix_caching
    assert summary["prefix_caching"].startswith("off: linear-attention")
    assert summary["linear_attention_layers"] == 3 and summary["recurrent_state_slots"] == 5
    assert summary["recurrent_state_bytes"] == 5 * summary["recurrent_state_bytes_per_slot"]


def test_generate_and_resume_write_the_same_tokens(dense, tmp_path):
    from typer.testing import CliRunner

    from pagedgen.cli.app import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a b c w{i} w{2 * i}", "max_tokens": 6})
                               + "\n" for i in range(6)))
    args = ["generate", str(prompts), "--model", str(dense), "--device", "cpu",
            "--temperature", "0"]
    out = tmp_path / "out.jsonl"
    assert CliRunner().invoke(app, args + ["-o", str(out)]).exit_code == 0
    first = out.read_text()
    out.write_text("".join(first.splitlines(keepends=True)[:2]))  # a crash after two lines
    res = CliRunner().invoke(app, args + ["-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    assert out.read_text() == first


def _multimodal(src, dst):
    """``src``'s checkpoint as Qwen3.5's published ones hold it: the config under
    ``text_config``, the tensors under ``model.language_model``, multi-token prediction's
    tensors beside them (one with a vision tower: tests/test_images.py)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "tie_word_embeddings": False}))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["mtp.fc.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_multimodal_checkpoint_runs_its_language_model(dense, tmp_path):
    path = _multimodal(dense, tmp_path / "mm")
    prompt = ids(12, seed=7)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _engine(dense).generate([prompt], greedy)[0].output_token_ids
    assert _engine(path).generate([prompt], greedy)[0].output_token_ids == want


def test_image_parts_parse_and_a_text_model_refuses_them_in_one_line(dense, tmp_path):
    """A line's image parts become the template's image parts and the line's images; other
    parts are one-line errors; a model without a vision tower refuses the line by name."""
    import json

    from typer.testing import CliRunner

    from pagedgen.cli.app import app
    from pagedgen.runtime.inputs.request import Request, set_prompt

    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "x"}}]}]
    req = Request(0, 1, 0)
    set_prompt(req, "messages", image, "p.jsonl:1", "messages")
    assert req.messages[0]["content"][1] == {"type": "image"} and req.images == ["x"]
    with pytest.raises(PagedgenError, match="only text and image parts.*'input_audio'"):
        set_prompt(Request(0, 1, 0), "messages", [{"role": "user", "content": [
            {"type": "input_audio"}]}], "p.jsonl:1", "messages")
    req = Request(0, 1, 0)
    set_prompt(req, "messages", [{"role": "user", "content": [
        {"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
        "p.jsonl:1", "messages")
    assert req.messages == [{"role": "user", "content": "two \nparts"}] and req.images is None
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"messages": image}) + "\n")
    res = CliRunner().invoke(app, ["generate", str(src), "--model", str(dense), "--device",
                                   "cpu", "-o", str(tmp_path / "o.jsonl"), "--on-bad-line",
                                   "stop"])
    assert res.exit_code != 0 and "p.jsonl:1: " in res.output
    assert "takes no images" in res.output and "Traceback" not in res.output


def test_a_misshapen_grouped_projection_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("qwen3_next", tmp_path / "next")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(PagedgenError, match=f"'{name}' has shape"):
        _engine(path)


@pytest.mark.process
def test_tp2_equals_tp1(checkpoint):
    """Two gloo ranks, each with half the full-attention heads (query, gate, KV), half the
    linear-attention key heads with the value heads they serve (their q, k, v, z, b, a rows,
    convolution channels, A and dt, recurrent state) and half of every MLP: one rank's greedy
    trace. Qwen3-Next's per-group projections, Qwen3.5's fused in_proj_qkv, and the MoE's
    shared expert."""
    from test_fp8 import assert_tp2_trace_equals_tp1
    assert_tp2_trace_equals_tp1(str(checkpoint), checkpoint.name, steps=4)


def test_a_split_that_does_not_divide_the_heads_is_refused_with_the_reason(dense):
    from pagedgen.runtime.models import registry
    from pagedgen.runtime.models.loader import resolve_model

    cfg = resolve_model(str(dense)).hf_config  # 2 linear-attention key heads
    assert registry.model_class(cfg).tensor_parallel_error(cfg, 2) is None
    why = registry.model_class(cfg).tensor_parallel_error(cfg, 4)
    assert why == "linear_num_key_heads 2 cannot be split over 4 tensor-parallel ranks"


def test_the_configs_ssm_dtype_keeps_the_delta_rule_state_in_float32(dense, tmp_path):
    """Qwen3.5's configs name ``mamba_ssm_dtype: float32`` (in ``text_config``): a bfloat16
    run keeps the delta-rule matrices in float32 (the convolution window in bfloat16), counted
    so in the memory plan; a value that is no dtype is a one-line error."""
    path = _multimodal(dense, tmp_path / "mm")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["mamba_ssm_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg))
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", backend="eager",
                              block_size=8, num_blocks=32, max_num_seqs=4,
                              max_num_batched_tokens=64))
    states = eng.runner.recurrent.states
    assert {(s.conv.dtype, s.ssm.dtype) for s in states.layers} == {
        (torch.bfloat16, torch.float32)}
    assert states.nbytes == sum(s.conv.nbytes + s.ssm.nbytes for s in states.layers)
    out = eng.generate([ids(9, 1)], SamplingParams(max_tokens=4, temperature=0.0,
                                                   ignore_eos=True))
    assert len(out[0].output_token_ids) == 4
    cfg["text_config"]["mamba_ssm_dtype"] = "fp32"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedgenError, match="mamba_ssm_dtype must be one of float32"):
        _engine(path)


def test_in_proj_qkv_and_its_fp8_scales_split_into_q_k_and_v_rows():
    """The fused checkpoint tensor (and FP8 block scales over its rows, or one scale for the
    tensor) as three row ranges, so each rank takes its share of each; scale blocks that
    straddle two parts are a one-line error."""
    from pagedgen.runtime.layers.gated_deltanet import GatedDeltaSpec
    from pagedgen.runtime.models.families.qwen3_next import _split_qkv
    spec = GatedDeltaSpec(2, 4, 16, 16, 4)  # q and k 32 rows each, v 64
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    weight = torch.arange(128.0)[:, None].expand(128, 8)
    parts = dict(_split_qkv(name, weight, spec))
    assert [(k.rsplit(".", 2)[1], v[0, 0].item(), len(v)) for k, v in parts.items()] == [
        ("in_proj_q", 0, 32), ("in_proj_k", 32, 32), ("in_proj_v", 64, 64)]
    blocks = dict(_split_qkv(name + "_scale_inv", torch.arange(8.0)[:, None], spec))
    assert [v.flatten().tolist() for v in blocks.values()] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    one = dict(_split_qkv(name.replace("weight", "input_scale"), torch.tensor(0.5), spec))
    assert list(one) == [name.replace("qkv.weight", f"{p}.input_scale") for p in "qkv"]
    with pytest.raises(ValueError, match="has 2 rows: its q, k and v parts"):
        list(_split_qkv(name + "_scale_inv", torch.ones(2, 1), spec))
