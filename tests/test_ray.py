"""pagedgen on Ray Data: the CLI's --ray replicas, the Generator in a user's own pipeline, and a
replica that dies mid-batch (a local Ray instance, CPU)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app

ray = pytest.importorskip("ray")  # in the test extra; CI installs it

CPU = {"device": "cpu"}


@pytest.fixture(scope="module")
def local_ray():
    # 3 logical CPUs: two actors and Ray Data's own tasks (2 would deadlock)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def prompts(tmp_path, n: int = 30):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"prompt {i}" * (i % 3 + 1),
                                        "max_tokens": i % 6 + 1, "tag": i}) + "\n"
                            for i in range(n)))
    return path


@pytest.mark.process
def test_cli_replicas_write_the_single_process_output(local_ray, tmp_path):
    src = prompts(tmp_path)
    common = ["generate", str(src), "--device", "cpu", "--temperature", "0",
              "--max-num-seqs", "4"]  # batches of 8 rows: several per replica
    runner = CliRunner()
    res = runner.invoke(app, [*common, "-o", str(tmp_path / "one.jsonl")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [*common, "-o", str(tmp_path / "ray.jsonl"), "--ray", "local",
                              "--replicas", "2", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["replicas"] == 2 and summary["requests"] == 30
    assert any(k.startswith("replica_") for k in summary)
    assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    lines = [json.loads(l) for l in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert [l["metadata"]["tag"] for l in lines] == list(range(30))


@pytest.mark.process
def test_directory_input_to_output_shards(local_ray, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for k in range(2):
        (d / f"part{k}.jsonl").write_text("".join(
            json.dumps({"id": f"{k}-{i}", "prompt": f"p{i}", "max_tokens": 2}) + "\n"
            for i in range(10)))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["generate", str(d), "--device", "cpu", "--temperature", "0",
                                   "--max-num-seqs", "4", "--ray", "local", "--replicas", "2",
                                   "-o", f"{out}/"])
    assert res.exit_code == 0, res.output
    shards = sorted(out.glob("part-*.jsonl"))
    assert len(shards) > 1
    ids = [json.loads(l)["id"] for s in shards for l in s.read_text().splitlines()]
    assert sorted(ids) == sorted(f"{k}-{i}" for k in range(2) for i in range(10))


@pytest.mark.process
def test_generator_in_a_users_pipeline_survives_a_dying_actor(local_ray, tmp_path):
    import pagedgen.ray

    marker = tmp_path / "died"

    class Flaky(pagedgen.ray.Generator):
        """Dies (the whole actor process) in the middle of the first batch it is given."""

        def __call__(self, batch):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return super().__call__(batch)
            os._exit(1)

    rows = [{"id": i, "prompt": f"question {i}", "max_tokens": 3, "answer": "ABCD"[i % 4]}
            for i in range(24)]
    ds = ray.data.from_items(rows, override_num_blocks=4)
    out = ds.map_batches(
        Flaky, fn_constructor_kwargs={"model": "tiny", "engine": CPU,
                                      "sampling": {"temperature": 0.0}},
        compute=ray.data.ActorPoolStrategy(size=2), batch_size=6,
        batch_format="numpy").take_all()
    assert marker.exists()  # an actor did die
    assert sorted(r["id"] for r in out) == list(range(24))  # every request exactly once
    for r in out:
        assert r["num_output_tokens"] == 3 and r["finish_reason"] == "length"
        assert r["metadata"] == {"answer": "ABCD"[r["id"] % 4]}
        assert r["prompt"] == f"question {r['id']}"


def test_bad_replicas_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(app, ["generate", str(prompts(tmp_path, 2)), "--device", "cpu",
                                   "--ray", "local", "--replicas", "0"])
    assert res.exit_code == 1 and "--replicas must be >= 1" in res.output


def test_generator_called_directly_seeds_rows_by_id():
    """Without Ray: two batches whose rows sit at the same positions sample differently when
    their ids differ, and identically when a row repeats (id and all)."""
    import numpy as np

    import pagedgen.ray

    gen = pagedgen.ray.Generator(model="tiny", engine=CPU, sampling={"temperature": 1.0,
                                                                     "max_tokens": 8})

    def batch(ids):
        return {"id": np.array(ids, dtype=object),
                "prompt": np.array(["same prompt"] * len(ids), dtype=object)}

    a, b, again = gen(batch(["x", "y"])), gen(batch(["z", "w"])), gen(batch(["x", "y"]))
    assert a["token_ids"][0] != b["token_ids"][0]
    assert a["token_ids"] == again["token_ids"] and a["id"] == ["x", "y"]
