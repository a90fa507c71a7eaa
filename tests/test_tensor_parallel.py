"""Tensor parallelism on the CPU (gloo): sharded models equal the unsharded one, shards are cut
from the checkpoint as they are read, and the command line starts and stops its ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_models import make_checkpoint
from test_first_minutes import worker_pids
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.cli.verify.model_checks import compare, trace
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.config import EngineConfig
from pagedgen.runtime.drivers.launch import WorkerError, Workers, free_port
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models.loader import build_model, resolve_model

runner = CliRunner()
PROMPTS = [[5, 9, 3], list(range(20, 57)), [7] * 16 + [8, 9]]


def config(model: str, tp: int = 1) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", load_format="auto", num_blocks=64,
                        block_size=16, max_model_len=128, max_num_seqs=4,
                        max_num_batched_tokens=32,  # chunked prefill
                        async_scheduling=False, tensor_parallel_size=tp)


def traces_worker(models: list[str], inbox):
    """Every model's greedy trace on this rank's shard (one process group for all)."""
    for model in models:
        logits, outputs = trace(Engine(config(model, 2)), PROMPTS, 6)
        yield {k: v.numpy() for k, v in logits.items()}, outputs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    base = tmp_path_factory.mktemp("tp")
    return [str(make_checkpoint("llama", base / "llama-kv2")),  # 2 KV heads: one per rank
            str(make_checkpoint("llama", base / "llama-kv1", num_key_value_heads=1)),  # replicated
            str(make_checkpoint("qwen3", base / "qwen3"))]  # q/k norms, tied embeddings


def assert_tp2_equals_tp1(models: list[str], tol: float = 1e-5) -> None:
    """Each model sharded over 2 gloo ranks gives one rank's logits (within ``tol``, relative)
    and greedy tokens (the MoE families' test uses it too)."""
    with Workers(traces_worker, [(models,)], [None], tp=2) as w:
        got = [msg for _, msg in w.messages()]
    assert len(got) == len(models)
    for model, sharded in zip(models, got):
        ref = trace(Engine(config(model)), PROMPTS, 6)
        row = compare(ref, sharded, tol, model)
        assert row.worst_abs < 1e-4 and row.passed, (model, row)
        assert sharded[1] == ref[1], model  # greedy tokens, token for token
        assert row.cases == 3 * 6


@pytest.mark.process
def test_tp2_logits_and_greedy_tokens_equal_tp1(checkpoints):
    assert_tp2_equals_tp1(["tiny", *checkpoints])


class RecordingSlice:
    """A checkpoint tensor that records which rows are read from it (as safetensors' lazy
    slices do, only the indexed part is materialized)."""

    def __init__(self, tensor: torch.Tensor, reads: list) -> None:
        self.tensor, self.reads = tensor, reads

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index]

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


def test_each_rank_loads_its_slices_of_the_checkpoint(checkpoints, monkeypatch):
    from safetensors.torch import load_file

    path = Path(checkpoints[0])  # Llama: 4 query heads, 2 KV heads, head_dim 32
    ckpt = load_file(str(path / "model.safetensors"))
    src = resolve_model(str(path))
    for rank in range(2):
        reads: list = []
        weights = [(n, RecordingSlice(t, reads)) for n, t in ckpt.items()]
        monkeypatch.setattr("pagedgen.runtime.models.loader._iter_safetensors",
                            lambda *a: iter(weights))
        model = build_model(src, "safetensors", torch.float32, torch.device("cpu"),
                            tp=TensorParallel(rank, 2))
        p = dict(model.named_parameters())
        layer = "model.layers.1"
        q, k, v = (ckpt[f"{layer}.self_attn.{x}_proj.weight"] for x in "qkv")
        qkv = p[f"{layer}.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv, torch.cat([q[64 * rank:64 * (rank + 1)],
                                           k[32 * rank:32 * (rank + 1)],
                                           v[32 * rank:32 * (rank + 1)]]))
        o = ckpt[f"{layer}.self_attn.o_proj.weight"]
        assert torch.equal(p[f"{layer}.self_attn.o_proj.weight"], o[:, 64 * rank:64 * (rank + 1)])
        gate, up = (ckpt[f"{layer}.mlp.{x}_proj.weight"] for x in ("gate", "up"))
        assert torch.equal(p[f"{layer}.mlp.gate_up_proj.weight"],
                           torch.cat([gate[128 * rank:128 * (rank + 1)],
                                      up[128 * rank:128 * (rank + 1)]]))
        down = ckpt[f"{layer}.mlp.down_proj.weight"]
        assert torch.equal(p[f"{layer}.mlp.down_proj.weight"], down[:, 128 * rank:128 * (rank + 1)])
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary 320: 160 each
            assert torch.equal(p[name], ckpt[name][160 * rank:160 * (rank + 1)])
        assert torch.equal(p["model.norm.weight"], ckpt["model.norm.weight"])  # replicated
        # sharded tensors were read a slice at a time; only 1-D norms were read whole
        whole = [i for i in reads if i is Ellipsis]  # load_segment's whole read
        assert len(whole) == sum(t.dim() == 1 for t in ckpt.values())


@pytest.mark.process
def test_generate_tp2_after_ctrl_c_resumes_to_the_tp1_file(tmp_path, one_layer):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"line {i} " * (i % 7 + 1),
                                       "max_tokens": 16 + i % 5}) + "\n" for i in range(48)))
    common = ["generate", str(src), "--model", one_layer, "--device", "cpu", "--temperature",
              "0", "--max-num-seqs", "4"]
    assert runner.invoke(app, [*common, "-o", str(tmp_path / "one.jsonl")]).exit_code == 0
    want = (tmp_path / "one.jsonl").read_text()
    out = tmp_path / "tp.jsonl"
    script = str(Path(sys.executable).with_name("pagedgen"))
    # its own process group with Ctrl-C's default action, as a terminal's foreground job (a
    # runner that ignores SIGINT, as a background job does, would pass that on to the child)
    proc = subprocess.Popen([sys.executable, script, *common, "-o", str(out), "-tp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        workers |= set(worker_pids(proc.pid))
        if out.exists() and out.read_text().count("\n") >= 1:  # at once: a fast run could end
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole group, workers included
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    assert len(workers) >= 2
    for _ in range(100):  # every rank is gone
        if not any(Path(f"/proc/{w}").exists() for w in workers):
            break
        time.sleep(0.1)
    assert not any(Path(f"/proc/{w}").exists() for w in workers)
    done = out.read_text().count("\n")
    assert 1 <= done < 48
    res = runner.invoke(app, [*common, "-o", str(out), "-tp", "2", "--resume", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["skipped_resumed"] == done and summary["requests"] == 48 - done
    assert summary["tensor_parallel_size"] == 2  # the engine's own summary
    assert summary["kv_cache_blocks"] > 0 and summary["startup_s"] > 0
    assert out.read_text() == want


@pytest.mark.process
def test_generate_under_torchrun(tmp_path, one_layer):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i} " * 9, "max_tokens": 4}) + "\n"
                           for i in range(6)))
    outs = []
    script = str(Path(sys.executable).with_name("pagedgen"))  # the installed command
    for launcher in ([], [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(free_port())]):
        out = tmp_path / f"out{len(outs)}.jsonl"
        cmd = [*(launcher or [sys.executable]), script, "generate", str(src), "-o", str(out),
               "--model", one_layer, "--device", "cpu", "--temperature", "0", "--json"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(out.read_text())
        if launcher:  # one summary (rank 0's), saying two ranks
            assert res.stdout.count('"requests"') == 1
            assert json.loads(res.stdout[res.stdout.index("{"):])["tensor_parallel_size"] == 2
    assert outs[0] == outs[1]


def test_bad_tp_options_fail_before_anything_starts(tmp_path, checkpoints):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a"}\n')
    for args, message in [
            (["-tp", "3"], "-tp 3: tiny: 4 attention heads cannot be split over 3"),
            (["-tp", "3", "--model", checkpoints[0]],  # its config.json, read as it is
             "llama-kv2: 4 attention heads cannot be split over 3"),
            (["-tp", "0"], "--tensor-parallel-size must be in 1.."),
            (["-tp", "2", "--device", "cuda"], "-dp 1 -tp 2 needs 2 GPUs"
             if torch.cuda.device_count() == 1 else "CUDA is not available here"),
            (["-tp", "2", "--device", "cpu", "--backend", "flashinfer"],
             "backend 'flashinfer' cannot run here"),
            (["-tp", "2", "--ray", "local"], "-tp is for local runs")]:
        t0 = time.perf_counter()
        res = runner.invoke(app, ["generate", str(src), *args])
        assert res.exit_code == 1 and message in res.output.replace("\n", ""), res.output
        assert "Traceback" not in res.output
        assert time.perf_counter() - t0 < 5  # no worker was started and waited for
    assert not (tmp_path / "p.completions.jsonl").exists()


def barrier_or_fail(inbox, error: type[Exception] = RuntimeError):
    import torch.distributed as dist

    from pagedgen.runtime.collectives import parallel

    if parallel.current().rank == 1:
        raise error("rank 1 fails")
    yield "waiting"
    dist.barrier()  # rank 0 would wait here forever
    yield "never"


@pytest.mark.process
def test_a_failing_rank_stops_the_others():
    t0 = time.perf_counter()
    seen = []
    with pytest.raises(WorkerError, match=r"worker 0 \(tensor-parallel rank 1\): "
                                          r"RuntimeError: rank 1 fails"):
        with Workers(barrier_or_fail, [()], [None], tp=2) as w:
            for _, msg in w.messages():
                seen.append(msg)
    assert "never" not in seen
    assert all(not p.is_alive() for p in w.procs)
    assert time.perf_counter() - t0 < 60


def bad_input_or_barrier(inbox):
    from pagedgen.errors import PagedgenError

    return barrier_or_fail(inbox, PagedgenError)


@pytest.mark.process
def test_a_rank_s_bad_input_error_is_its_message_alone():
    """A PagedgenError in a rank is the user's one line, without its type and source line."""
    with pytest.raises(WorkerError, match=r"^worker 0 \(tensor-parallel rank 1\): "
                                          r"rank 1 fails$"):
        with Workers(bad_input_or_barrier, [()], [None], tp=2) as w:
            for _ in w.messages():
                pass


@pytest.mark.process
def test_verify_and_profile_take_tp(tmp_path, one_layer):
    res = runner.invoke(app, ["verify", "--backend", "sdpa", "--device", "cpu", "--cases", "1",
                              "--steps", "4", "-tp", "2"])
    assert res.exit_code == 0, res.output
    assert "tensor parallel 2" in res.output and "FAIL" not in res.output
    res = runner.invoke(app, ["profile", "--model", one_layer, "--device", "cpu", "-tp", "2",
                              "--batch-sizes", "2",
                              "--output-len", "6", "--measured-steps", "2",
                              "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "profile.json").read_text())["results"][0]
    assert result["tensor_parallel_size"] == 2
    assert result["phases"]["decode"]["groups_us"]["all-reduce"] > 0


def test_shapes_that_cannot_be_sharded_say_which():
    from types import SimpleNamespace

    from pagedgen.runtime.models.families.llama import LlamaForCausalLM

    tensor_parallel_error = LlamaForCausalLM.tensor_parallel_error

    def cfg(heads=8, kv=4, inter=64):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                               intermediate_size=inter)

    assert tensor_parallel_error(cfg(), 2) is None
    assert tensor_parallel_error(cfg(kv=1), 4) is None  # one KV head, replicated on 4 ranks
    assert tensor_parallel_error(cfg(kv=2), 4) is None  # 2 KV heads, each on 2 ranks
    assert "6 KV heads" in tensor_parallel_error(cfg(heads=12, kv=6), 4)
    assert "intermediate_size 66" in tensor_parallel_error(cfg(inter=66), 4)
    assert "8 attention heads" in tensor_parallel_error(cfg(), 3)


def where_and_what(inbox):
    env = os.environ
    yield os.getcwd(), env.get("PAGEDGEN_TEST_MARK"), env.get("PAGEDGEN_HOST_PROCESSES")


@pytest.mark.process
def test_cpu_workers_run_in_the_callers_folder_and_environment_of_now(tmp_path, monkeypatch):
    """CPU workers come forked from a forkserver started before (in the folder and with the
    environment it started in): each still runs in its caller's folder (multiprocessing's
    doing) and environment (ours) as they are when it starts, its share of the cores
    included."""
    import multiprocessing

    from pagedgen.runtime.drivers.launch import start_method

    forks = "forkserver" in multiprocessing.get_all_start_methods()
    assert start_method([None, None]) == ("forkserver" if forks else "spawn")
    assert start_method([[0], None]) == "spawn"
    with Workers(where_and_what, [()], [None]) as w:  # the server started, if not yet
        assert [m for _, m in w.messages()] == [(os.getcwd(), None, "1")]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAGEDGEN_TEST_MARK", "now")
    with Workers(where_and_what, [(), ()], [None, None]) as w:
        assert [m for _, m in w.messages()] == [(str(tmp_path), "now", "2")] * 2
