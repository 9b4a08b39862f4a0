"""The reference backend: :class:`reference.session.Session` behind the parity protocol."""
from __future__ import annotations

import numpy as np

from reference.session import check_ids
from reference.errors import InputError

from parity.backends.base import Backend, BackendEntry, decode_args, Handles, LastLogits, load_weights, truth_model  # noqa: F401


class ReferenceBackend(Backend):
    """The reference (``reference.model.ReferenceModel`` sessions) as a backend.

    Options: ``dtype`` (np.float32 default, np.float64 for 'reference-f64'), ``page_size`` (accepted and
    ignored: the reference has no pages), ``perturb`` (see :func:`load_weights`), ``weights`` (an open
    Checkpoint/DictWeights to use instead of ``model_path``).
    """

    capabilities = {"page_sizes": None, "batched_decode": True, "perturb": True, "state_arrays": True,
                    "snapshot_file": True, "prefill_batch": "loop", "fork": True, "last_logits": True,
                    # one NumPy code path per session, no threads in the reductions: an identical call sequence is
                    # bitwise identical, and a decode row / verify row never depends on the batch or the width
                    # (each session steps alone, verify feeds token by token); chunked prefill is NOT claimed
                    # bitwise equal to one prefill (the chunked delta rule sums in another order)
                    "deterministic": True, "batch_invariant": True, "dense_logits": True}

    def __init__(self, model, name: str = "reference", model_path=None):
        self.model = model
        self.config = model.config if hasattr(model, "config") else model.ck.config
        self.name = name
        self.model_path = model_path
        self.precision = "float64" if np.dtype(getattr(model, "dtype", np.float32)) == np.float64 else "float32"
        self._sessions = Handles(self)
        self._held = LastLogits()
        has_mtp = getattr(model, "has_mtp", None)
        if has_mtp is not None and has_mtp():
            self.capabilities = {**type(self).capabilities, "mtp": True}

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
        return self._sessions.get_live(h)

    def new_sequence(self):
        """A new reference session; returns its int handle."""
        return self._sessions.add(self.model.new_session())

    def free(self, h) -> None:
        """Drop the session of ``h`` (an unknown handle is ignored)."""
        self._sessions.pop(h, None)
        self._held.freed(h)

    def prefill(self, h, ids, chunk_size=None):
        """Logits ``[T, V]`` of ``ids`` fed to session ``h`` (``chunk_size``: chunked prefill).

        Raises:
            InputError: ``ids`` not a non-empty 1-D list of integer ids in ``[0, vocab_size)``.
            BackendError: ``h`` is not a live handle of this backend.
        """
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        sess = self._sess(h)
        start = sess.position
        out = np.asarray(sess.prefill(ids, chunk_size=chunk_size))
        self._held.fed(h, out, start)
        return out

    def prefill_last(self, h, ids):
        """Logits ``[V]`` of the last of ``ids`` fed to session ``h`` (the other rows are never formed).

        Raises:
            InputError: bad ids. BackendError: ``h`` is not a live handle of this backend.
        """
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        sess = self._sess(h)
        start = sess.position
        row = np.asarray(sess.prefill(ids, last_only=True)).reshape(-1)
        self._held.fed(h, row, start + len(ids) - 1)
        return row

    def decode(self, hs, ids):
        """Logits ``[B, V]``: ``ids[i]`` decoded on session ``hs[i]``, one session after another.

        Raises:
            InputError: ``len(hs) != len(ids)`` or bad ids.
            BackendError: a handle that is not live.
        """
        ids = decode_args(hs, ids, self.config.vocab_size)
        rows = []
        for h, t in zip(hs, ids):
            sess = self._sess(h)
            start = sess.position
            rows.append(np.asarray(sess.decode(t)))
            self._held.fed(h, rows[-1], start)
        return np.stack(rows)

    def forward_tokens(self, h, ids):
        """Logits ``[k, V]`` of the ``k`` drafted ``ids`` on session ``h`` (``Session.forward_tokens``).

        Raises:
            InputError: bad ids.
            BackendError: ``h`` is not a live handle of this backend.
        """
        ids = check_ids(ids, self.config.vocab_size, "draft ids").tolist()
        sess = self._sess(h)
        start = sess.position
        out = np.asarray(sess.forward_tokens(ids))
        self._held.fed(h, out, start, verify=True)
        return out

    def rollback(self, h, n):
        """Forget the last ``n`` tokens of session ``h`` (``Session.rollback``). Raises BackendError when ``h`` is not
        a live handle."""
        sess = self._sess(h)
        sess.rollback(int(n))
        if n:
            self._held.rolled_back(h, sess.position)

    def snapshot(self, h):
        """Session ``h``'s snapshot (``Session.snapshot``). Raises BackendError when ``h`` is not a live handle."""
        snap = self._sess(h).snapshot()
        self._held.snapshot(h, snap)
        return snap

    def restore(self, h, snap):
        """Restore ``snap`` into session ``h`` (``Session.restore``). Raises BackendError when ``h`` is not a live
        handle."""
        self._sess(h).restore(snap)
        self._held.restored(h, snap)

    def position(self, h):
        """Tokens in session ``h``'s state. Raises BackendError when ``h`` is not a live handle."""
        return int(self._sess(h).position)

    def state_arrays(self, h):
        """Session ``h``'s state as named arrays (``parity.backends.snapshot_file.flatten_state``). Raises BackendError when
        ``h`` is not a live handle."""
        from parity.backends.snapshot_file import flatten_state
        return flatten_state(self._sess(h).state)

    def fork(self, h):
        """A new session holding a deep copy of session ``h``'s state and its verify checkpoints (so a
        rollback of the latest verify works on the child too). Raises BackendError when ``h`` is not live."""
        src = self._sess(h)
        c = self.new_sequence()
        sess = self._sessions[c]
        sess.state = src.state.copy()
        sess._checkpoints = {q: cp.copy() for q, cp in src._checkpoints.items()}
        self._held.forked(h, c)
        return c

    def last_logits(self, h):
        """The logits row ``[V]`` of session ``h``'s last consumed position (kept by this adapter through
        verify/rollback, snapshots, restores and forks). Raises BackendError when none is held."""
        self._sess(h)
        return self._held.get(h, self.name)

    def dense_logits(self, ids):
        """One-shot logits with QSA selection off: a forward whose selection keeps every complete block
        visible to each query (the model's ``selection_hook``)."""
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        old = self.model.selection_hook

        def every_block(layer, pos, scores, sel):
            n = (np.asarray(pos) + 1) // self.config.indexer_compress_ratio
            width = max(int(n.max()) if n.size else 0, 1)
            allb = np.broadcast_to(np.arange(width), (len(pos), width))
            return np.where(allb < n[:, None], allb, -1)
        self.model.selection_hook = every_block
        try:
            return np.asarray(self.model.forward(ids))
        finally:
            self.model.selection_hook = old

    def logits(self, ids):
        """The one-shot logits: the model's single full forward (the truth path)."""
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        return np.asarray(self.model.forward(ids))

    def draft(self, h, next_id, k):
        """The reference MTP head's greedy drafts after session ``h``'s tokens and ``next_id``
        (``Session.mtp_draft_next``: recomputed from the history -- the truth of every draft comparison).

        Raises:
            BackendError: no MTP head, or ``h`` is not a live handle. InputError: bad ids / k, unknown history.
        """
        if not self.capabilities.get("mtp"):
            return super().draft(h, next_id, k)
        ids, logits = self._sess(h).mtp_draft_next(int(next_id), k)
        return np.asarray(ids, np.int64), np.asarray(logits)


def _open_defaults(opts: dict) -> dict:
    # dtype is typed as a name; open() takes the NumPy dtype (float32 unless asked)
    return {**opts, "dtype": np.float64 if opts.get("dtype") == "float64" else np.float32}


BACKEND = BackendEntry("reference", ReferenceBackend, {"dtype": ("float32", "float64"), "page_size": int},
                       help="",
                       aliases={"reference-f64": {"dtype": "float64"}}, open_defaults=_open_defaults)
