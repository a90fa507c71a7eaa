"""`pagedgen bench throughput`, `latency` and `kernels` (issue 98): random prompts of the asked
lengths, or a dataset's lines, each to its output length with EOS ignored; the figures on a
terminal, as JSON, in a file; the latency's warm-up apart; a profiled run's time by kernel
group; bad options in one line."""

from __future__ import annotations

import json

import pytest
from fake_vllm import fake_vllm_site
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.cli.bench.measures import synthetic_prompts

runner = CliRunner()
FAST = ["--device", "cpu", "--max-num-seqs", "4"]


def bench(*args):
    return runner.invoke(app, ["bench", "throughput", *FAST, *map(str, args)])


def test_throughput_runs_every_request_to_its_length_and_reports_the_rates(tmp_path):
    res = bench("--num-prompts", 6, "--input-len", 12, "--output-len", 5, "--json",
                "-o", tmp_path / "b.json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s == json.loads((tmp_path / "b.json").read_text())
    # every request ran to --output-len (EOS ignored), from prompts of exactly --input-len
    assert (s["requests"], s["prompt_tokens"], s["output_tokens"]) == (6, 72, 30)
    assert s["output_tokens_per_s"] == s["output_tokens"] / s["wall_time_s"]
    assert s["requests_per_s"] == 6 / s["wall_time_s"] and s["startup_s"] > 0
    shown = bench("--num-prompts", 2, "--input-len", 4, "--output-len", 2)
    assert shown.exit_code == 0 and "requests/s" in shown.stdout
    assert shown.stdout.strip().splitlines()[-1].startswith("Throughput: ")


def test_random_prompts_spread_around_the_input_length_and_repeat_by_seed():
    ps = synthetic_prompts(500, 200, 100, 0.5, seed=1)
    lengths = [len(p) for p in ps]
    assert 50 <= min(lengths) < 60 and 140 < max(lengths) <= 150
    assert all(0 <= t < 500 for p in ps for t in p)
    assert ps == synthetic_prompts(500, 200, 100, 0.5, seed=1) != synthetic_prompts(
        500, 200, 100, 0.5, seed=2)
    assert {len(p) for p in synthetic_prompts(500, 5, 3, 0.0, 0)} == {3}


def test_a_dataset_gives_its_lines_and_their_own_lengths_eos_ignored(tmp_path):
    # the second line pushes the tiny preset's EOS (257) up: it still writes all 7 tokens
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in (
        {"prompt_token_ids": [1, 2, 3]},
        {"prompt_token_ids": [4, 5], "max_tokens": 7, "logit_bias": {"257": 100}},
        {"prompt_token_ids": [6]})) + "\n")
    res = bench("--dataset", src, "--num-prompts", 2, "--output-len", 3, "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert (s["requests"], s["prompt_tokens"], s["output_tokens"]) == (2, 5, 3 + 7)


def test_bad_options_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    for args, message in ((["--dataset", tmp_path / "none.jsonl"], "cannot read it"),
                          (["--dataset", tmp_path / "bad.jsonl"], "bad.jsonl:1: invalid JSON"),
                          (["--max-num-seqs", 0], "--max-num-seqs must be in 1..")):
        res = bench(*args)
        assert res.exit_code != 0 and message in res.output, res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_latency_times_each_batch_size_after_its_warm_up(tmp_path, monkeypatch):
    import pagedgen.runtime.api as api

    calls = []
    generate = api.LLM.generate

    def counted(self, prompts, params=None, use_tqdm=True, **kw):
        calls.append(len(prompts))
        return generate(self, prompts, params, use_tqdm, **kw)

    monkeypatch.setattr(api.LLM, "generate", counted)
    res = runner.invoke(app, ["bench", "latency", "--device", "cpu", "--batch-sizes", "1,3",
                              "--input-len", "40", "--output-len", "3", "--num-iters-warmup", "2",
                              "--num-iters", "4", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert calls == [1] * 6 + [3] * 6  # warm-up, then the measured batches, per size
    for r, size in zip(rows, (1, 3)):
        assert r["batch_size"] == size and len(r["latencies_s"]) == 4
        assert r["avg_latency_s"] == sum(r["latencies_s"]) / 4
        assert r["p50_latency_s"] in r["latencies_s"] and r["p99_latency_s"] == max(
            r["latencies_s"])
        assert 0 < r["mean_ttft_s"] <= r["avg_latency_s"] and r["mean_tpot_s"] > 0
        assert r["prefix_cache_hit_tokens"] == 0  # each batch prefilled afresh
    bad = runner.invoke(app, ["bench", "latency", "--device", "cpu", "--batch-sizes", "0,x"])
    assert bad.exit_code == 1 and "--batch-sizes: positive integers" in bad.output


def test_kernels_divides_the_profiled_run_by_kernel_group():
    """`bench kernels` on a CPU: the profiled run's operators' self time by group (the model's
    GEMMs and its attention among them), their sum the groups', every request run."""
    res = runner.invoke(app, ["bench", "kernels", *FAST, "--num-prompts", "5", "--input-len",
                              "12", "--output-len", "3", "--top", "4", "--json"])
    assert res.exit_code == 0, res.output
    k = json.loads(res.stdout)
    assert (k["requests"], k["output_tokens"], k["measured"]) == (
        5, 15, "CPU operators' self time")
    assert k["groups_s"]["GEMM"] > 0 and k["groups_s"]["attention"] > 0
    assert abs(sum(k["groups_s"].values()) - k["device_s"]) < 1e-9 and len(k["top_s"]) == 4
    assert 0 < k["device_s"] <= k["wall_time_s"] and k["launches"] > 0
    shown = runner.invoke(app, ["bench", "kernels", *FAST, "--num-prompts", "2",
                                "--input-len", "4", "--output-len", "2"])
    assert shown.exit_code == 0 and "pagedgen bench kernels" in shown.stdout


FAKE_LLM = '''
class LLM:
    def __init__(self, model, load_format, **kw):
        cfg = json.load(open(os.path.join(model, "config.json")))
        json.dump({"load_format": load_format, "architectures": cfg["architectures"], **kw},
                  open(os.environ["FAKE_VLLM_SAW"], "w"))
        print("INFO 12-07 10:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 1,234 tokens")
    def generate(self, prompts, params, use_tqdm=False):
        return [_Result([7] * params.max_tokens) for _ in prompts]
'''


@pytest.mark.process
def test_the_vllm_peer_runs_the_same_prompts_in_its_own_process(tmp_path, monkeypatch):
    """`--peer vllm`: the same token ids through vLLM in a process of its own (a stand-in
    package here, found as $PAGEDGEN_VLLM_SITE), a preset as its config on dummy weights, the
    run's dtype, each request to its length; the ratio of the two; where vLLM is not
    installed, the reason, pagedgen's figures kept."""
    site = fake_vllm_site(tmp_path / "site", FAKE_LLM, "def TokensPrompt(prompt_token_ids):\n"
                          "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PAGEDGEN_VLLM_SITE", str(site))
    monkeypatch.setenv("FAKE_VLLM_SAW", str(tmp_path / "saw.json"))
    res = bench("--num-prompts", 4, "--input-len", 8, "--output-len", 3, "--peer", "vllm",
                "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    theirs = s["peer"]
    assert theirs["system"] == "vLLM 0.0.fake" and theirs["requests"] == 4
    assert theirs["output_tokens"] == s["output_tokens"] == 12
    assert s["vs_vllm"] == s["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    assert theirs["vllm_kv_cache_tokens"] == 1234
    saw = json.loads((tmp_path / "saw.json").read_text())
    assert saw["load_format"] == "dummy" and saw["architectures"] == ["LlamaForCausalLM"]
    assert saw["dtype"] == s["dtype"] and saw["skip_tokenizer_init"] is True
    monkeypatch.setenv("PAGEDGEN_VLLM_SITE", str(tmp_path / "none"))
    res = bench("--num-prompts", 2, "--input-len", 4, "--output-len", 2, "--peer", "vllm")
    assert res.exit_code == 0 and "--peer vllm: vLLM is not installed here" in res.output
    bad = bench("--peer", "sglang")
    assert bad.exit_code == 1 and "--peer: vllm" in bad.output
