"""JSON documents of the harness: :func:`jsonable` (a JSON-safe copy of numpy-holding results) and
:func:`write_json_atomic` (written to a temporary name and renamed)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from reference import atomic

__all__ = ["jsonable", "write_json_atomic"]


def jsonable(x: Any):
    """A JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to strings ('nan', 'inf')."""
    if isinstance(x, np.generic):
        x = x.item()
    elif isinstance(x, np.ndarray):
        x = x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json_atomic(path, obj) -> Path:
    """Write ``obj`` (made :func:`jsonable`) as indented JSON to ``path`` via a temp file + rename
    (:func:`reference.atomic.atomic_write_json`: mode per umask)."""
    # looked up on the module at each call, so a stand-in writer (a simulated full disk) reaches every caller
    return atomic.atomic_write_json(path, jsonable(obj), indent=1)
