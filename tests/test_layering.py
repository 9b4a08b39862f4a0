"""The one-way import order ``reference <- taps <- engine <- parity`` and, inside ``parity``,
``backends <- harness <- {generate, bench, suites} <- cli`` (nothing imports ``parity.cli``), with no
import cycle between modules. Imports are read from the source (``ast``), including imports inside
functions, so a lazy back-edge counts too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "taps", "engine", "parity")
RANK = {p: k for k, p in enumerate(PACKAGES)}
# inside parity: a subpackage may import only subpackages of lower or equal rank
PARITY_RANK = {"backends": 0, "prompts": 0, "harness": 1, "generate": 2, "bench": 2, "suites": 2, "cli": 3}


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool = False, root: Path = ROOT,
             packages: tuple[str, ...] = PACKAGES) -> set[str]:
    """Own-package modules ``path`` imports: every import node of the AST (inside functions, methods and
    ``if TYPE_CHECKING`` blocks too) unless ``top_level_only``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    me = _module_name(path, root)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))] if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            for a in node.names:  # `from parity import cli` imports the submodule parity.cli
                out.add(f"{mod}.{a.name}")
    return {m for m in out if m.split(".")[0] in packages}


def _graph(top_level_only: bool = False, root: Path = ROOT,
           packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            mods[_module_name(path, root)] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(path, top_level_only, root, packages):
            # resolve to the longest known module prefix (`from x.y import func` -> x.y)
            parts = imp.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if parts and ".".join(parts) != name:
                deps.add(".".join(parts))
        graph[name] = deps
    return graph


def _violation(src: str, dst: str) -> str | None:
    a, b = src.split(".")[0], dst.split(".")[0]
    if RANK[b] > RANK[a]:
        return f"{src} imports {dst}: {b} is above {a}"
    if a == b == "parity":
        sa = src.split(".")[1] if "." in src else None
        sb = dst.split(".")[1] if "." in dst else None
        if sb == "cli" and sa != "cli":
            return f"{src} imports {dst}: nothing outside parity.cli imports the CLI"
        if sa in PARITY_RANK and sb in PARITY_RANK and PARITY_RANK[sb] > PARITY_RANK[sa]:
            return f"{src} imports {dst}: parity.{sb} is above parity.{sa}"
    return None


def test_no_back_edges():
    bad = sorted(v for src, deps in _graph().items() for dst in deps if (v := _violation(src, dst)))
    assert not bad, "layering violations:\n" + "\n".join(bad)


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_init_edge(src: str, dst: str) -> bool:
    # a package's __init__ re-exporting its own submodules is not a cycle of design
    return dst.startswith(src + ".") or src.startswith(dst + ".")


def _circles(graph) -> list[list[str]]:
    """Import circles of ``graph``, a package's ``__init__`` re-exporting its own submodules left out."""
    return _cycles({s: {d for d in deps if not _is_package_init_edge(s, d)} for s, deps in graph.items()})


def test_no_import_cycles():
    # every import counts, the ones inside functions too: a lazy import hides a circle from the interpreter,
    # not from a reader, and it still ties the two modules into one unit
    found = _circles(_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_at_module_top():
    # the import-time circles (a subset of the above): none at all, known or not
    cycles = _circles(_graph(top_level_only=True))
    assert not cycles, "import-time cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text, encoding="utf-8")


def test_the_checker_catches_a_function_level_circle(tmp_path):
    # negative control on a synthetic package: a -> b at module top, b -> a inside a function (the lazy
    # import that hid the harness circle); c imports a only, so it is outside the circle
    _write_package(tmp_path, {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": "def helper():\n    from pkg import a\n    return a\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "def f():\n    from ..a import helper\n    from . import e\n",
        "pkg/sub/e.py": "def g():\n    if True:\n        from pkg.sub.d import f\n",
    })
    g = _graph(root=tmp_path, packages=("pkg",))
    assert _circles(g) == [["pkg.a", "pkg.b"], ["pkg.sub.d", "pkg.sub.e"]]
    # only the module-top arrows: no circle (what the interpreter would see at import time)
    assert _circles(_graph(top_level_only=True, root=tmp_path, packages=("pkg",))) == []


def test_the_checker_catches_a_back_edge_and_a_cycle():
    # negative controls: the rules above must flag these
    assert _violation("reference.model", "taps.recorder")
    assert _violation("taps.diff", "parity.harness.kl")
    assert _violation("parity.harness.kl", "parity.cli.kl")
    assert _violation("parity.backends", "parity.harness.kl")
    assert _violation("engine.model", "taps.recorder") is None
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
