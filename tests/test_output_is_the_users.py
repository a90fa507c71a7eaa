"""The output path stays the user's (issue 57): writes go through symlinks, keep the file's mode,
streams get their lines in completion order, every derived name is checked before anything is
opened, a file changed under the run stops it, and --resume always leaves a file in order."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app

runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "4"]
PROMPTS = [{"id": f"r{i}", "prompt": f"p{i}", "max_tokens": 1 + i % 3} for i in range(6)]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def generate(*args) -> object:
    return runner.invoke(app, ["generate", *map(str, args)])


def ids(path: Path) -> list:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("clean")
    src = write(d / "p.jsonl", PROMPTS)
    assert generate(src, *FAST, "-o", d / "clean.jsonl").exit_code == 0
    return src, d / "clean.jsonl"


def test_a_symlinked_output_is_written_through_and_stays_a_link(tmp_path, clean):
    src, ref = clean
    (tmp_path / "data").mkdir()
    link = tmp_path / "out.jsonl"
    link.symlink_to(tmp_path / "data" / "real.jsonl")  # dangling until the first line
    res = generate(src, *FAST, "-o", link, "--max-num-seqs", "2")
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and (tmp_path / "data" / "real.jsonl").read_text() == \
        ref.read_text()
    assert (tmp_path / "data" / "real.jsonl.resume.json").is_file()  # beside the target


def test_the_reordering_keeps_the_files_mode(tmp_path, clean):
    src, ref = clean
    out = tmp_path / "o.jsonl"
    out.write_text("")
    out.chmod(0o640)
    res = generate(src, *FAST, "-o", out, "--max-num-seqs", "2")  # finishes out of order
    assert res.exit_code == 0, res.output
    assert out.read_text() == ref.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


@pytest.mark.process
def test_standard_output_gets_the_lines_and_stderr_the_summary(tmp_path, clean):
    src, ref = clean
    proc = subprocess.run([sys.executable, "-m", "pagedgen.cli.main", "generate", str(src),
                           *FAST, "-o", "-", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == sorted(ref.read_text().splitlines())
    assert '"output_stream": "standard output' in proc.stderr
    res = generate(src, *FAST, "-o", "-", "--resume")
    assert res.exit_code == 1 and "a stream cannot be resumed" in res.output


def test_a_fifo_input_says_it_waits_for_its_writer(tmp_path, clean):
    """Opening a FIFO to read waits for a writer: the run says so before it waits."""
    src, ref = clean
    fifo = tmp_path / "in"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(src.read_bytes()))
    writer.start()
    res = generate(fifo, *FAST, "-o", tmp_path / "o.jsonl")
    writer.join(timeout=60)
    assert res.exit_code == 0, res.output
    assert res.output.index("in: waiting for a writer of the FIFO") < res.output.index("model")
    assert (tmp_path / "o.jsonl").read_text() == ref.read_text()


def test_a_stream_cut_mid_write_says_how_many_whole_lines_it_got(monkeypatch):
    """A stream cannot be cut back: the error counts the whole lines that went out and says
    the next went in part (a short write, then a closed pipe)."""
    import errno
    from types import SimpleNamespace

    from pagedgen.cli.formats import output
    from pagedgen.errors import PagedgenError

    writer = output.StreamWriter(SimpleNamespace(given="-", fd=1, open_stream=lambda: 1))
    script = iter([None, 12])  # all of the first write; of the second, 12 bytes, then EPIPE

    def write(fd, data):
        step = next(script, "closed")
        if step == "closed":
            raise OSError(errno.EPIPE, os.strerror(errno.EPIPE))
        return len(data) if step is None else step

    monkeypatch.setattr(os, "write", write)
    writer.write_lines([(0, '{"a": 1}')])  # 9 bytes a line
    with pytest.raises(PagedgenError, match="Broken pipe; 2 whole lines were written, and "
                                            "part of the next"):
        writer.write_lines([(1, '{"b": 2}'), (2, '{"c": 3}')])


@pytest.mark.process
def test_a_fifo_is_a_stream_and_its_wait_can_be_interrupted(tmp_path, clean):
    src, ref = clean
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    res = generate(src, *FAST, "-o", fifo)
    reader.join(timeout=60)
    assert res.exit_code == 0, res.output
    assert sorted(got[0].decode().splitlines()) == sorted(ref.read_text().splitlines())
    assert not list(tmp_path.glob(".f.*")) and not (tmp_path / "f.resume.json").exists()
    # no reader: SIGTERM ends the wait at once, with one line and no stale lock
    proc = subprocess.Popen([sys.executable, "-m", "pagedgen.cli.main", "generate", str(src),
                             *FAST, "-o", str(fifo)], stderr=subprocess.PIPE, text=True)
    try:
        import time
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if "waiting for a reader" in (proc.stderr.readline() or ""):
                break
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err


@pytest.mark.parametrize("name,message", [
    ("", "--output is empty"),
    ("x" * 245, "the name is too long for the files kept beside it"),
])
def test_an_output_name_that_cannot_work_is_refused_before_anything_changes(tmp_path, clean,
                                                                           name, message):
    src, _ = clean
    before = sorted(os.listdir(tmp_path))
    res = generate(src, *FAST, "-o", str(tmp_path / name) if name else "", "--overwrite")
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output
    assert sorted(os.listdir(tmp_path)) == before


def test_an_overwrite_with_a_too_long_name_keeps_the_old_file(tmp_path, clean):
    src, ref = clean
    long = tmp_path / ("y" * 245)
    long.write_bytes(ref.read_bytes())
    res = generate(src, *FAST, "-o", long, "--overwrite")
    assert res.exit_code == 1 and "too long" in res.output
    assert long.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("change", ["truncate", "remove", "replace"])
def test_an_output_changed_under_the_run_stops_it_with_one_line(tmp_path, clean, monkeypatch,
                                                               change):
    import pagedgen.runtime.drivers.driver as gen

    src, _ = clean
    out = tmp_path / "o.jsonl"
    real = gen.Replica

    class ChangedMidRun(real):
        def stream(self, requests):
            for i, step in enumerate(super().stream(requests)):
                if i == 6 and out.exists():
                    if change == "truncate":  # logrotate's copytruncate
                        os.truncate(out, 0)
                    elif change == "remove":
                        out.unlink()
                    else:
                        out.rename(tmp_path / "moved.jsonl")
                        out.write_text("someone else's\n")
                yield step

    monkeypatch.setattr(gen, "Replica", ChangedMidRun)
    res = generate(src, *FAST, "-o", out, "--max-num-seqs", "1")
    text = res.output.replace("\n", "")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert ("truncated or written to by another program" if change == "truncate" else
            "removed or replaced by another program") in text
    if change == "truncate":  # stopped at once: nothing written after the cut, no holes
        assert out.read_bytes() == b""
    if change == "replace":
        assert out.read_text() == "someone else's\n"


def test_resume_puts_a_complete_out_of_order_file_in_order_and_removes_leftovers(tmp_path,
                                                                                clean):
    src, ref = clean
    out = tmp_path / "o.jsonl"
    assert generate(src, *FAST, "-o", out).exit_code == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(reversed(lines)) + "\n")  # a kill during the reordering...
    (tmp_path / ".o.jsonl.tmp").write_text(lines[0] + "\n")  # ...left its temporary file
    res = generate(src, *FAST, "-o", out, "--resume", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped_resumed"] == len(PROMPTS)
    assert out.read_text() == ref.read_text()
    assert not (tmp_path / ".o.jsonl.tmp").exists()
    (tmp_path / ".o.jsonl.tmp").write_text(lines[0] + "\n")  # a file already in order
    assert generate(src, *FAST, "-o", out, "--resume").exit_code == 0
    assert not (tmp_path / ".o.jsonl.tmp").exists() and out.read_text() == ref.read_text()
    # a cut-short last line and nothing else to run: dropped, and its request runs again
    out.write_text(ref.read_text() + lines[0][:20])
    assert generate(src, *FAST, "-o", out, "--resume").exit_code == 0
    assert out.read_text() == ref.read_text()


def test_the_seed_is_part_of_the_resume_record(tmp_path, clean):
    src, _ = clean
    out = tmp_path / "o.jsonl"
    assert generate(src, *FAST, "-o", out, "--seed", "1").exit_code == 0
    res = generate(src, *FAST, "-o", out, "--seed", "2", "--resume")
    assert res.exit_code == 1
    assert "was made with seed = 1, this run has 2" in res.output.replace("\n", "")


def test_a_directory_input_leaves_out_earlier_outputs(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "a.jsonl", PROMPTS[:2])
    assert generate(d, *FAST).exit_code == 0  # in.completions.jsonl, beside the folder
    (d / "old.completions.jsonl").write_text((tmp_path / "in.completions.jsonl").read_text())
    write(d / "mine.jsonl", PROMPTS[2:3])  # a file with a record beside it is an output too
    (d / "mine.jsonl.resume.json").write_text("{}")
    res = generate(d, *FAST, "-o", tmp_path / "o.jsonl", "--json")
    assert res.exit_code == 0, res.output
    assert "leaving out 2 earlier output file(s)" in res.output
    assert ids(tmp_path / "o.jsonl") == ["r0", "r1"]


def test_an_existing_outputs_hint_works_when_followed(tmp_path, clean):
    """The README's first two commands once collided: the hint said --resume, which then
    failed on another setting. Now the error says what differs, and --overwrite works."""
    src, _ = clean
    out = tmp_path / "o.jsonl"
    assert generate(src, *FAST, "-o", out).exit_code == 0
    res = generate(src, *FAST, "-o", out, "--temperature", "0")
    text = res.output.replace("\n", "")
    assert res.exit_code == 1 and "--resume" not in text.split(";", 1)[1], text
    assert "was made with temperature = 0.8, this run has 0.0" in text
    assert generate(src, *FAST, "-o", out, "--temperature", "0", "--overwrite").exit_code == 0
