"""The package's floors (docs/design.md, Layout): no import circle, lazy imports included,
and no arrow up but the face's lazy pick of the Ray backend.

Reads every module's source (imports inside functions too) instead of importing it,
so a lazy import is seen even where no test reaches it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {  # distribution name -> folder (pyproject.toml's package-dir)
    "specdec": ROOT / "specdec",
    "specdec.draft": ROOT / "draft",
    "specdec.verify": ROOT / "verify",
    "specdec.kernels": ROOT / "kernels",
    "specdec.cluster": ROOT / "cluster",
}
FLOORS = {"specdec.verify": 0, "specdec.kernels": 1, "specdec.draft": 2, "specdec.cluster": 4}
FACE = 3  # specdec/*.py: the engine and the face
UPWARD_OK = {"specdec.api", "specdec.cli"}  # may import cluster/ (lazily, when asked)


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            if "assets" in f.parts:
                continue
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


def floor(name: str) -> int:
    for pkg, n in FLOORS.items():
        if name == pkg or name.startswith(pkg + "."):
            return n
    return FACE


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = mod if is_pkg else mod.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        parent = parent.rsplit(".", 1)[0]
                    base = parent + ("." + base if base else "")
                # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]  # fmt: skip
            else:
                continue
            for t in targets:
                r = resolve(t) if t.startswith("specdec") else None
                if r is not None and r != mod:
                    edges[mod].add(r)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    edges = import_graph()
    assert len(edges) > 30
    assert "specdec.cluster.remote" in edges["specdec.api"]  # inside LLM.__init__
    assert "specdec.kernels.megakernel" in edges["specdec.workers"]  # inside a function


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_floors_import_only_downward():
    up = [
        (a, b)
        for a, targets in import_graph().items()
        for b in targets
        if floor(b) > floor(a) and not (a in UPWARD_OK and floor(b) == FLOORS["specdec.cluster"])
    ]
    assert up == []
