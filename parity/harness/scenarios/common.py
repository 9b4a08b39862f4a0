"""Scenario machinery shared by the four suites: a tracked run of a backend against the truth.

A *case* is a Python function ``case(run: Run)`` that drives a backend through operations on one or
more sequences (``run.new``, ``run.prefill``, ``run.decode``, ``run.verify``, ``run.rollback``,
``run.snapshot``, ``run.restore`` ...). The :class:`Run` keeps every sequence's token history and, after
each operation that returns logits, compares those rows against the TRUTH: the reference model's
single full forward over that sequence's history (:class:`TruthCache`). Non-logit expectations
(positions, refusals, state equality) are checked too. The first failing check stops the case.

On failure the case is replayed deterministically with taps recorded around the failing operation
(:func:`locate`), the truth's taps are recorded for the same positions, and tap-diff names the first
divergence. A failing batched decode is also replayed one sequence at a time, which tells a
batching bug ("correct alone, wrong in a batch") from a state bug.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from parity.backends.base import capabilities_of, capability, owned
from parity.harness.causes import fault_of
from parity.harness.floor import SelectionLog
from parity.harness.metrics import compare_logits
# the case, its outcome and the sizes are re-exported: the suites and their callers import them from here
from parity.harness.scenarios.case import Case, CaseConfined, CaseFailure, CaseResult, CaseSkip  # noqa: F401
from parity.harness.scenarios.truth import NonFiniteTruth, TruthCache, check_truth_finite  # noqa: F401
from parity.harness.sizes import GDN_CHUNK, Sizes, page_sizes_for, sizes, token_stream  # noqa: F401
from parity.harness.thresholds import KLThresholds, fault_positions, position_faults, verdict
from parity.harness.ties import SELECTION_TAPS, judge_ties
from reference.errors import UserError
from reference.taphook import layer_of
from taps.archive import MemoryArchive

__all__ = ["Case", "Run", "TruthCache", "CaseResult", "CaseFailure", "CaseConfined", "CaseSkip", "page_sizes_for", "sizes",
           "token_stream", "Sizes"]


# --- verdicts. Every logit row a case compares is judged by parity.harness.thresholds.verdict against the run's
# thresholds: a multiple of the precision floor measured on this model (parity.harness.floor), relative to the
# truth row's logit scale. Its top-1 rule is the near-tie rule of the whole harness: an argmax may flip only where
# the truth's two tokens are within 2 x tol x scale (an error within tolerance on each logit can flip exactly
# those); a flip farther from a tie fails at once, at every precision (no fraction of flips is excused).


def batch_row(arc, rank: int, count: int):
    """The recording ``arc`` of one batched call in which ``count`` sequences share each recorded position, cut to
    the rows of the ``rank``-th of them (batch order: a batched emit lists its rows in the batch's order, so the
    k-th row at a position belongs to the k-th sequence there). A tap emitted fewer times than ``count`` at a
    position (not per sequence) is kept as is.

    Args:
        arc: a :class:`taps.archive.TapSource` (the in-memory recording of the call).
    Returns:
        a :class:`taps.archive.MemoryArchive` with, per tap and position, the one row of that sequence.
    """
    data, taps = {}, {}
    manifest = dict(getattr(arc, "manifest", {}) or {})
    for name in arc.names():
        pos = np.asarray(arc.positions(name), dtype=np.int64)
        val = np.asarray(arc.get(name))
        keep = np.ones(len(pos), dtype=bool)
        for p in np.unique(pos):
            at = np.nonzero(pos == p)[0]
            if len(at) == count:
                keep[at] = False
                keep[at[rank]] = True
        data[name] = [(pos[keep].copy(), np.array(val[keep], copy=True))]
        t = dict((manifest.get("taps") or {}).get(name) or {})
        t["rows"] = int(keep.sum())
        t["segments"] = []
        taps[name] = t
    manifest["taps"] = taps
    return MemoryArchive(manifest, data)


def _null():
    return contextlib.nullcontext()


#: rank of a state array's kind inside its layer, in dataflow order (PLE before the mixer; the n-gram context
#: before the conv it feeds; conv before recurrent; indexer keys before the block keys pooled from them and
#: the attention K/V they select)
_STATE_RANK = {"context": 0, "conv": 1, "index_keys": 2, "block_keys": 3, "k": 4, "v": 5, "recurrent": 4}
_STATE_KIND = {"ple": 0, "gdn": 1, "qsa": 1}


def state_order(name: str) -> tuple:
    """Sort key walking state arrays (``ple.1.context``, ``gdn.0.conv``, ``qsa.2.k`` ...) in dataflow order:
    layer by layer, PLE state before the layer's mixer state, and inside a block in the order the forward
    reads them (see :data:`_STATE_RANK`); names of another form sort last, by name."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1].isdigit() and parts[0] in _STATE_KIND:
        return (0, int(parts[1]), _STATE_KIND[parts[0]], _STATE_RANK.get(parts[2], 9), name)
    return (1, 0, 0, 0, name)


# ----------------------------------------------------------------------------------------------- the run
class Seq:
    """A tracked sequence: backend handle + the token history its state should hold."""

    def __init__(self, label: str, handle):
        self.label = label
        self.h = handle
        self.hist: list[int] = []
        self.last_logits: np.ndarray | None = None
        self.rows: dict[int, np.ndarray] = {}  # the rows the backend returned, by position (tie resolution)
        self.last_verify: tuple[int, int] | None = None  # (drafted tokens, history length) right after a verify
        #: the QSA / MoE selections the backend took, ``{tap name: {position: row}}`` (Run.keep_selections)
        self.sel: dict[str, dict[int, np.ndarray]] = {}
        #: positions of the history whose rows were accepted under a tie resolution other than the canonical one:
        #: the backend's state holds that resolution, so every later row is judged against its truth too
        self.tie_pos: set[int] = set()


@dataclass
class Snap:
    """A backend snapshot plus the history it holds (and the tracked sequence it was taken from)."""

    obj: Any
    hist: list[int]
    src: Any = None
    tie_pos: frozenset = frozenset()   # the source's tie-resolved positions at snapshot time (Seq.tie_pos)


class Run:
    """One tracked execution of a case on one backend (see the module docstring).

    Args:
        backend: an open backend. truth: a :class:`TruthCache`. thresholds: pass thresholds.
        record_at: operation index around which taps are recorded (replays for tap-diff).
        unbatch_at: operation index of a batched decode to replay one sequence at a time.
    """

    def __init__(self, backend, truth: TruthCache, thresholds: KLThresholds, record_at: int | None = None,
                 unbatch_at: int | None = None, record_seq: str | None = None, record_batched: bool = False,
                 record_all: str | None = None):
        self.be = backend
        self.truth = truth
        self.th = thresholds
        self.config = backend.config
        self.sizes = sizes(backend.config)
        self.ops = 0
        self.checks = 0
        self.worst_kl = 0.0
        self.worst_err = 0.0
        self.worst_rel = 0.0
        self.record_at = record_at
        self.unbatch_at = unbatch_at
        self.unbatched_kind = None  # 'prefill_batch' when the unbatched op was a ragged prefill_batch
        self.record_seq = record_seq
        self.record_batched = record_batched  # record a batched decode AS a batch (the failing seq's position)
        self.recorded = None  # (archive, seq label, positions, history)
        self.recorded_out = None  # the logits rows the backend RETURNED for the recorded positions
        #: record every operation of the sequence labelled ``record_all`` (locate through state): a list of
        #: (op, archive, positions, history) in operation order
        self.record_all = record_all
        self.recorded_all: list = []
        self.top1_positions = 0
        self.tie_flips = 0  # argmax flips inside the near-tie gap (allowed; counted for the report)
        self.fault = None   # the failing comparison's fault (parity.harness.causes.fault_of), for --known
        self.tie_equivalent: list = []  # (op, seq, positions) judged against the tie-resolved truth
        self.seqs: list[Seq] = []
        self.scratch: dict = {}
        #: confine the case below the QSA bound (``--below-bound``): the most visible tokens a sequence may hold
        #: (the bound itself: ``len(hist) <= limit``); an operation reaching past it skips the case
        self.limit: int | None = None
        self.caps = capabilities_of(backend)
        self.current_op = None  # the protocol operation in progress (names a CapabilityLimit's operation)
        self.narrowed: list[str] = []  # parts left out for declared limits (see narrow)
        #: record the backend's selection taps at every prefill / verify / one-sequence decode, so a near-tie
        #: resolution is judged on the selections the case's own operations took (a chunked prefill may resolve
        #: a near tie otherwise than the one full prefill parity.harness.ties replays); set by the long cases
        self.keep_selections = False

    def _confine(self, s: "Seq", n: int) -> None:
        # ``limit``: the most visible tokens allowed (the QSA bound); position p sees p + 1 of them
        if self.limit is not None and len(s.hist) + n > self.limit:
            p = len(s.hist) + n - 1
            raise CaseConfined(f"reaches position {p} ({p + 1} visible tokens) past the QSA bound of {self.limit} "
                               f"visible tokens (run confined below the bound)")

    # --- capabilities
    def cap(self, op: str):
        """The backend's normalised declaration for ``op`` (:func:`parity.backends.base.capability`)."""
        return capability(self.caps, op)

    def refusal(self, op: str, what: str, ok=None) -> str | None:
        """Why this use of ``op`` cannot run on the backend (None when it can): ``op`` unsupported, or limited
        and ``ok(cap)`` false (outside the declared limit); ``what`` describes the use."""
        c = self.cap(op)
        if not c.usable:
            return f"{what}: needs {c.reason()}"
        if c.status == "limited" and ok is not None and not ok(c):
            return f"{what}: outside the declared limit ({c.reason()})"
        return None

    def need(self, op: str, what: str, ok=None) -> None:
        """Skip the case (:class:`CaseSkip`) when :meth:`refusal` gives a reason."""
        why = self.refusal(op, what, ok)
        if why:
            raise CaseSkip(why)

    def rollback_refusal(self, s: "Seq", n: int, what: str | None = None) -> str | None:
        """Why rolling ``s`` back by ``n`` tokens now is outside the backend's declaration (None: it is not)."""
        lv = s.last_verify
        return self.refusal("rollback", what or f"rollback {n} tokens",
                            lambda c: (c.max_tokens is None or n <= c.max_tokens) and (
                                c.within != "last_verify" or (lv is not None and lv[1] == len(s.hist) and n <= lv[0])))

    def narrow(self, reason: str) -> None:
        """Record a part of the case left out for a declared limit (the case still judges the rest; the
        result lists every narrowing, so a narrowed pass is never shown as a full one)."""
        self.narrowed.append(reason)

    # --- bookkeeping
    def _next_op(self) -> int:
        k = self.ops
        self.ops += 1
        return k

    def fail(self, op: int, what: str, divergence: str | None = None, seq: str | None = None):
        """Fail the case at operation ``op``: always raises CaseFailure(op, what, divergence, seq)."""
        raise CaseFailure(op, what, divergence, seq)

    def _compare(self, op: int, desc: str, s: Seq, logits: np.ndarray, start: int, k: int) -> None:
        """Compare ``k`` rows of ``logits`` (positions start..start+k-1 of s.hist) with the truth (KL only:
        see :func:`parity.harness.thresholds.verdict`)."""
        logits = np.asarray(logits)
        end = start + k
        if logits.shape != (k, self.sizes.vocab) or end > len(s.hist):
            self.shape_mismatch = True  # the case's KL figures then mean nothing (runner shows '-')
            want = f"({k}, {self.sizes.vocab}) = [positions, vocab_size]"
            self.fail(op, f"{desc}: seq {s.label}: backend returned logits of shape {logits.shape}, expected {want}",
                      f"backend returned logits of shape {logits.shape}, expected {want}", seq=s.label)
        ref = self.truth.logits(s.hist[:end])[start:end]
        cmp = compare_logits(ref, logits)
        self.checks += 1
        ok, why = verdict(cmp, self.th, offset=start)
        shown = cmp  # the comparison the worst-error figures report: vs the tie-resolved truth when it judged
        sticky = any(p < start for p in s.tie_pos)
        if not ok or sticky:
            # a history the backend resolved otherwise than the canonical truth is judged under its resolution
            # even where the canonical rows pass: their error would hold the resolution's effect, not the
            # backend's own (an inflated figure, or a fault offset by it)
            ok_r, why_r, resolved = self._tie_resolved(op, s, logits, start, end, cmp, why, every_row=sticky)
            if resolved is not None or not ok:
                ok, why = ok_r, why_r
                shown = resolved if resolved is not None else cmp
                if not ok and resolved is not None:
                    cmp = resolved   # the failure's positions are those of the judged comparison
        wk = shown.worst_kl()
        we = float(np.max(shown.max_abs_err)) if shown.n else 0.0
        self.worst_kl = max(self.worst_kl, wk) if np.isfinite(wk) else float("inf")
        self.worst_err = max(self.worst_err, we) if np.isfinite(we) else float("inf")
        wr = float(np.max(shown.rel_err())) if shown.n else 0.0
        self.worst_rel = max(self.worst_rel, wr) if np.isfinite(wr) else float("inf")
        flips = ~np.asarray(shown.top1, dtype=bool)
        self.top1_positions += int(flips.size)
        if ok:
            for i in range(k):
                s.rows[start + i] = logits[i]
        if not ok:
            first, worst = fault_positions(cmp, self.th, start)
            self.fault = fault_of(cmp, self.th, offset=start)
            self.fail(op, f"{desc}: seq {s.label}: {why} (first failing position {start if first is None else first}, "
                          f"worst logit error at position {worst})", seq=s.label)
        self.tie_flips += int(flips.sum())
        s.last_logits = logits[-1]

    def _tie_resolved(self, op, s: Seq, logits, start: int, end: int, cmp, why: str, every_row: bool = False):
        """A failing comparison may be tie-equivalent (parity.harness.ties): judge the rows against the truth
        under the tie resolution the backend took (its selection taps, or a search over the tied cuts of
        ``s.hist[:end]``). ``every_row``: the history before ``start`` was already resolved otherwise than the
        canonical truth (``s.tie_pos``): every row is judged under the resolution, passing canonically or not.
        Returns ``(ok, reason, comparison)``: the comparison against the tie-resolved truth when a resolution was
        found (else None; with ``every_row`` it is returned failing too, and judges the rows); a pick outside the
        tie set is the reason of a failure. The tie-equivalent positions are recorded in ``tie_equivalent``
        (reported apart from agreement) and ``s.tie_pos``."""
        model = getattr(self.truth, "model", None)
        if model is None or not hasattr(model, "selection_hook"):
            return False, why, None
        V = logits.shape[1]
        be = np.full((end, V), np.nan)
        for p, r in s.rows.items():
            if p < start:
                be[p] = r
        be[start:end] = logits
        bad = np.zeros(end, dtype=bool)
        bad[start:end] = True if every_row else position_faults(cmp, self.th)
        try:
            logged = getattr(self.truth, "logged", None)
            tj = judge_ties(model, s.hist[:end], be, bad, self.th, backend=self.be, be_sel=self._selection_log(s, end),
                            canon_log=logged(s.hist[:end]) if logged is not None else None)
        except Exception as e:  # noqa: BLE001 - the canonical verdict stands (named, so it is never silent)
            return False, f"{why} (the tie judgement raised {type(e).__name__}: {e})", None
        if tj.outside:
            return False, tj.outside + "; " + why, None
        if tj.logits is None:
            return False, why, None
        c2 = compare_logits(tj.logits[start:end], logits)
        ok2, why2 = verdict(c2, self.th, offset=start)
        if not ok2:
            return (False, why2 + " (judged under the backend's tie resolution of the earlier positions)", c2) \
                if every_row else (False, why, None)
        pos = [start + int(i) for i in np.nonzero(position_faults(cmp, self.th))[0]]
        if pos:
            self.tie_equivalent.append((op, s.label, pos))
            s.tie_pos.update(pos)
        return True, why2, c2

    def finish(self) -> None:
        """End-of-case checks (none left: every row is judged where it is compared; kept for the runner)."""

    def _recording(self, op: int, positions, seq: Seq, row: tuple[int, int] | None = None):
        """Context manager: records taps when op == record_at, or for every op of sequence ``record_all``
        (else a no-op). ``row``: ``(rank, count)`` when ``count`` sequences of one batched call are at the
        recorded position and ``seq`` is the ``rank``-th of them in batch order: a tap carries no sequence id,
        so each tap's rows at that position are matched to the sequence by that order (:func:`batch_row`)."""
        at, every = self.record_at == op, self.record_all is not None and seq.label == self.record_all
        if not (at or every):
            return contextlib.nullcontext()
        run = self

        @contextlib.contextmanager
        def cm():
            with run.be.taps(None, positions=list(positions)) as rec:
                yield rec
            arc = rec.archive()
            if row is not None and row[1] > 1:
                arc = batch_row(arc, *row)
            if at:
                run.recorded = (arc, seq.label, list(positions), list(seq.hist))
            if every:
                run.recorded_all.append((op, arc, list(positions), list(seq.hist)))
        return cm()

    def _keeping(self, s: "Seq", positions):
        """Context manager: with :attr:`keep_selections` (and taps usable, and no tap recording of this run),
        records the backend's selection taps at ``positions`` into ``s.sel``; else a no-op."""
        if not self.keep_selections or self.record_at is not None or self.record_all is not None \
                or not self.cap("taps").usable:
            return contextlib.nullcontext()
        run = self

        @contextlib.contextmanager
        def cm():
            with run.be.taps(None, include=list(SELECTION_TAPS), positions=list(positions)) as rec:
                yield rec
            arc = rec.archive()
            for name in arc.names():
                if not name.endswith(("indexer.selected_blocks", "gate.topk_ids")):
                    continue
                rows = np.asarray(arc.get(name)).astype(np.int64)
                got = s.sel.setdefault(name, {})
                for p, row in zip(np.asarray(arc.positions(name)).tolist(), rows.reshape(rows.shape[0], -1)):
                    got[int(p)] = row
        return cm()

    def _selection_log(self, s: "Seq", end: int):
        """The selections ``s``'s operations took at positions ``0..end-1`` as a
        :class:`parity.harness.floor.SelectionLog`, or None when any position is missing (the tie judge then
        reads them from one full prefill)."""
        if not s.sel:
            return None
        log = SelectionLog()
        for name, rows in s.sel.items():
            if any(p not in rows for p in range(end)):
                return None
            a = np.stack([rows[p] for p in range(end)])
            i = layer_of(name)
            (log.qsa_sel if name.endswith("indexer.selected_blocks") else log.moe_ids)[i] = a
        return log

    def _keep_returned(self, op: int, out) -> None:
        """Keep the logits the backend returned at the recorded operation (for the recorded sequence), so
        :func:`parity.harness.scenarios.locate.locate` can tell a fault after the last tap (in the returned logits)."""
        if self.record_at == op:
            self.recorded_out = np.array(out, copy=True)

    def check(self, cond: bool, what: str, divergence: str | None = None) -> None:
        """A non-logit expectation (counted as a check)."""
        op = self._next_op()
        self.checks += 1
        if not cond:
            self.fail(op, what, divergence)

    # --- operations
    def plan(self, *histories: Sequence[int]) -> None:
        """Declare token histories the case will build (one truth forward each, reused by every step)."""
        for h in histories:
            self.truth.prime(list(h))

    def new(self, label: str) -> Seq:
        """A new tracked sequence labelled ``label`` on the backend."""
        s = Seq(label, self.be.new_sequence())
        self.seqs.append(s)
        return s

    def free(self, s: Seq) -> None:
        """Free sequence ``s`` on the backend and stop tracking it."""
        self.be.free(s.h)
        if s in self.seqs:
            self.seqs.remove(s)

    def _segment(self, s: Seq, ids: Sequence[int], call, d_of):
        """Run one multi-token backend call on ``s`` (``call(handle, ids)``), recording its taps, and check
        the returned logits ``[len(ids), V]`` against the truth and the position afterwards."""
        self._confine(s, len(ids))
        op = self._next_op()
        ids = [int(t) for t in ids]
        start = len(s.hist)
        s.hist.extend(ids)
        d = d_of(start)
        with self._recording(op, range(start, start + len(ids)), s), self._keeping(s, range(start, start + len(ids))):
            out = call(s.h, ids)
        self._keep_returned(op, out)
        self._compare(op, d, s, out, start, len(ids))
        self._check_position(op, s, d)
        return np.asarray(out)

    def prefill(self, s: Seq, ids: Sequence[int], chunk_size: int | None = None, desc: str | None = None):
        """Prefill ``s`` with ``ids`` (optionally in chunks) and check the returned logits ``[len(ids), V]``
        against the truth and the backend's position afterwards; returns the logits.

        Raises:
            CaseFailure: a wrong shape, a disagreement with the truth, or a wrong position.
        """
        n = len(ids)
        call = lambda h, t: owned(self.be.prefill(h, t, chunk_size=chunk_size))  # noqa: E731
        bp = self.cap("batched_prefill")
        if chunk_size:
            self.need("batched_prefill", f"prefill {n} tokens in chunks of {chunk_size}",
                      lambda c: c.max_tokens is None or min(chunk_size, n) <= c.max_tokens)
        elif n > 1 and (not bp.usable or (bp.max_tokens is not None and n > bp.max_tokens)):
            # narrowed: a backend without (or limited in) multi-token prefill gets the prompt one token at a time
            call = lambda h, t: np.concatenate([owned(self.be.decode([h], [x])) for x in t])  # noqa: E731
            desc = desc or f"prefill {n} tokens one at a time ({bp.reason()})"
        self.current_op = "batched_prefill"
        return self._segment(s, ids, call,
                             lambda start: desc or f"prefill {n} tokens at position {start}"
                             + (f" in chunks of {chunk_size}" if chunk_size else ""))

    def decode(self, seqs: Sequence[Seq], ids: Sequence[int], desc: str | None = None):
        """Decode ``ids[i]`` on ``seqs[i]`` as one batch and check each row of the returned logits ``[B, V]``
        and each position; returns the logits.

        Raises:
            CaseFailure: a wrong shape, a disagreement with the truth, or a wrong position.
        """
        seqs = list(seqs)
        for s in seqs:
            self._confine(s, 1)
        op = self._next_op()
        ids = [int(t) for t in ids]
        starts = [len(s.hist) for s in seqs]
        for s, t in zip(seqs, ids):
            s.hist.append(t)
        d = desc or f"decode batch of {len(seqs)}"
        every = self.record_all is not None and len(seqs) > 1 and any(s.label == self.record_all for s in seqs)
        bd = self.cap("batched_decode")
        narrow = len(seqs) > 1 and (not bd.usable or (bd.max_tokens is not None and len(seqs) > bd.max_tokens))
        self.current_op = "batched_decode"
        if narrow and self.unbatch_at != op and self.record_at != op:
            d += f" (one sequence at a time: {bd.reason()})"
        if self.unbatch_at == op or narrow or (self.record_at == op and len(seqs) > 1 and not self.record_batched) \
                or every:
            rows = []
            for s, t, st in zip(seqs, ids, starts):
                if (self.record_at == op and s.label == self.record_seq) or s.label == self.record_all:
                    with self._recording(op, [st], s):
                        rows.append(owned(self.be.decode([s.h], [t]))[0])
                    self._keep_returned(op, rows[-1][None])
                else:
                    rows.append(owned(self.be.decode([s.h], [t]))[0])
            out = np.stack(rows)
            if not narrow or self.unbatch_at == op or self.record_at == op:
                d += " (replayed one sequence at a time)"
        else:
            i = next((j for j, s in enumerate(seqs) if s.label == self.record_seq), 0)
            keep = self._keeping(seqs[0], [starts[0]]) if len(seqs) == 1 else contextlib.nullcontext()
            # sequences of the batch at the same position (a fork's parent and child) emit rows at one position:
            # the recorded one's rows are found by its rank among them
            same = [j for j, st in enumerate(starts) if st == starts[i]]
            with self._recording(op, [starts[i]], seqs[i], row=(same.index(i), len(same))), keep:
                out = owned(self.be.decode([s.h for s in seqs], ids))
            self._keep_returned(op, out[i:i + 1])
        if out.ndim != 2 or out.shape[0] != len(seqs):
            self.shape_mismatch = True
            self.fail(op, f"{d}: backend returned logits of shape {out.shape}, expected ({len(seqs)}, "
                          f"{self.sizes.vocab}) = [sequences, vocab_size]", "decode batch shape")
        for i, (s, st) in enumerate(zip(seqs, starts)):
            self._compare(op, d, s, out[i:i + 1], st, 1)
            self._check_position(op, s, d)
        return out

    def verify(self, s: Seq, ids: Sequence[int], desc: str | None = None):
        """Verify drafted ``ids`` on ``s`` (``forward_tokens``) and check the logits ``[len(ids), V]`` and the
        position; returns the logits.

        Raises:
            CaseFailure: a wrong shape, a disagreement with the truth, or a wrong position.
        """
        n = len(ids)
        self.need("verify", f"verify {n} drafted tokens", lambda c: c.max_tokens is None or n <= c.max_tokens)
        self.current_op = "verify"
        out = self._segment(s, ids, lambda h, t: owned(self.be.forward_tokens(h, t)),
                            lambda start: desc or f"verify {n} drafted tokens at position {start}")
        s.last_verify = (n, len(s.hist))
        return out

    def prefill_batch(self, seqs: Sequence[Seq], id_lists: Sequence[Sequence[int]], chunk_size: int | None = None,
                      desc: str | None = None):
        """Prefill ragged prompts on several sequences in one ``prefill_batch`` call and check every
        returned ``[T_i, V]`` against the truth and every position; returns the list of logits.

        Raises:
            CaseFailure: a wrong count/shape, a disagreement with the truth, or a wrong position.
        """
        seqs = list(seqs)
        lists = [[int(t) for t in ids] for ids in id_lists]
        for s, ids in zip(seqs, lists):
            self._confine(s, len(ids))
        op = self._next_op()
        starts = [len(s.hist) for s in seqs]
        for s, ids in zip(seqs, lists):
            s.hist.extend(ids)
        d = desc or (f"ragged prefill_batch of {len(seqs)} requests (lengths {[len(x) for x in lists]})"
                     + (f" in chunks of {chunk_size}" if chunk_size else ""))
        rec_i = next((i for i, s in enumerate(seqs) if s.label == self.record_seq), 0)
        pos = range(starts[rec_i], starts[rec_i] + len(lists[rec_i]))
        every = next((i for i, s in enumerate(seqs) if s.label == self.record_all), None)
        if len(seqs) > 1 and (self.unbatch_at == op or every is not None
                              or (self.record_at == op and not self.record_batched)):
            # one request per call: a tap carries no sequence id, so the rows of requests sharing positions would
            # mix in one recording (the last emit of a position wins); alone, the recorded rows are its own
            outs = []
            for i, (s, ids) in enumerate(zip(seqs, lists)):
                rec = i == (every if every is not None else rec_i) and self.unbatch_at != op
                with (self._recording(op, range(starts[i], starts[i] + len(ids)), s) if rec else _null()):
                    outs.extend(self.be.prefill_batch([s.h], [ids], chunk_size=chunk_size))
            d += " (replayed one request at a time)"
            if self.unbatch_at == op:
                self.unbatched_kind = "prefill_batch"
        else:
            if self.record_at == op and len(seqs) > 1:   # recorded AS a batch: only the positions no other
                other = set().union(*(range(st, st + len(x)) for j, (st, x) in enumerate(zip(starts, lists))
                                      if j != rec_i))    # request of the batch emits (rows cannot mix there)
                pos = [p for p in pos if p not in other]
            with self._recording(op, pos, seqs[rec_i]) if len(pos) else _null():
                outs = list(self.be.prefill_batch([s.h for s in seqs], lists, chunk_size=chunk_size))
        if len(outs) != len(seqs):
            self.fail(op, f"{d}: expected {len(seqs)} logits arrays, found {len(outs)}", "prefill_batch result count")
        if self.record_at == op and rec_i < len(outs):   # the rows of the recorded positions only
            rows = np.asarray(outs[rec_i])
            idx = [p - starts[rec_i] for p in pos]
            self._keep_returned(op, rows[idx] if rows.ndim == 2 and len(rows) == len(lists[rec_i]) else rows)
        for s, out, st, ids in zip(seqs, outs, starts, lists):
            self._compare(op, d, s, out, st, len(ids))
            self._check_position(op, s, d)
        return outs

    def fork(self, s: Seq, label: str) -> Seq:
        """``fork`` sequence ``s`` into a new tracked sequence ``label`` holding the same history; checks its
        position."""
        op = self._next_op()
        c = Seq(label, self.be.fork(s.h))
        c.hist = list(s.hist)
        c.last_logits = s.last_logits
        c.rows, c.tie_pos = dict(s.rows), set(s.tie_pos)   # the same history, resolved the same way
        c.sel = {name: dict(rows) for name, rows in s.sel.items()}
        self.seqs.append(c)
        self._check_position(op, c, f"fork of {s.label}")
        return c

    def check_last_logits(self, s: Seq, desc: str):
        """The backend's held logits of ``s``'s last position (``last_logits``: what a full prefix-cache hit
        samples its first token from) must match the truth's row at that position (KL and top-1 as every
        other row). The failure names the held logits directly: they come from no forward to tap.

        Raises:
            CaseFailure: the held row disagrees with the truth, or has the wrong shape.
        """
        op = self._next_op()
        row = np.asarray(self.be.last_logits(s.h))
        p = len(s.hist) - 1
        try:
            self._compare(op, desc, s, row.reshape(1, -1) if row.ndim == 1 else row, p, 1)
        except CaseFailure as f:
            f.divergence = (f"held last-position logits (restored with the snapshot) at position {p}: they differ "
                            f"from the truth there; no forward produced them, so no tap can")
            raise

    def rollback(self, s: Seq, n: int, desc: str | None = None):
        """Roll ``s`` back by ``n`` tokens and check its position. Raises CaseFailure on a wrong position."""
        d = desc or f"rollback {n} tokens"
        why = self.rollback_refusal(s, n, d)
        if why:
            raise CaseSkip(why)
        op = self._next_op()
        self.current_op = "rollback"
        s.last_verify = None
        self.be.rollback(s.h, n)
        if n:
            del s.hist[-n:]
            s.tie_pos = {p for p in s.tie_pos if p < len(s.hist)}
        self._check_position(op, s, d)

    def snapshot(self, s: Seq) -> Snap:
        """Snapshot ``s``: the backend's snapshot plus a copy of the history it holds."""
        self.need("snapshot", f"snapshot of seq {s.label}")
        self._next_op()
        self.current_op = "snapshot"
        return Snap(self.be.snapshot(s.h), list(s.hist), s, frozenset(p for p in s.tie_pos if p < len(s.hist)))

    def restore(self, s: Seq, snap: Snap, desc: str | None = None):
        """Restore ``snap`` into ``s`` (history included) and check the position. Raises CaseFailure on a wrong
        position."""
        if snap.src is not None and snap.src is not s:
            self.need("fork", f"restore a snapshot of seq {snap.src.label} into seq {s.label}")
        op = self._next_op()
        self.current_op = "fork" if snap.src is not None and snap.src is not s else "snapshot"
        self.be.restore(s.h, snap.obj)
        s.last_verify = None
        s.sel = {}  # the restored positions' selections were taken on another history: the tie judge re-reads them
        s.hist = list(snap.hist)
        s.tie_pos = set(snap.tie_pos)
        self._check_position(op, s, desc or "restore")

    def _check_position(self, op: int, s: Seq, desc: str):
        pos = self.be.position(s.h)
        self.checks += 1
        if pos != len(s.hist):
            self.fail(op, f"{desc}: seq {s.label}: position {pos}, expected {len(s.hist)} (KV length)",
                      f"sequence length (KV length) {pos} != {len(s.hist)}")

    def expect_refusal(self, fn: Callable[[], Any], what: str):
        """``fn`` must raise a :class:`UserError` (a clear refusal); anything else fails the case."""
        op = self._next_op()
        self.checks += 1
        try:
            fn()
        except UserError:
            return
        except Exception as e:  # a crash is not a refusal
            self.fail(op, f"{what}: expected a clear refusal (UserError), found {type(e).__name__}: {e}",
                      f"{what}: crashed instead of refusing")
        self.fail(op, f"{what}: expected a refusal, found it silently accepted", f"{what}: silently accepted")

    def compare_state(self, a: Seq, b: Seq, desc: str, rel: float | None = None):
        """When the backend exposes ``state_arrays``: every state array of ``a`` equals ``b``'s (a run that
        never saw the rejected tokens); integer arrays (n-gram context) exactly, float arrays to
        ``max|a - b| <= rel * max|b|``. Tolerance: both are float32 paths of one backend whose histories
        were built by different op sequences (verify + rollback vs one prefill), so they agree to
        accumulation order: ~1e-5 of the array's scale after 6 layers on the tiny fixtures (measured
        3e-5 worst element vs 5 max); 1e-4 leaves margin while any stale state (a forgotten carry, an
        untruncated cache) is an O(1) relative difference. bf16/fp8 backends get 2e-2 (8 mantissa bits:
        ~4e-3 rounding per op, compounded over the layers), still far below a stale state's O(1)."""
        if rel is None:
            rel = 2e-2 if getattr(self.be, "precision", "float32") in ("bf16", "fp8") else 1e-4
        if not self.cap("state_arrays").usable:
            return
        op = self._next_op()
        sa, sb = self.be.state_arrays(a.h), self.be.state_arrays(b.h)
        self.checks += 1
        for name in sorted(set(sa) | set(sb), key=state_order):  # the first stale array upstream is named
            if name not in sa or name not in sb:
                self.fail(op, f"{desc}: state {name} present in only one of {a.label}, {b.label}", f"state {name}")
            x, y = np.asarray(sa[name]), np.asarray(sb[name])
            if x.shape != y.shape:
                self.fail(op, f"{desc}: state {name}: shape {x.shape} vs {y.shape} ({a.label} vs {b.label})",
                          f"state {name} (shape)")
            if x.dtype.kind in "iub":
                same = np.array_equal(x, y)
            else:
                x64, y64 = x.astype(np.float64), y.astype(np.float64)
                scale = max(float(np.max(np.abs(y64))) if y64.size else 0.0, 1e-30)
                same = bool(np.all(np.isfinite(x64))) and (not x64.size or
                                                           float(np.max(np.abs(x64 - y64))) <= rel * scale)
            if not same:
                self.fail(op, f"{desc}: state {name} of {a.label} differs from {b.label}", f"state {name}")

    def close(self):
        """Free every tracked sequence, ignoring errors from the backend."""
        for s in list(self.seqs):
            try:
                self.be.free(s.h)
            except Exception:
                pass
        self.seqs.clear()
