"""The house rules, read from the source: imports point down (the root's helpers < attention <
runtime < cli < benchmarks < the package's ``__init__``, its public face; inside runtime, its
base modules < collectives < quantization < layers < models < sampling < engine < worker <
output < inputs < drivers < the Python API), no module imports itself back through others
(function-local imports included), no module over 500 lines, and every package folder is in
the wheel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"pagedgen.errors": 0, "pagedgen.meta": 0, "pagedgen.envs": 0,  # the root's helpers
          "pagedgen.profiling": 0, "pagedgen.transfer": 0, "pagedgen.buffers": 0,
          "pagedgen": 5,  # the package itself: the public face (pagedgen.LLM), over all
          "pagedgen.attention": 1,
          # runtime: config, hardware, profiles, ... then its subpackages, bottom up
          "pagedgen.runtime": 2, "pagedgen.runtime.collectives": 2.1,
          "pagedgen.runtime.quantization": 2.2, "pagedgen.runtime.layers": 2.3,
          "pagedgen.runtime.models": 2.4, "pagedgen.runtime.sampling": 2.5,
          # the engine's requests, sequences, scheduler and KV blocks; the worker that runs its
          # steps and the output stage over them; the engine's loop (engine.engine) over both
          "pagedgen.runtime.engine": 2.6, "pagedgen.runtime.worker": 2.63,
          "pagedgen.runtime.output": 2.66, "pagedgen.runtime.engine.engine": 2.69,
          # what a run is asked (requests, settings), then the drivers, then the Python API
          "pagedgen.runtime.inputs": 2.68, "pagedgen.runtime.drivers": 2.7,
          "pagedgen.runtime.api": 2.8,
          "pagedgen.cli": 3, "pagedgen.ray": 3, "benchmarks": 4}
FOLDERS = {"attention": "pagedgen.attention", "runtime": "pagedgen.runtime",
           "cli/ray": "pagedgen.ray", "cli": "pagedgen.cli", "benchmarks": "benchmarks"}
MAX_LINES = 500


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    text = rel.as_posix()
    for folder, package in FOLDERS.items():
        if text == folder or text.startswith(folder + "/"):
            name = package + text[len(folder):].replace("/", ".")
            return name.removesuffix(".__init__")
    return "pagedgen" if text == "__init__" else f"pagedgen.{text}"


def sources() -> dict[str, Path]:
    files = sorted(ROOT.glob("*.py"))  # the root's modules: __init__, errors, helpers
    for folder in ("attention", "runtime", "cli", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return {module_name(f): f for f in files}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(pagedgen or benchmarks module, line) of every import in the file, function-local ones
    included, those under ``if TYPE_CHECKING:`` too; ``from pkg import sub`` names the
    submodule when there is one."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub if sub in known else node.module, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] in ("pagedgen", "benchmarks")]


SOURCES = sources()
GRAPH = {m: imports(p, set(SOURCES)) for m, p in SOURCES.items()}


def test_every_import_points_down():
    up = [f"{SOURCES[m].relative_to(ROOT)}:{line} imports {target}"
          for m, deps in GRAPH.items() for target, line in deps if layer(target) > layer(m)]
    assert not up, "\n".join(up)


def test_no_module_imports_itself_back():
    edges = {m: {t for t, _ in deps if t in GRAPH and t != m} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_wheel_lists_every_package_folder():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folders = {module_name(p) for p in SOURCES.values()
               if p.name == "__init__.py" and not module_name(p).startswith("benchmarks")}
    assert folders <= listed, folders - listed


def test_every_runtime_subpackage_has_its_place():
    """A new subpackage of runtime must be placed in the order above (else it would sit with
    runtime's base modules, below everything it imports)."""
    subs = {".".join(m.split(".")[:3]) for m in SOURCES if m.startswith("pagedgen.runtime.")
            and SOURCES[m].name == "__init__.py"}
    assert subs <= set(LAYERS), subs - set(LAYERS)


@pytest.mark.parametrize("planted", ["up", "up-inside-runtime", "cycle"])
def test_the_checks_catch_a_planted_breach(planted, monkeypatch):
    """An upward import (attention → runtime; runtime.models → runtime.engine) and a circle
    (runtime.config ↔ runtime.profiles) planted in the graph fail the checks above."""
    graph = {m: list(deps) for m, deps in GRAPH.items()}
    if planted == "up":
        graph["pagedgen.attention.backend"].append(("pagedgen.runtime.config", 1))
        check = test_every_import_points_down
    elif planted == "up-inside-runtime":
        graph["pagedgen.runtime.models.loader"].append(("pagedgen.runtime.engine.engine", 1))
        check = test_every_import_points_down
    else:
        graph["pagedgen.runtime.config"].append(("pagedgen.runtime.profiles", 1))
        check = test_no_module_imports_itself_back
    monkeypatch.setitem(globals(), "GRAPH", graph)
    with pytest.raises(AssertionError):
        check()


def test_every_environment_variable_pagedgen_reads_is_listed():
    """``envs.py`` lists every ``PAGEDGEN_*`` variable a module names (``pagedgen backends``
    prints the list), and only it reads them from ``os.environ``."""
    import re

    from pagedgen import envs

    listed = {v.name for v in envs.ALL}
    named, readers = set(), []
    for m, path in SOURCES.items():
        if m.startswith("benchmarks"):
            continue
        text = path.read_text()
        named |= set(re.findall(r"PAGEDGEN_[A-Z0-9_]+", text))
        if m != "pagedgen.envs" and re.search(r"environ(\.get)?\(?\[?\s*[\"']PAGEDGEN_", text):
            readers.append(m)
    assert named <= listed, named - listed
    assert not readers, readers


def runner_writes(tree: ast.AST) -> list[int]:
    """Lines that assign to an attribute of a ``runner`` (``x.runner.a = ...``,
    ``self.runner.a.b += ...``)."""
    def on_runner(node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            if node.attr == "runner":
                return True
            node = node.value
        return False
    targets = [(t, n.lineno) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign,
                                                                      ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return [line for t, line in targets
            if isinstance(t, ast.Attribute) and on_runner(t.value)]


def test_the_engine_sets_no_attribute_of_its_model_runner():
    """The engine hands the runner what it needs through the runner's methods
    (``sampling_hooks``), never by setting its attributes; so do the CLI and the drivers."""
    for m, path in SOURCES.items():
        if m.startswith(("pagedgen.runtime.engine.engine", "pagedgen.cli",
                         "pagedgen.runtime.drivers")):
            assert not runner_writes(ast.parse(path.read_text())), (m, runner_writes(
                ast.parse(path.read_text())))
    assert runner_writes(ast.parse("self.runner.grammars = g\neng.runner.a.b += 1")) == [1, 2]


def format_mentions(tree: ast.AST, formats: set[str]) -> list[int]:
    """Lines whose code names a weight format (an import of its package, an identifier, a
    string that is not a docstring): docs may say what a checkpoint holds, code may not."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr)}
    hits = []
    for node in ast.walk(tree):
        words = {ast.Name: lambda n: [n.id], ast.Attribute: lambda n: [n.attr],
                 ast.ImportFrom: lambda n: [n.module or "", *(a.name for a in n.names)],
                 ast.Import: lambda n: [a.name for a in n.names],
                 ast.FunctionDef: lambda n: [n.name], ast.ClassDef: lambda n: [n.name],
                 ast.Constant: lambda n: [n.value] if isinstance(n.value, str)
                 and id(n) not in docs else []}.get(type(node), lambda n: [])(node)
        if any(f in w.lower() for w in words for f in formats):
            hits.append(node.lineno)
    return sorted(set(hits))


def test_model_families_never_name_a_weight_format():
    """A family asks its ``QuantConfig`` for a layer's method; which formats exist is the
    registry's (``runtime/quantization/registry.py``), so a new format touches no family."""
    from pagedgen.runtime.quantization.registry import FORMATS
    formats = {f.name for f in FORMATS}
    named = {m: format_mentions(ast.parse(p.read_text()), formats) for m, p in SOURCES.items()
             if m.startswith("pagedgen.runtime.models.families.")}
    assert not any(named.values()), {m: lines for m, lines in named.items() if lines}
    planted = ("'''MXFP4 experts'''\nfrom pagedgen.runtime.quantization.mxfp4.moe import "
               "Mxfp4Moe\nx = 'fp8'\ndef f():\n    '''fp8'''\n")
    assert format_mentions(ast.parse(planted), formats) == [2, 3]


def test_every_weight_format_package_is_in_the_registry():
    from pagedgen.runtime.quantization.registry import FORMATS
    packages = {p.parent.name for p in (ROOT / "runtime" / "quantization").glob("*/__init__.py")}
    assert packages == {f.name for f in FORMATS}


def runner_reads(tree: ast.AST) -> int:
    return sum(isinstance(n, ast.Attribute) and n.attr == "runner" for n in ast.walk(tree))


def test_only_the_worker_and_the_engine_loop_read_the_runner():
    """The summary reads ``Engine.describe`` (the worker's description of itself); ``profile``
    and the benchmarks read ``Engine.measurement()`` (worker/measurement.py): nothing else
    reaches into the model runner."""
    reads = {m: n for m, p in SOURCES.items()
             if not m.startswith(("pagedgen.runtime.worker", "pagedgen.runtime.engine.engine"))
             and (n := runner_reads(ast.parse(p.read_text())))}
    assert reads == {}
    assert runner_reads(ast.parse("engine.runner.kv.summary()")) == 1
