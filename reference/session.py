"""Stateful sessions over the reference model: prefill, decode, verify, rollback, snapshot/restore.

A :class:`Session` owns one sequence's whole state (:class:`SessionState`):

* per QSA layer (:class:`QSAState`): rotated keys and values, the raw indexer-key history and the
  compressed block keys derived from it (a pure function of the raw keys, kept to avoid recomputation);
* per GDN layer (:class:`GDNState`): the causal-conv history ``[K-1, conv_dim]`` and the recurrent state
  ``[Hv, dk, dv]``;
* per PLE layer (:class:`PLEState`): the dilated-conv history ``[(K-1)*ngram_size, hc*H]`` and the
  ``ngram_size - 1`` token n-gram context.

Every path (one prefill, chunked prefill, decode, forward_tokens, snapshot/restore, rollback) computes
the same function as :meth:`reference.model.ReferenceModel.forward` over the same tokens.
A step is committed only when it completes, so an interrupted call leaves the session unchanged.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from reference.errors import InputError

__all__ = ["GrowBuffer", "GDNState", "PLEState", "QSAState", "SessionState", "Snapshot", "Session",
           "STATE_KINDS", "required_kinds", "check_ids", "check_length", "MTPState", "MTPSession",
           "speculative_greedy", "accept_greedy", "mtp_draft_from_history"]

_SNAPSHOT_TOKENS: dict[int, list] = {}  # id(Snapshot) -> the token history it holds (while it lives)

#: every state kind a snapshot can carry (``Snapshot.kinds`` lists the ones it holds)
STATE_KINDS = ("qsa.kv", "qsa.indexer_keys", "gdn.conv", "gdn.recurrent", "ple.conv", "ple.ngram_context")


def required_kinds(config) -> frozenset:
    """The state kinds a session of ``config`` needs (QSA kinds only with QSA layers, PLE kinds only with PLE)."""
    kinds = set()
    if "indexed_attention" in config.layer_types:
        kinds |= {"qsa.kv", "qsa.indexer_keys"}
    if "linear_attention" in config.layer_types:
        kinds |= {"gdn.conv", "gdn.recurrent"}
    if config.ple_layer_ids:
        kinds |= {"ple.conv", "ple.ngram_context"}
    return frozenset(kinds)


def check_ids(ids, vocab_size: int | None, what: str = "token ids") -> np.ndarray:
    """Validate token ids: a non-empty 1-D sequence of integers in ``[0, vocab_size)``. The one token-id
    check of the project (sessions, backends, id files, prompts files, generation).

    Args:
        ids: a sequence or array of integers (Python ints beyond int64 are reported, not wrapped); a
            scalar counts as one id.
        vocab_size: the exclusive upper bound; None: any id representable as int64 (``[0, 2^63)``).
        what: names the input in the message (``"--ids 'x.txt'"``, ``"prompt 3"``, ...).
    Returns:
        ``[T]`` int64.
    Raises:
        InputError: naming the problem (empty, not integers, wrong rank, out of range with the first bad id,
            its index and the count of bad ids).
    """
    arr = np.asarray(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InputError(f"{what}: expected a 1-D sequence of integers, found an array of shape {arr.shape}")
    if arr.size == 0:
        raise InputError(f"{what}: expected at least one token id, found none")
    # Python ints too large for int64 arrive as an object array: compare them as Python ints
    py_ints = arr.dtype == object and all(isinstance(x, int) and not isinstance(x, bool) for x in arr)
    if not py_ints and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer)):
        raise InputError(f"{what}: expected integers, found dtype {arr.dtype}")
    limit = 2 ** 63 if vocab_size is None else int(vocab_size)
    if py_ints:
        bad = np.nonzero(np.array([x < 0 or x >= limit for x in arr.tolist()], dtype=bool))[0]
    else:
        bad = np.nonzero((arr < 0) | (arr > min(limit - 1, np.iinfo(np.int64).max)))[0]
    if bad.size:
        hi = "2^63" if vocab_size is None else f"vocab_size={vocab_size}"
        raise InputError(f"{what}: expected token ids in [0, {hi}), found {arr[bad[0]]} at index {int(bad[0])} "
                         f"({bad.size} out of range)")
    return arr.astype(np.int64)


def check_length(n_ids: int, max_positions: int, what: str = "--ids") -> None:
    """Refuse more token ids than the model has positions (every backend: the reference would otherwise
    run for minutes before failing or silently go past the trained range).

    Args:
        n_ids: number of ids; max_positions: the config's ``max_position_embeddings``; what: names the input.
    Raises:
        InputError: ``n_ids > max_positions``.
    """
    if n_ids > max_positions:
        raise InputError(f"{what}: expected at most max_position_embeddings={max_positions} token ids, found "
                         f"{n_ids}")


class GrowBuffer:
    """An append-only ``[n, ...]`` array with amortised O(1) appends and exact truncation."""

    def __init__(self, tail_shape: tuple, dtype, capacity: int = 16):
        self._a = np.zeros((capacity, *tail_shape), dtype=dtype)
        self.n = 0

    @property
    def data(self) -> np.ndarray:
        """The filled part ``[n, ...]`` (a view)."""
        return self._a[:self.n]

    def append(self, x: np.ndarray) -> np.ndarray:
        """Append rows ``x [m, ...]`` (same tail shape, cast to the buffer's dtype), growing the storage to
        at least double when full; returns :attr:`data` ``[n + m, ...]`` (a view)."""
        need = self.n + x.shape[0]
        if need > self._a.shape[0]:
            new = np.zeros((max(need, 2 * self._a.shape[0]), *self._a.shape[1:]), dtype=self._a.dtype)
            new[:self.n] = self._a[:self.n]
            self._a = new
        self._a[self.n:need] = x
        self.n = need
        return self.data

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` rows (no-op when ``n >= self.n``); the storage is not shrunk."""
        self.n = min(self.n, n)

    def copy(self) -> "GrowBuffer":
        """An independent deep copy holding the filled rows (storage trimmed to ``max(n, 1)`` rows)."""
        b = GrowBuffer.__new__(GrowBuffer)
        b._a = self._a[:max(self.n, 1)].copy()
        b.n = self.n
        return b


@dataclass
class GDNState:
    """Gated DeltaNet layer state: ``conv [K-1, conv_dim]``, ``recurrent [Hv, dk, dv]``."""
    conv: np.ndarray
    recurrent: np.ndarray

    def copy(self) -> "GDNState":
        """A deep copy (both arrays copied)."""
        return GDNState(self.conv.copy(), self.recurrent.copy())


@dataclass
class PLEState:
    """PLE layer state: ``conv [(K-1)*ngram_size, hc*H]`` and ``context [ngram_size-1]`` int64 token ids."""
    conv: np.ndarray
    context: np.ndarray

    def copy(self) -> "PLEState":
        """A deep copy (both arrays copied)."""
        return PLEState(self.conv.copy(), self.context.copy())


@dataclass
class QSAState:
    """QSA layer state: ``k``/``v`` ``[L, nKV, hd]`` (normed, rotated), raw ``index_keys [L, D]`` and the derived
    compressed ``block_keys [L // r, D]``."""
    k: GrowBuffer
    v: GrowBuffer
    index_keys: GrowBuffer
    block_keys: GrowBuffer

    def copy(self) -> "QSAState":
        """A deep copy (every buffer copied)."""
        return QSAState(self.k.copy(), self.v.copy(), self.index_keys.copy(), self.block_keys.copy())

    def truncate(self, length: int, compress_ratio: int) -> None:
        """Keep the first ``length`` positions of ``k``, ``v`` and ``index_keys`` and the
        ``length // compress_ratio`` complete blocks of ``block_keys``."""
        for b in (self.k, self.v, self.index_keys):
            b.truncate(length)
        self.block_keys.truncate(length // compress_ratio)


@dataclass
class SessionState:
    """All per-sequence state of one session, keyed by 0-based layer index."""
    position: int
    gdn: dict = field(default_factory=dict)
    qsa: dict = field(default_factory=dict)
    ple: dict = field(default_factory=dict)

    @property
    def kinds(self) -> frozenset:
        """The state kinds held: 'qsa.kv' and 'qsa.indexer_keys' when any QSA layer state is held,
        'gdn.conv' and 'gdn.recurrent' for GDN layer state, 'ple.conv' and 'ple.ngram_context' for PLE layer state."""
        k = set()
        if self.qsa:
            k |= {"qsa.kv", "qsa.indexer_keys"}
        if self.gdn:
            k |= {"gdn.conv", "gdn.recurrent"}
        if self.ple:
            k |= {"ple.conv", "ple.ngram_context"}
        return frozenset(k)

    def copy(self) -> "SessionState":
        """A deep copy: same position, every layer's state copied."""
        return SessionState(self.position, {i: s.copy() for i, s in self.gdn.items()},
                            {i: s.copy() for i, s in self.qsa.items()}, {i: s.copy() for i, s in self.ple.items()})

    @staticmethod
    def empty(config, dtype) -> "SessionState":
        """The state at position 0: zero conv/recurrent states, EOS-filled n-gram context, empty caches."""
        st = SessionState(0)
        for i, lt in enumerate(config.layer_types):
            if lt == "linear_attention":
                st.gdn[i] = GDNState(np.zeros((config.linear_conv_kernel_dim - 1, config.linear_conv_dim), dtype),
                                     np.zeros((config.linear_num_value_heads, config.linear_key_head_dim,
                                               config.linear_value_head_dim), dtype))
            else:
                hd, nkv = config.head_dim, config.num_key_value_heads
                st.qsa[i] = QSAState(GrowBuffer((nkv, hd), dtype), GrowBuffer((nkv, hd), dtype),
                                     GrowBuffer((config.indexer_head_dim,), dtype),
                                     GrowBuffer((config.indexer_head_dim,), dtype))
        for i in config.ple_layers:
            st.ple[i] = PLEState(np.zeros((config.ple_conv_state_len, config.hc_hidden_size), dtype),
                                 np.full(config.ngram_size - 1, config.ple_eos_token_id, dtype=np.int64))
        return st

    def light_copy(self) -> "SessionState":
        """Copy of the fixed-size states (GDN, PLE) only; QSA caches are shared (restored by truncation)."""
        return SessionState(self.position, {i: s.copy() for i, s in self.gdn.items()}, dict(self.qsa),
                            {i: s.copy() for i, s in self.ple.items()})


def _content_problem(config, snapshot) -> str | None:
    """The first state a snapshot's CONTENTS lack for ``config`` (whatever its ``kinds`` label says), or None.

    Checks that every layer the model has carries its state objects with real arrays: GDN ``conv``/``recurrent``,
    PLE ``conv``/``context``, QSA ``k``/``v``/``index_keys`` filled to the snapshot position and ``block_keys`` to
    ``position // indexer_compress_ratio`` (a stripped array, e.g. by ``parity.backends.snapshot_file.strip_kind``, is None).
    """
    st, pos = getattr(snapshot, "state", None), snapshot.position
    if not isinstance(st, SessionState):
        return f"state: expected a SessionState, found {type(st).__name__}"
    r = config.indexer_compress_ratio or 1
    for i, lt in enumerate(config.layer_types):
        if lt == "linear_attention":
            g = st.gdn.get(i)
            for f, kind in (("conv", "gdn.conv"), ("recurrent", "gdn.recurrent")):
                if not isinstance(getattr(g, f, None), np.ndarray):
                    return f"layer {i} GDN {f} ({kind}): expected an array, found none"
        else:
            q = st.qsa.get(i)
            for f, kind, n in (("k", "qsa.kv", pos), ("v", "qsa.kv", pos), ("index_keys", "qsa.indexer_keys", pos),
                               ("block_keys", "qsa.indexer_keys", pos // r)):
                b = getattr(q, f, None)
                if not isinstance(getattr(b, "_a", None), np.ndarray) or getattr(b, "n", None) != n:
                    return f"layer {i} QSA {f} ({kind}): expected {n} rows, found none"
    for i in config.ple_layers:
        pl = st.ple.get(i)
        for f, kind in (("conv", "ple.conv"), ("context", "ple.ngram_context")):
            if not isinstance(getattr(pl, f, None), np.ndarray):
                return f"layer {i} PLE {f} ({kind}): expected an array, found none"
    return None


@dataclass(frozen=True)
class Snapshot:
    """A deep, independent copy of a session's state.

    ``kinds`` names the state kinds held (see :data:`STATE_KINDS`); a consumer must refuse a snapshot that
    lacks a kind its model needs (:meth:`Session.restore` does). ``config_hash`` and ``dtype`` identify the model.
    """
    position: int
    state: SessionState
    kinds: frozenset
    config_hash: str
    dtype: str


class Session:
    """One sequence on a :class:`~reference.model.ReferenceModel` (create with ``model.new_session()``)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.state = SessionState.empty(model.config, model.dtype)
        self._checkpoints: dict[int, SessionState] = {}
        #: when a list, every step appends its pre-final-mixer residual ``[T, hc*H]`` (the MTP head's input)
        self.residual_log: list | None = None
        #: the token ids the state holds (None when unknown: restored from a snapshot this process did not take)
        self.tokens: list | None = []
        # the trunk residuals of every position, kept once the MTP head has drafted (GrowBuffer), else None
        self._mtp_R: GrowBuffer | None = None

    # ------------------------------------------------------------------ queries
    @property
    def position(self) -> int:
        """Number of tokens consumed so far (the absolute position of the next token)."""
        return self.state.position

    # ------------------------------------------------------------------ steps
    def _advance(self, ids: np.ndarray, logits: str):
        p = self.state.position
        self._checkpoints = {q: c for q, c in self._checkpoints.items() if q <= p}
        res: list = [] if self._mtp_R is not None else None
        out = self.model._run(self.state, ids, logits, residual_out=res if res is not None else self.residual_log)
        if res is not None:
            self._mtp_R.append(res[0])
            if self.residual_log is not None:
                self.residual_log.append(res[0])
        if self.tokens is not None:
            self.tokens.extend(int(t) for t in ids)
        return out

    def prefill(self, ids, chunk_size: int | None = None, last_only: bool = False) -> np.ndarray:
        """Consume ``ids`` (optionally in chunks of ``chunk_size`` tokens).

        Returns:
            logits ``[T, vocab_size]`` in the model dtype, or ``[vocab_size]`` of the last token when ``last_only``.
        Raises:
            InputError: bad ids or a chunk size < 1.
        """
        ids = check_ids(ids, self.config.vocab_size)
        T = len(ids)
        if chunk_size is None:
            chunk_size = T
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise InputError(f"chunk_size: expected a positive integer, found {chunk_size!r}")
        chunk_size = int(chunk_size)
        starts = range(0, T, chunk_size)
        outs = []
        from tqdm.auto import tqdm
        for s in tqdm(starts, desc="prefill", unit="chunk", disable=len(starts) < 8 or T < 512, leave=False):
            chunk = ids[s:s + chunk_size]
            is_last = s + chunk_size >= T
            mode = ("last" if is_last else "none") if last_only else "all"
            out = self._advance(chunk, mode)
            if out is not None:
                outs.append(out)
        if last_only:
            return outs[-1][-1]
        return np.concatenate(outs, axis=0)

    def decode(self, token_id) -> np.ndarray:
        """Consume one token; returns its logits ``[vocab_size]``."""
        ids = check_ids(token_id, self.config.vocab_size, "token id")
        if len(ids) != 1:
            raise InputError(f"decode: expected one token id, found {len(ids)}")
        return self._advance(ids, "all")[0]

    def forward_tokens(self, ids) -> np.ndarray:
        """Verify step: consume ``k`` tokens, returning logits ``[k, vocab_size]``, and keep a checkpoint at every
        position so :meth:`rollback` can return exactly to any accepted prefix."""
        ids = check_ids(ids, self.config.vocab_size)
        outs = []
        for t in ids:
            self._checkpoints[self.state.position] = self.state.light_copy()
            outs.append(self._advance(np.array([t]), "all")[0])
        return np.stack(outs)

    def rollback(self, n_tokens: int) -> None:
        """Drop the last ``n_tokens`` tokens' state.

        Exact: QSA caches are truncated and the GDN/PLE states restored from the per-position checkpoint kept by
        :meth:`forward_tokens` (position 0 needs none).
        Raises:
            InputError: ``n_tokens`` negative or beyond the position, or no checkpoint at the target position.
        """
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or not \
                0 <= n_tokens <= self.position:
            raise InputError(f"rollback: expected 0 <= n_tokens <= position={self.position}, found {n_tokens!r}")
        target = self.position - int(n_tokens)
        if target == self.position:
            return
        if target == 0:
            self.state = SessionState.empty(self.config, self.model.dtype)
            self._checkpoints = {}
            self.tokens = []
            if self._mtp_R is not None:
                self._mtp_R.truncate(0)
            return
        cp = self._checkpoints.get(target)
        if cp is None:
            have = sorted(self._checkpoints)
            raise InputError(f"rollback to position {target}: no checkpoint there (checkpoints are kept by "
                             f"forward_tokens; available: {have or 'none'}); use snapshot()/restore() instead")
        r = self.config.indexer_compress_ratio or 1
        for q in self.state.qsa.values():
            q.truncate(target, r)
        self.state = SessionState(target, {i: s.copy() for i, s in cp.gdn.items()}, self.state.qsa,
                                  {i: s.copy() for i, s in cp.ple.items()})
        if self.tokens is not None:
            del self.tokens[target:]
        if self._mtp_R is not None:
            self._mtp_R.truncate(target)
        self._checkpoints = {q: c for q, c in self._checkpoints.items() if q <= target}

    def snapshot(self) -> Snapshot:
        """A deep, independent copy of the whole state (with the kinds it holds)."""
        snap = Snapshot(self.position, self.state.copy(), self.state.kinds, self.config.config_hash(),
                        np.dtype(self.model.dtype).name)
        if self.tokens is not None:  # the history rides along by identity (the Snapshot format is unchanged)
            _SNAPSHOT_TOKENS[id(snap)] = list(self.tokens)
            weakref.finalize(snap, _SNAPSHOT_TOKENS.pop, id(snap), None)
        return snap

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the state by a (copy of a) snapshot.

        Raises:
            InputError: not a Snapshot, another model or dtype, or a snapshot missing a state kind this model needs.
        """
        if not isinstance(snapshot, Snapshot):
            raise InputError(f"restore: expected a reference Snapshot, found {type(snapshot).__name__}")
        missing = required_kinds(self.config) - frozenset(snapshot.kinds)
        if missing:
            raise InputError(f"restore: snapshot lacks state kinds {sorted(missing)} that this model needs "
                             f"(it holds {sorted(snapshot.kinds)})")
        problem = _content_problem(self.config, snapshot)
        if problem:  # the label may claim a kind whose arrays are gone: check the contents too
            raise InputError(f"restore: snapshot contents: {problem}; refusing to restore a partial state")
        if snapshot.config_hash != self.config.config_hash():
            raise InputError(f"restore: snapshot is of model config {snapshot.config_hash}, this session's is "
                             f"{self.config.config_hash()}")
        if snapshot.dtype != np.dtype(self.model.dtype).name:
            raise InputError(f"restore: snapshot dtype {snapshot.dtype}, session dtype {np.dtype(self.model.dtype).name}")
        self.state = snapshot.state.copy()
        self._checkpoints = {}
        toks = _SNAPSHOT_TOKENS.get(id(snapshot))
        self.tokens = list(toks) if toks is not None and len(toks) == snapshot.position else None
        self._mtp_R = None  # recomputed from the tokens at the next draft

    def mtp_draft_next(self, next_id, k: int, hnorm: str = "global", draft_selection: str = "fresh"):
        """The MTP head's ``k`` greedy drafts after this session's tokens followed by ``next_id``, as
        :func:`mtp_draft_from_history` computes them: a fresh head over every pair, so there is no head state to
        roll back; the trunk residuals are kept (and truncated by rollback) once the first draft computed them.

        Returns:
            ``(draft_ids [k] int64, draft_logits [k, V])``.
        Raises:
            InputError: the history is unknown (restored from a foreign snapshot) or the session is empty.
            CheckpointError: no MTP head.
        """
        if self.tokens is None or len(self.tokens) != self.position:
            raise InputError("mtp draft: expected the session's token history, found it unknown (restored from a "
                             "snapshot this process did not take); prefill the history again to draft")
        if self.position < 1:
            raise InputError("mtp draft: expected at least one token in the session, found none")
        if self._mtp_R is None or self._mtp_R.n != self.position:
            # the first draft (or one after a restore) recomputes the trunk residuals once; from then on every
            # step keeps its rows (the same values: a step's residual is a function of the history)
            res: list = []
            self.model._run(SessionState.empty(self.config, self.model.dtype), np.asarray(self.tokens, np.int64),
                            "none", residual_out=res)
            self._mtp_R = GrowBuffer((self.config.hc_hidden_size,), self.model.dtype)
            self._mtp_R.append(res[0])
        nxt = check_ids([next_id], self.config.vocab_size, "mtp next id")
        ms = self.model.new_mtp_session(hnorm=hnorm, draft_selection=draft_selection)
        toks = np.asarray(self.tokens, np.int64)
        return ms.draft(self._mtp_R.data, np.concatenate([toks[1:], nxt]), k)


# ---------------------------------------------------------------------------------------------- the MTP head
@dataclass
class MTPState:
    """The MTP head's own state: its QSA layer's caches (``k``/``v``/``index_keys``/``block_keys``) over the
    ``position`` pairs ``(R_q, x_{q+1})`` consumed so far (PLE is off in the head; it has no recurrent state)."""
    position: int
    qsa: QSAState

    def copy(self) -> "MTPState":
        """A deep copy."""
        return MTPState(self.position, self.qsa.copy())

    @staticmethod
    def empty(config, dtype) -> "MTPState":
        """Position 0, empty caches."""
        hd, nkv, D = config.head_dim, config.num_key_value_heads, config.indexer_head_dim
        return MTPState(0, QSAState(GrowBuffer((nkv, hd), dtype), GrowBuffer((nkv, hd), dtype),
                                    GrowBuffer((D,), dtype), GrowBuffer((D,), dtype)))


class MTPSession:
    """The MTP head of one sequence (create with ``model.new_mtp_session()``).

    Position convention (vLLM's drafter: target positions, token ids shifted by one): the head's position ``q``
    holds the pair ``(R_q, x_{q+1})``, ``R_q`` the trunk's pre-final-mixer residual at position ``q``. After the
    trunk consumed ``x_0..x_{n-1}`` and ``x_n`` is known, :meth:`draft` consumes ``(R_{n-1}, x_n)`` at position
    ``n-1`` (kept) and runs ``k-1`` further steps at ``n .. n+k-2`` on its own output state and drafted tokens;
    those are speculative and dropped before :meth:`draft` returns, so the state only ever holds pairs with
    trunk residuals.
    """

    def __init__(self, model, hnorm: str = "global", draft_selection: str = "fresh"):
        self.model = model
        self.config = model.config
        self.hnorm = hnorm
        self.draft_selection = draft_selection
        self.state = MTPState.empty(model.config, model.dtype)

    @property
    def position(self) -> int:
        """Pairs consumed so far (the position of the next pair)."""
        return self.state.position

    def _check(self, residual, ids, what):
        cfg = self.config
        ids = check_ids(ids, cfg.vocab_size, what)
        R = np.asarray(residual)
        if R.ndim != 2 or R.shape != (len(ids), cfg.hc_hidden_size):
            raise InputError(f"{what}: residual: expected shape [{len(ids)}, hc_count*hidden_size="
                             f"{cfg.hc_hidden_size}], found {list(R.shape)}")
        return R, ids

    def step(self, residual, next_ids) -> tuple[np.ndarray, np.ndarray]:
        """Consume ``T`` pairs; returns ``(draft_logits [T, V], state_out [T, hc*H])`` (committed on success).

        Raises:
            InputError: bad ids or a residual not ``[T, hc*H]``.
        """
        R, ids = self._check(residual, next_ids, "mtp step")
        logits, h = self.model._mtp_run(self.state, R, ids, self.hnorm)
        self.state.position += len(ids)
        return logits, h

    def draft(self, residual, next_ids, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Greedy drafts: consume the ``m`` pairs ``(residual, next_ids)`` (kept: the catch-up of accepted
        positions and the current one), then draft ``k`` tokens, the first from the last pair's logits, each
        further one from an MTP step on the previous step's state and draft (speculative, dropped afterwards).

        Returns:
            ``(draft_ids [k] int64, draft_logits [k, V])``.
        Raises:
            InputError: ``k < 1``, bad ids or residual.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"mtp draft: k: expected a positive integer, found {k!r}")
        R, ids = self._check(residual, next_ids, "mtp draft")
        m = self.model
        sel = {} if self.draft_selection == "reuse_step0" else None
        logits, h = m._mtp_run(self.state, R, ids, self.hnorm, sel_out=sel)
        self.state.position += len(ids)
        keep = self.state.position
        nq = self.state.qsa.k.n
        out_l = [logits[-1]]
        toks = [int(np.argmax(logits[-1]))]
        hh = h[-1:]
        try:
            for _ in range(int(k) - 1):
                reuse = sel["selection"] if sel is not None else None
                lg, hh = m._mtp_run(self.state, hh, np.array([toks[-1]], np.int64), self.hnorm, reuse=reuse)
                self.state.position += 1
                out_l.append(lg[0])
                toks.append(int(np.argmax(lg[0])))
        finally:  # the speculative steps never stay in the head's state
            self.state.position = keep
            self.state.qsa.truncate(nq, self.config.indexer_compress_ratio)
        return np.asarray(toks, np.int64), np.stack(out_l)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` pairs (``0 <= n <= position``).

        Raises:
            InputError: ``n`` out of range.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.position:
            raise InputError(f"mtp truncate: expected 0 <= n <= position={self.position}, found {n!r}")
        self.state.qsa.truncate(int(n), self.config.indexer_compress_ratio)
        self.state.position = int(n)

    def snapshot(self) -> MTPState:
        """A deep copy of the head's state."""
        return self.state.copy()

    def restore(self, snap: MTPState) -> None:
        """Put the head back to a :meth:`snapshot` (copied; the snapshot stays valid).

        Raises:
            InputError: not an MTPState.
        """
        if not isinstance(snap, MTPState):
            raise InputError(f"mtp restore: expected an MTPState, found {type(snap).__name__}")
        self.state = snap.copy()


def accept_greedy(drafts, verify_logits) -> int:
    """Greedy acceptance: the longest prefix of ``drafts [k]`` equal to the argmax of the verify logits
    ``[k+1, V]`` (row ``j`` = the trunk's logits after the token before draft ``j``). Returns ``0..k``."""
    a = 0
    for j, d in enumerate(np.asarray(drafts).reshape(-1)):
        if int(np.argmax(verify_logits[j])) != int(d):
            break
        a = j + 1
    return a


def speculative_greedy(model, prompt, max_new: int, k: int, *, hnorm: str = "global",
                       draft_selection: str = "fresh", eos_ids=(), trace: list | None = None) -> list[int]:
    """Greedy generation drafting ``k`` tokens per round with the MTP head and verifying them with the trunk in
    one width-``k+1`` step (:meth:`Session.forward_tokens`), keeping the longest matching prefix plus the
    trunk's own next token; rejected positions are rolled back in the trunk (:meth:`Session.rollback`) and
    never enter the head's state. Produces exactly plain greedy decoding's tokens.

    Args:
        prompt: token ids (>= 1); max_new: tokens to generate (>= 1); k: drafts per round (>= 1).
        eos_ids: stop after emitting one of these.
        trace: optional list receiving one ``{"position", "drafts", "accepted"}`` dict per round.
    Returns:
        the generated ids (``max_new`` of them unless an EOS stopped it).
    Raises:
        InputError: bad prompt or sizes. CheckpointError: no MTP head.
    """
    cfg = model.config
    ids = check_ids(prompt, cfg.vocab_size, "prompt")
    if isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer)) or max_new < 1:
        raise InputError(f"max_new: expected a positive integer, found {max_new!r}")
    mtp = model.new_mtp_session(hnorm=hnorm, draft_selection=draft_selection)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k: expected a positive integer, found {k!r}")
    sess = model.new_session()
    sess.residual_log = []
    logits = sess.prefill(ids)
    R = np.concatenate(sess.residual_log, axis=0)
    out = [int(np.argmax(logits[-1]))]
    pend_R, pend_ids = R, np.concatenate([ids[1:], [out[0]]]).astype(np.int64)
    eos = {int(e) for e in eos_ids}
    while len(out) < max_new and out[-1] not in eos:
        kk = int(min(k, max_new - len(out)))
        n = sess.position  # the position of out[-1]
        drafts, _ = mtp.draft(pend_R, pend_ids, kk)
        sess.residual_log = []
        vl = sess.forward_tokens(np.concatenate([[out[-1]], drafts]).astype(np.int64))
        Rv = np.concatenate(sess.residual_log, axis=0)
        a = accept_greedy(drafts, vl)
        new = [int(d) for d in drafts[:a]] + [int(np.argmax(vl[a]))]
        sess.rollback(kk - a)
        if trace is not None:
            trace.append({"position": n, "drafts": [int(d) for d in drafts], "accepted": a})
        # the head catches up on the accepted positions n .. n+a with the trunk's residuals
        pend_R, pend_ids = Rv[:a + 1], np.asarray(new, np.int64)
        for t in new:
            out.append(t)
            if t in eos or len(out) >= max_new:
                break
    return out[:max_new]


def mtp_draft_from_history(model, tokens, next_id, k: int, hnorm: str = "global", draft_selection: str = "fresh"):
    """The truth of a draft: the MTP head's ``k`` greedy drafts after ``tokens`` (``x_0..x_{n-1}``) and the
    trunk's next token ``next_id`` (``x_n``), from scratch: one trunk forward gives ``R_0..R_{n-1}``, a fresh
    head consumes the pairs ``(R_q, x_{q+1})``, ``q = 0..n-1``, and drafts (:meth:`MTPSession.draft`).

    Returns:
        ``(draft_ids [k] int64, draft_logits [k, V])`` in the model dtype.
    Raises:
        InputError: empty ``tokens``, bad ids, ``k < 1``, unknown option. CheckpointError: no MTP head.
    """
    cfg = model.config
    ids = check_ids(tokens, cfg.vocab_size, "mtp history")
    nxt = check_ids([next_id], cfg.vocab_size, "mtp next id")
    ms = model.new_mtp_session(hnorm=hnorm, draft_selection=draft_selection)
    res: list = []
    model._run(SessionState.empty(cfg, model.dtype), ids, "none", residual_out=res)
    return ms.draft(res[0], np.concatenate([ids[1:], nxt]), k)
