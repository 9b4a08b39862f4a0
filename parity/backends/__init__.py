"""The parity Backend protocol and its adapters.

A *backend* is anything that can run the qwen4exp model incrementally for several concurrent
sequences. The parity harness (KL harness, scenario suites, ``qwen4exp parity``) drives backends only
through this protocol, so the reference session, the engine (CPU and CUDA paths) and any outside
engine (``--backend my_pkg.my_mod:MyBackend``) are judged the same way.

The protocol (duck-typed; subclass :class:`Backend` for the defaults and the docs)::

    be = Cls.open(model_path, **opts)       # opts: page_size=int, perturb=(tensor_name, fn) (optional)
    be.name -> str ; be.precision -> 'float64'|'float32'|'bf16'|'fp8' ; be.config -> ModelConfig
    be.capabilities -> dict                 # see Backend.capabilities
    h = be.new_sequence()                   # opaque handle; several may be live at once
    be.prefill(h, ids, chunk_size=None) -> np.ndarray [T, V]   # logits of every prompt position
    be.decode([h1, h2, ...], [t1, t2, ...]) -> [B, V]           # one token for each sequence, batched
    be.forward_tokens(h, ids) -> [k, V]     # verify k drafted tokens (keeps what rollback needs)
    be.rollback(h, n)                       # forget the last n tokens
    be.snapshot(h) -> obj ; be.restore(h, obj)   # restore into any live handle (empty or not)
    be.position(h) -> int                   # tokens in the sequence's state (the KV length)
    be.free(h)
    be.logits(ids) -> [T, V]                # one-shot: a fresh sequence prefilled with ids, freed
    with be.taps(out_dir=None, include=...) as rec: ...   # record taps (taps.recorder.Recorder)
    be.close()

Logits are host NumPy arrays (float32, or float64 for ``reference-f64``), rows in token order.
Handles from one backend must never be passed to another. Errors from bad input are
:class:`reference.errors.UserError` subclasses.

The TRUTH for every comparison is :func:`truth_model` 's ``forward`` -- the reference's single full
forward over the same tokens.
"""
from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from reference.errors import InputError, UserError

__all__ = ["Backend", "ReferenceBackend", "EngineBackend", "BackendError", "open_backend", "backend_class",
           "BACKEND_NAMES", "truth_model", "load_weights", "capabilities_of", "one_shot_logits"]

BACKEND_NAMES = ("reference", "reference-f64", "engine", "engine-cpu", "engine-cuda")


class BackendError(UserError, RuntimeError):
    """A backend that cannot be opened or used as asked (missing dependency, bad handle, refused op)."""


def load_weights(model_path, perturb=None):
    """Open a checkpoint (``reference.checkpoint.Checkpoint``), optionally with one tensor replaced.

    Args:
        model_path: checkpoint directory.
        perturb: None, or ``(tensor_name, fn)`` where ``fn(array float32) -> array`` gives the patched
            tensor (applied through ``with_override``).
    Raises:
        BackendError: reference.checkpoint is not importable yet.
        CheckpointError: unreadable checkpoint or unknown tensor name.
    """
    try:
        from reference.checkpoint import Checkpoint
    except ImportError as e:
        raise BackendError(f"reference.checkpoint: expected an importable checkpoint reader, found {e}") from e
    ck = Checkpoint.open(str(model_path))
    if perturb is not None:
        name, fn = perturb
        if not ck.has(name):
            from reference.errors import CheckpointError
            raise CheckpointError(f"perturb: expected a tensor name of the checkpoint, found {name!r}")
        ck = ck.with_override(name, np.asarray(fn(ck.get(name, dtype=np.float32)), dtype=np.float32))
    return ck


def truth_model(model_path, dtype=np.float32, weights=None):
    """The reference model whose ``forward(ids) -> [T, V]`` is the truth of every comparison.

    Raises:
        BackendError: reference.model is not importable yet.
    """
    try:
        from reference.model import ReferenceModel
    except ImportError as e:
        raise BackendError(f"reference.model: expected the reference model, found {e}") from e
    ck = weights if weights is not None else load_weights(model_path)
    return ReferenceModel(ck, dtype=dtype)


def capabilities_of(be) -> dict:
    """A backend's capabilities with the protocol defaults filled in (duck-typed backends may omit some)."""
    return {**Backend.capabilities, **(getattr(be, "capabilities", None) or {})}


def one_shot_logits(be, ids) -> np.ndarray:
    """``be.logits(ids)`` when the backend has it, else a fresh sequence prefilled with ``ids`` and freed."""
    fn = getattr(be, "logits", None)
    if fn is not None:
        return np.asarray(fn(ids))
    return Backend.logits(be, ids)


def _check_ids(ids, vocab: int, what: str = "ids") -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise InputError(f"{what}: expected a non-empty 1-D list of token ids, found shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{what}: expected integer token ids, found dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab:
        raise InputError(f"{what}: expected token ids in [0, {vocab}), found range [{arr.min()}, {arr.max()}]")
    return [int(x) for x in arr]


class Backend:
    """Base class of the backend protocol (see the module docstring). Subclasses implement the
    sequence operations; :meth:`logits` and :meth:`taps` have generic defaults.

    Attributes:
        name: shown in reports ('reference', 'engine-cpu', 'my_mod:MyBackend', ...).
        precision: 'float64' | 'float32' | 'bf16' | 'fp8' -- picks the pass thresholds.
        config: the model's :class:`reference.config.ModelConfig`.
        model_path: the checkpoint directory.
    """

    name = "backend"
    precision = "float32"

    #: capabilities every backend declares; override in subclasses
    capabilities: dict = {
        "page_sizes": None,        # None: paging is not a concept of this backend (page_size is a no-op)
        "batched_decode": True,
        "perturb": False,          # open(..., perturb=(name, fn)) supported
        "state_arrays": False,     # state_arrays(h) supported
        "snapshot_file": False,    # parity.backends.snapshot_file can serialise its snapshots
    }

    @classmethod
    def open(cls, model_path, **opts) -> "Backend":
        """Open the backend on a checkpoint directory. ``opts``: ``page_size`` (int), ``perturb``."""
        raise NotImplementedError

    # --- sequences
    def new_sequence(self):
        """Start an empty sequence; returns its opaque handle (several may be live at once)."""
        raise NotImplementedError

    def free(self, h) -> None:
        """Release the sequence ``h``; the handle is dead afterwards."""
        raise NotImplementedError

    def prefill(self, h, ids: Sequence[int], chunk_size: int | None = None) -> np.ndarray:
        """Feed ``ids`` (optionally in chunks of ``chunk_size``) to sequence ``h``; returns the logits
        ``[T, V]`` of every fed position (host float32, float64 for 'reference-f64')."""
        raise NotImplementedError

    def decode(self, hs: Sequence, ids: Sequence[int]) -> np.ndarray:
        """One token per sequence (``ids[i]`` for ``hs[i]``), decoded as a batch; returns logits ``[B, V]``."""
        raise NotImplementedError

    def forward_tokens(self, h, ids: Sequence[int]) -> np.ndarray:
        """Verify ``k`` drafted tokens on ``h`` (keeping what :meth:`rollback` needs); returns logits
        ``[k, V]``."""
        raise NotImplementedError

    def rollback(self, h, n: int) -> None:
        """Forget the last ``n`` tokens of sequence ``h``."""
        raise NotImplementedError

    def snapshot(self, h):
        """Capture sequence ``h``'s whole state; returns an opaque snapshot for :meth:`restore`."""
        raise NotImplementedError

    def restore(self, h, snap) -> None:
        """Put ``snap`` into the live handle ``h`` (empty or not)."""
        raise NotImplementedError

    def position(self, h) -> int:
        """Tokens in sequence ``h``'s state (the KV length)."""
        raise NotImplementedError

    def state_arrays(self, h) -> dict[str, np.ndarray]:
        """Named copies of the sequence's state (``layers.{i}.<kind>`` -> array), when supported.

        Raises:
            BackendError: the backend does not expose its state.
        """
        raise BackendError(f"backend {self.name}: state_arrays: not supported by this backend")

    # --- generic helpers
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """One-shot logits ``[T, V]`` of ``ids``: a fresh sequence, a single prefill, freed."""
        h = self.new_sequence()
        try:
            return np.asarray(self.prefill(h, ids))
        finally:
            self.free(h)

    @contextlib.contextmanager
    def taps(self, out_dir=None, **recorder_kw):
        """Record the taps produced by the calls inside the ``with`` block; yields the Recorder.

        Args:
            out_dir: archive directory, or None to record in memory (``rec.archive()`` after the block).
            recorder_kw: ``taps.recorder.Recorder`` options (include, layers, positions, meta, ...).
        Uses the producer-side hook, so it works for any backend whose code emits taps in this process.
        Raises:
            BackendError: the taps recorder is not available.
        """
        try:
            from taps.recorder import Recorder
        except ImportError as e:
            raise BackendError(f"taps.recorder.Recorder: expected the taps recorder, found {e}") from e
        meta = dict(recorder_kw.pop("meta", None) or {})
        meta.setdefault("backend", self.name)
        meta.setdefault("dtype", self.precision)
        with Recorder(out_dir, meta=meta, **recorder_kw) as rec:
            yield rec

    def close(self) -> None:
        """Release resources (default: nothing)."""

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}>"


class ReferenceBackend(Backend):
    """The reference (``reference.model.ReferenceModel`` sessions) as a backend.

    Options: ``dtype`` (np.float32 default, np.float64 for 'reference-f64'), ``page_size`` (accepted and
    ignored: the reference has no pages), ``perturb`` (see :func:`load_weights`), ``weights`` (an open
    Checkpoint/DictWeights to use instead of ``model_path``).
    """

    capabilities = {"page_sizes": None, "batched_decode": True, "perturb": True, "state_arrays": True,
                    "snapshot_file": True}

    def __init__(self, model, name: str = "reference", model_path=None):
        self.model = model
        self.config = model.config if hasattr(model, "config") else model.ck.config
        self.name = name
        self.model_path = model_path
        self.precision = "float64" if np.dtype(getattr(model, "dtype", np.float32)) == np.float64 else "float32"
        self._sessions: dict[int, Any] = {}
        self._next = 0

    @classmethod
    def open(cls, model_path, *, dtype=np.float32, page_size=None, perturb=None, weights=None, name=None,
             **opts) -> "ReferenceBackend":
        """Open the reference on ``model_path`` (see the class docstring for the options); ``name``
        defaults to 'reference' or 'reference-f64'.

        Raises:
            InputError: an unknown option. Checkpoint/config errors propagate from loading.
        """
        if opts:
            raise InputError(f"reference backend options: expected dtype/page_size/perturb/weights, "
                             f"found {sorted(opts)}")
        ck = weights if weights is not None else load_weights(model_path, perturb)
        if weights is not None and perturb is not None:
            name_, fn = perturb
            ck = ck.with_override(name_, np.asarray(fn(ck.get(name_, dtype=np.float32)), dtype=np.float32))
        model = truth_model(model_path, dtype=dtype, weights=ck)
        nm = name or ("reference-f64" if np.dtype(dtype) == np.float64 else "reference")
        return cls(model, nm, model_path)

    def _sess(self, h):
        try:
            return self._sessions[h]
        except (KeyError, TypeError):
            raise BackendError(f"backend {self.name}: sequence handle {h!r}: expected a live handle of this "
                               f"backend, found none (freed or foreign)") from None

    def new_sequence(self):
        """A new reference session; returns its int handle."""
        h = self._next
        self._next += 1
        self._sessions[h] = self.model.new_session()
        return h

    def free(self, h) -> None:
        """Drop the session of ``h`` (an unknown handle is ignored)."""
        self._sessions.pop(h, None)

    def prefill(self, h, ids, chunk_size=None):
        """Logits ``[T, V]`` of ``ids`` fed to session ``h`` (``chunk_size``: chunked prefill).

        Raises:
            InputError: ``ids`` not a non-empty 1-D list of integer ids in ``[0, vocab_size)``.
            BackendError: ``h`` is not a live handle of this backend.
        """
        ids = _check_ids(ids, self.config.vocab_size)
        return np.asarray(self._sess(h).prefill(ids, chunk_size=chunk_size))

    def decode(self, hs, ids):
        """Logits ``[B, V]``: ``ids[i]`` decoded on session ``hs[i]``, one session after another.

        Raises:
            InputError: ``len(hs) != len(ids)`` or bad ids.
            BackendError: a handle that is not live.
        """
        if len(hs) != len(ids):
            raise InputError(f"decode: expected one token per sequence, found {len(hs)} sequences and "
                             f"{len(ids)} tokens")
        ids = _check_ids(ids, self.config.vocab_size, "decode ids")
        return np.stack([np.asarray(self._sess(h).decode(t)) for h, t in zip(hs, ids)])

    def forward_tokens(self, h, ids):
        """Logits ``[k, V]`` of the ``k`` drafted ``ids`` on session ``h`` (``Session.forward_tokens``).

        Raises:
            InputError: bad ids.
            BackendError: ``h`` is not a live handle of this backend.
        """
        ids = _check_ids(ids, self.config.vocab_size, "draft ids")
        return np.asarray(self._sess(h).forward_tokens(ids))

    def rollback(self, h, n):
        """Forget the last ``n`` tokens of session ``h`` (``Session.rollback``). Raises BackendError when ``h`` is not
        a live handle."""
        self._sess(h).rollback(int(n))

    def snapshot(self, h):
        """Session ``h``'s snapshot (``Session.snapshot``). Raises BackendError when ``h`` is not a live handle."""
        return self._sess(h).snapshot()

    def restore(self, h, snap):
        """Restore ``snap`` into session ``h`` (``Session.restore``). Raises BackendError when ``h`` is not a live
        handle."""
        self._sess(h).restore(snap)

    def position(self, h):
        """Tokens in session ``h``'s state. Raises BackendError when ``h`` is not a live handle."""
        return int(self._sess(h).position)

    def state_arrays(self, h):
        """Session ``h``'s state as named arrays (``parity.backends.snapshot_file.flatten_state``). Raises BackendError when
        ``h`` is not a live handle."""
        from parity.backends.snapshot_file import flatten_state
        return flatten_state(self._sess(h).state)

    def logits(self, ids):
        """The one-shot logits: the model's single full forward (the truth path)."""
        ids = _check_ids(ids, self.config.vocab_size)
        return np.asarray(self.model.forward(ids))


class EngineBackend(Backend):
    """The engine (``engine.Engine``) as a backend: ``device`` 'cpu' or 'cuda'.

    Options: ``page_size`` (int, default the engine's), ``precision`` (engine precision, default
    'float32' on cpu and 'bf16' on cuda), ``perturb``, ``weights``; others are passed to ``engine.Engine``.
    """

    capabilities = {"page_sizes": "any", "batched_decode": True, "perturb": True, "state_arrays": True,
                    "snapshot_file": True}

    def __init__(self, eng, name, model_path, precision):
        self.eng = eng
        self.name = name
        self.model_path = model_path
        self.precision = precision
        self.config = getattr(eng, "config", None)
        self._live: set = set()
        pool = getattr(eng, "pool", None)
        if not all(hasattr(pool, a) for a in ("slab_arrays", "page_arrays", "slots")):
            self.capabilities = {**type(self).capabilities, "state_arrays": False}
        if not all(hasattr(eng, a) for a in ("export_snapshot", "import_snapshot")):
            self.capabilities = {**self.capabilities, "snapshot_file": False}

    @classmethod
    def open(cls, model_path, *, device="cpu", page_size=None, precision=None, perturb=None, weights=None,
             name=None, **opts) -> "EngineBackend":
        """Open ``engine.Engine`` on ``model_path`` (see the class docstring for the options; ``max_seqs``
        defaults to 16); ``name`` defaults to ``engine-<device>``.

        Raises:
            BackendError: ``engine.Engine`` cannot be imported.
        """
        try:
            import engine as engine_pkg
            Engine = engine_pkg.Engine
        except (ImportError, AttributeError) as e:
            raise BackendError(f"backend engine-{device}: expected engine.Engine to be importable, found {e!r}; "
                               f"the engine is not available -- use --backend reference to check the harness") from e
        ck = weights if weights is not None else load_weights(model_path, perturb)
        if weights is not None and perturb is not None:
            name_, fn = perturb
            ck = ck.with_override(name_, np.asarray(fn(ck.get(name_, dtype=np.float32)), dtype=np.float32))
        prec = precision or ("float32" if device == "cpu" else "bf16")
        kw = dict(opts)
        kw.setdefault("max_seqs", 16)  # the scenarios keep up to ~10 sequences live (batches + straight runs)
        if page_size is not None:
            kw["page_size"] = int(page_size)
        eng = Engine(ck, precision=prec, device=device, **kw)
        be = cls(eng, name or f"engine-{device}", model_path, "float32" if prec == "float32" else prec)
        if be.config is None:
            be.config = ck.config
        return be

    def new_sequence(self):
        """A new engine sequence (``Engine.add_sequence``); the sequence object is the handle."""
        s = self.eng.add_sequence()
        self._live.add(id(s))
        return s

    def free(self, h):
        """Release engine sequence ``h`` (``Engine.free``)."""
        self.eng.free(h)
        self._live.discard(id(h))

    def prefill(self, h, ids, chunk_size=None):
        """Logits ``[T, V]`` of ``ids`` fed to sequence ``h`` (``Engine.prefill``).

        Raises:
            InputError: ``ids`` not a non-empty 1-D list of integer ids in ``[0, vocab_size)``.
        """
        ids = _check_ids(ids, self.config.vocab_size)
        return np.asarray(self.eng.prefill(h, ids, chunk_size=chunk_size))

    def decode(self, hs, ids):
        """Logits ``[B, V]``: ``ids[i]`` for sequence ``hs[i]``, batched (``Engine.decode``).

        Raises:
            InputError: bad ids.
        """
        ids = _check_ids(ids, self.config.vocab_size, "decode ids")
        return np.asarray(self.eng.decode(list(hs), ids))

    def forward_tokens(self, h, ids):
        """Logits ``[k, V]`` of the ``k`` drafted ``ids`` on sequence ``h`` (``Engine.verify``).

        Raises:
            InputError: bad ids.
        """
        ids = _check_ids(ids, self.config.vocab_size, "draft ids")
        return np.asarray(self.eng.verify(h, ids))

    def rollback(self, h, n):
        """Forget the last ``n`` tokens of sequence ``h`` (``Engine.rollback``)."""
        self.eng.rollback(h, int(n))

    def snapshot(self, h):
        """Sequence ``h``'s snapshot (``Engine.snapshot``)."""
        return self.eng.snapshot(h)

    def restore(self, h, snap):
        """Restore a live engine snapshot (pages shared again), or a host-array export of one (from
        ``parity.backends.snapshot_file.load_snapshot`` / ``Engine.export_snapshot``: pages allocated, contents checked).

        Raises:
            StateError (a UserError): a foreign snapshot, or an export of another model or lacking any state.
        """
        if isinstance(snap, dict):
            self.eng.import_snapshot(h, snap)
        else:
            self.eng.restore(h, snap)

    _STATE_NAMES = {"gdn_conv": "gdn.{i}.conv", "gdn_rec": "gdn.{i}.recurrent", "ple_conv": "ple.{i}.conv",
                    "ple_ctx": "ple.{i}.context", "kv_k": "qsa.{i}.k", "kv_v": "qsa.{i}.v",
                    "idx_k": "qsa.{i}.index_keys", "blk_k": "qsa.{i}.block_keys"}

    def state_arrays(self, h):
        """The sequence's logical state, named like the reference's (``gdn.{i}.conv``, ``qsa.{i}.k`` ...):
        slab rows as they are, KV / indexer keys gathered from the sequence's pages for positions
        ``0..L-1``, block keys from the slot of each complete block's last token (engine/state.py layout).

        Raises:
            BackendError: the engine's state layout is not the one this adapter reads.
        """
        from engine.backend import to_numpy
        pool = self.eng.pool
        L = self.position(h)
        out = {}
        try:
            for key, arr in pool.slab_arrays():
                f, i = key.rsplit(".", 1)
                out[self._STATE_NAMES[f].format(i=i)] = np.array(to_numpy(arr[h.slab]), copy=True)
            slots = pool.slots(h, 0, L) if L else np.zeros(0, np.int64)
            r = self.config.indexer_compress_ratio or 1
            blk = slots[r - 1::r][:L // r] if L else slots
            for key, arr in pool.page_arrays():
                f, i = key.rsplit(".", 1)
                idx = blk if f == "blk_k" else slots
                out[self._STATE_NAMES[f].format(i=i)] = np.array(to_numpy(arr[idx]), copy=True)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BackendError(f"backend {self.name}: state_arrays: expected the engine/state.py layout, found "
                               f"{type(e).__name__}: {e}") from e
        return out

    def position(self, h):
        """Tokens in sequence ``h``'s state: ``Engine.position(h)``, else the handle's ``position``,
        ``length`` or ``seq_len``.

        Raises:
            BackendError: none of these exists.
        """
        pos = getattr(self.eng, "position", None)
        if pos is not None:
            return int(pos(h))
        for attr in ("position", "length", "seq_len"):
            v = getattr(h, attr, None)
            if v is not None:
                return int(v() if callable(v) else v)
        raise BackendError(f"backend {self.name}: position: the engine exposes no sequence length")


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


def backend_class(spec: str, flag: str = "--backend") -> tuple[type, dict]:
    """Resolve a ``--backend`` value to (class, default open options). ``flag``: the option named in
    error messages (``--a`` / ``--b`` for ``qwen4exp kl``).

    Names: 'reference', 'reference-f64', 'engine' (cuda when a GPU is present, else cpu), 'engine-cpu',
    'engine-cuda', or 'module:Class'.
    Raises:
        InputError: unknown name. BackendError: 'module:Class' not importable.
    """
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
    if ":" in spec and getattr(be, "name", None) in (None, "backend", *BACKEND_NAMES):
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
