"""Backend names and the one opener every verb uses (``--backend NAME`` or ``module:Class``)."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable


from reference.errors import InputError, UserError

from parity.backends import engine, llama_cpp_server, llamacpp, reference, transformers, vllm
from parity.backends.base import Backend, BackendEntry, BackendError, PRECISIONS  # noqa: F401
from parity.backends.refusal import EngineRefused

# ------------------------------------------------------------------------------------------ the registry
# The built-in backends, one line each, in the order help and messages list them. Each module declares its
# own entry (name, class, options, help, deprecated spellings); every list below is derived from these.
BACKENDS: dict[str, BackendEntry] = {e.name: e for e in (
    reference.BACKEND,
    engine.BACKEND,
    transformers.BACKEND,
    llamacpp.BACKEND,
    llama_cpp_server.BACKEND,
    vllm.BACKEND,
)}


def _load_module_class(spec: str, flag: str = "--backend"):
    mod_name, _, cls_name = spec.partition(":")
    if not mod_name or not cls_name:
        raise InputError(f"{flag} {spec!r}: expected a name ({', '.join(BACKEND_NAMES)}) or 'module:Class'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendError(f"{flag} {spec!r}: cannot import module {mod_name!r}: {e} (a module:Class "
                           f"backend must be importable: installed, or its folder on PYTHONPATH)") from e
    except SyntaxError as e:  # the plugin's own code does not parse: name the file and line
        raise BackendError(f"{flag} {spec!r}: cannot import module {mod_name!r}: SyntaxError at "
                           f"{e.filename}:{e.lineno}: {e.msg}") from e
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - raising (or sys.exit) at import: the backend cannot be opened
        what = f"SystemExit({e.code!r})" if isinstance(e, SystemExit) else type(e).__name__
        msg = "" if isinstance(e, SystemExit) else (str(e).strip().splitlines() or [""])[0]
        raise BackendError(f"{flag} {spec!r}: cannot import module {mod_name!r}: it raised {what} at import"
                           f"{': ' + msg if msg else ''}") from e
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise BackendError(f"{flag} {spec!r}: expected a backend class {cls_name!r} in module {mod_name!r} "
                           f"(module:Class), found no attribute of that name")
    if not hasattr(cls, "open"):
        raise BackendError(f"{flag} {spec!r}: expected a class with an open(model_path, **opts) classmethod "
                           f"(the parity Backend protocol), found {cls!r}")
    return cls


# -------------------------------------------------------------------------------------- the spec grammar
# The one ``--backend`` grammar:  NAME[:key=value,...]  or  module:Class[:key=value,...]
# (``engine:device=cuda,precision=bf16``, ``reference:dtype=float64``, ``my_pkg.my_mod:MyBackend``).
# After the first ':' an item holding '=' starts the options of NAME; anything else names a class.
# The options each built-in backend accepts; values are checked against the tuple, or converted by the type.
BACKEND_OPTIONS: dict[str, dict[str, Any]] = {n: e.options for n, e in BACKENDS.items()}
# old spellings, accepted for one version (0.2.x) with a deprecation note: name -> (name, options)
BACKEND_ALIASES: dict[str, tuple[str, dict]] = {a: (n, dict(o)) for n, e in BACKENDS.items()
                                                for a, o in e.aliases.items()}
# every name ``--backend`` takes: the current spellings, then the deprecated ones
BACKEND_NAMES: tuple[str, ...] = (*BACKENDS, *BACKEND_ALIASES)


def backend_help() -> str:
    """The ``--backend`` help text: the grammar, every built-in backend with its options, and module:Class."""
    return ("NAME[:key=value,...]: " + ", ".join(e.describe() for e in BACKENDS.values())
            + ", or module:Class[:key=value,...] for an outside engine")


class BackendSpec:
    """A parsed ``--backend`` value: ``name`` ('reference', 'engine', another registered name, or
    'module:Class'), ``options`` (key -> value as typed, a str), ``plugin`` (True for module:Class) and
    ``alias`` (the deprecated spelling it was given as, else None). ``str(spec)`` is the canonical text."""

    __slots__ = ("name", "options", "plugin", "alias")

    def __init__(self, name: str, options: dict | None = None, plugin: bool = False, alias: str | None = None):
        self.name, self.options, self.plugin, self.alias = name, dict(options or {}), plugin, alias

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return self.name + (":" + opts if opts else "")

    def __repr__(self) -> str:
        return f"BackendSpec({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BackendSpec) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def deprecation(self) -> str | None:
        """The one-line note for a deprecated spelling (None when the spelling is current)."""
        if self.alias is None:
            return None
        return (f"note: --backend {self.alias} is deprecated and will be removed after 0.2; write --backend {self}")

    def with_options(self, flag_values: dict, flag: str = "--backend") -> "BackendSpec":
        """This spec with options given by the old flags (``{'--device': 'cpu', ...}`` -> key ``device``);
        None values are ignored. A flag contradicting the spec, or not an option of this backend, is refused.

        Raises:
            InputError: naming the flag, the backend and its options.
        """
        opts = dict(self.options)
        for fl, v in flag_values.items():
            if v is None:
                continue
            key = fl.lstrip("-").replace("-", "_")
            valid = BACKEND_OPTIONS.get(self.name)
            if valid is not None and key not in valid:
                hint = {("engine", "dtype"): "; the engine's is --precision float32|bf16 (engine:precision=...)",
                        ("reference", "precision"): "; the reference's is --dtype float32|float64 "
                                                    "(reference:dtype=...)",
                        ("reference", "device"): "; the reference runs on the CPU (use --backend engine for the GPU)",
                        }.get((self.name, key), "")
                raise InputError(f"{fl} {v}: expected only options of the {self.name} backend ({', '.join(valid)}), "
                                 f"found {fl}, which applies to another backend (--backend {self.alias or self})"
                                 f"{hint}")
            want = (valid or {}).get(key)
            if isinstance(want, tuple) and str(v) not in want:
                raise InputError(f"{fl} {v}: expected one of {', '.join(want)} (the {self.name} backend's {key}), "
                                 f"found {v!r}")
            if key in opts and str(opts[key]) != str(v):
                raise InputError(f"{fl} {v}: expected the same {key} as {flag} {self.alias or self} "
                                 f"({key}={opts[key]}), found {v}")
            opts[key] = str(v)
        out = BackendSpec(self.name, opts, self.plugin, self.alias)
        _check_options(out, flag)
        return out


def _check_options(spec: BackendSpec, flag: str) -> None:
    valid = BACKEND_OPTIONS.get(spec.name)
    if valid is None:
        return  # a plugin's / another backend's options go to its open() as typed
    for k, v in spec.options.items():
        if k not in valid:
            raise InputError(f"{flag} {str(spec)!r}: expected options of the {spec.name} backend "
                             f"({', '.join(valid)}), found {k!r}")
        want = valid[k]
        if isinstance(want, tuple) and v not in want:
            raise InputError(f"{flag} {str(spec)!r}: {k}: expected one of {', '.join(want)}, found {v!r}")
        if want is int:
            try:
                if int(v) < 1:
                    raise ValueError
            except ValueError:
                raise InputError(f"{flag} {str(spec)!r}: {k}: expected an integer >= 1, found {v!r}") from None


def _parse_options(text: str, whole: str, flag: str) -> dict:
    opts: dict[str, str] = {}
    for item in text.split(","):
        k, eq, v = item.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k or not v:
            raise InputError(f"{flag} {whole!r}: expected options as key=value separated by commas, found "
                             f"{item!r}")
        if k in opts:
            raise InputError(f"{flag} {whole!r}: expected each option once, found {k!r} twice")
        opts[k] = v
    return opts


def _current_names() -> str:
    return ", ".join(BACKENDS)


def parse_backend_spec(text, flag: str = "--backend") -> BackendSpec:
    """Parse a ``--backend`` value (the one place the grammar is read; every verb and the pytest plugin
    call it): ``NAME[:key=value,...]`` or ``module:Class[:key=value,...]``; the deprecated spellings in
    :data:`BACKEND_ALIASES` map to their current form (``spec.alias`` keeps what was typed). A
    :class:`BackendSpec` is returned as is.

    Raises:
        InputError: an empty value, a malformed option list, an unknown key or value of a built-in backend.
    """
    if isinstance(text, BackendSpec):
        return text
    s = str(text).strip()
    if not s:
        raise InputError(f"{flag}: expected a backend name ({_current_names()}) or 'module:Class', "
                         f"found an empty string")
    head, colon, rest = s.partition(":")
    if head in BACKEND_ALIASES:
        name, opts = BACKEND_ALIASES[head]
        spec = BackendSpec(name, opts, alias=head)
        if colon:
            spec = BackendSpec(name, {**opts, **_parse_options(rest, s, flag)}, alias=s)
    elif not colon:
        spec = BackendSpec(head)
    else:
        first = rest.split(",", 1)[0].split(":", 1)[0]
        if "=" not in first and head in BACKEND_OPTIONS:
            raise InputError(f"{flag} {s!r}: expected {head}:key=value[,key=value...] (options: "
                             f"{', '.join(BACKEND_OPTIONS[head])}), found {rest!r}")
        if "=" in first:   # NAME:key=value,...
            spec = BackendSpec(head, _parse_options(rest, s, flag))
        else:              # module:Class[:key=value,...]
            cls_name, colon2, opt_text = rest.partition(":")
            if not head or not cls_name:
                raise InputError(f"{flag} {s!r}: expected a name ({_current_names()}[:key=value,...]) or "
                                 f"'module:Class'")
            spec = BackendSpec(f"{head}:{cls_name}", _parse_options(opt_text, s, flag) if colon2 else {},
                               plugin=True)
    _check_options(spec, flag)
    return spec


def _open_options(spec: BackendSpec) -> dict:
    """The spec's options as open() keyword arguments (dtype as a NumPy dtype, integers as int)."""
    out: dict[str, Any] = {}
    valid = BACKEND_OPTIONS.get(spec.name, {})
    for k, v in spec.options.items():
        if valid.get(k) is int or (spec.name not in BACKEND_OPTIONS and v.lstrip("-").isdigit()):
            out[k] = int(v)
        else:
            out[k] = v
    return out



def backend_class(spec, flag: str = "--backend") -> tuple[type, dict]:
    """Resolve a ``--backend`` value (:func:`parse_backend_spec`) to (class, default open options). ``flag``:
    the option named in error messages (``--a`` / ``--b`` for ``qwen4exp kl``).

    Names: those of :data:`BACKENDS` (each entry's ``open_defaults`` fills machine-dependent defaults, e.g.
    the engine's device=auto), their deprecated :data:`BACKEND_ALIASES`, and 'module:Class'.
    Raises:
        InputError: unknown name or option. BackendError: 'module:Class' not importable.
    """
    sp = parse_backend_spec(spec, flag)
    opts = _open_options(sp)
    entry = BACKENDS.get(sp.name)
    if entry is not None:
        return entry.cls, (entry.open_defaults(opts) if entry.open_defaults else opts)
    if sp.plugin:
        return _load_module_class(sp.name, flag), opts
    raise InputError(f"{flag}: expected one of {_current_names()} (NAME[:key=value,...]) or 'module:Class', "
                     f"found {str(spec)!r}")


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
    except (UserError, KeyboardInterrupt, EngineRefused):
        raise  # EngineRefused: the engine's defect (verdict REFUSED), not a usage error
    except (Exception, SystemExit) as e:  # a backend that cannot be opened is a clear exit-2 error, not a traceback
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BackendError(f"{flag} {spec!r}: cannot be opened on {model_path}: {type(e).__name__}"
                           f"{': ' + msg if msg else ''}") from e
    if be is None or isinstance(be, (bool, int, float, str, bytes, list, tuple, dict)):
        found = "None" if be is None else f"a {type(be).__name__} ({str(be)[:40]!r})"
        raise BackendError(f"{flag} {spec!r}: expected {getattr(cls, '__name__', 'the class')}.open() to return a "
                           f"backend object (the parity Backend protocol, parity/backends/base.py), found {found}")
    if parse_backend_spec(spec, flag).plugin and getattr(be, "name", None) in (None, "backend", *BACKEND_NAMES):
        try:
            be.name = str(spec)
        except (AttributeError, TypeError):  # a read-only name: keep the backend's own
            pass  # an outside backend (also one subclassing ours) is reported under its own spec
    for attr in ("new_sequence", "prefill", "decode", "forward_tokens", "rollback", "snapshot", "restore",
                 "position", "free", "config"):
        if not hasattr(be, attr):
            raise BackendError(f"{flag} {spec!r}: expected the parity Backend protocol (parity/backends/base.py), "
                               f"found no {attr!r} on {type(be).__name__}")
    if not hasattr(be, "precision"):
        try:
            be.precision = "float32"
        except (AttributeError, TypeError):
            raise BackendError(f"{flag} {spec!r}: expected a 'precision' attribute on {type(be).__name__}, "
                               f"found none (and it cannot be set)") from None
    if not isinstance(be.precision, str) or be.precision not in PRECISIONS:  # it picks the thresholds
        raise BackendError(f"{flag} {spec!r}: the 'precision' attribute of {type(be).__name__}: expected one of "
                           f"{', '.join(PRECISIONS)}, found {be.precision!r}")
    return be


def opener(spec: str, model_path, **opts) -> Callable[..., Backend]:
    """A factory ``f(**more_opts) -> Backend`` (scenarios re-open a backend per page size)."""
    def f(**more):
        return open_backend(spec, model_path, **{**opts, **more})
    f.spec = spec
    return f
