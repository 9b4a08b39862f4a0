"""The parity Backend protocol: the base class, its defaults, and the shared helpers.

A *backend* is anything that can run the qwen4exp model incrementally for several concurrent
sequences. The parity harness (KL harness, scenario suites, ``qwen4exp parity``) drives backends only
through this protocol, so the reference session, the engine (CPU and CUDA paths) and any outside
engine (``--backend my_pkg.my_mod:MyBackend``) are judged the same way.

The protocol (duck-typed; subclass :class:`Backend` for the defaults and the docs)::

    be = Cls.open(model_path, **opts)       # opts: page_size=int, perturb=(tensor_name, fn) (optional)
    be.name -> str ; be.precision -> one of PRECISIONS ; be.config -> ModelConfig
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
    be.decode_greedy(hs, ids) -> [B] int64  # optional: argmax on the backend's device (generation; without it
                                            # the argmax of decode(): decode_greedy_of). Both judged by the kl row
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

A *server backend* (an engine behind an API that returns top-k log-probabilities, not logits) follows the
second protocol of this module, :class:`TopkServer`: no sequences, one ``prompt_topk`` request per prompt,
judged by the kl-topk row (parity.harness.topk). parity.backends.openai is its OpenAI-API base.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from reference.errors import InputError, UserError


@dataclass(frozen=True)
class BackendEntry:
    """One built-in backend as ``--backend NAME`` knows it, declared by the module that defines the backend
    (its ``BACKEND``) and listed once in :data:`parity.backends.registry.BACKENDS`; every list of names,
    options, aliases and help text is derived from those entries.

    Fields: ``name`` (the current spelling); ``cls`` (the class opened, with an ``open(model_path, **opts)``
    classmethod); ``options`` (key -> a tuple of the accepted values, or the type the value converts to:
    ``int``, ``str``; a ``str`` is checked by the backend's own ``open``); ``help`` (what the backend is and
    what its options mean, one phrase for ``--backend``'s help, after the option list); ``aliases`` (deprecated spelling -> the options it stands for); ``open_defaults``
    (parsed options -> the ``open`` keyword arguments, for defaults that depend on the machine or a type
    conversion; None: the options as parsed)."""

    name: str
    cls: type
    options: dict[str, Any]
    help: str
    aliases: dict[str, dict] = field(default_factory=dict)
    open_defaults: Callable[[dict], dict] | None = None

    def describe(self) -> str:
        """``name (key=a|b, key=N, ...; help)`` for ``--backend``'s help."""
        opts = ", ".join(f"{k}={'|'.join(v) if isinstance(v, tuple) else 'N' if v is int else '...'}"
                         for k, v in self.options.items())
        return f"{self.name} ({opts}{'; ' + self.help if self.help else ''})"


#: the precisions a backend may declare (its ``precision`` attribute): each picks its pass thresholds
#: (parity.harness.kl.FLOOR_MULTIPLE has one entry per name)
PRECISIONS = ("float64", "float32", "bf16", "fp16", "fp8")


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


class BackendOutputError(UserError, RuntimeError):
    """The backend under test returned something other than the protocol's answer (logits of the wrong
    shape): its defect, as a raise would be -- exit :data:`reference.errors.EXIT_DIVERGENCE` (1), one line naming
    the backend, what was expected and what was found; nothing is written."""

    from reference.errors import EXIT_DIVERGENCE as exit_code  # noqa: N811 - the class attribute of UserError


class CapabilityLimit(BackendError):
    """An operation asked for outside the limit the backend DECLARED for it (``capabilities[op]`` 'limited').

    The scenario runner turns it into a skipped case (with this message as the reason) only when the
    operation is declared limited or unsupported; raised for an operation declared supported it is a
    refusal, and the case fails."""


#: the operations a backend may declare supported, limited (with its limit) or unsupported
OPERATIONS = ("rollback", "snapshot", "verify", "fork", "batched_prefill", "batched_decode", "taps", "perturb",
              "state_arrays", "snapshot_file", "mtp")
SUPPORTED, LIMITED, UNSUPPORTED = "supported", "limited", "unsupported"
#: the reason every operation of a backend declaring ``sequences: False`` is unsupported
NO_SEQUENCES = ("the backend has no sequences (capabilities['sequences'] is False: it answers whole prompts, "
                "e.g. a server's top-k logprobs)")


@dataclass(frozen=True)
class Capability:
    """One operation's declared support. ``status``: 'supported' | 'limited' | 'unsupported'; ``limit``: what
    the limit is, in words (limited/unsupported); ``max_tokens``: for rollback / verify, the most tokens one
    call may take (None: no count limit); ``within``: 'last_verify' when rollback only undoes the tokens of the
    last forward_tokens call."""

    op: str
    status: str
    limit: str | None = None
    max_tokens: int | None = None
    within: str | None = None

    @property
    def usable(self) -> bool:
        """True unless unsupported (a limited operation runs, narrowed)."""
        return self.status != UNSUPPORTED

    def reason(self) -> str:
        """The skip reason this declaration gives, e.g. ``rollback limited: at most 2 tokens``."""
        if self.status == SUPPORTED:
            return f"{self.op} supported"
        lim = self.limit or (f"at most {self.max_tokens} tokens" if self.max_tokens is not None else "")
        return f"{self.op} {self.status}" + (f": {lim}" if lim else "")

    def to_json(self) -> dict:
        """The declaration as a JSON-ready dict (report.json ``meta.capabilities``)."""
        return {k: v for k, v in {"status": self.status, "limit": self.limit, "max_tokens": self.max_tokens,
                                  "within": self.within}.items() if v is not None}


def capability(be_or_caps, op: str) -> Capability:
    """A backend's declaration for operation ``op`` (one of :data:`OPERATIONS`), normalised.

    Accepted declarations (``capabilities[op]``): a bool (True supported, False unsupported: the historical
    form, kept), a status string, a dict ``{"status": ..., "limit": "...", "max_tokens": n, "within": ...}``,
    a ``(status, limit)`` pair, or a :class:`Capability`. A missing key takes the protocol default
    (:attr:`Backend.capabilities`). A backend declaring ``sequences: False`` (the :class:`TopkServer` servers)
    supports no operation: each reads unsupported, with :data:`NO_SEQUENCES` as the reason unless it gives its
    own. ``be_or_caps``: a backend or its capabilities dict.

    Raises:
        BackendError: a declaration of none of these forms, an unknown status, or a bad max_tokens.
    """
    caps = be_or_caps if isinstance(be_or_caps, dict) else capabilities_of(be_or_caps)
    v = caps.get(op, Backend.capabilities.get(op, True))
    if caps.get("sequences", True) is False and op in OPERATIONS:
        # every operation acts on a sequence: a backend without them (a server's top-k logprobs) has none, whatever
        # the protocol default; its own reason for one is kept
        own = capability({op: v}, op) if not isinstance(v, bool) else None
        return Capability(op, UNSUPPORTED, own.limit if own is not None and own.limit else NO_SEQUENCES)
    if isinstance(v, Capability):
        return v
    if isinstance(v, bool) or v is None:
        return Capability(op, SUPPORTED if v else UNSUPPORTED)
    if isinstance(v, str):
        v = {"status": v}
    elif isinstance(v, (tuple, list)) and len(v) == 2:
        v = {"status": v[0], "limit": v[1]}
    if not isinstance(v, dict):
        raise BackendError(f"capabilities[{op!r}]: expected a bool, 'supported'/'limited'/'unsupported', a dict "
                           f"with 'status' or a (status, limit) pair, found {v!r}")
    st = v.get("status", LIMITED if ("limit" in v or "max_tokens" in v) else SUPPORTED)
    if st not in (SUPPORTED, LIMITED, UNSUPPORTED):
        raise BackendError(f"capabilities[{op!r}]: status: expected supported, limited or unsupported, found {st!r}")
    mt = v.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
        raise BackendError(f"capabilities[{op!r}]: max_tokens: expected a non-negative integer, found {mt!r}")
    return Capability(op, st, v.get("limit"), mt, v.get("within"))


def capability_table(be) -> dict[str, dict]:
    """Every operation's normalised declaration, JSON-ready (for report.json)."""
    caps = capabilities_of(be)
    return {op: capability(caps, op).to_json() for op in OPERATIONS}


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


def declares_tap(be, name: str) -> bool:
    """Whether backend ``be`` declares that it produces tap ``name`` (:attr:`Backend.produces_taps`; a backend
    without a declaration: every tap). Templates: ``{i}`` / ``{p}`` match one layer index, ``*`` any text."""
    import fnmatch
    import re
    decl = getattr(be, "produces_taps", None)
    if decl is None:
        return True
    for t in decl:
        pat = "".join(r"\d+" if part in ("{i}", "{p}") else ".*" if part == "*" else re.escape(part)
                      for part in re.split(r"(\{i\}|\{p\}|\*)", str(t)))
        if re.fullmatch(pat, name) or fnmatch.fnmatchcase(name, str(t)):
            return True
    return False


def capabilities_of(be) -> dict:
    """A backend's capabilities with the protocol defaults filled in (duck-typed backends may omit some)."""
    return {**Backend.capabilities, **(getattr(be, "capabilities", None) or {})}


def owned(x) -> np.ndarray:
    """A private copy of an array a backend returned. A backend may hand back a view of a buffer it reuses
    (llama.cpp's ``llama_get_logits``, a torch engine's static output tensor through ``.numpy()``): correct
    when returned, overwritten by its next call. The harness keeps rows across calls (a greedy stream's decode
    rows, a determinism check's two forwards, a batch replayed row by row), so it copies each answer at once
    rather than judging whatever the buffer holds later."""
    return np.array(x, copy=True)


def one_shot_logits(be, ids) -> np.ndarray:
    """``be.logits(ids)`` when the backend has it, else a fresh sequence prefilled with ``ids`` and freed (a
    copy of what the backend returned: :func:`owned`)."""
    fn = getattr(be, "logits", None)
    if fn is not None:
        return owned(fn(ids))
    return owned(Backend.logits(be, ids))


def prefill_last_of(be, h, ids) -> np.ndarray:
    """The generation path's prefill: ``be.prefill_last(h, ids)`` when the backend has it (the protocol
    default is ``prefill(h, ids)[-1]``), else -- a duck-typed backend -- the last row of ``be.prefill``.
    Returns the last position's logits as the backend returned them (``[V]`` for a correct backend)."""
    fn = getattr(be, "prefill_last", None)
    return owned(fn(h, ids) if fn is not None else np.asarray(be.prefill(h, ids))[-1])


def decode_greedy_of(be, hs, ids) -> np.ndarray:
    """The generation path's greedy step: ``be.decode_greedy(hs, ids)`` (the argmax on the backend's device)
    when the backend has it, else the first maximum (``np.argmax``) of each row of ``be.decode(hs, ids)``,
    which is what greedy generation samples without it. Returns the next tokens as the backend returned
    them (int ``[B]`` for a correct backend)."""
    fn = getattr(be, "decode_greedy", None)
    if fn is not None:
        return owned(fn(list(hs), [int(t) for t in ids]))
    return np.argmax(np.asarray(be.decode(list(hs), [int(t) for t in ids])), axis=-1).astype(np.int64)


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


def decode_args(hs, ids, vocab_size: int) -> list[int]:
    """The token ids of a ``decode(hs, ids)`` call as ints, one per sequence handle.

    Raises:
        InputError: ``len(hs) != len(ids)``, or an id not an integer in ``[0, vocab_size)``.
    """
    from reference.errors import InputError
    from reference.session import check_ids
    if len(hs) != len(ids):
        raise InputError(f"decode: expected one token per sequence, found {len(hs)} sequences and "
                         f"{len(ids)} tokens")
    return check_ids(list(ids), vocab_size, "decode ids").tolist()


class Handles(dict):
    """A backend's live sequences: int handle -> its per-sequence object (handles are never reused).

    ``handles.get_live(h)`` returns the object or raises :class:`BackendError` naming the handle; ``add(obj)``
    stores a new object and returns its handle; ``pop(h, None)`` frees (an unknown handle is ignored).
    """

    def __init__(self, owner):
        super().__init__()
        self._owner = owner  # its ``name`` (which a registry may set after opening) goes into the error
        self._next = 0

    def add(self, obj) -> int:
        """Store ``obj`` under a new handle and return it."""
        h = self._next
        self._next += 1
        self[h] = obj
        return h

    def get_live(self, h):
        """The object of live handle ``h``. Raises BackendError: ``h`` is freed, foreign or not hashable."""
        try:
            return self[h]
        except (KeyError, TypeError):
            raise dead_handle(self._owner.name, h) from None


def dead_handle(backend_name: str, h) -> BackendError:
    """The error for a sequence handle that is not live in backend ``backend_name``."""
    return BackendError(f"backend {backend_name}: sequence handle {h!r}: expected a live handle of this "
                        f"backend, found none (freed or foreign)")


class Backend:
    """Base class of the backend protocol (see the module docstring). Subclasses implement the
    sequence operations; :meth:`logits` and :meth:`taps` have generic defaults.

    Attributes:
        name: shown in reports ('reference', 'engine-cpu', 'my_mod:MyBackend', ...).
        precision: one of :data:`PRECISIONS` ('float64' | 'float32' | 'bf16' | 'fp16' | 'fp8') -- picks the pass
            thresholds; the registry refuses any other value when the backend is opened.
        config: the model's :class:`reference.config.ModelConfig`.
        model_path: the checkpoint directory.
    """

    name = "backend"
    precision = "float32"
    #: the taps this backend produces, as registry name templates (``{i}``: any layer index, e.g.
    #: ``"layers.{i}.mlp.out"``; a plain name for one tap; ``*`` globs allowed), or None: every registry tap.
    #: An outside engine declares the few it has, so a located failure lists as missing only the taps it
    #: should have had (:func:`declares_tap`), never the ones it has no counterpart for by design.
    produces_taps: tuple | None = None

    #: capabilities every backend declares; override in subclasses. Each operation of :data:`OPERATIONS` is
    #: True / False, or 'limited' with its limit (see :func:`capability`); the suites skip or narrow the cases
    #: that need an operation a backend does not fully support, and show each skip with its reason.
    capabilities: dict = {
        "page_sizes": None,        # None: paging is not a concept of this backend (page_size is a no-op)
        "batched_decode": True,
        "verify": True,            # forward_tokens(h, ids)
        "rollback": True,          # rollback(h, n)
        "snapshot": True,          # snapshot(h) / restore(same h, snap)
        "fork": True,              # restore(other h, snap): a snapshot restored into another (fresh) handle
        "batched_prefill": True,   # prefill of many tokens in one call, and chunk_size=
        "taps": True,              # taps() records the registry's taps
        "perturb": False,          # open(..., perturb=(name, fn)) supported
        "state_arrays": False,     # state_arrays(h) supported
        "snapshot_file": False,    # parity.backends.snapshot_file can serialise its snapshots
        "mtp": False,              # draft(h, next_id, k) supported (the checkpoint's MTP head)
        # --- the optional operations and the self-consistency claims (additive)
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

    # --- optional operations; defaults built on the required ones
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


# ------------------------------------------------------------------------------ the top-k server protocol
class EchoMisaligned(BackendError):
    """A server's answer does not attribute its rows to the prompt's positions: the echo (or the per-prompt-token
    logprobs) dropped, moved or replaced prompt tokens, so every later row would be judged at the wrong position.
    ``position``: the first prompt position whose token the answer does not hold where it should."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = int(position)


class TopkServer:
    """The protocol of a server backend: an engine reached through an API that returns, per position, the top-k
    log-probabilities of its distribution rather than full logits (an OpenAI-style completions server).

    It is not a sequence backend (``capabilities['topk_only']`` is True, which makes ``qwen4exp parity`` run
    the one ``kl-topk`` row of :func:`parity.harness.topk.run_topk`, the scenarios skipped with the reason),
    and that row reads only these members::

        Cls.open(model_path, **opts) -> TopkServer  # connects (and may probe the server) before anything is judged
        be.name -> str ; be.config -> ModelConfig ; be.precision -> one of PRECISIONS (picks the thresholds)
        be.topk -> int                    # the k asked for per position
        be.requests -> int                # requests made so far ...
        be.max_requests -> int            # ... and the most this backend will make (the row stops there)
        be.convention -> str | None       # which row the server puts at token i: 'openai' (the distribution OF
                                          # token i) or 'after-token' (the one after it); measured or declared
        be.retokenized -> int             # answers in which the server ran other ids than the prompt's
        be.sendable(ids) -> bool          # whether this prompt can be sent so that the server runs exactly ids
        be.mappable(token_id) -> bool     # whether a logprob the server gives can be attributed to this id
        be.prompt_topk(ids, n_new=1) -> (rows, greedy, ran)
        be.close()

    ``prompt_topk`` sends one prompt with ``n_new`` greedy (temperature 0) tokens after it and returns
    ``rows[p]`` = {token id: logprob (nats)} of the distribution AFTER position p of ``ran + greedy``
    (p = 0 .. len(ran) + len(greedy) - 2; None where the server gave no row), whatever convention the server
    answers in; ``greedy``: the generated ids (None for a token that maps to no single id; generation may stop
    early); ``ran``: the prompt ids the server ran (``ids``, unless it tokenized a text prompt otherwise).
    It raises :class:`EchoMisaligned` when the answer cannot be attributed to positions (a server defect the row
    fails at that position), :class:`BackendError` for any other unusable answer, and
    :class:`reference.errors.InputError` for a prompt that is not :meth:`sendable`.

    The sequence operations of :class:`Backend` exist (the opener checks for them) and raise BackendError.
    Subclasses implement :meth:`open`, :meth:`sendable`, :meth:`mappable` and :meth:`prompt_topk`.
    """

    name = "server"
    precision = "float32"
    topk: int = 20
    requests: int = 0
    max_requests: int = 64
    convention: str | None = None
    retokenized: int = 0
    capabilities = {"page_sizes": None, "batched_decode": False, "perturb": False, "state_arrays": False,
                    "snapshot_file": False, "rollback": False, "snapshot": False, "taps": False,
                    "sequences": False, "topk_only": True}

    @classmethod
    def open(cls, model_path, **opts) -> "TopkServer":
        """Connect to the server for the checkpoint at ``model_path`` (its config and, where prompts travel as
        text, its tokenizer). Raises InputError (bad options) or BackendError (the server does not answer)."""
        raise NotImplementedError

    def sendable(self, ids: Sequence[int]) -> bool:
        """Whether the prompt ``ids`` can be sent so that the server runs exactly these ids."""
        raise NotImplementedError

    def mappable(self, token_id: int) -> bool:
        """Whether a logprob the server returns can be attributed to ``token_id`` (a token string several ids
        decode to cannot: its logprob counts as unmapped, and the id's absence from a top-k is not a fault)."""
        raise NotImplementedError

    def prompt_topk(self, ids: Sequence[int], n_new: int = 1):
        """One request: ``(rows, greedy, ran)`` as the class docstring states."""
        raise NotImplementedError

    def _not_a_sequence_backend(self, *a, **k):
        raise BackendError(f"backend {self.name}: not a sequence backend (a server gives top-k logprobs only; "
                           f"qwen4exp parity runs its kl-topk row)")

    new_sequence = prefill = decode = forward_tokens = rollback = snapshot = restore = position = free = \
        _not_a_sequence_backend

    def close(self) -> None:
        """Release resources (default: nothing; the server is not ours)."""

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}>"
