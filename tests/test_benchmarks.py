"""The benchmark helpers on CPU: repeated runs on one engine, the roofline estimate."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import common, peers, roofline, workloads  # the root is on pytest's path


def test_run_engine_repeats_on_one_engine():
    cfg, sampling = common.profile_configs("tiny", device="cpu", backend="sdpa")
    prompts = common.random_prompts(4, 5, 30, vocab=256)
    params = [replace(sampling, max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (3, 5, 7, 9)]
    runs = common.run_engine(cfg, prompts, params, copy_bw=1e11, repeats=2)
    assert len(runs) == 2
    for r in runs:
        assert r["output_tokens"] == 24 and r["requests"] == 4
        assert r["decode_steps"] > 0 and 0 < r["decode_roofline_fraction"]
        assert r["sequences"] == 4 and 1 <= r["distinct_tokens_mid"] <= 4


def test_workload_requests_are_fixed_and_in_range():
    wl = peers.WORKLOADS["c"]
    a, outs = wl.requests(vocab=1000)
    b, outs2 = wl.requests(vocab=1000)
    assert a == b and outs == outs2 and len(a) == 256
    assert all(100 <= len(p) <= 1024 for p in a) and all(100 <= n <= 1024 for n in outs)


def test_output_spread_counts_the_tokens_sequences_share():
    same = [[5, 7, 7, 7], [9, 7, 7], [1, 2, 7, 3]]  # position 1 (of the shortest's 3): 7, 7, 2
    assert workloads.output_spread(same) == {
        "distinct_tokens_mid": 2, "distinct_tokens_all": 6, "sequences": 3}
    assert workloads.output_spread([[], []]) == {  # max_tokens 0: prompt log-probs only
        "distinct_tokens_mid": 0, "distinct_tokens_all": 0, "sequences": 2}


def test_sampled_moe_workloads_are_their_greedy_ones_at_temperature_1():
    w = workloads.WORKLOADS
    for k in ("m", "o", "j"):
        assert w[k + "t"] == replace(w[k], temperature=1.0) and w[k].temperature == 0.0
        assert w[k + "t"].requests(1000) == w[k].requests(1000)


# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 10 (tied)
ROOFLINE_CONFIG = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=4, intermediate_size=16,
                                  vocab_size=10, tie_word_embeddings=True)
ROOFLINE_LINEAR = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16)  # matmul weights a token meets


def test_roofline_estimate_by_hand():
    c, linear = ROOFLINE_CONFIG, ROOFLINE_LINEAR
    flops, bw = 1e3, 1e2
    prefill = (2 * linear * 3 + 2 * 80 + 2 * 2 * 8 * 9) / flops
    assert roofline.roofline_s(c, [[1, 2, 3]], [1], flops, bw) == pytest.approx(prefill)
    weights = 2 * (linear + 80)
    kv_token = 2 * 2 * 4 * 2
    step = max((weights + 4 * kv_token) / bw, 2 * (linear + 80) / flops)
    assert roofline.roofline_s(c, [[1, 2, 3]], [2], flops, bw) == pytest.approx(prefill + step)


def test_roofline_of_a_moe_model_counts_the_experts_a_step_reads():
    """4 experts of width 16, 2 per token: a token's FLOPs meet 2 experts; a decode step of
    one token reads 2 experts' weights, of two tokens 4 * (1 - (1/2)^2) = 3 expected."""
    c = SimpleNamespace(**vars(ROOFLINE_CONFIG), num_local_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16)
    flops, bw = 1e3, 1e2
    attn, expert = 8 * (8 + 2 * 4) + 8 * 8, 3 * 8 * 16
    linear = 2 * (attn + 2 * expert)
    kv_token = 2 * 2 * 4 * 2
    prefill = (2 * linear * 3 + 2 * 80 + 2 * 2 * 8 * 9) / flops
    step = max((2 * (2 * (attn + 2 * expert) + 80) + 4 * kv_token) / bw,
               2 * (linear + 80) / flops)
    assert roofline.roofline_s(c, [[1, 2, 3]], [2], flops, bw) == pytest.approx(prefill + step)
    two = roofline.roofline_s(c, [[1, 2, 3], [4, 5, 6]], [2, 2], flops, bw)
    step2 = max((2 * (2 * (attn + 3 * expert) + 80) + 8 * kv_token) / bw,
                2 * 2 * (linear + 80) / flops)
    assert two == pytest.approx(2 * prefill + step2)


def test_roofline_estimate_with_a_shared_prefix_by_hand():
    """(d): the shared prefix is prefilled once and its K/V read once per decode step."""
    c, linear = ROOFLINE_CONFIG, ROOFLINE_LINEAR
    flops, bw = 1e3, 1e2
    prompts, outs = [[9, 9, 1], [9, 9, 2, 3]], [1, 2]
    # attention: 4 FLOPs per query-key pair per query feature and layer (QK and PV); a causal
    # block of n tokens has about n^2 / 2 pairs, n new tokens over the prefix n x 2
    attn = 4 * 2 * 8
    prefill = (2 * linear * 2 + attn * 2 * 2 / 2  # the prefix, once
               + 2 * linear * 1 + 2 * 80 + attn * 1 * 2 + attn * 1 * 1 / 2  # 1 new token
               + 2 * linear * 2 + 2 * 80 + attn * 2 * 2 + attn * 2 * 2 / 2) / flops  # 2 new
    kv_token = 2 * 2 * 4 * 2
    step = max((2 * (linear + 80) + (2 + 3) * kv_token) / bw, 2 * (linear + 80) / flops)
    got = roofline.roofline_s(c, prompts, outs, flops, bw, shared=2)
    assert got == pytest.approx(prefill + step)
    assert got < roofline.roofline_s(c, prompts, outs, flops, bw)  # no reuse costs more


def test_roofline_of_a_hybrid_model_counts_attention_only_on_its_full_layers():
    """Two layers, one Gated DeltaNet (2 key heads and 2 value heads of 4, no KV cache) and one
    full attention (its q_proj also writes the output gate), a shared expert of width 8 beside
    4 routed experts of width 16 (2 per token)."""
    c = SimpleNamespace(**vars(ROOFLINE_CONFIG), layer_types=["linear_attention",
                                                              "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
                        linear_value_head_dim=4, num_local_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, shared_expert_intermediate_size=8)
    flops, bw = 1e3, 1e2
    attn = 8 * (2 * 8 + 2 * 4) + 8 * 8
    gdn = 8 * (2 * 8 + 2 * 8 + 2 * 2) + 8 * 8
    expert, shared = 3 * 8 * 16, 3 * 8 * 8
    linear = attn + gdn + 2 * (2 * expert + shared)
    state = 2 * 4 * 4  # value heads x key width x value width
    # one attention layer's causal pairs (3 tokens: 9 / 2) and 4 FLOPs per state entry a token
    prefill = (2 * linear * 3 + 2 * 80 + 4 * 8 * 9 / 2 + 4 * state * 3) / flops
    kv_token = 2 * 1 * 4 * 2  # K and V of one layer's one KV head, bf16
    step_bytes = 2 * (attn + gdn + 2 * (2 * expert + shared)) + 2 * 80 + 4 * kv_token \
        + 2 * 2 * state
    step = max(step_bytes / bw, (2 * (linear + 80) + 4 * state) / flops)
    assert roofline.roofline_s(c, [[1, 2, 3]], [2], flops, bw) == pytest.approx(prefill + step)
    assert roofline.kv_bytes_per_token(c) == kv_token


def test_roofline_caps_a_sliding_layers_keys_at_its_window():
    """A 2-token window over 4 causal queries (pairs counted as the full layer's n^2 / 2): 2^2 /
    2 under the window, then 2 keys each; decode reads 2 tokens' K/V there, all 5 in the full
    layer."""
    c = SimpleNamespace(**vars(ROOFLINE_CONFIG), layer_types=["sliding_attention",
                                                              "full_attention"],
                        sliding_window=2)
    m = roofline.Shapes.of(c)
    assert m.pairs(4, 0) == 4 * 4 / 2 + (2 * 2 / 2 + 2 * 2)
    assert m.decode_kv_bytes([5]) == 2 * 4 * 2 * (5 + 2)
    assert roofline.Shapes.of(SimpleNamespace(**{**vars(c), "sliding_window": None})).pairs(
        4, 0) == 2 * 4 * 4 / 2


def test_transformers_peers_run_the_requested_lengths():
    from pagedgen.runtime.models.loader import resolve_model

    model = peers.hf_model(resolve_model("tiny").hf_config, device="cpu").float()
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert peers.hf_padded(model, prompts, [3, 2, 4], batch_size=2) > 0
    # asserts each output length; a cache of 8 pages (not one sized from the host's RAM, which
    # peaked at 6-12 GB of this test process)
    assert peers.hf_continuous(model, prompts, [3, 2, 4], cache_blocks=8) > 0


@pytest.mark.parametrize("tied", [False, True])
def test_step_weight_bytes_skips_an_untied_embedding_table(tied):
    """A decode step reads its tokens' rows of the embedding table, not the table: rooflines
    count it only when it doubles as the LM head."""
    from pagedgen.runtime.models.families.llama import LlamaForCausalLM
    from pagedgen.runtime.models.loader import resolve_model

    cfg = resolve_model("tiny").hf_config
    cfg.tie_word_embeddings = tied
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.model.embed_tokens.weight
    expected = total if tied else total - table.numel() * table.element_size()
    assert model.step_weight_bytes() == expected
    c = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=4, intermediate_size=16, vocab_size=10,
                        tie_word_embeddings=tied)
    assert roofline.roofline_s(c, [[1, 2, 3]], [2], 1e3, 1e2) == pytest.approx(
        roofline.roofline_s(SimpleNamespace(**{**vars(c), "tie_word_embeddings": not tied}),
                         [[1, 2, 3]], [2], 1e3, 1e2))


def test_vllm_peer_takes_our_limits_and_is_skipped_with_the_reason(monkeypatch):
    from benchmarks import vllm_peer
    from pagedgen.runtime.models.loader import resolve_model

    cfg, _ = common.profile_configs("llama-3-8b")
    # the preset leaves the seats and the step's tokens to the device: a CPU's here
    assert cfg.max_num_seqs is None and cfg.max_num_batched_tokens is None
    assert vllm_peer.same_limits(cfg) == {"max_num_seqs": 128, "max_num_batched_tokens": 8192,
                                          "enable_prefix_caching": True}
    assert vllm_peer.same_limits(replace(cfg, max_num_seqs=300))["max_num_seqs"] == 300
    monkeypatch.setattr(vllm_peer, "vllm_site", lambda: None)
    res = vllm_peer.run_vllm("a", 4, resolve_model("tiny").hf_config, {})
    assert "not installed" in res["skipped"]
    with pytest.raises(ValueError, match="dummy weights are gone"):
        vllm_peer.run_vllm("a", 4, resolve_model("tiny").hf_config, {},
                           weights=("normal", "dummy"))


def test_a_failed_vllm_run_reports_the_engine_cores_traceback_not_only_the_clients():
    from benchmarks import vllm_peer

    core = "".join(f"(EngineCore pid=7) {x}\n" for x in (  # as vLLM's logger prefixes them
        "Traceback (most recent call last):", "  File worker.py", "ValueError: unsupported layer"))
    client = ("noise\n" * 2000 + "Traceback (most recent call last):\n  File llm.py\n"
              "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    res = vllm_peer.failure("INFO start\n" + core, client)  # EngineCore logs to stdout
    assert "ValueError: unsupported layer" in res["skipped"]
    assert "EngineDeadError" in res["skipped"]
    assert "ValueError: unsupported layer" in res["log"] and "INFO start" not in res["log"]
    assert res["log"].rstrip().endswith("EngineCore encountered an issue.")


def test_a_failed_vllm_run_names_the_fatal_traceback_not_a_warm_up_it_logged_as_a_warning():
    from benchmarks import vllm_peer

    def logged(level: str, *lines: str) -> str:  # as vLLM's logger writes them
        return "".join(f"(EngineCore pid=7) {level} 12-07 17:33:55 [core.py:9] {x}\n"
                       for x in lines)

    warm_up = logged("WARNING", "Traceback (most recent call last):", "  File gdn.py",
                     "NotImplementedError: SM90 GDN prefill DSL kernel is unavailable")
    fatal = logged("ERROR", "EngineCore failed to start.", "Traceback (most recent call last):",
                   "  File core.py", "RuntimeError: CUDA out of memory")
    client = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    res = vllm_peer.failure(warm_up + fatal, client)
    assert "RuntimeError: CUDA out of memory" in res["skipped"]
    assert "NotImplementedError" not in res["skipped"]
    assert res["log"].startswith("(EngineCore pid=7) ERROR") and "RuntimeError" in res["log"]
    only_warned = vllm_peer.failure(warm_up, client)  # no fatal one: the warning's is all there is
    assert "NotImplementedError" in only_warned["skipped"]


def test_vllms_kernel_choices_are_kept_from_its_log_once_each():
    from benchmarks import vllm_peer

    log = ("INFO 11-27 06:50:01 [cuda.py:300] Using FLASH_ATTN backend.\n"
           "INFO 11-27 06:50:02 [fused_moe.py:800] Using default MoE config. Performance "
           "might be sub-optimal!\n"
           "INFO 11-27 06:50:03 [gpu_model_runner.py:10] Loading weights took 0.5 s\n"
           "(EngineCore pid=7) INFO 11-27 06:50:04 [cuda.py:300] Using FLASH_ATTN backend.\n")
    assert vllm_peer.kernel_lines(log) == [
        "Using FLASH_ATTN backend.",
        "Using default MoE config. Performance might be sub-optimal!"]


def test_vllms_kv_capacity_is_read_from_its_start_up_log():
    from benchmarks import vllm_peer

    log = ("(EngineCore pid=7) INFO 12-06 20:58:57 [kv_cache_utils.py:1087] GPU KV cache "
           "size: 213,344 tokens\n(EngineCore pid=7) INFO 12-06 20:58:57 [kv_cache_utils.py:"
           "1091] Maximum concurrency for 8,192 tokens per request: 26.04x\n")
    assert vllm_peer.kv_capacity(log) == {"vllm_kv_cache_tokens": 213_344,
                                          "vllm_max_concurrency": "26.04x at 8,192 tokens"}
    assert vllm_peer.kv_capacity("INFO no such lines\n") == {}


def test_mixed_steps_diagnostic_counts_every_step_and_its_host_time(tmp_path):
    from benchmarks import mixed_steps

    cfg, sampling = common.profile_configs("tiny", device="cpu", backend="sdpa",
                                           max_num_seqs=4, max_num_batched_tokens=128)
    wl = replace(peers.WORKLOADS["s"], profile="tiny", num_prompts=10, input_len=(5, 40),
                 output_len=(3, 8), system_len=(10, 30))
    prompts, params = mixed_steps._requests(wl, 256, sampling)
    out = mixed_steps.synchronous(cfg, prompts, params, 3, 6, tmp_path)
    kinds = out["decode"]["steps"], out["mixed"]["steps"]
    assert all(kinds) and sum(kinds) == out["steps"] == sum(b["steps"] for b in out["buckets"])
    assert out["buckets"][0]["prefill_tokens"] == "[0, 1)"
    assert set(out["mixed_fit_ms"]) == {"constant", "per_prefill_token", "per_decode"}
    prof = out["profiled"]
    assert sum(prof["steps"].values()) == 6
    for kind, n in prof["steps"].items():
        if n:  # each step's range once, the forward's scope inside it
            host = prof["host_ms_per_step"][kind]
            assert host["count step"] == 1.0 and 0 < host["pg:forward"] <= host["step"]
    assert not (tmp_path / "mixed-steps-trace.json").exists()


def test_gpu_time_divides_into_steps_at_their_markers():
    from benchmarks.mixed_steps import MARKER, step_timeline

    m = MARKER
    kernels = [(0, 1, m), (1, 5, "gemm"), (4, 9, "attn"), (12, 20, "gemm"),  # decode: 3 inside
               (30, 31, m), (31, 40, "gemm"), (45, 50, "attn"),  # mixed: 10 before, 5 inside
               (50, 51, m), (51, 60, "gemm")]  # decode: none idle
    out = step_timeline(kernels, ["decode", "mixed", "decode"])
    times = ("steps", "busy_ms", "idle_before_ms", "idle_inside_ms")
    assert [out["decode"][k] for k in times] == [2, (8 + 8 + 9) / 1000, 0.0, 3 / 1000]
    assert [out["mixed"][k] for k in times] == [1, 14 / 1000, 10 / 1000, 5 / 1000]
    assert out["decode"]["groups_ms"] == pytest.approx({"GEMM": (4 + 8 + 9) / 2000,
                                                        "attention": 5 / 2000})
    assert out["mixed"]["top_ms"] == [("gemm", 9 / 1000), ("attn", 5 / 1000)]


def test_a_traced_window_gives_its_steps_span_and_busy_fraction(tmp_path):
    """``traced_window`` stops the profiler, reads the trace's kernels, removes the file and
    divides the GPU's time among the window's steps."""
    import json

    from benchmarks.mixed_steps import MARKER, traced_window

    events = [{"ph": "X", "cat": "kernel", "ts": s, "dur": e - s, "name": n}
              for s, e, n in [(0, 1, MARKER), (1, 5, "gemm"), (10, 11, MARKER),
                              (15, 20, "attn")]]
    events.append({"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 99, "name": "aten::mm"})

    class Prof:
        stopped = False

        def stop(self):
            self.stopped = True

        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    prof, trace = Prof(), tmp_path / "trace.json"
    per_kind, span, busy = traced_window(prof, trace, ["decode", "mixed"])
    assert prof.stopped and not trace.exists()
    assert span == 20 / 1000 and busy == pytest.approx(9 / 20)  # markers are not work
    assert per_kind["decode"]["busy_ms"] == 4 / 1000
    assert per_kind["mixed"]["idle_before_ms"] == 5 / 1000
    assert per_kind["mixed"]["idle_inside_ms"] == 4 / 1000


def test_run_kernels_groups_both_systems_kernels_by_the_same_rules(tmp_path):
    import gzip

    from benchmarks import run_kernels

    def trace(kernels):
        return {"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "ts": i * 100.0,
                                 "dur": us, "tid": 1, "args": {"correlation": i}}
                                for i, (n, us) in enumerate(kernels)]}

    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(trace([("_grouped_gemm_kernel", 300.0),
                                      ("_grouped_gemm_kernel", 100.0),
                                      ("nvjet_sm90_tst_64x32", 50.0)])))
    theirs = tmp_path / "worker0.pt.trace.json.gz"  # vLLM's workers write gzip
    with gzip.open(theirs, "wt") as f:
        json.dump(trace([("fused_moe_kernel", 250.0), ("flash_fwd_splitkv_kernel", 40.0)]), f)
    a = run_kernels.kernel_table(run_kernels.trace_kernels([ours]))
    b = run_kernels.kernel_table(run_kernels.trace_kernels([theirs]))
    assert a["groups_s"] == pytest.approx({"MoE": 4e-4, "GEMM": 5e-5})
    assert a["top_s"][0] == ("_grouped_gemm_kernel", pytest.approx(4e-4)) and a["launches"] == 3
    assert b["groups_s"] == pytest.approx({"MoE": 2.5e-4, "attention": 4e-5})
    lines = run_kernels.side_by_side([{"system": "pagedgen", **a}, {"system": "vLLM", **b},
                                      {"system": "vLLM fp8", "skipped": "not installed"}])
    assert lines[0].split() == ["group", "pagedgen", "vLLM"]
    assert [line.split()[0] for line in lines[1:4]] == ["attention", "GEMM", "MoE"]
    assert "vLLM fp8: not installed" in lines


def test_run_kernels_finds_where_the_gpu_waited_between_kernels(tmp_path):
    from benchmarks import run_kernels
    from pagedgen.runtime.kernel_stats import load_kernels

    spans = [("a", 0.0, 150.0), ("b", 20.0, 30.0),  # b inside a (two streams): no gap
             ("c", 2200.0, 10.0), ("d", 2310.0, 40.0), ("e", 2350.0, 5.0)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": us, "tid": 1,
         "args": {"correlation": i}} for i, (n, ts, us) in enumerate(spans)]}))
    idle = run_kernels.idle_table(load_kernels(path), wall_s=0.01, largest=2)
    assert idle["idle_s"] == pytest.approx((2050 + 100) / 1e6)  # a ends at 150, c at 2210
    assert idle["gaps_over_1ms"] == 1 and idle["gaps_over_1ms_s"] == pytest.approx(2.05e-3)
    assert idle["outside_kernels_s"] == pytest.approx(0.01 - 2355 / 1e6)
    assert idle["largest_gaps"] == [
        {"at_s": 0.0022, "ms": 2.05, "after": "a", "before": "c"},
        {"at_s": 0.0023, "ms": 0.1, "after": "c", "before": "d"}]
    lines = run_kernels.side_by_side([{"system": "pagedgen", "groups_s": {}, "gpu_s": 0,
                                       "launches": 5, "top_s": [], "idle": idle}])
    assert "2.050 ms at   0.002 s  a -> c" in "\n".join(lines)


def test_prefill_gemms_are_the_hybrid_models_projections_by_hand():
    from benchmarks import prefill_gemms
    from pagedgen.runtime.models.loader import resolve_model

    dense = prefill_gemms.projections(resolve_model("qwen3.5-9b").hf_config)
    assert dense == [("attn qkv+gate", 2 * 16 * 256 + 2 * 4 * 256, 4096, 8),
                     ("attn o", 4096, 16 * 256, 8),
                     ("gdn in (qkvz | ba)", 2 * 2048 + 2 * 4096 + 64, 4096, 24),
                     ("gdn out", 4096, 4096, 24),
                     ("mlp gate_up", 2 * 12288, 4096, 32), ("mlp down", 4096, 12288, 32)]
    moe = prefill_gemms.projections(resolve_model("qwen3.5-35b-a3b").hf_config)
    assert moe[-2:] == [("router | shared gate | gate/up", 256 + 8 + 1024, 2048, 40),
                        ("shared down", 2048, 512, 40)]  # the gate's one row padded to 8


def test_vllm_profiles_its_last_run_where_asked(tmp_path, monkeypatch):
    from benchmarks import vllm_peer
    from pagedgen.runtime.models.loader import resolve_model

    seen = {}

    def fake_run(cmd, timeout, **kw):
        seen.update(json.loads(Path(cmd[-2]).read_text()))
        return 1, "", "Traceback\nRuntimeError: no GPU"

    monkeypatch.setattr(vllm_peer, "vllm_site", lambda: "")
    monkeypatch.setattr(vllm_peer, "run_in_group", fake_run)
    res = vllm_peer.run_vllm("a", 4, resolve_model("tiny").hf_config, {},
                             profile_dir=tmp_path / "traces")
    assert "RuntimeError: no GPU" in res["skipped"]
    assert seen["profile_dir"] == str((tmp_path / "traces").resolve())
    vllm_peer.run_vllm("a", 4, resolve_model("tiny").hf_config, {})
    assert seen["profile_dir"] is None


def test_run_kernels_profiles_a_whole_pagedgen_run(monkeypatch):
    from benchmarks import run_kernels, workloads

    monkeypatch.setitem(workloads.WORKLOADS, "t", workloads.Workload("tiny", 3, (4, 9), (3, 3)))
    row = run_kernels.pagedgen_run("t", None)
    assert row["system"] == "pagedgen" and row["warm_output_tokens_per_s"] > 0
    assert row["profiled_wall_s"] > 0 and row["launches"] == len(row["top_s"]) == 0  # CPU


def test_merged_plans_keep_other_shapes_and_drop_an_arriving_kinds_older_version(tmp_path):
    from benchmarks import kernel_plans as kp

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"moe-plans.json": {"4|a": 1, "5|b": 2},
                                "fp8-gemm-plans.json": {"2|c": 3}}))
    counts = kp.merge(path, "GPU", {"moe-plans.json": {"5|d": 4, "5|b": 5}})
    data = json.loads(path.read_text())
    assert data["moe-plans.json"] == {"5|b": 5, "5|d": 4}  # version 4's plan would never be read
    assert data["fp8-gemm-plans.json"] == {"2|c": 3} and data["gpu"] == "GPU"
    assert counts == {"moe-plans.json": 2, "fp8-gemm-plans.json": 1}


def test_a_preset_that_runs_out_of_memory_while_planned_is_skipped_not_fatal(monkeypatch):
    """One GPU process plans preset after preset: one too large to build is a line, and the
    next runs (torch's out-of-memory error used to end the process)."""
    from benchmarks import kernel_plans as kp

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.44 GiB")

    src, cpu = kp.resolve_model("tiny"), torch.device("cpu")
    monkeypatch.setattr(kp, "build_model", oom)
    assert kp.build(src, None, 1, False, cpu).startswith("out of memory")
    monkeypatch.setattr(kp, "build_model", lambda *args, **kwargs: torch.nn.Linear(1, 1))
    assert kp.build(src, None, 1, False, cpu) is None


def test_presets_planned_on_their_first_layers_keep_every_layer_kind():
    """Plans are keyed by a layer's shape: the first layers a preset is planned on must hold
    every kind of layer (attention shape, linear attention or not) the whole preset has."""
    from benchmarks import kernel_plans as kp
    from pagedgen.runtime.models import registry

    def kinds(src):
        cls = registry.model_class(src.hf_config)
        attn = {repr(s) for s in cls.layer_specs(src.hf_config, 1)}
        return attn, {repr(s) for s in cls.state_specs(src.hf_config, 1)}

    for name in {m for m, _ in kp.default_runs()}:
        full = kp.resolve_model(name)
        short = kp.shortened(full, 4)
        layers = full.hf_config.num_hidden_layers  # 4, or 6 where the sixth is the first
        assert min(4, layers) <= short.hf_config.num_hidden_layers <= min(6, layers)  # global
        assert kinds(short) == kinds(full), name
    assert kp.shortened(full, 0) is full


def test_plan_runs_are_listed_for_a_host_to_deal_over_its_gpus(monkeypatch, capsys):
    from benchmarks import kernel_plans as kp

    monkeypatch.setattr(sys, "argv", ["kernel_plans", "--list", "--models", "tiny,qwen3-0.6b",
                                      "--quantizations", "none,fp8"])
    kp.main()
    assert capsys.readouterr().out.split() == [
        "tiny:none", "tiny:fp8", "qwen3-0.6b:none", "qwen3-0.6b:fp8"]


def test_vllms_site_path_holds_the_cute_dsl_packages_a_target_install_leaves_off(tmp_path):
    from pagedgen.cli.bench import peer

    assert peer.site_path(str(tmp_path)) == str(tmp_path)
    dsl = tmp_path / "nvidia_cutlass_dsl" / "dsl_packages"
    dsl.mkdir(parents=True)
    assert peer.site_path(str(tmp_path)) == f"{tmp_path}:{dsl}"


def test_vllms_fp8_experts_in_the_layer_benchmark_take_one_scale_per_expert():
    from benchmarks.moe_kernels import _per_expert_fp8

    w = torch.randn(3, 8, 16) * torch.tensor([1.0, 30.0, 0.01])[:, None, None]
    q, scale = _per_expert_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3,)
    assert torch.equal(q.float().abs().amax(dim=(1, 2)), torch.full((3,), 448.0))
    back = q.float() * scale[:, None, None]
    assert ((back - w).abs() <= 0.07 * w.abs().amax(dim=(1, 2))[:, None, None]).all()


def test_vllms_weights_drawn_again_in_pagedgens_distribution_keep_scales_and_packed_tensors():
    from benchmarks.vllm_peer import normal_weights

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 256, dtype=torch.bfloat16)
    model.input_layernorm = torch.nn.Module()
    model.input_layernorm.weight = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    experts = model.experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.zeros(4, 128, 64).to(torch.float8_e4m3fn),
                                            requires_grad=False)
    experts.w13_weight_scale = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    experts.packed = torch.nn.Parameter(torch.full((8,), 7, dtype=torch.uint8),
                                        requires_grad=False)
    experts.k_scale = torch.nn.Parameter(torch.tensor(3.0), requires_grad=False)
    assert normal_weights(model) == 4
    assert abs(model.proj.weight.float().std().item() - 0.02) < 0.002
    assert not model.proj.bias.any() and (model.input_layernorm.weight == 1).all()
    w13 = experts.w13_weight.float() * experts.w13_weight_scale[:, None, None]
    assert abs(w13.std().item() - 0.02) < 0.002 and (experts.w13_weight_scale < 1e-3).all()
    assert (experts.packed == 7).all() and experts.k_scale.item() == 3.0


def test_a_vllm_run_that_outruns_its_limit_keeps_the_runs_it_measured(monkeypatch):
    from benchmarks import vllm_peer
    from pagedgen.runtime.models.loader import resolve_model

    def outran(runs):
        def fake_run(cmd, timeout, **kw):
            if runs is not None:  # what the worker writes after each run
                Path(cmd[-1]).write_text(json.dumps({"vllm": "0.26.0", "startup_s": 140.0,
                                                     "engine": {}, "runs": runs}))
            return None, "INFO loading\n", ""
        return fake_run

    monkeypatch.setattr(vllm_peer, "vllm_site", lambda: "")
    run = {"wall_time_s": 5.0, "output_tokens": 10, "output_tokens_per_s": 2.0}
    monkeypatch.setattr(vllm_peer, "run_in_group", outran([run]))
    res = vllm_peer.run_vllm("a", 4, resolve_model("tiny").hf_config, {}, timeout=300)
    assert res["runs"] == [run] and res["outran"] == "vLLM outran 300 s after 1 runs"
    for runs in ([], None):  # started but measured nothing, or never started
        monkeypatch.setattr(vllm_peer, "run_in_group", outran(runs))
        res = vllm_peer.run_vllm("a", 4, resolve_model("tiny").hf_config, {}, timeout=300)
        assert res["skipped"] == "vLLM outran 300 s before its first run"
        assert "INFO loading" in res["log"]


@pytest.mark.process
def test_a_process_group_outrunning_its_limit_is_killed_with_its_children(tmp_path):
    from benchmarks import vllm_peer

    pid_file = tmp_path / "child.pid"  # the worker's own child: vLLM's engine process
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
            "time.sleep(60)")
    rc, out, _ = vllm_peer.run_in_group([sys.executable, "-c", code], timeout=3)
    assert rc is None and "started" in out
    child = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie until init reaps it
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the worker's child outlived the limit")
    assert vllm_peer.run_in_group([sys.executable, "-c", "print(1)"], timeout=30) == (0, "1\n", "")


def test_peers_gives_a_vllm_row_per_weight_set_and_ratios_against_each(monkeypatch):
    runs = {"dummy": [12.0, 11.0], "normal": [9.0, 10.0]}  # output tokens per second
    wl = replace(peers.WORKLOADS["m"], num_prompts=2, input_len=(4, 4), output_len=(3, 3))
    out_tok = wl.output_tokens(wl.requests(1000)[1])

    def fake_vllm(name, num_prompts, hf_config, engine, repeats, weights):
        assert weights == ("dummy", "normal")
        return {"vllm": "0.26.0", "startup_s": 140.0, "outran": "vLLM outran 9 s after 4 runs",
                "runs": [{"weights": w, "output_tokens": out_tok, "output_tokens_per_s": r,
                          "wall_time_s": out_tok / r, "distinct_tokens_mid": 2}
                         for w, rs in runs.items() for r in rs]}

    monkeypatch.setattr(peers, "run_vllm", fake_vllm)
    rows: list[dict] = []
    peers.run_workload("m", wl, [], ["vllm"], 2, 1, 1, 1e12, 1e11, rows, lambda: None, [],
                       vllm_weights=("dummy", "normal"))
    assert [r["system"] for r in rows] == ["vLLM 0.26.0",
                                          "vLLM 0.26.0 (pagedgen's weight distribution)"]
    assert [r["runs_output_tokens_per_s"] for r in rows] == [[12.0, 11.0], [9.0, 10.0]]
    assert rows[0]["output_tokens_per_s"] == pytest.approx(12.0)  # the median of two: the upper
    assert rows[1]["vs vLLM 0.26.0"] == pytest.approx(10.0 / 12.0)


def test_the_schedule_replay_counts_preemptions_only_where_the_cache_is_short():
    from benchmarks.schedule_replay import workload_replay
    roomy = workload_replay("g", 260_000)  # every sequence of g held at once
    assert roomy["windows"] == [128] and roomy["preemptions"] == 0
    assert roomy["recomputed_tokens"] == 0 and roomy["decode_only_steps"] == 255
    short = workload_replay("g", 213_408)  # the H100's cache: ~15% short
    assert short["preemptions"] > 0 and short["recomputed_tokens"] > 0
    assert short["steps"] > roomy["steps"]


def test_vllm_gets_gemma_4s_global_shape_in_the_published_form(tmp_path):
    """vLLM reads ``global_head_dim`` and ``num_global_key_value_heads`` by ``getattr`` (else
    its global layers take heads of 256) and ``head_dim``: on the config transformers makes
    of the written file, with vLLM's ``hf_overrides`` applied as vLLM applies them
    (``config.update``), all three read as the published Gemma-4-31B's."""
    import json

    from transformers import AutoConfig

    from pagedgen.cli.bench import peer
    from pagedgen.runtime.models.loader import resolve_model

    cfg, more = peer.peer_config(resolve_model("gemma-4-31b").hf_config)
    assert cfg["architectures"] == ["Gemma4ForCausalLM"] and set(more) == {"hf_overrides"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoConfig.from_pretrained(tmp_path)
    loaded.update(more["hf_overrides"])
    assert (loaded.head_dim, loaded.global_head_dim, loaded.num_global_key_value_heads,
            loaded.num_key_value_heads, loaded.attention_k_eq_v) == (256, 512, 4, 16, True)
    qwen, more = peer.peer_config(resolve_model("qwen3.5-9b").hf_config)
    assert qwen["model_type"] == "qwen3_5" and more == {"language_model_only": True}
