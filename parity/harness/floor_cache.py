"""A content-addressed store of measured floors, so that several runs on one model measure its floor once.

A run's floor (:func:`parity.harness.floor.thresholds_for_run`: the float32 envelope over the evaluation orders,
the reduced-precision floor of the backend's stores, the truth's tie cuts and the per-tap floors of the tap
profile) is a pure function of the weights, the floor prompts, the stores and the code that measures it. With
``$QWEN4EXP_FLOOR_CACHE`` set to a folder, that measurement is kept there as one JSON file named by the sha256
of everything it depends on (:func:`key_material`):

* the weights: their fingerprint (``Checkpoint.fingerprint``: the config hash, every tensor's name, dtype,
  shape and sampled bytes; all bytes for in-memory weights) and each weight file's name, size and mtime;
* the floor prompts and the tap-profile stream (token ids), the stores (``{kind: format}``) and the evaluation
  orders (:data:`parity.harness.floor.FLOOR_ORDERS`, every field);
* the code: sha256 of every source file of ``reference/``, ``taps/`` and ``parity/harness/`` (the model, the
  kernels, the comparison metrics, this module), NumPy's and Numba's versions.

An entry holds its own key material and is used only when that equals the run's (a hash collision or a renamed
file is a miss); an entry that cannot be parsed, is of another schema or lacks a field is a miss too (measured
again and overwritten). Entries are written atomically (:mod:`reference.atomic`): an interrupted write leaves
no file a later run reads. Unset (the default), nothing is read or written.

Backends judged in one process (``qwen4exp parity --backend A --backend B``, as ci/gpu_realwidth.sh runs them) share
the floor and the control in memory; the cache is for runs in separate processes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

__all__ = ["ENV", "SCHEMA", "cache_dir", "key_material", "entry_path", "load", "store", "code_version",
           "control_material", "load_control", "store_control"]

#: the environment variable naming the folder (unset or empty: no cache)
ENV = "QWEN4EXP_FLOOR_CACHE"
#: the entry format; a change of what an entry holds bumps it (older entries are then misses)
SCHEMA = 1
#: the packages whose source the measurement runs (relative to the repository root)
_CODE_DIRS = ("reference", "taps", "parity/harness")

_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path | None:
    """The folder of ``$QWEN4EXP_FLOOR_CACHE``, or None when unset/empty."""
    v = os.environ.get(ENV, "")
    return Path(v).expanduser() if v else None


def code_version() -> str:
    """sha256 (hex) over the path and bytes of every ``.py`` file under :data:`_CODE_DIRS`, and NumPy's and Numba's
    versions: any edit of the code that measures a floor changes it."""
    import numba
    import numpy
    h = hashlib.sha256(f"numpy {numpy.__version__} numba {numba.__version__}".encode())
    for d in _CODE_DIRS:
        for p in sorted((_ROOT / d).rglob("*.py")):
            h.update(str(p.relative_to(_ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _weight_files(weights) -> list[list]:
    """``[[name, size, mtime_ns]]`` of the files behind ``weights`` (a Checkpoint, or an overlay over one; none for
    in-memory weights, whose fingerprint hashes every byte)."""
    base = weights
    while getattr(base, "_base", None) is not None:
        base = base._base
    entries = getattr(base, "_entries", None) or {}
    out = []
    for f in sorted({str(en.file) for en in entries.values()}):
        st = os.stat(f)
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


def key_material(weights, prompts: Sequence[Sequence[int]], stores: dict, tap_ids: Sequence[int],
                 orders: Sequence) -> dict:
    """Everything a floor measurement depends on (see the module docstring), as a JSON-ready dict; ``orders``:
    the evaluation orders measured (:data:`parity.harness.floor.FLOOR_ORDERS`, dataclasses)."""
    import dataclasses
    ids = hashlib.sha256(json.dumps([[int(t) for t in p] for p in prompts]).encode()).hexdigest()
    tap = hashlib.sha256(json.dumps([int(t) for t in tap_ids]).encode()).hexdigest()
    return {"schema": SCHEMA, "fingerprint": weights.fingerprint(), "files": _weight_files(weights),
            "prompts": ids, "prompt_lengths": [len(p) for p in prompts], "tap_stream": tap,
            "stores": {str(k): str(v) for k, v in sorted(dict(stores).items())},
            "orders": [dataclasses.asdict(o) for o in orders], "code": code_version()}


def entry_path(material: dict, root: Path | None = None, kind: str = "floor") -> Path | None:
    """The entry file of ``material`` in ``root`` (default :func:`cache_dir`); None when no cache is set."""
    root = root if root is not None else cache_dir()
    if root is None:
        return None
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return Path(root) / f"{kind}-{key[:40]}.json"


def _read(material: dict, kind: str):
    """``(payload, path)`` of the entry of ``material``, or None (no cache, no entry, unreadable, or an entry of
    other key material)."""
    path = entry_path(material, kind=kind)
    if path is None or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("material") != material or "payload" not in doc:
        return None
    return doc["payload"], path


def _write(material: dict, kind: str, payload) -> Path | None:
    from reference.atomic import atomic_write_json, write_failed
    path = entry_path(material, kind=kind)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_failed(path.parent, e) from e
    return atomic_write_json(path, {"material": material, "payload": payload}, indent=None,
                             default=lambda x: x.item() if hasattr(x, "item") else str(x))  # NumPy scalars


def load(material: dict):
    """``(payload, path)`` of the cached floor entry of ``material`` (the dict :func:`store` wrote), or None (no
    cache set, no entry, or an entry that is unreadable or of other key material)."""
    got = _read(material, "floor")
    if got is None or not isinstance(got[0], dict):
        return None
    return got


def store(material: dict, payload: dict) -> Path | None:
    """Write the floor entry of ``material`` (atomically); returns its path, or None when no cache is set.

    Raises:
        reference.errors.OutputWriteError: the folder cannot be created or written (named, with the OS reason).
    """
    return _write(material, "floor", payload)


def control_material(weights, prompts: Sequence[Sequence[int]], th, note: str) -> dict:
    """Everything the negative control of a run depends on when it perturbs the REFERENCE (not the backend under
    test): the weights, the token lists of its truths (``prompts``: each KL prompt + the continuation judged after
    it, parity.harness.kl.run_kl), the thresholds' numbers (tol_rel, floor_rel, multiple, score_rel: what its
    verdicts read; the precision and source labels excluded), the perturbation's note (target and tensor) and the
    code (the perturbation itself is :func:`parity.harness.run.perturbation`, under parity/harness)."""
    ids = hashlib.sha256(json.dumps([[int(t) for t in p] for p in prompts]).encode()).hexdigest()
    return {"schema": SCHEMA, "fingerprint": weights.fingerprint(), "files": _weight_files(weights), "prompts": ids,
            "thresholds": [float(th.tol_rel), float(th.floor_rel), float(th.multiple), float(th.score_rel)],
            "note": str(note), "code": code_version()}


def load_control(material: dict):
    """``(control dict, path)`` of a cached negative control, or None."""
    got = _read(material, "control")
    if got is None or not isinstance(got[0], dict) or "ok" not in got[0]:
        return None
    return got


def store_control(material: dict, control: dict) -> Path | None:
    """Keep a negative control's result (atomically); None when no cache is set."""
    return _write(material, "control", control)
