"""CSV, TSV and Parquet inputs (issue 99): each row a request, run as the same lines in JSONL
would be; cells that hold lists and objects in CSV are JSON; errors name the file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

pa = pytest.importorskip("pyarrow")
runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "6", "--temperature", "0"]
LINES = [{"id": "a", "prompt": "Hello", "max_tokens": 3},
         {"id": "b", "prompt": "The sky is", "max_tokens": None, "stop": None},
         {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
          "stop": "q"}]


def run(tmp_path: Path, src: Path, *args: str) -> dict:
    out = tmp_path / f"{src.name}.out.jsonl"
    res = runner.invoke(app, ["generate", str(src), "-o", str(out), *FAST, *args])
    assert res.exit_code == 0, res.output
    return {x["id"]: (x["text"], x["token_ids"], x["finish_reason"])
            for x in map(json.loads, out.read_text().splitlines())}


def jsonl(tmp_path: Path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({k: v for k, v in x.items() if v is not None}) + "\n"
                         for x in LINES))
    return p


def test_csv_tsv_and_parquet_rows_run_as_their_jsonl_lines(tmp_path):
    want = run(tmp_path, jsonl(tmp_path))
    cols = ["id", "prompt", "messages", "max_tokens", "stop"]

    def cell(x, c):
        v = x.get(c)
        return json.dumps(v) if isinstance(v, list) else ("" if v is None else str(v))

    for sep, name in ((",", "p.csv"), ("\t", "p.tsv")):
        path = tmp_path / name
        rows = [sep.join(cols)] + [sep.join(
            '"' + cell(x, c).replace('"', '""') + '"' if sep == "," and cell(x, c) else
            cell(x, c) for c in cols) for x in LINES]
        path.write_text("\n".join(rows) + "\n")
        assert run(tmp_path, path) == want, name
    import pyarrow.parquet as pq
    table = pa.table({c: [x.get(c) for x in LINES] for c in cols})
    pq.write_table(table, tmp_path / "p.parquet")
    assert run(tmp_path, tmp_path / "p.parquet") == want


def test_a_bad_row_is_named_and_pyarrow_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text('prompt,max_tokens\n"Hello",3\n"Hi",-1\n')
    res = runner.invoke(app, ["generate", *STOP, str(bad), *FAST])
    assert res.exit_code == 1 and f"{bad}:2: max_tokens must be" in res.output.replace("\n", "")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    res = runner.invoke(app, ["generate", *STOP, str(broken), *FAST])
    text = res.output.replace("\n", "")
    assert res.exit_code == 1 and "cannot read it as PARQUET" in text and "Traceback" not in text
    js = tmp_path / "js.csv"
    js.write_text('messages\n"[{""role"": ""user"""\n')
    res = runner.invoke(app, ["generate", *STOP, str(js), *FAST])
    assert res.exit_code == 1 and "row 1: column 'messages' holds invalid JSON" in \
        res.output.replace("\n", ""), res.output


def table_of_lines():
    cols = ["id", "prompt", "messages", "max_tokens", "stop"]
    return pa.table({c: [x.get(c) for x in LINES] for c in cols})


def test_hugging_face_dataset_directories_run_as_their_jsonl_lines(tmp_path):
    """A dataset saved with ``save_to_disk`` (Arrow streams in two shards, listed out of name
    order in state.json, as the datasets library writes them) and a Hub snapshot (Parquet
    under data/) give the JSONL lines' completions, in the dataset's order."""
    want = run(tmp_path, jsonl(tmp_path))
    table = table_of_lines()
    saved = tmp_path / "saved"
    saved.mkdir()
    shards = [("data-00001-of-00002.arrow", table.slice(0, 2)),
              ("data-00000-of-00002.arrow", table.slice(2))]
    for name, part in shards:
        with pa.OSFile(str(saved / name), "wb") as f, pa.ipc.new_stream(f, part.schema) as w:
            w.write_table(part)
    (saved / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": n} for n, _ in shards], "_split": None}))
    (saved / "dataset_info.json").write_text("{}")
    got = run(tmp_path, saved)
    assert got == want
    out = tmp_path / "saved.out.jsonl"
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b", "c"]
    import pyarrow.parquet as pq
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("# a dataset card\n")
    pq.write_table(table, hub / "data" / "train-00000-of-00001.parquet")
    assert run(tmp_path, hub) == want


def test_a_dataset_of_several_splits_names_them_in_one_line(tmp_path):
    import pyarrow.parquet as pq
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(table_of_lines(), hub / "data" / f"{split}-00000-of-00001.parquet")
    res = runner.invoke(app, ["generate", str(hub), "-o", str(tmp_path / "o.jsonl"), *FAST])
    assert res.exit_code != 0 and "Traceback" not in res.output
    text = " ".join(res.output.split())
    assert "2 splits (test, train)" in text and "train-*.parquet" in text
    saved = tmp_path / "dict"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    res = runner.invoke(app, ["generate", str(saved), "-o", str(tmp_path / "o.jsonl"), *FAST])
    assert res.exit_code != 0 and "2 splits (train, validation)" in " ".join(res.output.split())
    (saved / "dataset_dict.json").unlink()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "x.arrow"}]}))
    res = runner.invoke(app, ["generate", str(saved), "-o", str(tmp_path / "o.jsonl"), *FAST])
    assert res.exit_code != 0 and "lists x.arrow, which is not there" in res.output
    (saved / "state.json").write_text(json.dumps({"_data_files": ["x.arrow"]}))
    res = runner.invoke(app, ["generate", str(saved), "-o", str(tmp_path / "o.jsonl"), *FAST])
    assert res.exit_code != 0 and "is not a list of" in res.output and "Traceback" not in \
        res.output


def test_parquet_files_not_named_as_the_hubs_shards_are_one_input(tmp_path):
    import pyarrow.parquet as pq
    d = tmp_path / "mine"
    d.mkdir()
    table = table_of_lines()
    pq.write_table(table.slice(0, 2), d / "first-part.parquet")
    pq.write_table(table.slice(2), d / "second-part.parquet")
    want = run(tmp_path, jsonl(tmp_path))
    assert run(tmp_path, d) == want  # read as a directory of tables, sorted by name
    (d / "sub").mkdir()
    for p in d.glob("*.parquet"):
        p.rename(d / "sub" / p.name)
    assert run(tmp_path, d, "--overwrite") == want  # found below it, as a Hub snapshot's are
