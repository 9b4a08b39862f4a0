"""The qwen4exp serving engine: sequences, batched decode, chunked prefill, verify/rollback, snapshots.

API (docs/design.md, "Engine")::

    eng = Engine(ck, precision="bf16"|"float32", device="cuda"|"cpu", page_size=16, kv_tokens=..., max_seqs=...)
    seq = eng.add_sequence() ; eng.free(seq) ; child = eng.fork(seq)
    eng.prefill(seq, ids, chunk_size=None) -> logits [T, V] (numpy float32)
    eng.decode(seqs, ids) -> logits [B, V]       # batched, sequences of different lengths
    eng.verify(seq, ids) -> logits [k, V] ; eng.rollback(seq, n)
    eng.snapshot(seq) -> EngineSnapshot ; eng.restore(seq, snap)
    eng.mtp_draft(seq, residual, next_ids, k) ; eng.generate_speculative(seq, prompt, max_new, k)   # MTP head
    eng.export_snapshot(snap) -> dict of host arrays ; eng.import_snapshot(seq, data)   # to/from disk, any page size

``device="cpu"`` runs the same engine code on NumPy (every kernel's NumPy twin): CI exercises it.
Memory limits are fixed at construction (``eng.limits``, printed by ``eng.describe_limits()``); a request
beyond them raises :class:`engine.state.CapacityError`. The sequence kernels' limits
(:func:`engine.kernels.seq_limits.seq_kernel_limits`) are checked at load too (``eng.limits["seq_kernels"]``): a
config beyond what the CUDA kernels handle is refused with a :class:`reference.config.ConfigError` before any
weight is read.
"""
from __future__ import annotations

import numpy as np

from engine.backend import get_xp
from engine.kernels.seq_limits import seq_kernel_limits
from engine.graphs import DecodeGraphs
from engine.model import EngineModel, Segment
from engine.state import CapacityError, Snapshot, StateError, StatePool
from reference.errors import InputError
from reference import taphook as tap_recorder

__all__ = ["Engine", "EngineSnapshot", "CapacityError", "StateError"]

EngineSnapshot = Snapshot


class Engine:
    """A qwen4exp inference engine over one checkpoint.

    Args:
        ck: ``reference.checkpoint.Checkpoint`` (or ``DictWeights``); ``ck.config`` is the model config.
        precision: 'bf16' (default: BF16 weights, FP32 accumulation and state) or 'float32'.
        device: 'cuda' (CuPy + CUDA kernels), 'cpu' (NumPy twins) or 'auto' (cuda when a GPU is present).
        page_size: KV tokens per page (any positive integer).
        kv_tokens: KV token capacity shared by all sequences (rounded up to whole pages). Default:
            ``max_seqs * max_position_embeddings`` capped to what ``kv_memory_fraction`` of free device
            memory holds (on CPU: 65536 tokens or less).
        max_seqs: live sequences at once (slab rows), forks and verify drafts included.
        prefill_chunk: default prefill chunk length (None = the whole prompt in one chunk).
        ple_placement: 'host' (memory-mapped PLE table, default: read in place where the device reads
            pageable host memory, else pinned staging), 'device', or 'unified' (force in place; see
            :mod:`engine.ple_table`). The path in use is ``limits['ple_table']``.
        progress: show weight-upload progress (tqdm).
        cuda_graphs: replay batched decode steps as CUDA graphs (cuda only; each graph verified against an
            eager step before use, see :class:`engine.graphs.DecodeGraphs`). Default: on, unless the
            environment sets ``QWEN4EXP_CUDA_GRAPHS=0``.
        devices: expert parallelism (:mod:`engine.parallel`): a list of CUDA device ids (distinct ids:
            NCCL; the first runs the trunk and owns all state) or a number of ranks / repeated ids (the
            stand-in communicator: logical ranks on this one device, NumPy on the CPU). None: one device.
        mtp: load the MTP head (``mtp.*``) for drafting: True, False, or None (default: when the checkpoint
            has one). mtp_hnorm, mtp_draft_selection: the head's options (:mod:`reference.blocks.mtp`).
    Raises:
        InputError: bad precision/page_size/sizes. DeviceError: device 'cuda' without a GPU.
        ConfigError: device 'cuda' and the config exceeds a CUDA sequence-kernel limit (checked first).
    """

    def __init__(self, ck, precision: str = "bf16", device: str = "cuda", page_size: int = 16,
                 kv_tokens: int | None = None, max_seqs: int = 8, prefill_chunk: int | None = None,
                 ple_placement: str = "host", progress: bool = False, kv_memory_fraction: float = 0.5,
                 cuda_graphs: bool | None = None, devices=None, mtp: bool | None = None,
                 mtp_hnorm: str = "global", mtp_draft_selection: str = "fresh", quantized: str = "stored"):
        if precision not in ("bf16", "float32"):
            raise InputError(f"precision: expected 'bf16' or 'float32', found {precision!r}")
        if device == "auto":
            from engine.backend import gpu_available
            device = "cuda" if gpu_available() else "cpu"
        # the sequence kernels' limits, stated (and refused, for the CUDA kernels) before anything is loaded
        seq_limits = seq_kernel_limits(ck.config, gpu=(device == "cuda"))
        self.xp = xp = get_xp(device)
        self.device = device
        self.precision = precision
        self.config = c = ck.config
        self.ck = ck  # weights identity (ck.fingerprint()) for snapshot files
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk <= 0):
            raise InputError(f"prefill_chunk: expected a positive integer or None, found {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        # expert parallelism (engine/parallel.py): devices=N or [ids]; rank 0 (the first device) runs the trunk
        self.comm = None
        if devices is not None:
            from engine.parallel import make_comm
            self.comm = make_comm(devices, device, xp)
        from reference.blocks.mtp import check_mtp_options
        check_mtp_options(mtp_hnorm, mtp_draft_selection)
        has = getattr(ck, "has_mtp", None)
        ck_mtp = bool(has()) if has is not None else False
        if mtp and not ck_mtp:
            raise InputError("mtp: expected a checkpoint with an MTP head (mtp.* tensors), found none")
        if mtp and self.comm is not None:
            raise InputError("mtp: the MTP head is not supported with expert parallelism (devices=...), found both")
        self.mtp_hnorm, self.mtp_draft_selection = mtp_hnorm, mtp_draft_selection
        self.model = EngineModel(ck, xp, precision=precision, ple_placement=ple_placement, progress=progress,
                                 comm=self.comm, mtp=(ck_mtp if mtp is None else bool(mtp)) and self.comm is None,
                                 quantized=quantized)
        if not isinstance(page_size, (int, np.integer)) or isinstance(page_size, bool) or page_size <= 0:
            raise InputError(f"page_size: expected a positive integer, found {page_size!r}")
        if kv_tokens is None:
            want = max_seqs * c.max_position_embeddings
            probe = StatePool(c, np, page_size=page_size, num_pages=1, max_seqs=1)
            per_tok = max(1, probe.page_bytes() // page_size)
            if device == "cuda":
                free, _ = xp.cuda.runtime.memGetInfo()
                cap = int(free * kv_memory_fraction) // per_tok
            else:
                cap = 65536
            kv_tokens = max(page_size, min(want, cap))
        num_pages = -(-int(kv_tokens) // page_size)
        self.pool = StatePool(c, xp, page_size=int(page_size), num_pages=num_pages, max_seqs=int(max_seqs))
        if self.model.mtp_layer is not None:
            self.pool.enable_mtp()
        if cuda_graphs is None:
            import os
            cuda_graphs = os.environ.get("QWEN4EXP_CUDA_GRAPHS", "1") != "0"
        self.graphs = None
        self.last_logits = None  # device logits of the latest decode_greedy step (valid until the next step)
        if self.comm is not None and type(self.comm).__name__ == "NcclComm":
            cuda_graphs = False  # one graph per device would be needed; the sharded step runs eagerly
        if cuda_graphs and device == "cuda":
            self.graphs = DecodeGraphs(self.model)
        self.limits = self.pool.limits()
        self.limits["weight_bytes"] = self.model.weight_bytes()
        self.limits["seq_kernels"] = seq_limits
        self.limits["ple_table"] = sorted({t.mode for t in self.model.ple.values()})

    # ------------------------------------------------------------------ info
    def describe_limits(self) -> str:
        """One line stating the memory limits fixed at load."""
        k = self.limits.get("seq_kernels") or {}
        kern = f"; kernels: conv state rows {k['conv_state_rows']} <= {k['max_conv_state_rows']}" if k else ""
        if "block_topk" in k:
            kern += (f", block top-k {k['block_topk']} <= {k['max_block_topk']}, blocks {k['max_blocks']} <= "
                     f"{k['max_scored_blocks']}")
        if k and self.device != "cuda":
            kern += " (CUDA limits; the NumPy path has none)"
        ple = self.limits.get("ple_table") or []
        kern += f"; PLE table: {'/'.join(ple)}" if ple else ""
        return (self.pool.describe_limits() + f"; weights {self.limits['weight_bytes'] / 2**20:.1f} MiB "
                f"({self.precision})" + kern)

    @property
    def host_syncs(self) -> int:
        """Device->host copies made so far (logits, and taps while recording)."""
        return self.model.syncs.count

    def position(self, seq) -> int:
        """Committed tokens of ``seq`` (``seq.length``): the position the next token gets."""
        return seq.length

    # ------------------------------------------------------------------ sequences
    def add_sequence(self):
        """A new empty sequence. Raises CapacityError when ``max_seqs`` are live."""
        return self.pool.add()

    def free(self, seq) -> None:
        """Release a sequence (its state is scrubbed; the handle is dead)."""
        self.pool.free(seq)

    def fork(self, seq):
        """A copy of ``seq`` (pages shared copy-on-write, slab state copied)."""
        return self.pool.fork(seq)

    def snapshot(self, seq) -> Snapshot:
        """Capture ``seq``'s whole state (``StatePool.snapshot``).

        Raises:
            StateError: ``seq`` is not a live sequence of this engine, or a step on it was interrupted.
        """
        return self.pool.snapshot(seq)

    def restore(self, seq, snap: Snapshot) -> None:
        """Put ``seq`` back to ``snap`` (``StatePool.restore``); the snapshot stays valid.

        Raises:
            StateError: ``seq`` is not a live sequence of this engine, or ``snap`` is not a snapshot of this engine.
        """
        self.pool.restore(seq, snap)

    def export_snapshot(self, snap: Snapshot) -> dict:
        """A snapshot as host numpy copies + meta (``format``, ``version``, ``config_hash``, ``length``, ``kinds``:
        the state kinds present), independent of pages, page size and device; see
        :meth:`engine.state.StatePool.export_snapshot` for the layout (``qsa.{i}.k`` ``[L, nKV, hd]`` ...).

        Raises:
            StateError: not a live snapshot of this engine.
        """
        return self.pool.export_snapshot(snap)

    def import_snapshot(self, seq, data: dict) -> None:
        """Put ``seq`` into the state of an :meth:`export_snapshot` dict (pages allocated here).

        Raises:
            StateError: another model/format, or a partial state (a kind or any layer's array missing or
                misshapen; the contents are checked, not only the ``kinds`` label). CapacityError: out of pages.
        """
        self.pool.import_snapshot(seq, data)

    def rollback(self, seq, n: int) -> None:
        """Forget the last ``n`` tokens of the latest :meth:`verify` (per-position checkpoints)."""
        self.pool.rollback(seq, n)

    # ------------------------------------------------------------------ forward
    def _ids(self, ids, what="ids") -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{what}: expected a non-empty 1-D list of integer token ids, found {arr.dtype} "
                             f"shape {arr.shape}")
        V = self.config.vocab_size
        if arr.min() < 0 or arr.max() >= V:
            raise InputError(f"{what}: expected token ids in [0, {V}), found range [{arr.min()}, {arr.max()}]")
        return arr.astype(np.int64)

    def _run(self, segs, mode, last_only=False, tokens=False):
        """One step; returns the logits, or with ``tokens`` (decode only) ``(logits, argmax ids)`` (device)."""
        for s in segs:
            self.pool.reserve(s.seq, len(s.ids))
        try:
            # with the MTP head loaded the eager path runs (the head needs each step's residual)
            if mode == "decode" and self.graphs is not None and tap_recorder.current() is None and not self.has_mtp:
                logits, tok = self.graphs.decode(self.pool, segs)
                if tokens:
                    logits = (logits, tok)
            else:
                logits = self.model.forward(self.pool, segs, mode, last_only=last_only)
                if tokens:
                    from engine.kernels.sampling import row_argmax
                    logits = (logits, row_argmax(logits))
        except BaseException:
            # slab rows may be half updated (e.g. Ctrl-C between layers): refuse further use of these
            # sequences until restore()/free() rather than continue from a corrupt state
            for s in segs:
                s.seq.broken = True
            raise
        for s in segs:
            s.seq.length += len(s.ids)
        if self.has_mtp:
            self._mtp_track(segs, mode)
        return logits

    def prefill(self, seq, ids, chunk_size: int | None = None, last_only: bool = False) -> np.ndarray:
        """Append a prompt, in chunks of ``chunk_size`` tokens (default: the engine's ``prefill_chunk``).

        Returns:
            numpy float32 ``[T, V]`` logits of every prompt position (``[V]`` with ``last_only``).
        Raises:
            InputError: bad ids/chunk size. CapacityError: beyond pages or max_position_embeddings (checked
                for the whole prompt before anything runs).
        """
        self.pool._check(seq)
        ids = self._ids(ids)
        cs = chunk_size if chunk_size is not None else self.prefill_chunk
        if cs is not None and (not isinstance(cs, (int, np.integer)) or cs <= 0):
            raise InputError(f"chunk_size: expected a positive integer or None, found {cs!r}")
        end = seq.length + len(ids)
        if end > self.pool.max_positions:
            raise CapacityError(f"sequence {seq.sid}: {end} positions requested, expected <= "
                                f"max_position_embeddings={self.pool.max_positions}")
        need = self.pool.pages_needed(seq, len(ids))
        if need > self.pool.free_pages():
            raise CapacityError(f"KV pages: sequence {seq.sid}: a prompt of {len(ids)} tokens needs {need} free pages, "
                                f"found {self.pool.free_pages()} (pool of {self.pool.num_pages} pages x "
                                f"{self.pool.page_size} tokens; raise kv_tokens or free sequences)")
        seq.checkpoints = None
        cs = len(ids) if cs is None else int(cs)
        outs = []
        for a in range(0, len(ids), cs):
            chunk = ids[a:a + cs]
            lg = self._run([Segment(seq, chunk)], "prefill", last_only=last_only)
            if not last_only:
                outs.append(self.model.syncs.host(lg))
            elif a + cs >= len(ids):
                outs.append(self.model.syncs.host(lg)[0])
        return outs[-1] if last_only else np.concatenate(outs, axis=0)

    def decode(self, seqs, ids) -> np.ndarray:
        """One token for each of ``seqs`` (any lengths), in one batched step.

        Returns:
            numpy float32 ``[B, V]``.
        Raises:
            InputError: lengths differ, duplicate sequences, bad ids. CapacityError: out of pages/positions.
        """
        segs = self._decode_segs(seqs, ids)
        return self.model.syncs.host(self._run(segs, "decode"))

    def decode_greedy(self, seqs, ids) -> np.ndarray:
        """:meth:`decode`, returning the greedy next tokens instead of the logits: the argmax of each row
        (first maximum, as ``np.argmax``) is taken on the device, so the step's only device->host copy is
        ``B`` int64 ids. The logits stay on the device (:attr:`last_logits`).

        Returns:
            numpy int64 ``[B]``.
        Raises:
            as :meth:`decode`.
        """
        segs = self._decode_segs(seqs, ids)
        logits, tok = self._run(segs, "decode", tokens=True)
        self.last_logits = logits
        return self.model.syncs.host(tok)

    def decode_greedy_steps(self, seqs, ids, steps: int, step_times: list | None = None) -> np.ndarray:
        """``steps`` greedy decode steps of ``seqs``, starting from the tokens ``ids``: the same tokens and
        state as calling :meth:`decode_greedy` ``steps`` times and feeding each result back, but pipelined
        on the GPU once the batch's CUDA graphs are in steady state: each step's token ids are the previous
        step's device argmax, so its first layers run while the host reads the previous tokens and gathers
        their PLE rows (:meth:`engine.graphs.DecodeGraphs.pipelined_step`).

        Args:
            seqs: the batch; ids: ``[B]`` tokens to feed first; steps: number of steps (>= 1).
            step_times: optional list that receives each step's duration in seconds: CUDA events between
                the ends of consecutive steps on the GPU (the first step excluded), wall clock on the CPU.
        Returns:
            numpy int64 ``[steps, B]``: row ``k`` holds the tokens produced by step ``k``.
        Raises:
            as :meth:`decode`; InputError for ``steps < 1``.
        """
        if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
            raise InputError(f"steps: expected a positive integer, found {steps!r}")
        seqs = list(seqs)
        cur = self._ids(ids, "decode ids")
        out = []
        g = self.graphs
        if g is None or tap_recorder.current() is not None or self.has_mtp:  # the head needs every residual
            import time
            for _ in range(int(steps)):
                t0 = time.perf_counter()
                cur = self.decode_greedy(seqs, cur)
                if step_times is not None:
                    step_times.append(time.perf_counter() - t0)
                out.append(cur)
            return np.stack(out)
        cp = self.xp
        pending = None  # (entry, event after its tail, tokens already on the host or None)
        pairs = []  # (start, end) device events of each step
        first = cur
        while len(out) < steps:
            nxt = g.steady([Segment(s, [0]) for s in seqs]) if pending is not None else None
            if pending is not None and nxt is pending[0] and len(out) + (pending[2] is None) < steps:
                e, ev_prev, have = pending
                for s in seqs:
                    self.pool._check(s)
                    s.checkpoints = None
                try:
                    toks, ev = g.pipelined_step(self.pool, seqs, e, ev_prev, known=have)
                except BaseException:
                    for s in seqs:
                        s.broken = True
                    raise
                for s in seqs:
                    s.length += 1
                if have is None:
                    out.append(toks)
                pairs.append((ev_prev, ev))  # timed once the loop has synchronised
                pending = (e, ev, None)
                continue
            if pending is not None:  # the batch's graph changes (or the last step): fetch, then step plainly
                e, ev_prev, have = pending
                if have is None:
                    ev_prev.synchronize()
                    out.append(self.model.syncs.host(e["tok"]))
                pending = None
                continue
            t0 = cp.cuda.Event()
            t0.record(g.stream)
            cur = self.decode_greedy(seqs, out[-1] if out else first)
            t1 = cp.cuda.Event()
            t1.record(g.stream)
            out.append(cur)
            pairs.append((t0, t1))
            e = g.steady([Segment(s, [0]) for s in seqs])
            if e is not None and self.last_logits is e["out"]:  # a replay of e: its argmax is in e['tok']
                pending = (e, t1, cur)
        if step_times is not None:
            for a, b in pairs[:steps]:
                b.synchronize()
                step_times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        return np.stack(out[:steps])

    def _decode_segs(self, seqs, ids):
        seqs = list(seqs)
        ids = self._ids(ids, "decode ids")
        if len(seqs) != len(ids):
            raise InputError(f"decode: expected one token per sequence ({len(seqs)} sequences), found {len(ids)}")
        if len({s.sid for s in seqs}) != len(seqs):
            raise InputError("decode: expected distinct sequences, found one sequence twice")
        for s in seqs:
            self.pool._check(s)
            s.checkpoints = None
        return [Segment(s, ids[j:j + 1]) for j, s in enumerate(seqs)]

    def verify(self, seq, ids) -> np.ndarray:
        """Forward ``k`` drafted tokens keeping per-position recurrent checkpoints, so :meth:`rollback`
        can return to any accepted prefix.

        Returns:
            numpy float32 ``[k, V]``.
        """
        self.pool._check(seq)
        ids = self._ids(ids, "draft ids")
        self.pool.begin_checkpoints(seq, len(ids))
        try:
            lg = self._run([Segment(seq, ids)], "verify")
        except BaseException:
            seq.checkpoints = None
            raise
        # the n-gram context (host) per position
        return self.model.syncs.host(lg)

    def verify_greedy(self, seq, ids) -> np.ndarray:
        """:meth:`verify` returning the greedy token after each position (argmax on the device: the step's only
        device->host copy is ``k`` int64 ids; the logits stay on the device in :attr:`last_logits`).

        Returns:
            numpy int64 ``[k]``.
        """
        self.pool._check(seq)
        ids = self._ids(ids, "draft ids")
        self.pool.begin_checkpoints(seq, len(ids))
        try:
            logits, tok = self._run([Segment(seq, ids)], "verify", tokens=True)
        except BaseException:
            seq.checkpoints = None
            raise
        self.last_logits = logits
        return self.model.syncs.host(tok)

    # ------------------------------------------------------------------ the MTP head (drafting)
    @property
    def has_mtp(self) -> bool:
        """True when the MTP head is loaded."""
        return self.model.mtp_layer is not None

    @property
    def last_residual(self):
        """The pre-final-mixer multi-stream residual ``[T, hc*H]`` of the latest prefill chunk / verify / decode
        (device array; the MTP head's input ``R``)."""
        return self.model.last_residual

    #: pending trunk rows per sequence beyond which the head catches up at once (bounds the kept residuals)
    MTP_TAIL_ROWS = 256

    def _mtp_track(self, segs, mode: str) -> None:
        """Keep each segment's residual rows for the head (``seq.mtp_tail``); a prefill chunk (or a long tail)
        is consumed at once: the head follows the trunk one position behind. Never after a verify: its
        positions may be rolled back, and the head only ever consumes committed positions."""
        R = self.model.last_residual
        a = 0
        for s in segs:
            n = len(s.ids)
            s.seq.mtp_tail.append((s.start, R[a:a + n], np.asarray(s.ids, np.int64)))
            a += n
            if mode != "verify" and (mode == "prefill" or
                                     sum(len(t[2]) for t in s.seq.mtp_tail) > self.MTP_TAIL_ROWS):
                self._mtp_catch_up(s.seq)

    def _mtp_rows(self, seq):
        """``(R [m, hc*H], ids [m])`` of the pending trunk positions ``seq.mtp_len .. length-1``.

        Raises:
            InputError: the residuals of some of those positions are not held (a snapshot file was imported).
        """
        tail = [t for t in seq.mtp_tail if t[0] + len(t[2]) > seq.mtp_len]
        if not tail or tail[0][0] > seq.mtp_len or tail[-1][0] + len(tail[-1][2]) != seq.length:
            raise InputError(f"mtp: sequence {seq.sid}: expected the trunk's residuals of positions "
                             f"{seq.mtp_len}..{seq.length - 1} for the MTP head, found them missing (e.g. after "
                             f"importing a snapshot file: prefill the history again to draft)")
        off = seq.mtp_len - tail[0][0]
        R = self.xp.concatenate([t[1] for t in tail], axis=0)[off:] if len(tail) > 1 else tail[0][1][off:]
        ids = np.concatenate([t[2] for t in tail])[off:]
        return R, ids

    def _mtp_catch_up(self, seq) -> None:
        """Consume every pending pair whose next token the trunk holds (positions ``mtp_len .. length-2``)."""
        if seq.length - 1 <= seq.mtp_len:
            return
        R, ids = self._mtp_rows(seq)
        self.mtp_consume(seq, R[:-1], ids[1:])
        seq.mtp_tail = [(seq.length - 1, R[-1:], ids[-1:])]

    def _mtp_pairs(self, seq, residual, next_ids, extra: int):
        if not self.has_mtp:
            raise InputError("mtp: expected an engine with the MTP head loaded (Engine(..., mtp=True)), found none")
        self.pool._check(seq)
        ids = self._ids(next_ids, "mtp next ids")
        R = self.xp.asarray(residual, dtype=np.float32)
        c = self.config
        if R.ndim != 2 or R.shape != (len(ids), c.hc_hidden_size):
            raise InputError(f"mtp: residual: expected shape [{len(ids)}, hc_count*hidden_size={c.hc_hidden_size}], "
                             f"found {list(R.shape)}")
        start = seq.mtp_len
        if start + len(ids) > seq.length:
            raise InputError(f"mtp: {len(ids)} pairs from head position {start}: expected <= the trunk's "
                             f"{seq.length} positions (a pair at q needs the trunk's residual at q)")
        # the head writes below the trunk's length (its catch-up) and past it (draft steps): private pages
        self.pool.reserve_range(seq, start, max(seq.length, start + len(ids) + extra))
        return R, ids, start

    def mtp_consume(self, seq, residual, next_ids) -> None:
        """Feed the head ``m`` pairs ``(R_q, x_{q+1})`` at its next positions ``seq.mtp_len ..`` without drafting
        (low level: :meth:`mtp_draft_next` does the bookkeeping from the engine's own residuals).

        Raises:
            InputError: no head, bad shapes, or pairs past the trunk's positions.
        """
        R, ids, start = self._mtp_pairs(seq, residual, next_ids, 0)
        self.model.mtp_step(self.pool, seq, R, start, ids=ids, hnorm=self.mtp_hnorm)
        seq.mtp_len = start + len(ids)

    def mtp_draft_next(self, seq, next_id: int, k: int, return_logits: bool = False):
        """The head's ``k`` greedy drafts after ``seq`` followed by ``next_id`` (the token the trunk chose at its
        last position, not yet fed): the head catches up on the trunk positions it has not consumed (the
        engine keeps their residuals), then drafts (:meth:`mtp_draft`). The pair ``(R_{n-1}, next_id)`` is not
        committed (``next_id`` is not in the trunk yet), so the call can be repeated; rejected draft steps and
        rolled-back trunk positions never stay in the head's state (:meth:`rollback` trims it too).

        Returns:
            int64 ``[k]`` draft ids (and host float32 ``[k, V]`` logits with ``return_logits``).
        Raises:
            InputError: no head, an empty sequence, ``k < 1``, or the residuals needed are not held.
        """
        if not self.has_mtp:
            raise InputError("mtp: expected an engine with the MTP head loaded (Engine(..., mtp=True)), found none")
        self.pool._check(seq)
        if seq.length < 1:
            raise InputError(f"mtp draft: sequence {seq.sid}: expected at least one token in the trunk, found none")
        nxt = self._ids([next_id], "mtp next id")
        self._mtp_catch_up(seq)
        R, _ = self._mtp_rows(seq)
        try:
            return self.mtp_draft(seq, R[-1:], nxt, k, return_logits=return_logits)
        finally:
            seq.mtp_len = seq.length - 1

    def mtp_draft(self, seq, residual, next_ids, k: int, return_logits: bool = False):
        """Greedy drafts from the MTP head (low level): consume the ``m`` pairs (committed: the head's state
        advances by ``m``), then ``k - 1`` further steps at the following positions on the head's own state and
        drafted tokens (speculative: their cache entries lie past ``seq.mtp_len``, invisible and rewritten by the
        next catch-up, so a rejection needs no further rollback of the head). The drafted ids stay on the device
        between steps; one device->host copy returns them.

        Args:
            residual: ``[m, hc*H]`` (device or host); next_ids: ``[m]``; k: drafts (>= 1).
            return_logits: also return the draft logits ``[k, V]`` (host float32).
        Returns:
            int64 ``[k]`` draft ids (and the logits).
        Raises:
            InputError: no head, bad shapes, pairs past the trunk, ``k < 1``. CapacityError: out of pages.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"mtp draft: k: expected a positive integer, found {k!r}")
        xp, c = self.xp, self.config
        R, ids, start = self._mtp_pairs(seq, residual, next_ids, int(k) - 1)
        from engine.kernels.sampling import row_argmax
        r = c.indexer_compress_ratio or 1
        reuse = self.mtp_draft_selection == "reuse_step0"
        keep: dict = {}

        def hook0(sel):  # remember draft step 0's selection (the last pair's row)
            keep["sel"] = sel[-1:]
            return sel
        lg, h = self.model.mtp_step(self.pool, seq, R, start, ids=ids, hnorm=self.mtp_hnorm,
                                    select_hook=hook0 if reuse else None)
        seq.mtp_len = start + len(ids)
        toks = [row_argmax(xp.ascontiguousarray(lg[-1:]))]
        logits = [lg[-1:]]
        h = h[-1:]
        p0 = seq.mtp_len - 1  # the position of draft step 0
        for j in range(1, int(k)):
            hook = None
            if reuse:  # step 0's blocks plus every block completed since (step 0 could not score those)
                nc0, ncj = (p0 + 1) // r, (p0 + j + 1) // r
                hook = _reuse_hook(xp, keep["sel"], nc0, ncj, c.block_topk + int(k))
            lg, h = self.model.mtp_step(self.pool, seq, h, p0 + j, ids_dev=toks[-1], hnorm=self.mtp_hnorm,
                                        select_hook=hook)
            toks.append(row_argmax(xp.ascontiguousarray(lg)))
            logits.append(lg)
        out = self.model.syncs.host(xp.concatenate(toks)).astype(np.int64)
        if return_logits:
            return out, self.model.syncs.host(xp.concatenate(logits, axis=0))
        return out

    def generate_speculative(self, seq, prompt, max_new: int, k: int, eos_ids=(), trace: list | None = None,
                             chunk_size: int | None = None, propose=None) -> list[int]:
        """Greedy generation with MTP drafts: per round the head drafts ``k`` tokens (:meth:`mtp_draft_next`),
        the trunk verifies ``[x, d_1..d_k]`` in one width-``k+1`` step (:meth:`verify_greedy`), the longest
        matching prefix plus the trunk's own next token are kept and the rejected positions rolled back
        (:meth:`rollback`: trunk and head). Same tokens as plain greedy decoding (the head only proposes).

        Args:
            seq: an empty (or any) sequence; prompt: ids (>= 1); max_new, k: >= 1; eos_ids: stop ids.
            trace: optional list receiving ``{"position", "drafts", "accepted"}`` per round.
            chunk_size: prefill chunk length (default: the engine's); the head follows chunk by chunk.
            propose: test hook ``(round, position, drafts) -> drafts`` replacing the head's drafts of a round
                (random-weight heads accept almost nothing; this forces acceptance counts 1..k while the head's
                state still follows the real loop).
        Returns:
            the generated ids.
        Raises:
            InputError: no head, bad arguments. CapacityError: out of pages/positions.
        """
        if not self.has_mtp:
            raise InputError("generate --speculative mtp: expected a checkpoint with an MTP head, found none")
        for name, v in (("max_new", max_new), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InputError(f"{name}: expected a positive integer, found {v!r}")
        last = self.prefill(seq, prompt, chunk_size=chunk_size, last_only=True)
        out = [int(np.argmax(last))]
        eos = {int(e) for e in eos_ids}
        rnd = 0
        while len(out) < max_new and out[-1] not in eos:
            kk = int(min(k, max_new - len(out)))
            n = seq.length
            drafts = self.mtp_draft_next(seq, out[-1], kk)
            if propose is not None:
                drafts = np.asarray(propose(rnd, n, drafts), np.int64).reshape(kk)
            rnd += 1
            greedy = self.verify_greedy(seq, np.concatenate([[out[-1]], drafts]))
            acc = 0
            while acc < kk and int(greedy[acc]) == int(drafts[acc]):
                acc += 1
            self.rollback(seq, kk - acc)
            if trace is not None:
                trace.append({"position": n, "drafts": [int(d) for d in drafts], "accepted": acc})
            for t in [int(d) for d in drafts[:acc]] + [int(greedy[acc])]:
                out.append(t)
                if t in eos or len(out) >= max_new:
                    break
        return out[:max_new]


def _reuse_hook(xp, sel0, nc0: int, ncj: int, width: int):
    """A QSA selection hook for draft step j under ``draft_selection='reuse_step0'``: step 0's selected blocks
    ``sel0 [1, k0]`` plus blocks ``nc0 .. ncj-1`` (completed after step 0), ``-1`` padded to ``width``.

    The valid entries form a prefix (the layout :func:`engine.kernels.qsa.qsa_topk` returns and the CUDA
    attention reads): step 0 selected ``min(nc0, k0)`` blocks, so the new blocks start there, over the -1
    padding step 0 had when fewer than ``k0`` blocks were complete."""
    n0 = min(int(nc0), int(sel0.shape[1]))

    def hook(sel):
        new = xp.full((sel.shape[0], width), -1, dtype=sel.dtype)
        new[:, :n0] = sel0[:, :n0]
        if ncj > nc0:
            new[:, n0:n0 + (ncj - nc0)] = xp.arange(nc0, ncj, dtype=sel.dtype)
        return new
    return hook
