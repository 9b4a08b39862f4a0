"""Batched decode steps as CUDA graphs (cupy only): capture, verification against eager runs, replay, and the
pipelined steady state (:class:`DecodeGraphs`, used by :class:`engine.engine.Engine`)."""
from __future__ import annotations

import numpy as np

from engine.backend import pdl_capture
from engine.model import Segment, Step

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """Batched decode steps replayed as CUDA graphs (cupy only).

    A graph is keyed by the batch's slab rows and the QSA score width rounded up to ``bucket`` blocks
    (``n_blocks`` only sets the width of the score row: blocks past a query's visible count score -inf,
    so a wider row selects exactly the same blocks). The graph computes the logits and their row argmax
    (the greedy next tokens) into static device buffers.

    Memory: both graphs allocate from the entry's private pool, in which the tail's temporaries may reuse
    the head's addresses (they run in order); what must outlive a step while the next head runs (the
    argmax tokens) is allocated outside that pool. The logits of a pipelined step may be overwritten by
    the next step's head: only :meth:`Engine.decode_greedy` (not pipelined) exposes them.

    Steady-state step (a key's graph captured and verified): the host half
    (:meth:`EngineModel.prepare_host`: token ids, positions, n-gram hashing, PLE row gather) writes into the
    graph's own pinned staging buffers, two asynchronous host->device copies fill its static inputs
    (ids + positions; PLE rows), then the graph is launched. No pageable copy, no synchronisation; the
    caller's copy of the logits or tokens is the step's only device->host transfer.

    Safety: a key is run eagerly the first time (kernels compile); then captured (into a private memory
    pool, so no other allocation can reuse the graph's buffers) and its first ``verify_replays`` replays are
    checked against an eager run of the same step from a snapshot of the batch's state (1e-5 relative,
    summation order is identical so they agree to rounding). A capture that fails (an op not allowed
    while capturing) or a replay that disagrees disables graphs for that key: the step runs eagerly.
    """

    def __init__(self, model, bucket: int = 512, max_graphs: int = 16, verify_replays: int = 2):
        import cupy as cp
        self.cp = cp
        self.model = model
        self.bucket = int(bucket)
        self.max_graphs = int(max_graphs)
        self.verify_replays = int(verify_replays)
        # a blocking stream: ordered with the legacy default stream every other engine op runs on
        self.stream = cp.cuda.Stream()
        self.entries: dict = {}
        self.seen: dict = {}
        self.failed: dict = {}
        self.stats = {"eager": 0, "captures": 0, "replays": 0, "verified": 0, "failed": 0, "pipelined": 0}
        self._side = None  # stream for the pipelined token copies

    def _nb(self, n_blocks: int) -> int:
        return -(-int(n_blocks) // self.bucket) * self.bucket

    def _key_of(self, segs):
        """The graph key of a decode batch, from the host only: (slab rows, bucketed score width)."""
        r = self.model.config.indexer_compress_ratio or 1
        nb = self._nb(max(1, (max(s.start for s in segs) + 1) // r))
        return (tuple(int(s.seq.slab) for s in segs), nb), nb

    def decode(self, pool, segs):
        """One decode step for ``segs`` (one token each).

        Returns:
            (logits ``[B, V]`` float32, tokens ``[B]`` int64 = the row argmax), both on the device; a
            replayed graph's outputs are its static buffers, valid until the next step of the same key.
        """
        m = self.model
        key, nb = self._key_of(segs)
        e = self.entries.get(key)
        if e is not None and e["checks"] >= self.verify_replays:
            return self._fast_replay(pool, segs, e)
        st = m.prepare_step(pool, segs, "decode", None)
        st.n_blocks = nb
        if e is None:
            n = self.seen.get(key, 0)
            self.seen[key] = n + 1
            if key in self.failed or n < 1:
                return self._eager(pool, st, segs)
            e = self._capture(pool, st, segs, key)
            if e is None:
                return self._eager(pool, st, segs)
        return self._verified_replay(pool, st, segs, key, e)

    def _eager(self, pool, st, segs):
        from engine.kernels.sampling import row_argmax
        self.stats["eager"] += 1
        lg = self.model.run_step(pool, st, segs)
        return lg, row_argmax(lg)

    def _fast_replay(self, pool, segs, e):
        """Steady state: host half into the pinned staging, two async copies, launch."""
        B = len(segs)
        for k in ("pos_staged", "staged"):  # the previous copies out of the staging buffers are done
            if e[k] is not None:
                e[k].synchronize()
        st = self.model.prepare_host(pool, segs, "decode", None, ple_out=e["host_emb"])
        hi = e["host_i64"]
        hi[:B] = st.ids
        hi[B:] = st.positions
        s = self.stream
        e["dev_i64"].set(hi, stream=s)
        for i, buf in e["emb"].items():
            src = st.emb[i]
            if isinstance(src, np.ndarray):
                buf.set(src, stream=s)  # src is e["host_emb"][i] (pinned): asynchronous
            else:
                with s:
                    buf[...] = src
        e["staged"] = s.record()
        e["head"].launch(stream=s)
        e["tail"].launch(stream=s)
        self.stats["replays"] += 1
        return e["out"], e["tok"]

    def _replay_from_device(self, st, e):
        with self.stream:
            e["ids"][...] = st.ids_dev
            e["pos"][...] = st.pos_dev
            for i, buf in e["emb"].items():
                buf[...] = st.emb[i]
        e["head"].launch(stream=self.stream)
        e["tail"].launch(stream=self.stream)
        self.stats["replays"] += 1
        return e["out"], e["tok"]

    def _verified_replay(self, pool, st, segs, key, e):
        from engine.kernels.sampling import row_argmax
        snaps = [pool.snapshot(s.seq) for s in segs]
        try:
            ref = self.model.run_step(pool, st, segs).copy()
            for s, sn in zip(segs, snaps):
                pool.restore(s.seq, sn)
            got, tok = self._replay_from_device(st, e)
            cp = self.cp
            err = float(cp.abs(got - ref).max() / cp.maximum(cp.abs(ref).max(), 1e-30))
            self.model.syncs.count += 1  # the check's scalar copy (first replays of a key only)
            if not err <= 1e-5:
                self.failed[key] = f"replay differs from eager (rel {err:.2e})"
                self.stats["failed"] += 1
                del self.entries[key]
                for s, sn in zip(segs, snaps):
                    pool.restore(s.seq, sn)
                lg = self.model.run_step(pool, st, segs)
                return lg, row_argmax(lg)
            e["checks"] += 1
            self.stats["verified"] += 1
            return got, tok
        finally:
            for sn in snaps:
                sn.release()

    def _capture(self, pool, st, segs, key):
        import cupyx

        from engine.kernels.sampling import row_argmax
        cp = self.cp
        m = self.model
        if len(self.entries) >= self.max_graphs:
            self.entries.pop(next(iter(self.entries)))
        B = len(segs)
        dev_i64 = cp.empty((2 * B,), np.int64)
        e = {"dev_i64": dev_i64, "ids": dev_i64[:B], "pos": dev_i64[B:],
             "host_i64": cupyx.empty_pinned((2 * B,), np.int64),
             "emb": {i: a.copy() for i, a in st.emb.items()},
             "host_emb": {i: cupyx.empty_pinned(tuple(a.shape), np.float32) for i, a in st.emb.items()
                          if m.ple[i].mode == "pinned"},
             "tok_host": cupyx.empty_pinned((B,), np.int64),
             "staged": None, "pos_staged": None, "mem": cp.cuda.MemoryPool(), "checks": 0}
        e["ids"][...] = st.ids_dev
        e["pos"][...] = st.pos_dev
        # the tokens outlive the step (the pipelined loop copies them out while the next head runs), so they
        # must not live in the graphs' pool, where the head's temporaries may take the same addresses
        e["tok"] = cp.empty((B,), np.int64)
        cst = Step()
        cst.mode, cst.rec, cst.positions, cst.slabs = "decode", None, st.positions, st.slabs
        cst.ids_dev, cst.pos_dev, cst.emb = e["ids"], e["pos"], e["emb"]
        cst.rows_dev, cst.slabs_dev = st.rows_dev.copy(), st.slabs_dev.copy()
        cst.n_blocks = st.n_blocks
        e["rows"], e["slabs"] = cst.rows_dev, cst.slabs_dev
        cp.cuda.Device().synchronize()  # inputs in place before capture starts
        try:
            with self.stream, pdl_capture():
                with cp.cuda.using_allocator(e["mem"].malloc):
                    self.stream.begin_capture()
                    try:
                        h = m.run_step(pool, cst, segs, part="head")
                    finally:
                        ga = self.stream.end_capture()
                    self.stream.begin_capture()
                    try:
                        out = m.run_step(pool, cst, segs, part="tail", h=h)
                        tok = row_argmax(out, out=e["tok"])
                    finally:
                        gb = self.stream.end_capture()
        except Exception as ex:  # an op that cannot be captured: run this key eagerly from now on
            self.failed[key] = f"{type(ex).__name__}: {ex}"[:200]
            self.stats["failed"] += 1
            return None
        e["head"], e["tail"], e["h"], e["out"], e["tok"] = ga, gb, h, out, tok
        self.entries[key] = e
        self.stats["captures"] += 1
        return e

    def steady(self, segs):
        """The captured and verified entry for this decode batch, or None."""
        e = self.entries.get(self._key_of(segs)[0])
        return e if e is not None and e["checks"] >= self.verify_replays else None

    def pipelined_step(self, pool, seqs, e, prev_done, known=None):
        """One greedy step whose token ids are the previous step's device argmax (``e['tok']``), launched
        before the host has read them: the head graph (embedding + layers before the first host-PLE layer)
        runs while the host copies the previous tokens out, hashes their n-grams, gathers the PLE rows and
        uploads them; then the tail graph. Sequence lengths must already count the previous step.

        Args:
            seqs: the batch (same slab rows as ``e``'s key; pages are reserved here).
            e: the steady entry of this batch (:meth:`steady`), whose last replay produced ``e['tok']``.
            prev_done: the event recorded after the previous step's tail.
            known: the previous tokens when the host already has them (no copy is made then).
        Returns:
            (host int64 ``[B]`` previous tokens = this step's inputs, event after this step's tail).
        """
        cp, s, m = self.cp, self.stream, self.model
        B = len(seqs)
        for q in seqs:
            pool.reserve(q, 1)
        for k in ("pos_staged", "staged"):  # earlier copies out of the pinned staging are done
            if e[k] is not None:
                e[k].synchronize()
        hi = e["host_i64"]
        hi[B:] = [q.length for q in seqs]
        e["pos"].set(hi[B:], stream=s)
        with s:
            e["ids"][...] = e["tok"]  # device feedback: this step's inputs are the previous argmax
        e["pos_staged"] = s.record()
        e["head"].launch(stream=s)
        fetched = None
        if known is not None:
            toks = np.asarray(known, dtype=np.int64)
        else:  # the previous tokens to the host on a side stream (ordered after the previous tail only)
            if self._side is None:
                self._side = cp.cuda.Stream(non_blocking=True)
            side = self._side
            side.wait_event(prev_done)
            e["tok"].get(stream=side, out=e["tok_host"])
            fetched = side.record()
            fetched.synchronize()
            m.syncs.count += 1
            toks = np.array(e["tok_host"], copy=True)
        segs = [Segment(q, toks[j:j + 1]) for j, q in enumerate(seqs)]
        st = m.prepare_host(pool, segs, "decode", None, ple_out=e["host_emb"])
        for i, buf in e["emb"].items():
            src = st.emb[i]
            if isinstance(src, np.ndarray):
                buf.set(src, stream=s)
            else:
                with s:
                    buf[...] = src
        e["staged"] = s.record()
        if fetched is not None:
            s.wait_event(fetched)  # the tail rewrites e['tok'] only after the copy above read it
        e["tail"].launch(stream=s)
        self.stats["replays"] += 1
        self.stats["pipelined"] += 1
        return toks, s.record()
