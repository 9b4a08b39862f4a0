"""The one-way import order ``reference <- taps <- engine <- parity`` and, inside ``parity``,
``backends <- harness <- {generate, bench, suites} <- cli`` (nothing imports ``parity.cli``), with no
import cycle between modules. Imports are read from the source (``ast``), including imports inside
functions, so a lazy back-edge counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "taps", "engine", "parity")
RANK = {p: k for k, p in enumerate(PACKAGES)}
# inside parity: a subpackage may import only subpackages of lower or equal rank
PARITY_RANK = {"backends": 0, "prompts": 0, "harness": 1, "generate": 2, "bench": 2, "suites": 2, "cli": 3}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    me = _module_name(path)
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
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _graph(top_level_only: bool = False) -> dict[str, set[str]]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[_module_name(path)] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(path, top_level_only):
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


def test_no_import_cycles():
    # import-time cycles (module-level imports). Function-level imports still count for the layering rule
    # above; a lazy mutual import between modules of one layer is not an import-time cycle.
    g = {s: {d for d in deps if not _is_package_init_edge(s, d)} for s, deps in _graph(top_level_only=True).items()}
    cycles = _cycles(g)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_catches_a_back_edge_and_a_cycle():
    # negative controls: the rules above must flag these
    assert _violation("reference.model", "taps.recorder")
    assert _violation("taps.diff", "parity.harness.kl")
    assert _violation("parity.harness.kl", "parity.cli.kl")
    assert _violation("parity.backends", "parity.harness.kl")
    assert _violation("engine.model", "taps.recorder") is None
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
