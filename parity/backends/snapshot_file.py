"""Snapshot files: a sequence's state written to disk and read back (versioned, identity-checked).

Layout of a snapshot file ``X.qsnap`` (a directory written to a temp name and renamed)::

    X.qsnap/meta.json          {"format": "qwen4exp-snapshot", "format_version": 1,
                                "model": {"config_hash", "weights_fingerprint"}, "position",
                                "kinds": [...state kinds present...], "tree": <structure>}
    X.qsnap/state.safetensors  every array of the snapshot, named by its path in the structure

The structure is a generic encoding of the snapshot object (dataclasses, dicts, lists, tuples,
arrays, scalars); only classes from the ``reference`` and ``engine`` packages are rebuilt on load.

State kinds (the reference's ``reference.session.STATE_KINDS`` names): ``qsa.kv`` (attention
keys/values), ``qsa.indexer_keys`` (QSA raw indexer keys and their compressed blocks), ``gdn.conv`` /
``gdn.recurrent`` (Gated DeltaNet), ``ple.conv`` (PLE dilated conv history), ``ple.ngram_context``
(PLE n-gram token context). A snapshot lacking a kind that the model needs is refused on load
(:class:`SnapshotError`), as is one of another model (config hash or weights fingerprint) or
another format version.

Snapshots that are handles to live device state (the engine's, whose KV lives in refcounted pages) provide
``to_portable()`` returning their state as host arrays (``engine.state.StatePool.export_snapshot``: a dict
with ``qsa.{i}.k`` ... named like the reference's state); :func:`save_snapshot`, :func:`strip_kind`,
:func:`flatten_state` and :func:`state_kinds` use that form (:func:`portable`), so a loaded engine snapshot is
that dict and the engine backend restores it with ``Engine.import_snapshot`` (which checks contents, not labels).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import numpy as np

from reference.errors import UserError

__all__ = ["SnapshotError", "FORMAT", "FORMAT_VERSION", "save_snapshot", "load_snapshot", "read_meta",
           "flatten_state", "state_kinds", "required_kinds", "strip_kind", "kind_of", "KINDS", "portable"]

FORMAT = "qwen4exp-snapshot"
FORMAT_VERSION = 1
KINDS = ("qsa.kv", "qsa.indexer_keys", "gdn.conv", "gdn.recurrent", "ple.conv", "ple.ngram_context")

_ALLOWED_MODULES = ("reference.", "engine.")


class SnapshotError(UserError, ValueError):
    """A snapshot that cannot be used: other model, other format version, missing state, unreadable."""


# ------------------------------------------------------------------------------------------- kinds
# (family component, field component) -> kind, for paths like ``state.ple.1.context`` / ``state.qsa.3.k._a``
_FIELD_KINDS = {
    "qsa": [("index", "qsa.indexer_keys"), ("block", "qsa.indexer_keys"), ("k", "qsa.kv"), ("v", "qsa.kv"),
            ("key", "qsa.kv"), ("value", "qsa.kv"), ("kv", "qsa.kv")],
    "gdn": [("conv", "gdn.conv"), ("recurrent", "gdn.recurrent"), ("ssm", "gdn.recurrent"), ("state", "gdn.recurrent")],
    "ple": [("conv", "ple.conv"), ("context", "ple.ngram_context"), ("ngram", "ple.ngram_context"),
            ("ctx", "ple.ngram_context")],
}
_FAMILY_ALIASES = {"qsa": "qsa", "attn": "qsa", "self_attn": "qsa", "kv": "qsa", "gdn": "gdn", "linear_attn": "gdn",
                   "ple": "ple"}


def kind_of(path: str) -> str | None:
    """The state kind of an array at ``path`` inside a snapshot, or None (not model state).

    The path's first family component (``qsa``/``gdn``/``ple``, or ``self_attn``/``linear_attn``) and the
    first field component after it decide: e.g. ``state.qsa.3.index_keys._a`` -> 'qsa.indexer_keys',
    ``state.ple.1.context`` -> 'ple.ngram_context'.
    """
    parts = [p for p in path.lower().split(".") if p]
    for i, part in enumerate(parts):
        fam = _FAMILY_ALIASES.get(part)
        if fam is None:
            continue
        for field_ in parts[i + 1:]:
            if field_.isdigit():
                continue
            for prefix, kind in _FIELD_KINDS[fam]:
                if field_ == prefix or field_.startswith(prefix + "_") or (len(prefix) > 2 and field_.startswith(prefix)):
                    return kind
            break
    return None


def required_kinds(config) -> set[str]:
    """State kinds a snapshot of this model must hold (the reference session's own rule)."""
    from reference.session import required_kinds as _session_kinds
    return set(_session_kinds(config))


def portable(obj):
    """``obj.to_portable()`` when the snapshot object offers it (live device-state handles), else ``obj``."""
    fn = getattr(obj, "to_portable", None)
    return fn() if callable(fn) else obj


# ------------------------------------------------------------------------------------------- encode
def _encode(obj, path: str, arrays: dict):
    if isinstance(obj, np.ndarray) or type(obj).__module__.startswith("cupy"):
        a = np.asarray(obj if isinstance(obj, np.ndarray) else obj.get())
        arrays[path] = a
        return {"t": "a", "k": path}
    if isinstance(obj, np.generic):
        return {"t": "s", "v": obj.item()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"t": "s", "v": obj}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {"t": "dc", "cls": f"{cls.__module__}:{cls.__qualname__}",
                "f": {f.name: _encode(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name, arrays)
                      for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):
        return {"t": "d", "items": [[k if isinstance(k, (str, int)) else str(k),
                                     _encode(v, f"{path}.{k}" if path else str(k), arrays)] for k, v in obj.items()]}
    if isinstance(obj, (set, frozenset)):
        return {"t": "fs" if isinstance(obj, frozenset) else "set", "v": sorted(obj, key=repr)}
    if isinstance(obj, (list, tuple)):
        return {"t": "l" if isinstance(obj, list) else "tu",
                "v": [_encode(v, f"{path}.{i}" if path else str(i), arrays) for i, v in enumerate(obj)]}
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(_ALLOWED_MODULES):
        cls = type(obj)
        return {"t": "obj", "cls": f"{cls.__module__}:{cls.__qualname__}",
                "f": {k: _encode(v, f"{path}.{k}" if path else k, arrays) for k, v in vars(obj).items()}}
    if hasattr(obj, "__slots__") and type(obj).__module__.startswith(_ALLOWED_MODULES):
        cls = type(obj)
        return {"t": "obj", "cls": f"{cls.__module__}:{cls.__qualname__}",
                "f": {k: _encode(getattr(obj, k), f"{path}.{k}" if path else k, arrays)
                      for k in cls.__slots__ if hasattr(obj, k)}}
    raise SnapshotError(f"snapshot: cannot encode a {type(obj).__module__}.{type(obj).__qualname__} at "
                        f"{path or '<root>'}: expected arrays, scalars, containers or reference/engine classes")


def _load_cls(spec: str):
    mod, _, qual = spec.partition(":")
    if not mod.startswith(_ALLOWED_MODULES):
        raise SnapshotError(f"snapshot file: class {spec!r}: expected a class of the reference or engine package")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _decode(node, arrays: dict):
    t = node["t"]
    if t == "a":
        return arrays[node["k"]] if node["k"] in arrays else None
    if t == "s":
        return node["v"]
    if t in ("dc", "obj"):
        cls = _load_cls(node["cls"])
        inst = cls.__new__(cls)
        for k, v in node["f"].items():
            object.__setattr__(inst, k, _decode(v, arrays))
        return inst
    if t == "d":
        return {k: _decode(v, arrays) for k, v in node["items"]}
    if t == "l":
        return [_decode(v, arrays) for v in node["v"]]
    if t == "tu":
        return tuple(_decode(v, arrays) for v in node["v"])
    if t == "fs":
        return frozenset(node["v"])
    if t == "set":
        return set(node["v"])
    raise SnapshotError(f"snapshot file: unknown node type {t!r}")


def _logical(obj):
    """Replace grow-buffers (objects with a ``data`` view and ``truncate``) by their filled part, recursively,
    so states of equal content compare equal whatever their spare capacity."""
    if hasattr(obj, "truncate") and hasattr(type(obj), "data"):
        try:
            data = obj.data
        except (TypeError, AttributeError):  # a buffer whose storage was stripped
            return None
        if isinstance(data, np.ndarray):
            return data
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _logical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _logical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_logical(v) for v in obj]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(_ALLOWED_MODULES):
        return {k: _logical(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return obj


def flatten_state(obj) -> dict[str, np.ndarray]:
    """Every array of a state/snapshot object by path (``gdn.0.conv``, ``qsa.3.index_keys``), logical content
    only (grow-buffers trimmed to their filled part). Copies."""
    arrays: dict = {}
    _encode(_logical(portable(obj)), "", arrays)
    return {k: np.array(v, copy=True) for k, v in arrays.items()}


def state_kinds(obj) -> set[str]:
    """The state kinds present (non-empty arrays) in a snapshot object."""
    return {k for p, a in flatten_state(obj).items() if a is not None and a.dtype != object
            and (k := kind_of(p)) is not None}


def _drop_kind_labels(node, kind: str):
    """Remove ``kind`` from every set/list of kind names in an encoded tree (e.g. ``Snapshot.kinds``)."""
    t = node.get("t")
    if t in ("fs", "set") and kind in node["v"]:
        node["v"] = [v for v in node["v"] if v != kind]
    for key in ("f",):
        if key in node:
            for v in node[key].values():
                _drop_kind_labels(v, kind)
    if t == "d":
        for _k, v in node["items"]:
            _drop_kind_labels(v, kind)
    if t in ("l", "tu"):
        for v in node["v"]:
            _drop_kind_labels(v, kind)


def strip_kind(obj, kind: str):
    """A deep copy of snapshot ``obj`` that lacks state ``kind``: its arrays replaced by None and the kind
    removed from any kind list it carries (e.g. ``Snapshot.kinds``). Restoring it must be refused.

    Raises:
        SnapshotError: unknown kind.
    """
    if kind not in KINDS:
        raise SnapshotError(f"strip_kind: kind: expected one of {KINDS}, found {kind!r}")
    arrays: dict = {}
    tree = _encode(portable(obj), "", arrays)
    _drop_kind_labels(tree, kind)
    kept = {k: np.array(v, copy=True) for k, v in arrays.items() if kind_of(k) != kind}
    return _decode(tree, kept)


# ------------------------------------------------------------------------------------------- files
def _identity(backend) -> dict:
    cfg = backend.config
    fp = None
    for src in (getattr(backend, "model", None), getattr(backend, "eng", None)):
        for attr in ("weights", "ck", "checkpoint"):
            ck = getattr(src, attr, None)
            if ck is not None and hasattr(ck, "fingerprint"):
                fp = ck.fingerprint()
                break
        if fp is not None:
            break
    return {"config_hash": cfg.config_hash(), "weights_fingerprint": fp}


def save_snapshot(path, snap, backend, position: int | None = None) -> Path:
    """Write ``snap`` (a backend snapshot) to the snapshot file ``path`` (directory; temp + rename).

    Args:
        backend: the backend that made it (gives the model identity).
        position: the sequence length the snapshot holds (stored in meta).
    Raises:
        SnapshotError: the snapshot holds objects that cannot be encoded.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    arrays: dict = {}
    tree = _encode(portable(snap), "", arrays)
    kinds = sorted({k for p in arrays if (k := kind_of(p)) is not None})
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": _identity(backend),
            "backend": getattr(backend, "name", None), "position": position, "kinds": kinds, "tree": tree}
    path.parent.mkdir(parents=True, exist_ok=True)
    from reference.atomic import atomic_dir  # temp dir + rename, modes per umask
    with atomic_dir(path, prefix=path.name + ".tmp-") as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp / "state.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta))
    return path


def read_meta(path) -> dict:
    """The meta.json of a snapshot file. Raises SnapshotError when missing or not a snapshot."""
    p = Path(path) / "meta.json"
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SnapshotError(f"snapshot file {path}: expected a readable meta.json, found {e}") from None
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"snapshot file {path}: format: expected {FORMAT!r}, found {meta.get('format')!r}")
    return meta


def load_snapshot(path, backend):
    """Read a snapshot file for ``backend``'s model.

    Raises:
        SnapshotError: another format version; another model (config hash or weights fingerprint);
            state kinds the model needs are missing (e.g. PLE or indexer state); unreadable data.
    """
    from safetensors.numpy import load_file

    meta = read_meta(path)
    v = meta.get("format_version")
    if v != FORMAT_VERSION:
        raise SnapshotError(f"snapshot file {path}: format_version: expected {FORMAT_VERSION}, found {v!r}")
    want = _identity(backend)
    got = meta.get("model") or {}
    for key in ("config_hash", "weights_fingerprint"):
        if want.get(key) is not None and got.get(key) != want.get(key):
            raise SnapshotError(f"snapshot file {path}: model {key}: expected {want[key]} (this model), found "
                                f"{got.get(key)} (a snapshot of another model)")
    try:
        arrays = load_file(str(Path(path) / "state.safetensors"))
    except Exception as e:  # noqa: BLE001
        raise SnapshotError(f"snapshot file {path}: state.safetensors unreadable: {e}") from None
    present = {k for p in arrays if (k := kind_of(p)) is not None}
    missing = sorted(required_kinds(backend.config) - present)
    pos = meta.get("position")
    if missing and (pos is None or pos > 0):
        raise SnapshotError(f"snapshot file {path}: state kinds: expected {sorted(required_kinds(backend.config))} "
                            f"for this model, found {sorted(present)} (missing {missing}); refusing to restore "
                            f"a partial state")
    return _decode(meta["tree"], arrays)
