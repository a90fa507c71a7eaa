"""Request scale: a host cost per request that does not grow with the queue, and output faults."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.cli.formats.output import OutputWriter
from pagedgen.cli.formats.output_claim import OutputClaim
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.sequence import Sequence

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def write_requests(path: Path, n: int, **fields) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": [256, i % 256], **fields})
                    + "\n")
    return path


def ids_in(path: Path) -> list:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_engine_never_compares_sequences_by_value(monkeypatch):
    """Queues of thousands must not compare sequences field by field: any ``==`` between two
    sequences (``in``, ``list.remove``) fails this test, through preemption, chunked prefill,
    async stops and finishing while preempted."""
    def no_eq(self, other):
        raise AssertionError("Sequence compared by value")

    monkeypatch.setattr(Sequence, "__eq__", no_eq)
    eng = Engine(EngineConfig(device="cpu", backend="sdpa", load_format="dummy", block_size=4,
                              num_blocks=24, max_num_seqs=6, max_num_batched_tokens=32))
    # later requests finish first, so finishing one is never a removal from the queue's front
    params = [SamplingParams(max_tokens=40 - 3 * i, temperature=1.0, seed=i,
                             stop=["z"] if i % 3 == 0 else []) for i in range(12)]
    eng.add_requests(([256] + [(7 * i + j) % 256 for j in range(3 + 4 * i)], p, None, i)
                     for i, p in enumerate(params))
    done = []
    eng.run(on_finish=done.append)
    assert len(done) == 12 and eng.stats.num_preemptions > 0
    assert eng.block_manager.num_free_blocks == 23  # every block back (one is the scratch block)


def test_lazy_intake_keeps_a_bounded_window_of_sequences():
    eng = Engine(EngineConfig(device="cpu", backend="sdpa", load_format="dummy", max_num_seqs=8,
                              max_num_batched_tokens=64))
    made = []
    add = eng.add_request
    eng.add_request = lambda *a, **k: made.append(add(*a, **k)) or made[-1]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    eng.add_requests(([256, i % 256], params, i, i) for i in range(500))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, len(eng.scheduler.waiting) + len(eng.scheduler.running))
    assert len(made) == 500 and [s.request for s in made] == list(range(500))
    assert peak <= 2 * 8  # the lookahead (max_num_seqs) plus the running seats
    assert eng.stats.requests_finished == 500 and eng.stats.output_tokens == 500


def test_20000_one_token_requests_finish_in_order_each_once(tmp_path):
    src = write_requests(tmp_path / "p.jsonl", 20_000, max_tokens=1)
    out = tmp_path / "o.jsonl"
    res = invoke("generate", src, "-o", out, "--device", "cpu", "--max-num-seqs", 512,
                 "--max-num-batched-tokens", 2048, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["requests"] == 20_000
    assert ids_in(out) == [f"r{i}" for i in range(20_000)]


@pytest.mark.parametrize("make,message", [
    (lambda d: (d / "file").write_text("") or d / "file" / "o.jsonl", "is not a directory"),
    (lambda d: (d / "dir").mkdir() or d / "dir", "is a directory"),
])
def test_unwritable_output_fails_before_the_model_loads(tmp_path, monkeypatch, make, message):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "__init__", no_load)
    src = write_requests(tmp_path / "p.jsonl", 3)
    res = invoke("generate", src, "-o", make(tmp_path), "--device", "cpu")
    assert res.exit_code == 1, res.output
    assert message in res.output.replace("\n", "") and "Traceback" not in res.output


def test_disk_full_mid_run_keeps_lines_and_resume_finishes(tmp_path, monkeypatch):
    src = write_requests(tmp_path / "p.jsonl", 40, max_tokens=3, temperature=0)
    args = ["--device", "cpu", "--max-num-seqs", 4, "--max-num-batched-tokens", 64]
    clean = tmp_path / "clean.jsonl"
    assert invoke("generate", src, "-o", clean, *args).exit_code == 0
    out = tmp_path / "o.jsonl"
    real_write, writes, lines = os.write, [], []

    def write(fd, data):
        if bytes(data[:7]) == b'{"id": ':  # the completions file's writes only
            writes.append(fd)
            lines.append(bytes(data).count(b"\n"))
            if len(writes) == 4:  # a short write: a line and part of the next
                return real_write(fd, bytes(data[:bytes(data).index(b"\n") + 21]))
        elif len(writes) >= 4 and fd == writes[0]:  # the rest of that write: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    res = invoke("generate", src, "-o", out, *args)
    monkeypatch.undo()
    assert res.exit_code == 1, res.output
    text = res.output.replace("\n", "")
    assert "No space left on device" in text and str(out.name) in text
    assert "Traceback" not in res.output
    data = out.read_bytes()  # whole lines only: three writes' and one of the fourth's
    kept = data.decode().splitlines()
    assert data.endswith(b"\n") and len(kept) == sum(lines[:3]) + 1
    assert all(json.loads(line)["id"].startswith("r") for line in kept)
    assert f"the {len(kept)} lines written are kept" in text
    res = invoke("generate", src, "-o", out, *args, "--resume", "--json")
    assert res.exit_code == 0, res.output
    assert out.read_text() == clean.read_text()


def test_writer_reorders_linearly_and_only_when_needed(tmp_path):
    index_of = {f"r{i}": i for i in range(6)}
    path = tmp_path / "o.jsonl"

    def claim(resume: bool) -> OutputClaim:
        return OutputClaim(path, [], "sha", {}, resume=resume, overwrite=False)

    class Writer(OutputWriter):  # records in, as the engine's lines come
        def write(self, records):
            self.write_lines([(index_of[r["id"]], json.dumps(r)) for r in records])

    w = Writer(claim(False), index_of, lambda obj: True)
    w.write([{"id": "r0"}, {"id": "r1"}])
    w.write([{"id": "r2"}])
    inode = path.stat().st_ino
    w.close()
    assert path.stat().st_ino == inode  # already in order: not rewritten
    w = Writer(claim(True), index_of, lambda obj: True)
    assert w.num_done == 3 and w.is_done(2) and not w.is_done(3)
    w.write([{"id": "r5", "x": 1}, {"id": "r3"}])
    w.close()
    assert ids_in(path) == ["r0", "r1", "r2", "r3", "r5"]
    # a line of an id this input does not have, or one that is not a whole record, is dropped
    path.write_text(path.read_text() + json.dumps({"id": "other"}) + "\n")
    w = Writer(claim(True), index_of, lambda obj: "x" not in obj)
    assert w.num_done == 4 and w.num_dropped == 2 and not w.is_done(5)
    w.write([{"id": "r4"}, {"id": "r5"}])
    w.close()
    assert ids_in(path) == ["r0", "r1", "r2", "r3", "r4", "r5"]
