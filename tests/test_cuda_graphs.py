"""Decode CUDA graphs (runtime/worker/cuda_graphs.py): which batch sizes get a graph, what a
capture in the middle of a run warms up first, and how many seats a device gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedgen.runtime.worker.cuda_graphs import graph_buckets


@pytest.mark.parametrize("seats", [1, 3, 8, 63, 128, 255, 256, 257, 300, 1024, 1000])
def test_every_batch_size_has_a_bucket_and_padding_stays_small(seats):
    b = graph_buckets(seats)
    assert b == sorted(set(b)) and b[0] >= 1 and b[-1] == seats
    for n in range(1, seats + 1):
        bucket = next(s for s in b if s >= n)
        # padding a step to its bucket: at most 8 rows to 64, 16 to 256, 32 beyond
        assert bucket - n < (8 if n <= 64 else 16 if n <= 256 else 32), (n, bucket)


def test_buckets_up_to_256_seats_are_those_of_every_earlier_release():
    assert graph_buckets(256) == [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16)]
    assert graph_buckets(100) == [1, 2, 4, *range(8, 65, 8), 80, 96, 100]


def test_a_thousand_seats_capture_steps_of_32_beyond_256():
    b = graph_buckets(1024)
    assert b[b.index(256):] == list(range(256, 1025, 32))
    assert len(b) == 47


# ---- the seats a device gives (vLLM's rule) -----------------------------------------------

@pytest.mark.parametrize("name, gib, seats", [
    ("NVIDIA H200", 139.8, 1024), ("NVIDIA H100 80GB HBM3", 79.1, 1024),
    ("NVIDIA A100-SXM4-80GB", 79.2, 256), ("NVIDIA L4", 22.0, 256),
    ("NVIDIA GH200 96GB", 94.5, 1024), ("NVIDIA H100 PCIe 64GB", 63.9, 256)])
def test_default_seats_and_step_tokens_follow_vllms_rule(monkeypatch, name, gib, seats):
    import torch

    from pagedgen.runtime import hardware
    from pagedgen.runtime.config import EngineConfig

    props = SimpleNamespace(name=name, total_memory=int(gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert hardware.default_max_num_seqs(torch.device("cuda")) == seats
    assert hardware.default_max_num_seqs(torch.device("cpu")) == 128
    monkeypatch.setattr(EngineConfig, "torch_device", lambda self: torch.device("cuda"))
    assert EngineConfig().with_step_limits().max_num_seqs == seats
    assert EngineConfig(max_num_seqs=7).with_step_limits().max_num_seqs == 7  # an explicit count
    # never more seats than tokens a step holds
    assert EngineConfig(max_num_batched_tokens=300).with_step_limits().max_num_seqs == \
        min(seats, 300)
    tokens = 16384 if seats == 1024 else 8192  # vLLM's LLM class: its prefill chunk budget
    assert hardware.default_batched_tokens(torch.device("cuda")) == tokens
    assert hardware.default_batched_tokens(torch.device("cpu")) == 8192
    assert EngineConfig().with_step_limits().max_num_batched_tokens == tokens
    assert EngineConfig(max_num_batched_tokens=300).with_step_limits().max_num_batched_tokens == 300


def test_gpu_presets_leave_the_seats_and_step_tokens_to_the_device():
    from pagedgen.runtime.profiles import configs_from_profile, list_profiles, load_profile

    for name in list_profiles():
        cfg, _ = configs_from_profile(load_profile(name))
        assert (cfg.max_num_seqs is None) == (name not in ("tiny", "smollm2-135m")), name
        assert (cfg.max_num_batched_tokens is None) == (name != "tiny"), name


# ---- captures in the middle of a run: what warms up first ---------------------------------

class _FakeGraph:
    fail = 0  # captures left to fail
    capturing = False

    def capture_begin(self, *pool, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"  # other threads' CUDA calls stay legal
        _FakeGraph.capturing = True

    def capture_end(self):
        _FakeGraph.capturing = False
        if _FakeGraph.fail:
            _FakeGraph.fail -= 1
            raise RuntimeError("operation not permitted when stream is capturing")

    def pool(self):
        return "pool"


class _State:
    def make_graph_plan(self, *args):
        pass

    def build(self, md, graph_batch_size=None):
        return md


def _runner(monkeypatch, seats=1024):
    import contextlib

    import torch

    from pagedgen.runtime.worker import cuda_graphs as cg

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    eager = []

    def model(ids, pos, caches, md):
        if not _FakeGraph.capturing:
            eager.append(len(ids))
        return torch.zeros(len(ids), 4)

    r = cg.CudaGraphRunner(model, _State(), [], seats, 256, 16, 0, torch.device("cpu"))
    return r, eager


def test_start_up_warms_every_bucket_and_a_run_warms_each_cascade_key_once(monkeypatch):
    """Start-up captures warm every bucket up eagerly; a cascade graph captured during a run
    warms up only for the first bucket of its key with each remainder mod 16 (the rest of its
    forward was warmed up by the bucket's plain graph), and every graph is recorded."""
    r, eager = _runner(monkeypatch)
    r.capture()
    start = [b for b in r.buckets if b <= cg_max()]
    assert len(eager) == len(start) and set(r.graphs[(0, 0)]) == set(start)
    eager.clear()
    for bs in (1024, 992, 512, 288, 64, 56, 48, 24, 8, 4, 2, 1, 16):
        r._capture(bs, (1, 8))
    r._capture(512, (2, 16))  # another key warms up again
    # 992..288, 64, 48, 16 as 1024 (0 mod 16); 24 and 8 as 56 (8 mod 16)
    assert eager == [1024, 56, 4, 2, 1, 512]
    assert len(r.graphs[(1, 8)]) == 13 and len(r.graphs[(2, 16)]) == 1
    s = r.summary()
    assert s["graphs_captured_in_run"] == 14 and s["graph_warmups_in_run"] == 6


def test_a_capture_that_fails_without_warming_up_warms_up_and_captures_again(monkeypatch):
    r, eager = _runner(monkeypatch)
    r._capture(1024, (1, 4))
    eager.clear()
    monkeypatch.setattr(_FakeGraph, "fail", 1)
    r._capture(512, (1, 4))  # no warm-up planned: the capture fails, then warms up
    assert eager == [512] and 512 in r.graphs[(1, 4)] and r.summary()["graph_warmups_in_run"] == 2
    _FakeGraph.fail = 2  # fails after a warm-up too: the error is the caller's
    with pytest.raises(RuntimeError, match="capturing"):
        r._capture(256, (1, 4))


def cg_max() -> int:
    from pagedgen.runtime.worker.cuda_graphs import STARTUP_CAPTURE_MAX
    return STARTUP_CAPTURE_MAX


def test_buckets_past_512_rows_are_captured_by_the_first_step_that_needs_them(monkeypatch):
    """1,024 seats: start-up captures the 31 buckets up to 512 rows; a step of 700 decodes
    captures 704's graph then (no eager warm-up: 512's start-up graph warmed its kernels'
    kind), counted as a capture in the run, and the next step of 700 replays it."""
    import torch

    from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq

    r, eager = _runner(monkeypatch)
    r.capture()
    assert max(r.graphs[(0, 0)]) == 512 and len(r.graphs[(0, 0)]) == 31
    eager.clear()
    md = AttentionMetadataBuilder(16, torch.device("cpu")).build(
        [], [ScheduledSeq([i], 3, 1) for i in range(700)])
    ids = torch.zeros(700, dtype=torch.long)
    for _ in range(2):
        bs, key = r.prepare(ids, ids, md)
        assert (bs, key) == (704, (0, 0))
    assert 704 in r.graphs[(0, 0)] and eager == []
    assert r.summary()["graphs_captured_in_run"] == 1
