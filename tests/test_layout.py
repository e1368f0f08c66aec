"""The layout's import direction (docs/architecture.md): the runtime never imports the lab
(sidecar/lab: tune, eval, cascade fitting, plots); the layers below the engine (core, learn,
store, recommend) never import an edge (serve, proxy, mcp, the CLI, replay, the client); no
module is in an import circle; the package's top holds few modules, the rest in the folders
of their layer. Read from the source's import statements, so an import hidden inside a
function counts too; `if TYPE_CHECKING:` blocks do not (they never run)."""

from __future__ import annotations

import ast
import subprocess
import sys

from .conftest import ROOT

PACKAGE = ROOT / "sidecar"
EDGES_INTO_LAB = {"sidecar.cli"}
BELOW_THE_EDGES = ("sidecar.core", "sidecar.learn", "sidecar.store", "sidecar.recommend", "sidecar.engine", "sidecar.config", "sidecar.protocol")
EDGES = ("sidecar.serve", "sidecar.proxy", "sidecar.mcp", "sidecar.cli", "sidecar.replay", "sidecar.client", "sidecar.lab")
MOST_AT_THE_TOP = 15  # modules directly in sidecar/, __init__ and __main__ included  # the CLI's lab commands (tune, eval, cascade) import it inside their functions


def module_name(path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path, me: str | None = None) -> list[tuple[str, int, bool]]:
    """(module imported, line, at module level) for every sidecar import in the file (module
    `me`, by default the one its path names)."""
    me = me or module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                if base.startswith("sidecar"):
                    # `from . import x` imports the module x when it is one
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        is_module = (ROOT / (sub.replace(".", "/") + ".py")).exists() or (ROOT / sub.replace(".", "/")).is_dir()
                        out.append((sub if is_module else base, child.lineno, top))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, top) for a in child.names if a.name.startswith("sidecar"))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), True)
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(f): {m for m, _, _ in imports(f)} for f in PACKAGE.rglob("*.py")}


def test_the_runtime_never_imports_the_lab():
    wrong = []
    for f in PACKAGE.rglob("*.py"):
        me = module_name(f)
        if me.startswith("sidecar.lab"):
            continue
        for mod, line, top in imports(f):
            if mod.startswith("sidecar.lab") and (me not in EDGES_INTO_LAB or top):
                wrong.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not wrong, "the runtime imports the lab:\n" + "\n".join(wrong)


def test_serving_loads_no_lab_module():
    """What `serve`, `mcp`, `replay` and the client load, in a fresh interpreter."""
    code = ("import sys, sidecar.cli, sidecar.serve.server, sidecar.mcp.server, sidecar.replay, sidecar.client, sidecar.engine;"
            "print(sorted(m for m in sys.modules if m.startswith('sidecar.lab')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_the_engine_is_in_no_import_circle():
    g = graph()
    seen: set[str] = set()
    stack = ["sidecar.engine"]
    while stack:  # everything the engine reaches
        m = stack.pop()
        for n in g.get(m, ()):
            if n not in seen:
                seen.add(n)
                stack.append(n)
    assert "sidecar.engine" not in seen, "an import circle through the engine: " + ", ".join(sorted(m for m in seen if "sidecar.engine" in g.get(m, ())))


def test_the_checks_see_a_lazy_import(tmp_path):
    """The import reader finds an import inside a function and skips TYPE_CHECKING blocks."""
    f = PACKAGE / "engine.py"
    found = {m for m, _, top in imports(f)}
    assert "sidecar.core.pipeline" in found and "sidecar.lab" not in found
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .lab import tune\ndef f():\n    from .lab import evaluate\n")
    assert [(m, top) for m, _, top in imports(probe, "sidecar.probe")] == [("sidecar.lab.evaluate", False)]


def _within(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_module_is_in_an_import_circle():
    assert circles(graph()) == []


def test_the_circle_check_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layers_below_the_engine_never_import_an_edge():
    wrong = []
    for f in PACKAGE.rglob("*.py"):
        me = module_name(f)
        if not _within(me, BELOW_THE_EDGES):
            continue
        for mod, line, _ in imports(f):
            if _within(mod, EDGES):
                wrong.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not wrong, "a lower layer imports an edge:\n" + "\n".join(wrong)


def test_the_top_of_the_package_holds_few_modules():
    top = sorted(f.name for f in PACKAGE.glob("*.py"))
    assert len(top) <= MOST_AT_THE_TOP, top


def test_every_import_of_the_package_names_a_module_that_exists():
    """In the package, its tests and benchmarks, lazy imports too: a module moved to its
    layer's folder leaves no import of its old name behind (importing every module runs only
    the imports at module level)."""
    missing = []
    for f in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py")]:
        for mod, line, _ in imports(f):
            path = ROOT / mod.replace(".", "/")
            if not (path.is_dir() or path.with_suffix(".py").exists()):
                missing.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
