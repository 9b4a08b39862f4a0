"""The backend registry (parity/backends/registry.BACKENDS) is the one list of built-in backends: names,
options, deprecated spellings, ``--backend`` help and error messages are all derived from its entries, and
every backend module's own entry is registered."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from parity.backends import registry
from parity.backends.base import BackendEntry
from parity.cli import main
from reference.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_every_derived_list_comes_from_the_entries():
    entries = list(registry.BACKENDS.values())
    assert [e.name for e in entries] == list(registry.BACKENDS)
    assert registry.BACKEND_OPTIONS == {e.name: e.options for e in entries}
    assert registry.BACKEND_ALIASES == {a: (e.name, o) for e in entries for a, o in e.aliases.items()}
    assert registry.BACKEND_NAMES == (*registry.BACKENDS, *registry.BACKEND_ALIASES)
    assert registry._current_names() == ", ".join(registry.BACKENDS)
    for e in entries:
        assert e.describe() in registry.backend_help()
        assert registry.backend_class(e.name)[0] is e.cls
        for alias, opts in e.aliases.items():
            spec = registry.parse_backend_spec(alias)
            assert (spec.name, spec.options, spec.alias) == (e.name, opts, alias)


def test_help_and_errors_list_every_registered_name(capsys):
    with pytest.raises(SystemExit):
        main(["parity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    with pytest.raises(InputError) as ei:
        registry.backend_class("no-such-backend:x=1")
    for name in registry.BACKENDS:
        assert f"{name} (" in text, name
        assert name in str(ei.value), name
    for key in registry.BACKENDS["engine"].options:
        assert f"{key}=" in text


def _modules_defining_backends() -> dict[str, str]:
    """module -> class name, for every parity/backends module whose top level defines a class with an
    ``open`` classmethod (a backend) -- its own, or one inherited from such a class of these modules -- read
    from the source."""
    classes = []
    for f in sorted((REPO / "parity" / "backends").glob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                own = any(isinstance(b, ast.FunctionDef) and b.name == "open" for b in node.body)
                classes.append((f"parity.backends.{f.stem}", node.name, bases, own))
    with_open = {name for _, name, _, own in classes if own}
    while True:  # inherited open(): a subclass of a class with one has one
        more = {name for _, name, bases, _ in classes if bases & with_open} - with_open
        if not more:
            break
        with_open |= more
    return {mod: name for mod, name, _, _ in classes if name in with_open}


def test_every_backend_module_registers_its_entry():
    found = _modules_defining_backends()
    found.pop("parity.backends.base")  # the protocol's base classes, not backends
    # a base class that registered backends subclass (parity.backends.openai: the OpenAI-API base of the
    # server backends) is not a backend of its own; anything else defining open() must be registered
    bases = {(c.__module__, c.__name__) for e in registry.BACKENDS.values() for c in e.cls.__mro__[1:]}
    found = {m: c for m, c in found.items() if (m, c) not in bases}
    registered = {e.cls.__module__: e.cls.__name__ for e in registry.BACKENDS.values()}
    assert found == registered
    for mod in found:
        entry = importlib.import_module(mod).BACKEND
        assert isinstance(entry, BackendEntry) and registry.BACKENDS[entry.name] is entry


def test_the_module_scan_sees_an_unregistered_backend(tmp_path, monkeypatch):
    # negative control: a backend module without a registry line is found by the scan the test above uses
    fake = tmp_path / "parity" / "backends"
    fake.mkdir(parents=True)
    (fake / "vllm.py").write_text("class VllmBackend:\n    @classmethod\n    def open(cls, path):\n        pass\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert _modules_defining_backends() == {"parity.backends.vllm": "VllmBackend"}
    # ... and one whose open() is inherited from another module's class (a sibling of a server base)
    (fake / "sibling.py").write_text("from parity.backends.vllm import VllmBackend\n\n\n"
                                     "class SiblingBackend(VllmBackend):\n    scheme = 'sibling'\n")
    assert _modules_defining_backends() == {"parity.backends.vllm": "VllmBackend",
                                            "parity.backends.sibling": "SiblingBackend"}


def test_no_hand_kept_list_of_backend_names_outside_the_entries():
    # the deprecated spellings appear as code only in their own entry (reference.py, engine.py); a tuple or
    # dict literal holding two backend names elsewhere would be a second list to keep in step
    names = set(registry.BACKEND_NAMES)
    bad = []
    for f in sorted((REPO / "parity").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                elts = node.keys if isinstance(node, ast.Dict) else node.elts
                held = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
                if len(held) >= 3:
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno}: {sorted(held)}")
    assert not bad, "hand-kept backend name lists:\n" + "\n".join(bad)
