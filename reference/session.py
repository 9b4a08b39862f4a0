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

from dataclasses import dataclass, field

import numpy as np

from reference.errors import InputError

__all__ = ["GrowBuffer", "GDNState", "PLEState", "QSAState", "SessionState", "Snapshot", "Session",
           "STATE_KINDS", "required_kinds", "check_ids", "check_length"]

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

    # ------------------------------------------------------------------ queries
    @property
    def position(self) -> int:
        """Number of tokens consumed so far (the absolute position of the next token)."""
        return self.state.position

    # ------------------------------------------------------------------ steps
    def _advance(self, ids: np.ndarray, logits: str):
        p = self.state.position
        self._checkpoints = {q: c for q, c in self._checkpoints.items() if q <= p}
        return self.model._run(self.state, ids, logits)

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
        self._checkpoints = {q: c for q, c in self._checkpoints.items() if q <= target}

    def snapshot(self) -> Snapshot:
        """A deep, independent copy of the whole state (with the kinds it holds)."""
        return Snapshot(self.position, self.state.copy(), self.state.kinds, self.config.config_hash(),
                        np.dtype(self.model.dtype).name)

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
