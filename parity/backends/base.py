"""The parity Backend protocol: the base class, its defaults, and the shared helpers.

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
    be.prefill_last(h, ids) -> [V]          # prefill keeping only the last row (default: prefill(...)[-1])
    be.decode_greedy(hs, ids) -> [B] int64  # optional: argmax on the backend's device (generation)
    be.draft(h, next_id, k) -> (ids [k], logits [k, V])   # capability 'mtp': the backend's own MTP drafts
    be.prefill_batch([h1, h2], [ids1, ids2]) -> [[T1, V], [T2, V]]   # ragged requests at once (optional)
    child = be.fork(h)                      # a sequence copy (optional; default snapshot + restore)
    be.last_logits(h) -> [V]                # the held logits of the last position (optional)
    be.dense_logits(ids) -> [T, V]          # QSA selection off (optional; capability 'dense_logits')
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


BACKEND_NAMES = ("reference", "reference-f64", "engine", "engine-cpu", "engine-cuda")


class BackendError(UserError, RuntimeError):
    """A backend that cannot be opened or used as asked (missing dependency, bad handle, refused op)."""


def describe_exception(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception a backend raised; ``SystemExit(code)`` for a
    backend that called sys.exit(); a MemoryError names what ran out (GPU memory for CuPy / CUDA allocators,
    else host memory)."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) (the backend called sys.exit)"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}{': ' + msg if msg else ''}"
    if isinstance(e, MemoryError):
        mod = type(e).__module__ or ""
        gpu = mod.startswith(("cupy", "torch.cuda", "numba.cuda")) or "cuda" in text.lower()
        text += f" (out of {'GPU' if gpu else 'host'} memory)"
    return text


class BackendRaised(UserError, RuntimeError):
    """The backend under test raised (or called sys.exit, or ran out of memory) while it ran: the documented
    "backend raised" outcome of every verb -- exit :data:`reference.errors.EXIT_DIVERGENCE` (1), one ERROR line
    naming the backend and the exception; ``traceback`` (the backend's stack) is printed only with
    ``--traceback``."""

    from reference.errors import EXIT_DIVERGENCE as exit_code  # noqa: N811 - the class attribute of UserError

    def __init__(self, spec, exc: BaseException, during: str = ""):
        import traceback as _tb
        super().__init__(f"backend {str(spec)!r} raised {describe_exception(exc)}{' ' + during if during else ''}")
        self.spec = str(spec)
        self.traceback = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))


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


class LastLogits:
    """What a backend adapter holds for :meth:`Backend.last_logits`: per sequence, the logits row of its last
    consumed position, kept through verify/rollback (the rows of the latest verify), snapshots (each snapshot
    object carries the row of its position), restores and forks. Keys are handle identities."""

    def __init__(self):
        self.last: dict = {}      # key -> row [V] or None
        self.verify: dict = {}    # key -> (start position, rows [k, V], row before the verify)
        self.snaps: dict = {}     # id(snapshot) -> (snapshot, row); the snapshot is kept so its id stays unique

    @staticmethod
    def key(h):
        """The dictionary key of a handle (ints as they are, objects by identity)."""
        return h if isinstance(h, (int, np.integer)) else id(h)

    def fed(self, h, rows, start: int, verify: bool = False) -> None:
        """Sequence ``h`` consumed positions ``start..start+k-1`` whose logits are ``rows [k, V]``."""
        k = self.key(h)
        rows = np.asarray(rows)
        if rows.ndim == 1:
            rows = rows[None]
        if verify:
            self.verify[k] = (start, rows.copy(), self.last.get(k))
        else:
            self.verify.pop(k, None)
        if rows.shape[0]:
            self.last[k] = rows[-1].copy()

    def rolled_back(self, h, position: int) -> None:
        """``h`` is back at ``position``: its last row comes from the latest verify's rows (or before them)."""
        k = self.key(h)
        v = self.verify.get(k)
        if v is None:
            self.last[k] = None
            return
        start, rows, before = v
        self.last[k] = before if position <= start else rows[position - start - 1]

    def snapshot(self, h, snap) -> None:
        """``snap`` was taken of ``h``: it carries ``h``'s last row."""
        self.snaps[id(snap)] = (snap, self.last.get(self.key(h)))

    def restored(self, h, snap) -> None:
        """``snap`` was restored into ``h`` (an unknown snapshot, e.g. one read from a file, carries none)."""
        k = self.key(h)
        hit = self.snaps.get(id(snap))
        self.last[k] = None if hit is None or hit[0] is not snap else hit[1]
        self.verify.pop(k, None)

    def forked(self, parent, child) -> None:
        """``child`` is a copy of ``parent``."""
        pk, ck = self.key(parent), self.key(child)
        self.last[ck] = self.last.get(pk)
        if pk in self.verify:
            self.verify[ck] = self.verify[pk]

    def forget(self, h) -> None:
        """``h`` consumed tokens whose logits the adapter never saw (e.g. a device-side greedy step)."""
        k = self.key(h)
        self.last[k] = None
        self.verify.pop(k, None)

    def freed(self, h) -> None:
        """``h`` is gone."""
        k = self.key(h)
        self.last.pop(k, None)
        self.verify.pop(k, None)

    def get(self, h, name: str) -> np.ndarray:
        """The held row of ``h``. Raises BackendError when none is held (nothing consumed, or a restore of
        a snapshot that carries none)."""
        row = self.last.get(self.key(h))
        if row is None:
            raise BackendError(f"backend {name}: last_logits: sequence holds no logits for its last position "
                               f"(nothing consumed yet, or restored from a snapshot that carries none)")
        return row.copy()


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
        "mtp": False,              # draft(h, next_id, k) supported (the checkpoint's MTP head)
        # --- issue 14 (additive): the optional operations and the self-consistency claims
        "prefill_batch": "loop",   # 'native': ragged requests in one forward; 'loop': the default one by one
        "fork": True,              # fork(h): the default is a snapshot restored into a new sequence
        "last_logits": False,      # last_logits(h): the logits a full prefix-cache hit samples from
        "deterministic": False,    # an identical call sequence gives bitwise identical logits
        "batch_invariant": False,  # a row's logits do not depend on the batch, verify width or chunking
        "dense_logits": False,     # dense_logits(ids): the same model with QSA selection off (every block)
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

    def prefill_last(self, h, ids: Sequence[int]) -> np.ndarray:
        """:meth:`prefill` returning only the last position's logits ``[V]`` (generation; backends that can
        skip the other rows override it). Default: the last row of :meth:`prefill`."""
        return np.asarray(self.prefill(h, ids))[-1]

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

    def draft(self, h, next_id: int, k: int):
        """The backend's own MTP-head drafts (capability ``mtp``): the ``k`` greedy draft tokens after sequence
        ``h``'s history followed by ``next_id`` (the trunk's chosen next token, not yet fed), and their draft
        logits ``[k, V]`` (host float32). Must not change what ``h`` holds (a repeated call gives the same);
        the backend's head follows the sequence through prefill, verify, rollback and restore itself.

        Raises:
            BackendError: the backend has no MTP drafting.
        """
        raise BackendError(f"backend {self.name}: draft: not supported by this backend (no MTP head)")

    def state_arrays(self, h) -> dict[str, np.ndarray]:
        """Named copies of the sequence's state (``layers.{i}.<kind>`` -> array), when supported.

        Raises:
            BackendError: the backend does not expose its state.
        """
        raise BackendError(f"backend {self.name}: state_arrays: not supported by this backend")

    # --- optional operations (issue 14); defaults built on the required ones
    def prefill_batch(self, hs: Sequence, id_lists: Sequence[Sequence[int]], chunk_size: int | None = None) -> list:
        """Prefill several sequences with ragged prompts (``id_lists[i]`` for ``hs[i]``, lengths may differ) as
        one request batch; returns one ``[T_i, V]`` logits array per sequence, in order.

        The default feeds them one by one (``capabilities['prefill_batch'] == 'loop'``); a backend with a
        packed/ragged prefill overrides it and declares ``'native'``.
        Raises:
            InputError: ``len(hs) != len(id_lists)`` or a sequence given twice; bad ids as :meth:`prefill`.
        """
        hs, id_lists = list(hs), list(id_lists)
        if len(hs) != len(id_lists):
            raise InputError(f"prefill_batch: expected one id list per sequence, found {len(hs)} sequences and "
                             f"{len(id_lists)} id lists")
        if len({id(h) for h in hs}) != len(hs):
            raise InputError("prefill_batch: expected distinct sequences, found one sequence twice")
        return [np.asarray(self.prefill(h, ids, chunk_size=chunk_size)) for h, ids in zip(hs, id_lists)]

    def fork(self, h):
        """A new sequence holding a copy of ``h``'s state (a sequence copy, e.g. OpenAI ``n > 1``); both
        continue independently. Default: ``restore(new_sequence(), snapshot(h))``."""
        child = self.new_sequence()
        try:
            self.restore(child, self.snapshot(h))
        except BaseException:
            self.free(child)
            raise
        return child

    def last_logits(self, h) -> np.ndarray:
        """Logits ``[V]`` of the last position sequence ``h`` consumed, as the backend holds them (a full
        prefix-cache hit, none of the prompt left to prefill, samples its first token from these).

        Raises:
            BackendError: not supported (``capabilities['last_logits']`` false).
        """
        raise BackendError(f"backend {self.name}: last_logits: not supported by this backend")

    def dense_logits(self, ids: Sequence[int]) -> np.ndarray:
        """One-shot logits ``[T, V]`` with QSA's top-k selection off (every complete block kept): below the
        budget bound the model is dense, so this must equal :meth:`logits` there.

        Raises:
            BackendError: not supported (``capabilities['dense_logits']`` false).
        """
        raise BackendError(f"backend {self.name}: dense_logits: not supported by this backend")

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
