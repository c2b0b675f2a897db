"""The file layout's promises (docs/ and the README): the import graph of `policy/`
and `engine/` has no circles, lazy and type-only imports included, and `policy/`
never imports `engine/`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    name = ".".join(("kvpolicy", *path.relative_to(ROOT).with_suffix("").parts))
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports anywhere in its body (functions and
    ``if TYPE_CHECKING:`` blocks too); ``from pkg import sub`` counts as importing ``pkg.sub``."""
    files = [*ROOT.glob("policy/**/*.py"), *ROOT.glob("engine/**/*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    graph = import_graph()
    assert "kvpolicy.engine.decision" in graph and "kvpolicy.engine.runtime.transfer" in graph  # the graph saw the tree
    assert cycles(graph) == []


def test_the_checker_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_policy_imports_nothing_of_engine() -> None:
    graph = import_graph()
    leaks = {m: sorted(d for d in deps if d.startswith("kvpolicy.engine")) for m, deps in graph.items()
             if m.startswith("kvpolicy.policy")}
    assert {m: d for m, d in leaks.items() if d} == {}


def test_repository_root_holds_no_stray_files() -> None:
    """A scratch file committed at the root (``bad.yaml``, issue 22) reaches every checkout and sdist:
    the root holds only the project's own files; test inputs live in tests/fixtures or tmp_path."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {line for line in tracked.splitlines() if "/" not in line}
    # __init__.py: a clone named `kvpolicy` imports as the package from its parent (tests/test_clone_import.py)
    assert top <= {".gitignore", "README.md", "pyproject.toml", "LICENSE", "__init__.py"}, sorted(top)
    # and the folders are the design card's: a review's scripts live in .ci/, not beside the package
    folders = {line.split("/", 1)[0] for line in tracked.splitlines() if "/" in line}
    assert folders <= {"policy", "rules", "engine", "tests", "bench", "docs", ".ci", "kvpolicy"}, sorted(folders)
