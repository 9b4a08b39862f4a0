"""Engine serving state: paged KV pools, recurrent/PLE state slabs, the sequence table.

Layout (all arrays live on the engine's device, ``xp`` = numpy or cupy):

* **Token slots.** A pool of ``num_pages`` pages of ``page_size`` token slots each. Token ``t`` of a
  sequence lives in slot ``block_table[t // page_size] * page_size + t % page_size``. Per QSA layer
  ``i`` the pools hold, indexed by slot:

  - ``kv_k[i]``, ``kv_v[i]``: ``[num_slots, num_key_value_heads, head_dim]`` (normed, roped keys; values)
  - ``idx_k[i]``: ``[num_slots, indexer_head_dim]`` the raw indexer key of that token (same slot, so a
    selected token index addresses K, V and the indexer key alike)
  - ``blk_k[i]``: ``[num_slots, indexer_head_dim]`` the pooled/normed/roped key of the compressed block
    that *ends* at this token (written when a block completes; the block ``b`` of a sequence is read at
    the slot of token ``b * compress_ratio + compress_ratio - 1``), so decode never recomputes old blocks
    and copy-on-write/snapshots carry block keys with their pages. Any page size works (1, 3, 16, 64):
    blocks may straddle pages.

* **Slabs.** ``max_seqs`` rows, one per live sequence (``Sequence.slab``):

  - GDN layers: ``gdn_conv[i]`` ``[max_seqs, linear_conv_kernel_dim - 1, linear_conv_dim]`` (newest input last) and
    ``gdn_rec[i]`` ``[max_seqs, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]`` (FP32)
  - PLE layers: ``ple_conv[i]`` ``[max_seqs, ple_conv_state_len, hc_count * hidden_size]`` and
    ``ple_ctx[i]`` ``[max_seqs, ngram_size - 1]`` int64 (n-gram history, EOS-filled when empty; host numpy
    on every device, since n-gram ids are hashed on the host from the ids it feeds)

* **Device block tables.** ``block_tables`` ``[max_seqs, max_pages_per_seq]`` int32 (row = slab), kept in
  step with the host lists so kernels read it without any host round trip; ``-1`` = no page.

Pages are reference counted: forks and snapshots share pages, and a write into a shared page copies it
first (copy on write). Freed pages and slab rows are scrubbed (zeros, EOS context) so nothing of a freed
sequence can reach the next owner.

Limits are fixed at construction and reported by :meth:`StatePool.limits`; a request beyond them raises
:class:`CapacityError` naming the resource, never truncates. The only cap on a sequence's length is the
config's ``max_position_embeddings`` (and the pool's page count).

Source of the state semantics: modeling_qwen4_exp.py (``Qwen4ExpTextGatedDeltaNet.forward`` conv and
recurrent states; ``Qwen4ExpTextNGramEmbedding.forward`` n-gram context; ``Qwen4ExpTextPLELayer._short_conv``
dilated conv state; ``Qwen4ExpTextQSAIndexer.forward`` raw indexer keys).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np

from reference.errors import InputError, UserError

__all__ = ["CapacityError", "StateError", "Sequence", "Snapshot", "StatePool", "SLAB_FIELDS", "EXPORT_FORMAT",
           "EXPORT_VERSION"]


class CapacityError(UserError, MemoryError):
    """A request needs more state memory (pages, slab rows, positions) than the engine was built with."""


class StateError(UserError, ValueError):
    """Misuse of sequence state: a freed sequence, a rollback past the checkpoints, a foreign snapshot."""


# slab-resident per-sequence state (copied by fork/snapshot, checkpointed by verify)
SLAB_FIELDS = ("gdn_conv", "gdn_rec", "ple_conv", "ple_ctx")

#: the ``format`` / ``version`` of :meth:`StatePool.export_snapshot` dicts
EXPORT_FORMAT = "qwen4exp-engine-state"
EXPORT_VERSION = 1
# (family, field) of every exported array -> (pool attribute, state kind); names follow the reference's
# SessionState (``qsa.{i}.k``, ``gdn.{i}.conv``, ``ple.{i}.context`` ...) so parity.backends.snapshot_file.kind_of reads them
_EXPORT_FIELDS = {("qsa", "k"): ("kv_k", "qsa.kv"), ("qsa", "v"): ("kv_v", "qsa.kv"),
                  ("qsa", "index_keys"): ("idx_k", "qsa.indexer_keys"),
                  ("qsa", "block_keys"): ("blk_k", "qsa.indexer_keys"),
                  ("gdn", "conv"): ("gdn_conv", "gdn.conv"), ("gdn", "recurrent"): ("gdn_rec", "gdn.recurrent"),
                  ("ple", "conv"): ("ple_conv", "ple.conv"), ("ple", "context"): ("ple_ctx", "ple.ngram_context")}


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sequence's handle. ``length`` = committed tokens; ``pages`` = host block table (page ids)."""

    sid: int
    slab: int
    pages: list = dataclasses.field(default_factory=list)
    length: int = 0
    alive: bool = True
    # verify checkpoints: {"k": n, "start": length before verify, "<field>.<layer>": xp [n+1, ...]}
    checkpoints: dict | None = None
    pool_id: int = 0
    # set when a forward was interrupted mid-step (state partly written): only restore/free are allowed
    broken: bool = False
    # pairs (R_q, x_{q+1}) the MTP head's caches hold (positions 0 .. mtp_len-1); 0 without an MTP head
    mtp_len: int = 0
    # the trunk's residual rows the head has not consumed yet: [(start, R [m, hc*H] device, ids [m] host)],
    # contiguous, covering positions mtp_len .. length-1 (engine.Engine keeps it when the head is loaded)
    mtp_tail: list = dataclasses.field(default_factory=list)

    def __repr__(self):
        return f"Sequence(sid={self.sid}, length={self.length}, pages={len(self.pages)})"


class Snapshot:
    """A sequence's whole state at one length: pages by reference (refcounted, copy on write), slab rows
    by copy. Released automatically when garbage collected (or explicitly with :meth:`release`)."""

    def __init__(self, pool: "StatePool", seq: Sequence):
        self.pool_id = id(pool)
        self.length = seq.length
        self.mtp_len = seq.mtp_len
        self.mtp_tail = list(seq.mtp_tail)  # rows are never written in place: sharing them is safe
        self.pages = list(seq.pages)
        self.slab = {key: arr[seq.slab].copy() for key, arr in pool.slab_arrays()}
        pool._incref(self.pages)
        self._pool_ref = weakref.ref(pool)
        self._finalizer = weakref.finalize(self, StatePool._decref_static, weakref.ref(pool), list(self.pages))

    def release(self) -> None:
        """Drop this snapshot's page references (idempotent)."""
        self._finalizer()

    def to_portable(self) -> dict:
        """This snapshot as host arrays (:meth:`StatePool.export_snapshot`); used by ``parity.backends.snapshot_file``.

        Raises:
            StateError: the engine that took it is gone.
        """
        pool = self._pool_ref()
        if pool is None:
            raise StateError("snapshot: expected the engine that took it to be alive, found it garbage collected")
        return pool.export_snapshot(self)


class StatePool:
    """All per-sequence serving state of one engine.

    Args:
        config: the :class:`reference.config.ModelConfig`.
        xp: numpy or cupy.
        page_size: token slots per page (any positive integer).
        num_pages: pages in the pool (shared by all sequences).
        max_seqs: slab rows (live sequences at once, forks included).
        kv_dtype: dtype of K/V/indexer-key pools (float32 by default; state slabs are always float32).
    Raises:
        InputError: non-positive sizes.
    """

    def __init__(self, config, xp, *, page_size: int = 16, num_pages: int = 256, max_seqs: int = 8,
                 kv_dtype=np.float32):
        for name, v in (("page_size", page_size), ("num_pages", num_pages), ("max_seqs", max_seqs)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise InputError(f"{name}: expected a positive integer, found {v!r}")
        self.config = c = config
        self.xp = xp
        self.page_size = int(page_size)
        self.num_pages = int(num_pages)
        self.max_seqs = int(max_seqs)
        self.max_positions = int(c.max_position_embeddings)
        self.max_pages_per_seq = -(-self.max_positions // self.page_size)
        self.kv_dtype = np.dtype(kv_dtype)
        self.num_slots = self.num_pages * self.page_size
        self.eos = c.ple_eos_token_id if c.ple_eos_token_id is not None else 0
        f32 = np.float32
        self.qsa_layers = [i for i, t in enumerate(c.layer_types) if t == "indexed_attention"]
        self.gdn_layers = [i for i, t in enumerate(c.layer_types) if t == "linear_attention"]
        self.ple_layers = list(c.ple_layers)
        S = self.num_slots
        self.kv_k = {i: xp.zeros((S, c.num_key_value_heads, c.head_dim), self.kv_dtype) for i in self.qsa_layers}
        self.kv_v = {i: xp.zeros((S, c.num_key_value_heads, c.head_dim), self.kv_dtype) for i in self.qsa_layers}
        ihd = c.indexer_head_dim or 1
        self.idx_k = {i: xp.zeros((S, ihd), self.kv_dtype) for i in self.qsa_layers}
        self.blk_k = {i: xp.zeros((S, ihd), self.kv_dtype) for i in self.qsa_layers}
        M = self.max_seqs
        self.gdn_conv = {i: xp.zeros((M, c.linear_conv_kernel_dim - 1, c.linear_conv_dim), f32)
                         for i in self.gdn_layers}
        self.gdn_rec = {i: xp.zeros((M, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                    f32) for i in self.gdn_layers}
        self.ple_conv = {i: xp.zeros((M, c.ple_conv_state_len, c.hc_hidden_size), f32) for i in self.ple_layers}
        # the n-gram context stays on the host (numpy) on every device: the host hashes n-grams from the token
        # ids it feeds, so the host-resident PLE table needs no device->host copy
        self.ple_ctx = {i: np.full((M, max(c.ngram_size - 1, 1)), self.eos, np.int64) for i in self.ple_layers}
        self.block_tables = xp.full((M, self.max_pages_per_seq), -1, np.int32)
        #: the MTP head's QSA layer (pool key -> {"kv_k", "kv_v", "idx_k", "blk_k"} arrays), see :meth:`enable_mtp`
        self.mtp: dict = {}
        self.refcount = np.zeros(self.num_pages, np.int64)  # host-side bookkeeping
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() gives the lowest id first
        self._free_slabs = list(range(M - 1, -1, -1))
        self._next_sid = 0
        self.seqs: dict[int, Sequence] = {}

    # ------------------------------------------------------------------ limits
    def page_bytes(self) -> int:
        """Bytes of one page across all QSA layers (K, V, indexer key, block key)."""
        c = self.config
        per_tok = (2 * c.num_key_value_heads * c.head_dim + 2 * (c.indexer_head_dim or 1)) * self.kv_dtype.itemsize
        return per_tok * self.page_size * len(self.qsa_layers)

    def slab_bytes(self) -> int:
        """Bytes of one sequence's slab rows (GDN conv + recurrent, PLE conv + context)."""
        return sum(int(a[0].nbytes) for _, a in self.slab_arrays())

    def limits(self) -> dict:
        """The memory limits this pool imposes (stated at load)."""
        return {"page_size": self.page_size, "num_pages": self.num_pages, "kv_token_capacity": self.num_slots,
                "max_seqs": self.max_seqs, "max_positions_per_seq": self.max_positions,
                "page_bytes": self.page_bytes(), "slab_bytes_per_seq": self.slab_bytes(),
                "kv_pool_bytes": self.page_bytes() * self.num_pages, "slab_pool_bytes": self.slab_bytes() * self.max_seqs,
                "block_table_bytes": int(self.block_tables.nbytes)}

    def describe_limits(self) -> str:
        """One human-readable line stating :meth:`limits` (pages, KV tokens, MiB, sequences, positions)."""
        L = self.limits()
        return (f"state limits: {L['num_pages']} pages x {L['page_size']} tokens = {L['kv_token_capacity']} KV tokens "
                f"shared by all sequences ({L['kv_pool_bytes'] / 2**20:.1f} MiB); {L['max_seqs']} sequences at once "
                f"({L['slab_bytes_per_seq'] / 2**20:.2f} MiB slab each); <= {L['max_positions_per_seq']} positions "
                f"per sequence (max_position_embeddings)")

    def free_pages(self) -> int:
        """Number of KV pages not in use."""
        return len(self._free_pages)

    def free_slabs(self) -> int:
        """Number of per-sequence state slabs not in use (sequences that can still be added)."""
        return len(self._free_slabs)

    # ------------------------------------------------------------------ helpers
    def slab_arrays(self):
        """Every slab-resident array as ``(key, array)`` with key ``"<field>.<layer>"``."""
        for f in SLAB_FIELDS:
            for i, arr in getattr(self, f).items():
                yield f"{f}.{i}", arr

    def page_arrays(self):
        """Every slot-indexed pool array of the trunk as ``(key, array)`` (``kv_k.{layer}`` ...)."""
        for f in ("kv_k", "kv_v", "idx_k", "blk_k"):
            for i, arr in getattr(self, f).items():
                yield f"{f}.{i}", arr

    def _slot_arrays(self):
        """:meth:`page_arrays` plus the MTP head's (``mtp.<field>``): what page scrubs and copies on write cover."""
        yield from self.page_arrays()
        for f, arr in self.mtp.items():
            yield f"mtp.{f}", arr

    def enable_mtp(self) -> None:
        """Allocate the MTP head's QSA caches: one more set of K/V/indexer-key/block-key pools, indexed by the
        same slots as the trunk's (the head's position ``q`` lives in the slot of the trunk's position ``q``),
        so pages, copy on write, forks and snapshots carry them. Not exported by :meth:`export_snapshot`: the
        head's state is rebuilt by its catch-up from the trunk's residuals."""
        if self.mtp:
            return
        c, xp, S = self.config, self.xp, self.num_slots
        ihd = c.indexer_head_dim or 1
        self.mtp = {"kv_k": xp.zeros((S, c.num_key_value_heads, c.head_dim), self.kv_dtype),
                    "kv_v": xp.zeros((S, c.num_key_value_heads, c.head_dim), self.kv_dtype),
                    "idx_k": xp.zeros((S, ihd), self.kv_dtype), "blk_k": xp.zeros((S, ihd), self.kv_dtype)}

    def _check(self, seq: Sequence, allow_broken: bool = False) -> None:
        if not isinstance(seq, Sequence):
            raise StateError(f"sequence: expected an engine Sequence, found {type(seq).__name__}")
        if not seq.alive or self.seqs.get(seq.sid) is not seq:
            raise StateError(f"sequence {seq.sid}: expected a live sequence of this engine, found a freed or "
                             f"foreign one")
        if seq.broken and not allow_broken:
            raise StateError(f"sequence {seq.sid}: a step on it was interrupted and its state is partly written; "
                             f"expected restore() of a snapshot or free(), found another use")

    def _incref(self, pages) -> None:
        for p in pages:
            self.refcount[p] += 1

    @staticmethod
    def _decref_static(pool_ref, pages) -> None:
        pool = pool_ref()
        if pool is not None:
            pool._decref(pages)

    def _decref(self, pages) -> None:
        dead = []
        for p in pages:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                dead.append(p)
            elif self.refcount[p] < 0:  # a bookkeeping bug, never user input
                raise RuntimeError(f"page {p}: refcount below zero")
        if dead:
            self._scrub_pages(dead)
            # freed pages go back in ascending order so the next allocation reuses the lowest ids
            self._free_pages.extend(sorted(dead, reverse=True))
            self._free_pages.sort(reverse=True)

    def _page_slots(self, pages):
        ps = self.page_size
        pages = np.asarray(pages, np.int64)
        return (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)

    def _scrub_pages(self, pages) -> None:
        slots = self.xp.asarray(self._page_slots(pages))
        for _, arr in self._slot_arrays():
            arr[slots] = 0

    def _scrub_slab(self, slab: int) -> None:
        for key, arr in self.slab_arrays():
            arr[slab] = self.eos if key.startswith("ple_ctx") else 0
        self.block_tables[slab] = -1

    def _alloc_page(self, what: str) -> int:
        if not self._free_pages:
            raise CapacityError(f"KV pages: {what} needs a free page, found none (pool of {self.num_pages} pages x "
                                f"{self.page_size} tokens is full; raise kv_tokens/num_pages or free sequences)")
        p = self._free_pages.pop()
        self.refcount[p] = 1
        return p

    # ------------------------------------------------------------------ sequences
    def add(self) -> Sequence:
        """A new empty sequence with a scrubbed slab row.

        Raises:
            CapacityError: all ``max_seqs`` slab rows are in use.
        """
        if not self._free_slabs:
            raise CapacityError(f"sequences: expected a free slab row, found all {self.max_seqs} in use "
                                f"(raise max_seqs or free sequences)")
        slab = self._free_slabs.pop()
        self._scrub_slab(slab)
        seq = Sequence(sid=self._next_sid, slab=slab, pool_id=id(self))
        self._next_sid += 1
        self.seqs[seq.sid] = seq
        return seq

    def free(self, seq: Sequence) -> None:
        """Release a sequence: its pages lose a reference (scrubbed when unreferenced), its slab row is
        scrubbed and returned. The handle is dead afterwards."""
        self._check(seq, allow_broken=True)
        self._decref(seq.pages)
        seq.pages = []
        self._scrub_slab(seq.slab)
        self._free_slabs.append(seq.slab)
        seq.alive = False
        seq.checkpoints = None
        seq.mtp_tail = []
        del self.seqs[seq.sid]

    def fork(self, seq: Sequence) -> Sequence:
        """A child sharing the parent's pages (copy on write) with its own copy of every slab row."""
        self._check(seq)
        child = self.add()
        child.pages = list(seq.pages)
        self._incref(child.pages)
        child.length = seq.length
        child.mtp_len = seq.mtp_len
        child.mtp_tail = list(seq.mtp_tail)
        for _, arr in self.slab_arrays():
            arr[child.slab] = arr[seq.slab]
        self._sync_table(child)
        return child

    def _sync_table(self, seq: Sequence) -> None:
        row = self.block_tables[seq.slab]
        row[...] = -1
        if seq.pages:
            row[:len(seq.pages)] = self.xp.asarray(np.asarray(seq.pages, np.int32))

    def reserve(self, seq: Sequence, n_new: int) -> None:
        """Make positions ``[length, length + n_new)`` writable: allocate pages, copy shared ones (COW).

        Raises:
            CapacityError: past ``max_position_embeddings`` or out of pages (the sequence is unchanged
                in the latter case: pages taken are given back).
        """
        self._check(seq)
        self.reserve_range(seq, seq.length, seq.length + int(n_new))

    def reserve_range(self, seq: Sequence, start: int, end: int) -> None:
        """Make positions ``[start, end)`` writable (``start <= length``): allocate pages past the sequence's,
        copy the shared ones in the range (COW). The MTP head writes below ``length`` (its catch-up), so its
        pages must be private too.

        Raises:
            CapacityError: as :meth:`reserve`.
        """
        self._check(seq)
        if end > self.max_positions:
            raise CapacityError(f"sequence {seq.sid}: {end} positions requested, expected <= "
                                f"max_position_embeddings={self.max_positions}")
        ps = self.page_size
        need_pages = -(-end // ps)
        first = min(int(start), seq.length) // ps
        new_pages = []
        try:
            for p in range(first, need_pages):
                if p < len(seq.pages):
                    old = seq.pages[p]
                    if self.refcount[old] > 1:  # shared with a fork or a snapshot: copy on write
                        q = self._alloc_page(f"sequence {seq.sid} (copy on write of page {old})")
                        new_pages.append((p, q, old))
                else:
                    q = self._alloc_page(f"sequence {seq.sid} at position {p * ps}")
                    new_pages.append((p, q, None))
        except CapacityError:
            for _, q, _ in new_pages:
                self.refcount[q] = 0
                self._free_pages.append(q)
            self._free_pages.sort(reverse=True)
            raise
        if not new_pages:
            return
        xp = self.xp
        cow = [(p, q, old) for p, q, old in new_pages if old is not None]
        if cow:
            src = xp.asarray(self._page_slots([o for _, _, o in cow]))
            dst = xp.asarray(self._page_slots([q for _, q, _ in cow]))
            for _, arr in self._slot_arrays():
                arr[dst] = arr[src]
            self._decref([o for _, _, o in cow])
        for p, q, old in new_pages:
            if p < len(seq.pages):
                seq.pages[p] = q
            else:
                seq.pages.append(q)
        idx = np.asarray([p for p, _, _ in new_pages], np.int64)
        vals = np.asarray([q for _, q, _ in new_pages], np.int32)
        self.block_tables[seq.slab, xp.asarray(idx)] = xp.asarray(vals)

    def pages_needed(self, seq: Sequence, n_new: int) -> int:
        """Free pages that :meth:`reserve` of ``n_new`` tokens would take (new pages + copy-on-write)."""
        ps = self.page_size
        end = seq.length + int(n_new)
        need = max(0, -(-end // ps) - len(seq.pages))
        first = seq.length // ps
        need += sum(1 for p in range(first, min(len(seq.pages), -(-end // ps))) if self.refcount[seq.pages[p]] > 1)
        return need

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Host int64 slot ids of positions ``[start, end)`` (pages must exist)."""
        pos = np.arange(start, end, dtype=np.int64)
        pages = np.asarray(seq.pages, np.int64)
        if end > len(seq.pages) * self.page_size:
            raise RuntimeError(f"sequence {seq.sid}: positions up to {end} not reserved")
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def truncate(self, seq: Sequence, new_length: int) -> None:
        """Drop positions ``>= new_length`` (pages wholly past it lose a reference)."""
        self._check(seq)
        keep = -(-new_length // self.page_size)
        drop = seq.pages[keep:]
        seq.pages = seq.pages[:keep]
        seq.length = new_length
        seq.mtp_len = max(0, min(seq.mtp_len, new_length - 1))  # a pair at q needs the token at q + 1
        tail = []
        for start, R, ids in seq.mtp_tail:  # the head's pending trunk rows past the new length go too
            if start < new_length:
                n = min(len(ids), new_length - start)
                tail.append((start, R[:n], ids[:n]))
        seq.mtp_tail = tail
        if drop:
            self._decref(drop)
            self.block_tables[seq.slab, keep:keep + len(drop)] = -1

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, seq: Sequence) -> Snapshot:
        """Capture the sequence's whole state (see :class:`Snapshot`)."""
        self._check(seq)
        return Snapshot(self, seq)

    def restore(self, seq: Sequence, snap: Snapshot) -> None:
        """Put ``seq`` back to ``snap`` (pages shared again, slab rows copied back). The snapshot stays
        valid and can be restored again.

        Raises:
            StateError: a snapshot of another engine.
        """
        self._check(seq, allow_broken=True)
        if not isinstance(snap, Snapshot) or snap.pool_id != id(self):
            raise StateError(f"snapshot: expected a snapshot taken by this engine, found {type(snap).__name__}")
        self._incref(snap.pages)
        self._decref(seq.pages)
        seq.pages = list(snap.pages)
        seq.length = snap.length
        seq.mtp_len = snap.mtp_len
        seq.mtp_tail = list(snap.mtp_tail)
        seq.checkpoints = None
        seq.broken = False
        for key, arr in self.slab_arrays():
            arr[seq.slab] = snap.slab[key]
        self._sync_table(seq)

    # ------------------------------------------------------------------ export / import (host arrays)
    def _layers_of(self, fam: str) -> list:
        return {"qsa": self.qsa_layers, "gdn": self.gdn_layers, "ple": self.ple_layers}[fam]

    def required_kinds(self) -> frozenset:
        """The state kinds a sequence of this model holds (QSA, GDN, PLE kinds for the layers present)."""
        return frozenset(kind for (fam, _), (_, kind) in _EXPORT_FIELDS.items() if self._layers_of(fam))

    def _expected_export_shape(self, fam: str, field: str, length: int) -> tuple:
        c = self.config
        if fam == "qsa":
            arr = getattr(self, _EXPORT_FIELDS[(fam, field)][0])[self.qsa_layers[0]]
            n = length // (c.indexer_compress_ratio or 1) if field == "block_keys" else length
            return (n,) + tuple(arr.shape[1:])
        arr = next(iter(getattr(self, _EXPORT_FIELDS[(fam, field)][0]).values()))
        return tuple(arr.shape[1:])

    def _block_end_slots(self, slots: np.ndarray, length: int) -> np.ndarray:
        r = self.config.indexer_compress_ratio or 1
        return slots[r - 1::r][:length // r]

    def export_snapshot(self, snap: Snapshot) -> dict:
        """A snapshot's whole state as host numpy copies, independent of pages, page size and device.

        Returns:
            dict ``{"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "config_hash": str, "length": L,
            "kinds": frozenset of state kinds present, "qsa": {i: {"k" [L, nKV, hd], "v" [L, nKV, hd],
            "index_keys" [L, D], "block_keys" [L // ratio, D]}}, "gdn": {i: {"conv" [K-1, conv_dim],
            "recurrent" [Hv, dk, dv]}}, "ple": {i: {"conv" [ple_conv_state_len, hc*H], "context" [n-1] int64}}}``
            (float arrays in the pool dtype, float32). Names follow the reference's ``SessionState``.
        Raises:
            StateError: not a live snapshot of this engine (another engine's, or released).
        """
        self._check_snapshot(snap)
        from engine.backend import to_numpy
        L = int(snap.length)
        ps = self.page_size
        pos = np.arange(L, dtype=np.int64)
        pages = np.asarray(snap.pages, np.int64)
        slots = pages[pos // ps] * ps + pos % ps if L else np.zeros(0, np.int64)
        blk = self._block_end_slots(slots, L)
        out: dict = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "config_hash": self.config.config_hash(),
                     "length": L, "qsa": {}, "gdn": {}, "ple": {}}
        kinds = set()
        xslots, xblk = self.xp.asarray(slots), self.xp.asarray(blk)
        for (fam, field), (attr, kind) in _EXPORT_FIELDS.items():
            for i, arr in getattr(self, attr).items():
                if fam == "qsa":
                    val = arr[xblk if field == "block_keys" else xslots]
                else:
                    val = snap.slab[f"{attr}.{i}"]
                out[fam].setdefault(int(i), {})[field] = np.array(to_numpy(val), copy=True)
                kinds.add(kind)
        out["kinds"] = frozenset(kinds)
        return out

    def _check_snapshot(self, snap) -> None:
        if not isinstance(snap, Snapshot) or snap.pool_id != id(self):
            raise StateError(f"snapshot: expected a snapshot taken by this engine, found {type(snap).__name__}")
        if not snap._finalizer.alive:
            raise StateError("snapshot: expected a live snapshot, found a released one (its pages may be reused)")

    def validate_export(self, data) -> int:
        """Check an :meth:`export_snapshot` dict against this model: format, version, model, length, the kinds
        label AND the contents (every array of every layer present, with its exact shape and a fitting dtype).

        Returns:
            the length (positions) it holds.
        Raises:
            StateError: naming the first problem (e.g. ``qsa.2.index_keys (state kind qsa.indexer_keys): expected
                an array [12, 16], found none``).
        """
        if not isinstance(data, dict):
            raise StateError(f"engine state import: expected a dict from export_snapshot(), found {type(data).__name__}")
        if data.get("format") != EXPORT_FORMAT:
            raise StateError(f"engine state import: format: expected {EXPORT_FORMAT!r}, found {data.get('format')!r}")
        if data.get("version") != EXPORT_VERSION:
            raise StateError(f"engine state import: version: expected {EXPORT_VERSION}, found {data.get('version')!r}")
        want_hash = self.config.config_hash()
        if data.get("config_hash") != want_hash:
            raise StateError(f"engine state import: config_hash: expected {want_hash} (this model), found "
                             f"{data.get('config_hash')!r} (a state of another model)")
        L = data.get("length")
        if not isinstance(L, (int, np.integer)) or isinstance(L, bool) or not 0 <= L <= self.max_positions:
            raise StateError(f"engine state import: length: expected an integer in [0, {self.max_positions}], "
                             f"found {L!r}")
        L = int(L)
        need = self.required_kinds()
        have = frozenset(data.get("kinds") or ())
        if need - have:
            raise StateError(f"engine state import: kinds: expected {sorted(need)} for this model, found "
                             f"{sorted(have)} (missing {sorted(need - have)}); refusing a partial state")
        for (fam, field), (attr, kind) in _EXPORT_FIELDS.items():
            layers = self._layers_of(fam)
            if not layers:
                continue
            shape = self._expected_export_shape(fam, field, L)
            fam_d = data.get(fam)
            for i in layers:
                layer_d = None
                if isinstance(fam_d, dict):
                    layer_d = fam_d.get(i, fam_d.get(str(i)))
                a = layer_d.get(field) if isinstance(layer_d, dict) else None
                name = f"{fam}.{i}.{field} (state kind {kind})"
                if not isinstance(a, np.ndarray):
                    raise StateError(f"engine state import: {name}: expected an array {list(shape)}, found "
                                     f"{'none' if a is None else type(a).__name__}; refusing a partial state")
                if tuple(a.shape) != shape:
                    raise StateError(f"engine state import: {name}: expected shape {list(shape)}, found "
                                     f"{list(a.shape)}")
                int_field = attr == "ple_ctx"
                if (a.dtype.kind in "iu") != int_field or (not int_field and a.dtype.kind != "f"):
                    raise StateError(f"engine state import: {name}: expected "
                                     f"{'integer token ids' if int_field else 'floating point values'}, found "
                                     f"dtype {a.dtype}")
        return L

    def import_snapshot(self, seq: Sequence, data: dict) -> None:
        """Put ``seq`` (live, empty or not) into the state of an :meth:`export_snapshot` dict: pages are
        allocated here (any page size), KV / indexer / block keys written to their slots, slab rows copied.

        Everything is checked before anything changes (:meth:`validate_export`, then capacity).
        Raises:
            StateError: not an export of this model, or a partial one (a kind label or an array missing).
            CapacityError: not enough free pages (``seq`` is unchanged).
        """
        self._check(seq, allow_broken=True)
        L = self.validate_export(data)
        need = -(-L // self.page_size)
        own = sum(1 for p in seq.pages if self.refcount[p] == 1)
        if need > self.free_pages() + own:
            raise CapacityError(f"KV pages: importing a state of {L} tokens into sequence {seq.sid} needs {need} "
                                f"pages, found {self.free_pages()} free + {own} of its own (pool of {self.num_pages} "
                                f"pages x {self.page_size} tokens; raise kv_tokens or free sequences)")
        xp = self.xp
        self._decref(seq.pages)
        seq.pages = [self._alloc_page(f"import into sequence {seq.sid}") for _ in range(need)]
        seq.length = L
        seq.mtp_len = 0  # the MTP head's caches are not exported (nor the trunk residuals it would need)
        seq.mtp_tail = []
        seq.checkpoints = None
        seq.broken = False
        self._sync_table(seq)
        slots = self.slots(seq, 0, L) if L else np.zeros(0, np.int64)
        xslots, xblk = xp.asarray(slots), xp.asarray(self._block_end_slots(slots, L))
        for (fam, field), (attr, _kind) in _EXPORT_FIELDS.items():
            for i, arr in getattr(self, attr).items():
                fam_d = data[fam]
                a = (fam_d[i] if i in fam_d else fam_d[str(i)])[field]
                if fam == "qsa":
                    if a.shape[0]:
                        arr[xblk if field == "block_keys" else xslots] = xp.asarray(a.astype(arr.dtype, copy=False))
                else:
                    mod = np if isinstance(arr, np.ndarray) else xp
                    arr[seq.slab] = mod.asarray(a.astype(arr.dtype, copy=False))

    # ------------------------------------------------------------------ verify checkpoints
    def begin_checkpoints(self, seq: Sequence, k: int) -> dict:
        """Start verify checkpoints for ``k`` tokens: index 0 holds the state before the first token;
        the forward fills index ``j + 1`` with the state after token ``j`` for every slab field."""
        self._check(seq)
        ck: dict[str, Any] = {"k": int(k), "start": seq.length}
        for key, arr in self.slab_arrays():
            mod = np if isinstance(arr, np.ndarray) else self.xp
            buf = mod.empty((k + 1,) + arr.shape[1:], arr.dtype)
            buf[0] = arr[seq.slab]
            ck[key] = buf
        seq.checkpoints = ck
        return ck

    def rollback(self, seq: Sequence, n: int) -> None:
        """Drop the last ``n`` tokens of the latest verify (0 <= n <= k): slab rows come back from the
        per-position checkpoint, positions past the kept prefix are released.

        Raises:
            StateError: no verify checkpoints, or ``n`` beyond the verified tokens.
        """
        self._check(seq)
        ck = seq.checkpoints
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise StateError(f"rollback: expected a token count >= 0, found {n!r}")
        if ck is None:
            if n == 0:
                return
            raise StateError(f"sequence {seq.sid}: rollback of {n} tokens needs the checkpoints of a verify, found "
                             f"none (use snapshot/restore to go further back)")
        done = seq.length - ck["start"]
        if n > done:
            raise StateError(f"sequence {seq.sid}: rollback of {n} tokens, expected <= {done} (tokens of the "
                             f"latest verify still held)")
        keep = done - n
        for key, arr in self.slab_arrays():
            arr[seq.slab] = ck[key][keep]
        self.truncate(seq, ck["start"] + keep)
        # checkpoints stay valid for a further (smaller) rollback; keep positions beyond new length out
        seq.checkpoints = ck
