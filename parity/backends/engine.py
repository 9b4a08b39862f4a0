"""The engine backend: :class:`engine.Engine` (CPU NumPy path or CUDA) behind the parity protocol."""
from __future__ import annotations

import numpy as np

from reference.session import check_ids

from parity.backends.base import Backend, BackendEntry, BackendError, LastLogits, load_weights  # noqa: F401


class EngineBackend(Backend):
    """The engine (``engine.Engine``) as a backend: ``device`` 'cpu' or 'cuda'.

    Options: ``page_size`` (int, default the engine's), ``precision`` (engine precision, default
    'float32' on cpu and 'bf16' on cuda), ``perturb``, ``weights``; others are passed to ``engine.Engine``.
    """

    # stores: the engine keeps activations, accumulation and all state in float32 at either precision (bf16 =
    # BF16 weights only, engine/model.py), so it is judged against the float32 floor (parity.harness.floor)
    capabilities = {"page_sizes": "any", "batched_decode": True, "perturb": True, "state_arrays": True,
                    "snapshot_file": True, "prefill_batch": "loop", "fork": True, "last_logits": True,
                    # no bitwise claims: batched decode / verify rows differ from one-by-one by accumulation
                    # order (measured 8e-7 on engine-cpu, tiny); the self-consistency suite holds it to its own
                    # measured reordering noise instead
                    "deterministic": False, "batch_invariant": False, "dense_logits": False, "stores": {}}

    def __init__(self, eng, name, model_path, precision):
        self.eng = eng
        self.name = name
        self.model_path = model_path
        self.precision = precision
        self.config = getattr(eng, "config", None)
        self._live: set = set()
        self._held = LastLogits()
        pool = getattr(eng, "pool", None)
        if not all(hasattr(pool, a) for a in ("slab_arrays", "page_arrays", "slots")):
            self.capabilities = {**type(self).capabilities, "state_arrays": False}
        if not all(hasattr(eng, a) for a in ("export_snapshot", "import_snapshot")):
            self.capabilities = {**self.capabilities, "snapshot_file": False}
        if getattr(eng, "has_mtp", False):
            self.capabilities = {**self.capabilities, "mtp": True}

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
        self._held.freed(h)

    def prefill(self, h, ids, chunk_size=None):
        """Logits ``[T, V]`` of ``ids`` fed to sequence ``h`` (``Engine.prefill``).

        Raises:
            InputError: ``ids`` not a non-empty 1-D list of integer ids in ``[0, vocab_size)``.
        """
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        start = self.position(h)
        out = np.asarray(self.eng.prefill(h, ids, chunk_size=chunk_size))
        self._held.fed(h, out, start)
        return out

    def prefill_last(self, h, ids):
        """Logits ``[V]`` of the last of ``ids`` fed to sequence ``h`` (``Engine.prefill(last_only=True)``).

        Raises:
            InputError: bad ids.
        """
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        start = self.position(h)
        row = np.asarray(self.eng.prefill(h, ids, last_only=True)).reshape(-1)
        self._held.fed(h, row, start + len(ids) - 1)
        return row

    def decode_greedy(self, hs, ids):
        """Greedy decode: int64 ``[B]`` next tokens, the row argmax taken on the engine's device
        (``Engine.decode_greedy``; first maximum, as ``np.argmax``).

        Raises:
            InputError: bad ids.
        """
        ids = check_ids(ids, self.config.vocab_size, "decode ids").tolist()
        for h in hs:  # the logits stay on the device: the held row of each sequence is gone
            self._held.forget(h)
        return np.asarray(self.eng.decode_greedy(list(hs), np.asarray(ids, dtype=np.int64)))

    @property
    def max_positions(self):
        """Positions one sequence may hold (the engine pool's ``max_positions``), or None when unknown."""
        return getattr(getattr(self.eng, "pool", None), "max_positions", None)

    def decode(self, hs, ids):
        """Logits ``[B, V]``: ``ids[i]`` for sequence ``hs[i]``, batched (``Engine.decode``).

        Raises:
            InputError: bad ids.
        """
        ids = check_ids(ids, self.config.vocab_size, "decode ids").tolist()
        starts = [self.position(h) for h in hs]
        out = np.asarray(self.eng.decode(list(hs), ids))
        for h, st, row in zip(hs, starts, out):
            self._held.fed(h, row, st)
        return out

    def forward_tokens(self, h, ids):
        """Logits ``[k, V]`` of the ``k`` drafted ``ids`` on sequence ``h`` (``Engine.verify``).

        Raises:
            InputError: bad ids.
        """
        ids = check_ids(ids, self.config.vocab_size, "draft ids").tolist()
        start = self.position(h)
        out = np.asarray(self.eng.verify(h, ids))
        self._held.fed(h, out, start, verify=True)
        return out

    def rollback(self, h, n):
        """Forget the last ``n`` tokens of sequence ``h`` (``Engine.rollback``)."""
        self.eng.rollback(h, int(n))
        if n:
            self._held.rolled_back(h, self.position(h))

    def snapshot(self, h):
        """Sequence ``h``'s snapshot (``Engine.snapshot``)."""
        snap = self.eng.snapshot(h)
        self._held.snapshot(h, snap)
        return snap

    def fork(self, h):
        """A child sequence sharing ``h``'s pages copy-on-write with its own slab state (``Engine.fork``)."""
        c = self.eng.fork(h)
        self._live.add(id(c))
        self._held.forked(h, c)
        return c

    def last_logits(self, h):
        """The logits row ``[V]`` of ``h``'s last consumed position (held by this adapter through verify/rollback,
        snapshots, restores and forks). Raises BackendError when none is held."""
        return self._held.get(h, self.name)

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
        self._held.restored(h, snap)

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

    def draft(self, h, next_id, k):
        """The engine's MTP drafts (``Engine.mtp_draft_next``; capability ``mtp`` when the head is loaded).

        Raises:
            BackendError: no MTP head loaded. InputError: bad ids / k, residuals not held (imported snapshot).
        """
        if not self.capabilities.get("mtp"):
            return super().draft(h, next_id, k)
        ids, logits = self.eng.mtp_draft_next(h, int(next_id), int(k), return_logits=True)
        return np.asarray(ids, np.int64), np.asarray(logits)

    def verify_greedy(self, h, ids):
        """``forward_tokens`` returning the greedy token after each position (``Engine.verify_greedy``: argmax on
        the device, only the ids copied to the host); used by speculative generation."""
        ids = check_ids(ids, self.config.vocab_size, "draft ids")
        return np.asarray(self.eng.verify_greedy(h, ids), np.int64)


def _open_defaults(opts: dict) -> dict:
    # device=auto (the default): cuda when a GPU is present, else cpu
    device = opts.get("device", "auto")
    if device == "auto":
        try:
            from engine.backend import gpu_available
            device = "cuda" if gpu_available() else "cpu"
        except ImportError:
            device = "cpu"
    return {**opts, "device": device}


BACKEND = BackendEntry(
    "engine", EngineBackend,
    {"device": ("auto", "cpu", "cuda"), "precision": ("float32", "bf16"), "page_size": int, "max_seqs": int,
     "kv_tokens": int},
    help="kv_tokens: KV token capacity shared by all sequences, max_seqs: live sequences; auto = cuda when a GPU "
         "is present",
    aliases={"engine-cpu": {"device": "cpu"}, "engine-cuda": {"device": "cuda"}}, open_defaults=_open_defaults)
