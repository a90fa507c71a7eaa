"""The wheel installs `pagedgen` only (no generic top-level names) and its console script runs."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.process
def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("pagedgen-*.whl"))
    from pagedgen.meta import __version__
    assert wheel.name.startswith(f"pagedgen-{__version__}-"), wheel.name  # meta's, the one
    assert not re.search(r'^version\s*=\s*"', (ROOT / "pyproject.toml").read_text(), re.M)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pagedgen"}, tops
    for must in ("pagedgen/cli/main.py", "pagedgen/attention/backend.py",
                 "pagedgen/runtime/engine/engine.py",
                 "pagedgen/runtime/models/families/llama.py", "pagedgen/ray/generator.py",
                 "pagedgen/profiles/tiny.yaml"):
        assert must in names
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)
    # a fresh venv that borrows torch & co. from this interpreter (itself perhaps a venv, whose
    # packages system_site_packages would not reach), with pagedgen from the wheel
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    env_site = subprocess.run([str(py), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(env_site, "borrowed.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheel)], check=True)
    where = subprocess.run([str(py), "-c", "import pagedgen; print(pagedgen.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(env_dir) in where
    res = subprocess.run([str(env_dir / "bin" / "pagedgen"), "--help"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert res.returncode == 0 and "generate" in res.stdout
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    res = subprocess.run([str(env_dir / "bin" / "pagedgen"), "generate", str(prompts), "--device",
                          "cpu", "--max-tokens", "2", "--json"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr  # every module the run needs is in the wheel
