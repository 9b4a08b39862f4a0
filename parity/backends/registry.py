"""Backend names and the one opener every verb uses (``--backend NAME`` or ``module:Class``)."""
from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from reference.errors import InputError, UserError

from parity.backends.base import BACKEND_NAMES, Backend, BackendError  # noqa: F401
from parity.backends.engine import EngineBackend
from parity.backends.reference import ReferenceBackend


def _load_module_class(spec: str, flag: str = "--backend"):
    mod_name, _, cls_name = spec.partition(":")
    if not mod_name or not cls_name:
        raise InputError(f"{flag} {spec!r}: expected a name ({', '.join(BACKEND_NAMES)}) or 'module:Class'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendError(f"{flag} {spec!r}: cannot import module {mod_name!r}: {e} (a module:Class "
                           f"backend must be importable: installed, or its folder on PYTHONPATH)") from e
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise BackendError(f"{flag} {spec!r}: module {mod_name!r} has no attribute {cls_name!r}")
    if not hasattr(cls, "open"):
        raise BackendError(f"{flag} {spec!r}: expected a class with an open(model_path, **opts) classmethod "
                           f"(the parity Backend protocol), found {cls!r}")
    return cls


def split_backend_options(spec: str, flag: str = "--backend") -> tuple[str, dict]:
    """``NAME:key=value,...`` -> ``(NAME, {key: value})`` for a built-in NAME (:data:`BACKEND_NAMES`); any other
    spec comes back as ``(spec, {})`` (``module:Class`` keeps its colon). Values: integers when they parse as
    one, else strings. (A small, separate parser of the ``--backend`` option grammar; the CLI's
    ``parse_backend_spec`` may fold it in.)

    Raises:
        InputError: an item without '=', an empty key, or a key given twice -- naming ``flag`` and the item.
    """
    name, sep, rest = str(spec).partition(":")
    if not sep or name not in BACKEND_NAMES:
        return spec, {}
    opts: dict = {}
    for item in rest.split(","):
        k, eq, v = item.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k:
            raise InputError(f"{flag} {spec!r}: expected {name}:key=value,..., found the item {item!r}")
        if k in opts:
            raise InputError(f"{flag} {spec!r}: expected each option once, found {k!r} twice")
        try:
            opts[k] = int(v)
        except ValueError:
            opts[k] = v
    return name, opts


def backend_class(spec: str, flag: str = "--backend") -> tuple[type, dict]:
    """Resolve a ``--backend`` value to (class, default open options). ``flag``: the option named in
    error messages (``--a`` / ``--b`` for ``qwen4exp kl``).

    Names: 'reference', 'reference-f64', 'engine' (cuda when a GPU is present, else cpu), 'engine-cpu',
    'engine-cuda', 'transformers' (the official implementation, :mod:`parity.backends.transformers`), or
    'module:Class'; a built-in name may carry options, ``NAME:key=value,...`` (:func:`split_backend_options`).
    Raises:
        InputError: unknown name. BackendError: 'module:Class' not importable.
    """
    base, extra = split_backend_options(spec, flag)
    if extra:
        cls, defaults = backend_class(base, flag)
        return cls, {**defaults, **extra}
    if spec == "transformers":
        from parity.backends.transformers import TransformersBackend
        return TransformersBackend, {}
    if spec == "reference":
        return ReferenceBackend, {"dtype": np.float32}
    if spec == "reference-f64":
        return ReferenceBackend, {"dtype": np.float64}
    if spec in ("engine", "engine-cpu", "engine-cuda"):
        if spec == "engine":
            try:
                from engine.backend import gpu_available
                device = "cuda" if gpu_available() else "cpu"
            except ImportError:
                device = "cpu"
        else:
            device = spec.split("-")[1]
        return EngineBackend, {"device": device}
    if ":" in spec:
        return _load_module_class(spec, flag), {}
    raise InputError(f"{flag}: expected one of {', '.join(BACKEND_NAMES)} or 'module:Class', found {spec!r}")


def open_backend(spec: str, model_path, flag: str = "--backend", **opts) -> Backend:
    """Open a backend by ``--backend`` value on a checkpoint directory. ``opts`` override the defaults;
    ``flag`` is the option named in error messages.

    Raises:
        InputError / BackendError: see :func:`backend_class`; the backend's own errors on open.
    """
    cls, defaults = backend_class(spec, flag)
    kw = {**defaults, **opts}
    try:
        be = cls.open(Path(model_path), **kw)
    except UserError:
        raise
    except Exception as e:  # a backend that cannot be opened is a clear exit-2 error, not a traceback
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BackendError(f"{flag} {spec!r}: cannot be opened on {model_path}: {type(e).__name__}"
                           f"{': ' + msg if msg else ''}") from e
    if be is None or isinstance(be, (bool, int, float, str, bytes, list, tuple, dict)):
        found = "None" if be is None else f"a {type(be).__name__} ({str(be)[:40]!r})"
        raise BackendError(f"{flag} {spec!r}: expected {getattr(cls, '__name__', 'the class')}.open() to return a "
                           f"backend object (the parity Backend protocol, parity/backend.py), found {found}")
    if ":" in spec and getattr(be, "name", None) in (None, "backend", *BACKEND_NAMES):  # module:Class or NAME:opts
        try:
            be.name = spec
        except (AttributeError, TypeError):  # a read-only name: keep the backend's own
            pass  # an outside backend (also one subclassing ours) is reported under its own spec
    for attr in ("new_sequence", "prefill", "decode", "forward_tokens", "rollback", "snapshot", "restore",
                 "position", "free", "config"):
        if not hasattr(be, attr):
            raise BackendError(f"{flag} {spec!r}: expected the parity Backend protocol (parity/backend.py), "
                               f"found no {attr!r} on {type(be).__name__}")
    if not hasattr(be, "precision"):
        try:
            be.precision = "float32"
        except (AttributeError, TypeError):
            raise BackendError(f"{flag} {spec!r}: expected a 'precision' attribute on {type(be).__name__}, "
                               f"found none (and it cannot be set)") from None
    return be


def opener(spec: str, model_path, **opts) -> Callable[..., Backend]:
    """A factory ``f(**more_opts) -> Backend`` (scenarios re-open a backend per page size)."""
    def f(**more):
        return open_backend(spec, model_path, **{**opts, **more})
    f.spec = spec
    return f
