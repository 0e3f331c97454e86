"""The package layout shows the architecture: every concern in its folder, and no two modules
importing each other, directly or round a longer loop; imports under TYPE_CHECKING and inside
functions count too (a cycle there still ties the two modules' designs together)."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "zero_bench"
# What stays at the top: the entry points and the leaves every package shares.
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "errors.py", "units.py", "records.py", "store.py"}
PACKAGES = {"commands", "config", "devices", "engines", "estimate", "models", "report", "search", "trial"}


def module_names(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.with_suffix("").relative_to(root.parent).parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its file (a package counts for
    `from pkg import x` unless x is a module of it)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
                break  # `from a.b import c`: module a.b.c if it is one, else a.b
    return out


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    known = module_names(root)
    graph = {n: imported(n, p, known) for n, p in known.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other():
    assert cycles(PACKAGE) == []


def test_the_check_sees_a_type_only_cycle_and_a_longer_loop(tmp_path):
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from demo import a\n")
    (pkg / "sub" / "c.py").write_text("from ..sub import d\n")
    (pkg / "sub" / "d.py").write_text("import demo.sub.e\n")
    (pkg / "sub" / "e.py").write_text("from demo.sub.c import x\n")
    assert cycles(pkg) == [["demo.a", "demo.b"], ["demo.sub.c", "demo.sub.d", "demo.sub.e"]]


def test_each_concern_has_its_folder():
    top = {p.name for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top == TOP_LEVEL and folders == PACKAGES
    for name in PACKAGES:  # each package says what it holds, module by module
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        modules = {p.name for p in (PACKAGE / name).glob("*.py")} - {"__init__.py"}
        assert modules <= set(re.findall(r"\b\w+\.py\b", doc)), (name, modules - set(re.findall(r"\w+\.py", doc)))
