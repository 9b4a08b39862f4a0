"""Logit-KL metrics and the KL harness (``qwen4exp kl``).

The metrics compare two backends' next-token distributions position by position. They work on
plain arrays (``[T, V]`` logits, float32 or float64) and are computed in float64 so the metric
itself adds no noise above the backends'. Every threshold is a multiple of a precision floor MEASURED on
the model and prompts of the run (:mod:`parity.harness.floor`), and logit errors are judged relative to the
model's logit scale (:func:`logit_scale`): no constant depends on one checkpoint. The harness
(:func:`run_kl`) runs both backends over a prompt set, judges the prefill rows and the greedy decode rows,
and computes three controls in the same run:

* **determinism** -- backend b run twice on every prompt: bitwise equal when b declares ``deterministic``;
  otherwise its run-to-run spread is measured and must be within the tolerance (else INCONCLUSIVE);
* **precision floor** -- the floor that sets the thresholds (float32 vs float64 reference, or the rounding
  reference of b's precision); a tolerance above :data:`USEFUL_FAULT_REL` makes the run INCONCLUSIVE;
* **negative control** -- b with one weight perturbed, sized from the floor to move the logits by
  :data:`CONTROL_MARGIN` x the tolerance with every selection forced to the truth's picks (a continuous
  effect), must be flagged (else INCONCLUSIVE, never a backend FAIL).

Logit errors are judged with each row's common offset removed (:func:`offset_free_error`): softmax ignores it.

Formula source: standard definitions (KL(P||Q) = sum_v P_v (log P_v - log Q_v)); the distribution is
the softmax of the LM-head logits as in the official ``Qwen4ExpForCausalLM.forward`` (modeling_qwen4_exp.py).
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from reference.errors import InputError

__all__ = ["log_softmax", "kl_per_position", "summarize", "compare_logits", "LogitComparison", "logit_scale",
           "offset_free_error", "rerun_spread",
           "greedy_agreement", "KLThresholds", "thresholds_for", "verdict", "position_faults", "run_kl", "KLReport",
           "FLOOR_MAX_KL", "FLOOR_MULTIPLE", "PERCENTILES", "PASS", "FAIL", "INCONCLUSIVE"]

#: the three verdicts a judgement can reach (``qwen4exp`` exit codes 0 / 1 / 3: parity/cli)
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"

PERCENTILES = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9), ("max", 100.0))

# Kept for callers of the former absolute floor check; the harness now derives every bound from a measured floor.
FLOOR_MAX_KL = 1e-6


def _check_logits(name: str, x) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise InputError(f"{name}: expected logits of shape [T, V], found shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise InputError(f"{name}: expected float logits, found dtype {a.dtype}")
    return a


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64.

    Args:
        logits: ``[T, V]`` (or ``[V]``) float32/float64.
    Returns:
        ``[T, V]`` float64 log-probabilities. Non-finite inputs propagate (they are a fault to report).
    """
    x = _check_logits("logits", logits).astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl_per_position(logits_p: np.ndarray, logits_q: np.ndarray) -> np.ndarray:
    """KL(P || Q) per position, P = softmax(logits_p), Q = softmax(logits_q).

    Args:
        logits_p, logits_q: ``[T, V]`` float logits of the same shape.
    Returns:
        ``[T]`` float64, >= 0 (clipped at 0 against rounding); inf/nan where a row is non-finite.
    Raises:
        InputError: shapes differ or are not ``[T, V]``.
    """
    p = _check_logits("logits_p", logits_p)
    q = _check_logits("logits_q", logits_q)
    if p.shape != q.shape:
        raise InputError(f"logits: expected equal shapes [T, V], found {p.shape} and {q.shape}")
    lp, lq = log_softmax(p), log_softmax(q)
    kl = _kl_rows(lp, lq)
    return np.where(np.isnan(kl), np.nan, np.maximum(kl, 0.0))


def _kl_rows(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """``[T]`` sum_v P_v (log P_v - log Q_v) from log-probabilities, with the convention 0 log 0 = 0: a token P
    gives probability 0 (a -inf logit) adds nothing, so a row truncated to -inf by one side gives KL = inf in
    the direction that sees the truncation, not nan (nan only from a nan logit)."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lp)
        terms = np.where(p == 0.0, 0.0, p * (lp - lq))
    return np.sum(terms, axis=-1)


def kl_rounding_floor(vocab: int) -> float:
    """The float64 rounding floor of :func:`_kl_rows` on ``[., vocab]`` rows of log-probabilities from
    :func:`log_softmax`: a KL at or below it cannot be told from 0 (float64, logits units squared: none).

    Why this formula: each log-probability is ``lp_v = z_v - lse`` with ``lse = log sum_u exp(z_u)``. Its float64
    absolute error is at most ``eps64 * (|lp_v| + |lse| + ceil(log2 V) + 2)``: one rounding of the subtraction
    (relative to ``|lp_v|``), one of the log (relative to ``|lse|``), the pairwise sum of V exp terms (relative
    error ``<= ceil(log2 V) eps64``, which the log turns into an absolute one) and the exp itself. Weighted by
    ``p_v`` and summed, ``sum_v p_v |lp_v|`` is the entropy ``<= ln V`` and ``0 <= lse <= ln V`` (``z <= 0``, its
    max 0), so ``sum_v p_v (lp_v - lq_v)`` carries an error of at most ``eps64 * (2 ln V + ceil(log2 V) + 2)``
    from each side's log-probabilities: twice that in all (the final sum of the V terms adds a relative
    error of the KL itself, negligible). A distribution near uniform -- a model with a small logit scale --
    has KL values of this size from rounding alone (e.g. 8e-16 for V = 512), so a threshold
    ``(tol_rel * scale) ** 2`` below it would fail a correct backend; the logit rule still judges such rows.

    Args:
        vocab: V >= 1.
    """
    v = max(int(vocab), 1)
    eps = float(np.finfo(np.float64).eps)
    return 2.0 * eps * (2.0 * np.log(v) + np.ceil(np.log2(v)) + 2.0)


def summarize(values: np.ndarray) -> dict:
    """mean, median, p90, p99, p99.9, max of a 1-D array (float64; nan-propagating: a nan is a fault; +inf
    entries give inf where they reach the percentile, never nan)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        return {k: float("nan") for k, _ in PERCENTILES}
    out = {}
    srt = np.sort(v)
    for key, q in PERCENTILES:
        if q is None:
            out[key] = float(np.mean(v))
            continue
        # linear interpolation between order statistics (numpy's default), written out so that a step towards
        # +inf (a KL of a -inf logit) is inf, never the nan of inf - inf
        pos = q / 100.0 * (v.size - 1)
        lo, hi = int(np.floor(pos)), int(np.ceil(pos))
        frac = pos - lo
        if np.isposinf(srt[hi]) and (frac > 0 or lo == hi):
            out[key] = float("inf")
        else:
            out[key] = float(srt[lo] + (srt[hi] - srt[lo]) * frac) if hi != lo else float(srt[lo])
    if np.isnan(v).any():
        out = {k: float("nan") for k in out}
    return out


def _topk_sets(logits: np.ndarray, k: int) -> np.ndarray:
    """``[T, k]`` token ids of each row's ``k`` largest logits, value descending then lower token id first (the
    canonical tie-break of the project): a stable argsort's first ``k``. Rows whose ``k``-th value is not tied
    with an excluded one and that hold no NaN take a partition (O(V), not O(V log V): prefills past 32768
    positions compare ``[T, V]`` rows); every other row the stable sort itself."""
    T, V = logits.shape
    k = min(k, V)
    x = -np.asarray(logits)
    if k >= V or V <= 64 or T == 0:
        return np.argsort(x, axis=-1, kind="stable")[:, :k]
    part = np.argpartition(x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, part, -1)
    with np.errstate(invalid="ignore"):
        kth = vals.max(axis=-1)
        ok = ((x <= kth[:, None]).sum(axis=-1) == k) & ~np.isnan(x).any(axis=-1)
    out = np.take_along_axis(part, np.lexsort((part, vals), axis=-1), -1)  # value, then token id
    bad = np.nonzero(~ok)[0]
    if bad.size:
        out[bad] = np.argsort(x[bad], axis=-1, kind="stable")[:, :k]
    return out


def logit_scale(logits: np.ndarray) -> np.ndarray:
    """The model's logit scale per position: the standard deviation of each row over the vocabulary (float64).

    Why the std: an offset common to all logits changes nothing (softmax is shift-invariant), so the scale
    must ignore the mean; what an error does to the distribution is measured against the spread of the
    logits (KL ~ Var_P(delta)/2, and an argmax flips only where two logits are closer than twice the error).
    A checkpoint with logits of max |logit| 0.2 has a scale ~0.05 and an error of 5e-3 there is 10% of it,
    however small it is in absolute terms. A row of equal logits has scale 0: it is floored at the smallest
    positive float so any error on it is judged infinite (an engine must reproduce a uniform row exactly
    to rounding, and a measured floor is never exactly 0 there either).
    """
    x = _check_logits("logits", logits).astype(np.float64)
    with np.errstate(invalid="ignore"):
        sd = np.std(x, axis=-1)
    return np.where(np.isfinite(sd), np.maximum(sd, np.finfo(np.float64).tiny), np.nan)


@dataclass
class LogitComparison:
    """Per-position comparison of backend a (the truth) against backend b over one set of positions.

    All arrays are ``[T]``: ``kl_ab`` = KL(P_a||P_b), ``kl_ba`` = KL(P_b||P_a), ``top1`` (bool),
    ``top5_overlap`` (fraction in [0, 1]), ``top_prob_diff`` = P_b(t) - P_a(t) for a's top token t,
    ``max_abs_err`` = max_v |logit_b - logit_a - offset| (the logit error once the row's common offset is
    removed: :func:`offset_free_error`), ``scale`` = :func:`logit_scale` of a's logits,
    ``top1_gap`` = logit_a[a's argmax] - logit_a[b's argmax] (0 where they agree: how far from a tie a flip is),
    ``offset`` = the per-row offset removed (mean over the vocabulary of logit_b - logit_a; softmax ignores it),
    ``kl_floor`` = the float64 rounding floor of the KL values (:func:`kl_rounding_floor` of the vocabulary size;
    0 when the comparison was built without logits, i.e. no floor known).
    """

    kl_ab: np.ndarray
    kl_ba: np.ndarray
    top1: np.ndarray
    top5_overlap: np.ndarray
    top_prob_diff: np.ndarray
    max_abs_err: np.ndarray
    scale: np.ndarray = None
    top1_gap: np.ndarray = None
    offset: np.ndarray = None
    kl_floor: np.ndarray = None

    def __post_init__(self):
        n = np.asarray(self.kl_ab).shape
        if self.scale is None:
            self.scale = np.ones(n)
        if self.top1_gap is None:
            self.top1_gap = np.zeros(n)
        if self.offset is None:
            self.offset = np.zeros(n)
        if self.kl_floor is None:
            self.kl_floor = np.zeros(n)

    @staticmethod
    def concat(items: Sequence["LogitComparison"]) -> "LogitComparison":
        """Concatenate several comparisons position-wise (an empty one when ``items`` is empty)."""
        if not items:
            z = np.zeros(0)
            return LogitComparison(z, z, z.astype(bool), z, z, z, z, z, z, z)
        return LogitComparison(*[np.concatenate([getattr(i, f.name) for i in items])
                                 for f in dataclasses.fields(LogitComparison)])

    def select(self, idx) -> "LogitComparison":
        """The comparison restricted to positions ``idx`` (a slice, index array or bool mask)."""
        return LogitComparison(*[np.asarray(getattr(self, f.name))[idx] for f in dataclasses.fields(LogitComparison)])

    @property
    def n(self) -> int:
        """Number of positions compared."""
        return int(self.kl_ab.size)

    def rel_err(self) -> np.ndarray:
        """``[T]`` worst logit error relative to the logit scale: ``max_abs_err / scale`` (nan propagates)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(self.max_abs_err, dtype=np.float64) / np.asarray(self.scale, dtype=np.float64)

    def offset_rel(self) -> float:
        """The largest per-row offset removed (:attr:`offset`), relative to the row's logit scale (0 when no
        position; nan rows skipped): a figure, never a fault (softmax ignores a per-row offset)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.abs(np.asarray(self.offset, dtype=np.float64)) / np.asarray(self.scale, dtype=np.float64)
        r = r[np.isfinite(r)]
        return float(np.max(r)) if r.size else 0.0

    def summary(self) -> dict:
        """JSON-ready summary: KL stats both directions, top-1 agreement, top-5 overlap, prob-diff RMS/max,
        worst logit error (absolute and relative to the logit scale, per-row offset removed) and the largest
        per-row offset removed (absolute and relative)."""
        n = self.n
        rel = self.rel_err()
        off = np.abs(np.asarray(self.offset, dtype=np.float64))
        off = off[np.isfinite(off)]
        return {
            "positions": n,
            "kl_ab": summarize(self.kl_ab),
            "kl_ba": summarize(self.kl_ba),
            "top1_agreement": float(np.mean(self.top1)) if n else float("nan"),
            "top5_overlap": float(np.mean(self.top5_overlap)) if n else float("nan"),
            "top_prob_diff_rms": float(np.sqrt(np.mean(self.top_prob_diff ** 2))) if n else float("nan"),
            "top_prob_diff_max": float(np.max(np.abs(self.top_prob_diff))) if n else float("nan"),
            "max_logit_err": float(np.max(self.max_abs_err)) if n else float("nan"),
            "max_logit_err_rel": (float("nan") if np.isnan(rel).any() else float(np.max(rel))) if n else float("nan"),
            "logit_scale_median": float(np.median(self.scale)) if n else float("nan"),
            "max_removed_offset": float(np.max(off)) if off.size else 0.0,
            "max_removed_offset_rel": self.offset_rel(),
        }

    def worst_kl(self) -> float:
        """max over positions of max(KL(a||b), KL(b||a)); nan/inf when any row is non-finite."""
        if not self.n:
            return 0.0
        both = np.maximum(self.kl_ab, self.kl_ba)
        return float(np.nan) if np.isnan(both).any() else float(np.max(both))


def offset_free_error(logits_a: np.ndarray, logits_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the logit error once the row's common offset is removed: ``(max_v |b - a - c|, c)``, both ``[T]``
    float64, with ``c`` = the mean over the vocabulary of ``b - a`` (the offset minimising the squared error).

    Softmax ignores a per-row offset (logits + 3, or log-probabilities returned instead of logits, give the same
    distribution), so such a shift is no error; any error that differs across the entries of a row remains (its
    residual is at least half its range). Entries not finite on both sides: ``c`` is taken over the finite
    common entries; equal infinities (both -inf: a token both sides exclude) agree; one side finite and the
    other infinite is an infinite error; a nan on either side gives nan. ``a``, ``b``: ``[T, V]`` float arrays
    of equal shape (callers check).
    """
    a = np.asarray(logits_a, dtype=np.float64)
    b = np.asarray(logits_b, dtype=np.float64)
    common = np.isfinite(a) & np.isfinite(b)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(common, b - a, 0.0)
        cnt = np.sum(common, axis=-1)
        c = np.sum(d, axis=-1) / np.maximum(cnt, 1)
        res = np.abs(d - c[..., None])
        agree_inf = ~common & (a == b)
        res = np.where(common | agree_inf, np.where(common, res, 0.0),
                       np.where(np.isnan(a) | np.isnan(b), np.nan, np.inf))
    return np.max(res, axis=-1), c


def rerun_spread(first: np.ndarray, second: np.ndarray, truth: np.ndarray) -> float:
    """A backend's run-to-run spread on one prompt: max over positions of :func:`offset_free_error` between its
    two runs' ``[T, V]`` logits, relative to the truth's :func:`logit_scale` (the unit every logit error is
    judged in). inf when the two runs' shapes differ or a row is not finite on both runs alike."""
    x, y, t = np.asarray(first), np.asarray(second), np.asarray(truth)
    if x.shape != y.shape or x.ndim not in (1, 2) or x.size == 0:
        return float("inf")
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    err, _ = offset_free_error(x, y)
    sc = logit_scale(t) if t.reshape(-1, t.shape[-1]).shape == x.shape else logit_scale(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = err / sc
    return float(np.max(rel)) if np.isfinite(rel).all() else float("inf")


def compare_logits(logits_a: np.ndarray, logits_b: np.ndarray) -> LogitComparison:
    """Compare two ``[T, V]`` logit arrays position by position (see :class:`LogitComparison`; a is the truth).
    The logit error is judged after removing each row's common offset (:func:`offset_free_error`).

    Raises:
        InputError: shapes differ or are not 2-D float arrays.
    """
    a = _check_logits("logits_a", logits_a)
    b = _check_logits("logits_b", logits_b)
    if a.shape != b.shape:
        raise InputError(f"logits: expected equal shapes [T, V], found {a.shape} (a) and {b.shape} (b)")
    la, lb = log_softmax(a), log_softmax(b)
    pa, pb = np.exp(la), np.exp(lb)
    kl_ab, kl_ba = _kl_rows(la, lb), _kl_rows(lb, la)
    kl_ab = np.where(np.isnan(kl_ab), np.nan, np.maximum(kl_ab, 0.0))
    kl_ba = np.where(np.isnan(kl_ba), np.nan, np.maximum(kl_ba, 0.0))
    ta, tb = _topk_sets(a, 1)[:, 0], _topk_sets(b, 1)[:, 0]
    t5a, t5b = _topk_sets(a, 5), _topk_sets(b, 5)
    k = t5a.shape[1]
    overlap = np.array([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(t5a, t5b)], dtype=np.float64)
    rows = np.arange(a.shape[0])
    diff = pb[rows, ta] - pa[rows, ta]
    a64 = a.astype(np.float64)
    err, off = offset_free_error(a64, b)
    with np.errstate(invalid="ignore"):
        gap = a64[rows, ta] - a64[rows, tb]
    return LogitComparison(kl_ab, kl_ba, ta == tb, overlap, diff, err, logit_scale(a), gap, off,
                           np.full(a.shape[0], kl_rounding_floor(a.shape[1])))


def greedy_agreement(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> int:
    """Length of the common prefix of two greedy continuations."""
    n = 0
    for x, y in zip(tokens_a, tokens_b):
        if int(x) != int(y):
            break
        n += 1
    return n


#: how many times its floor a backend's relative logit error may be, per declared precision.
#: float64/float32: a correct float32 engine computes the same function with the same unit roundoff as the
#: float32 reference, so its error against float64 is of the floor's order; only the summation order (GEMM
#: tiling, chunked scans, fused kernels) changes the constant, and the float32 floor is already the envelope
#: over several orders (parity.harness.floor.FLOOR_ORDERS). Measured against the float32 truth: the official
#: model on CPU 0.12..0.28 of 8x that floor on the bundled fixtures, the engine CPU path 0.2-0.6x the floor on
#: the verdict-matrix models; 8x keeps a factor >= 2 (a correct engine may use half the limit) while a fault
#: of 1e-3 of max |logit| (about 4e-3 of the logit scale) stays ~50x above an 8e-5 limit.
#: Reduced precision: the floor rounds at every store point of a correct engine (floor.STORE_KINDS), so a correct
#: engine rounding at those points or fewer is at most about the floor; the max over positions of a sum of
#: many independent roundings fluctuates by < 2x between two such engines; 4x covers that with a factor 2.
FLOOR_MULTIPLE = {"float64": 8.0, "float32": 8.0, "bf16": 4.0, "fp16": 4.0, "fp8": 4.0}
#: the nominal floor's format per declared precision (only without a measured floor)
FLOOR_OF = {"float64": "float32", "float32": "float32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
#: used ONLY when no floor was measured (a direct call of :func:`thresholds_for` without one): the floor is
#: then assumed to be the format's unit roundoff times this growth (sqrt of the summed lengths times the
#: depth of a small model). Every harness entry point (run_kl, run_parity, the scenario runner under
#: run_parity) measures the floor instead; reports say which was used.
NOMINAL_GROWTH = 128.0


@dataclass(frozen=True)
class KLThresholds:
    """Pass thresholds of one backend on one model (docs/parity.md, "Thresholds").

    ``tol_rel``: the largest per-position logit error allowed, relative to the logit scale
    (:func:`logit_scale`): ``max_v |truth - backend| <= tol_rel * scale`` at every position. The KL and top-1
    rules follow from it (see :func:`verdict`). ``floor_rel``: the floor it is a multiple of; ``multiple``:
    :data:`FLOOR_MULTIPLE`; ``precision``: the backend's declared precision; ``source``: 'measured ...' or
    'nominal ...'. ``max_kl`` / ``near_tie_rel`` are derived (per unit scale) for display.
    """

    tol_rel: float
    floor_rel: float = float("nan")
    multiple: float = float("nan")
    precision: str = "float32"
    source: str = "nominal"
    score_rel: float = float("nan")   # the floor's selection-score floor (sets the tie band, parity.harness.ties)
    #: a taps.diff.Profile measured on this model (parity.harness.floor.tap_floor_profile), used by tap-diff
    #: localisation; None: the bundled profile of the precision
    tap_profile: object = field(default=None, compare=False, repr=False)

    @property
    def max_kl(self) -> float:
        """The KL bound at unit logit scale: ``tol_rel ** 2`` (per position it is ``(tol_rel * scale) ** 2``)."""
        return self.tol_rel ** 2

    @property
    def near_tie_rel(self) -> float:
        """The near-tie gap relative to the logit scale: ``2 * tol_rel``."""
        return 2.0 * self.tol_rel

    def to_json(self) -> dict:
        """JSON-ready fields."""
        return {"tol_rel": self.tol_rel, "floor_rel": self.floor_rel, "multiple": self.multiple,
                "precision": self.precision, "source": self.source, "score_rel": self.score_rel,
                "max_kl_at_unit_scale": self.max_kl,
                "near_tie_rel": self.near_tie_rel}


def thresholds_for(precision: str, floor=None) -> KLThresholds:
    """The :class:`KLThresholds` of a backend precision ('float64', 'float32', 'bf16', 'fp16', 'fp8').

    Args:
        floor: a :class:`parity.harness.floor.Floor` measured on this model (float32 floor for float
            precisions, the precision's rounding floor otherwise), or None (nominal, see :data:`NOMINAL_GROWTH`).
            A measured floor below the format's unit roundoff is raised to it.
    Raises:
        InputError: unknown precision, or a floor of the wrong kind.
    """
    from parity.harness.floor import UNIT_ROUNDOFF
    if precision not in FLOOR_MULTIPLE:
        raise InputError(f"backend precision: expected one of {sorted(FLOOR_MULTIPLE)}, found {precision!r}")
    if floor is None:
        kind = FLOOR_OF[precision]
        mult = FLOOR_MULTIPLE[kind]
        fr = UNIT_ROUNDOFF[kind] * NOMINAL_GROWTH
        return KLThresholds(mult * fr, fr, mult, precision, f"nominal (no floor measured: {kind} unit roundoff "
                                                            f"x {NOMINAL_GROWTH:g})", fr)
    # the floor's own kind decides the multiple: a float32 floor (the backend rounds no activation store) gets
    # the float32 multiple whatever the weight precision, a rounding floor the reduced-precision one
    rounded = bool(floor.stores)
    fmt = floor.precision.split("[")[0] if rounded else "float32"
    mult = FLOOR_MULTIPLE.get(fmt, FLOOR_MULTIPLE["bf16"]) if rounded else FLOOR_MULTIPLE["float32"]
    fr = max(float(floor.logit_rel), UNIT_ROUNDOFF["float32"])
    return KLThresholds(mult * fr, fr, mult, precision,
                        f"measured ({floor.precision} floor {fr:.3g} of the logit scale over {floor.positions} "
                        f"positions)", max(float(floor.score_rel), UNIT_ROUNDOFF["float32"]))


def top1_flips(top1, top1_gap, scale, th: KLThresholds) -> np.ndarray:
    """``[T]`` bool: the kl row's near-tie rule -- a top-1 disagreement (``top1`` False) is a fault only where the
    truth's gap between its argmax and the backend's pick (``top1_gap``, logits units) exceeds the near-tie band
    ``2 * tol_rel * scale`` (an error of at most tol on each of the two logits can flip exactly those)."""
    tol = th.tol_rel * np.asarray(scale, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return ~np.asarray(top1, dtype=bool) & (np.asarray(top1_gap, dtype=np.float64) > 2.0 * tol)


def pick_faults(truth_rows, picks, th: KLThresholds):
    """The kl row's top-1 rule (:func:`top1_flips`) for tokens a backend picked greedily: ``picks[i]`` against
    the truth's argmax of ``truth_rows[i]`` (value descending, lower token id first), a disagreement failing
    only outside the near-tie band ``2 * tol_rel * scale`` (an exact or near tie at the top may be broken
    either way). The one implementation behind the generation path's ``decode_greedy`` tokens and the MTP
    cases' drafts and speculative greedy tokens.

    Args:
        truth_rows: ``[n, V]`` the truth's logits of the rows the tokens were picked from.
        picks: ``[n]`` token ids in ``[0, V)`` (the caller checks the range).
    Returns:
        ``(faults [n] bool, best [n] int64, gap [n] float64, band [n] float64)``: the picks outside the band, the
        truth's argmax, its logit minus the pick's, and the band ``2 * tol_rel * scale``. A pick with ``gap`` 0..band
        that differs from ``best`` is tie-equivalent.
    """
    truth_rows = np.asarray(truth_rows)
    picks = np.asarray(picks, dtype=np.int64).reshape(-1)
    r = np.arange(len(picks))
    best = _topk_sets(truth_rows, 1)[:, 0] if len(picks) else np.zeros(0, np.int64)
    with np.errstate(invalid="ignore"):
        gap = truth_rows[r, best].astype(np.float64) - truth_rows[r, picks]
    scale = logit_scale(truth_rows) if len(picks) else np.zeros(0)
    return (top1_flips(best == picks, gap, scale, th), best.astype(np.int64), gap,
            2.0 * th.tol_rel * np.asarray(scale, dtype=np.float64))


def kl_bound(cmp: LogitComparison, th: KLThresholds) -> np.ndarray:
    """``[T]`` float64: the KL rule's bound per position, ``max((tol_rel * scale) ** 2, kl_floor)`` -- the
    second-order bound of :func:`verdict`, never below the float64 rounding floor of the KL computation itself
    (:func:`kl_rounding_floor`: on a model with a small logit scale ``(tol_rel * scale) ** 2`` falls below it)."""
    tol = th.tol_rel * np.asarray(cmp.scale, dtype=np.float64)
    return np.maximum(tol ** 2, np.asarray(cmp.kl_floor, dtype=np.float64))


def position_faults(cmp: LogitComparison, th: KLThresholds) -> np.ndarray:
    """``[T]`` bool: positions failing :func:`verdict`'s rules (non-finite, logit error, KL, top-1 gap)."""
    tol = th.tol_rel * np.asarray(cmp.scale, dtype=np.float64)
    both = np.maximum(cmp.kl_ab, cmp.kl_ba)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(both) | ~np.isfinite(cmp.max_abs_err)
        bad |= cmp.max_abs_err > tol
        bad |= both > kl_bound(cmp, th)
        bad |= top1_flips(cmp.top1, cmp.top1_gap, cmp.scale, th)
    return bad


def verdict(cmp: LogitComparison, th: KLThresholds, top1: bool = True, offset: int = 0) -> tuple[bool, str]:
    """(passed, reason) of a comparison against thresholds. Per position t, with ``tol_t = tol_rel * scale_t``:

    * logits finite;
    * ``max_v |delta| <= tol_t`` (the worst logit error is part of the verdict);
    * ``KL <= tol_t ** 2`` (either direction): KL ~ Var_P(delta)/2 <= max|delta|^2/2 to second order, so a
      position within the logit rule is within this one with a factor 2 for higher-order terms; it only adds
      a check where the second-order picture breaks down. The bound is never below the float64 rounding floor
      of the KL itself (:func:`kl_bound`, :func:`kl_rounding_floor`);
    * a top-1 flip only where the truth's gap between the two tokens is ``<= 2 * tol_t`` (a near tie: an
      error of at most tol_t on each logit can flip exactly those). ``top1=False`` skips this rule.

    ``offset`` is added to the positions the reason names (a comparison of rows starting at that position).
    """
    tol = th.tol_rel * np.asarray(cmp.scale, dtype=np.float64)
    both = np.maximum(cmp.kl_ab, cmp.kl_ba)
    if not cmp.n:
        return True, "no positions"
    if (~np.isfinite(both)).any() or (~np.isfinite(cmp.max_abs_err)).any():
        bad = ~np.isfinite(both) | ~np.isfinite(cmp.max_abs_err)
        w = int(np.argmax(bad))
        if np.isnan(both[w]) or np.isnan(cmp.max_abs_err[w]):
            return False, f"non-finite KL (nan logits) at position {offset + w}"
        return False, (f"KL inf at position {offset + w}: one side gives probability 0 (a -inf logit) to a token "
                       f"the other gives probability > 0")
    rel = cmp.rel_err()
    w = int(np.argmax(rel))
    if rel[w] > th.tol_rel:
        return False, (f"logit error {rel[w]:.3g} of the logit scale > {th.tol_rel:.3g} ({th.multiple:g}x floor "
                       f"{th.floor_rel:.3g}) at position {offset + w}")
    bound = kl_bound(cmp, th)
    klr = both / np.maximum(bound, np.finfo(np.float64).tiny)
    if (klr > 1).any():
        w = int(np.argmax(klr))
        if bound[w] > tol[w] ** 2:
            return False, (f"KL {both[w]:.3g} > the float64 rounding floor of the KL {bound[w]:.3g} (above "
                           f"(tol x scale)^2 = {tol[w] ** 2:.3g}) at position {offset + w}")
        return False, f"KL {both[w]:.3g} > (tol x scale)^2 = {tol[w] ** 2:.3g} at position {offset + w}"
    if top1:
        flips = top1_flips(cmp.top1, cmp.top1_gap, cmp.scale, th)
        if flips.any():
            w = int(np.argmax(flips))
            return False, (f"top-1 differs at position {offset + w} with truth gap {cmp.top1_gap[w]:.3g} > near-tie "
                           f"2 x tol x scale = {2 * tol[w]:.3g}")
    why = f"logit error {float(np.max(rel)):.3g} <= {th.tol_rel:.3g} of the logit scale; max KL {float(np.max(both)):.3g}"
    off = cmp.offset_rel()
    if off > th.tol_rel:   # a figure, not a fault: say it, since a raw |difference| would have been far larger
        why += f"; a per-row logit offset of up to {off:.3g} of the logit scale removed (softmax ignores it)"
    return True, why


# ----------------------------------------------------------------------------------------------- the harness

#: the size of fault the harness must be able to resolve on a model, relative to the logit scale: the issue's
#: range of faults that matter (a wrong constant, a stale state entry, a tie broken outside its set) moves logits
#: by 1e-3..1e-2 of max |logit|, i.e. up to ~4e-2 of the scale (max |logit| is ~4 std on these models). A model
#: and precision whose tolerance is above it cannot tell such a fault from rounding: the verdict is INCONCLUSIVE.
USEFUL_FAULT_REL = 1e-2
#: the negative control's perturbation is sized so that its effect on the logits is this many times the
#: tolerance (detectable by design, with margin for the nonlinearity of the response)
CONTROL_MARGIN = 10.0


@dataclass
class KLReport:
    """Everything ``qwen4exp kl`` reports. ``to_json()`` is the ``--json`` document.

    ``comparison``: every judged position (prefill rows of every prompt, then each prompt's greedy decode
    rows); ``decode``: the decode rows alone; ``status``: PASS / FAIL / INCONCLUSIVE (with ``reason``).
    """

    a: str
    b: str
    model: str
    comparison: LogitComparison
    per_prompt_positions: list[int]
    greedy: list[dict]
    thresholds: KLThresholds
    passed: bool
    reason: str
    controls: dict = field(default_factory=dict)
    seconds: float = 0.0
    status: str = ""
    decode: LogitComparison | None = None
    floor: dict | None = None
    ties: dict | None = None
    failed_prompts: list = field(default_factory=list)  # prompts failing (prefill or decode rows, or a tie pick)
    decode_failed: list = field(default_factory=list)   # of those, the ones whose prefill rows agree
    generation: dict | None = None   # generation_paths(): prefill_last / decode_greedy judged
    generation_failed: list = field(default_factory=list)  # failing only in prefill_last / decode_greedy

    def __post_init__(self):
        if not self.status:
            self.status = PASS if (self.passed and self.controls_ok) else FAIL

    @property
    def controls_ok(self) -> bool:
        """True when every control has ``ok`` set (also when there are no controls)."""
        return all(c.get("ok") for c in self.controls.values())

    @property
    def exit_code(self) -> int:
        """0 PASS; 1 FAIL (b disagrees, or is not deterministic); 3 INCONCLUSIVE (the model/precision cannot
        resolve a fault of useful size, or the negative control was not flagged)."""
        return {PASS: 0, FAIL: 1, INCONCLUSIVE: 3}[self.status]

    def to_json(self) -> dict:
        """The ``--json`` document: verdict, thresholds, summary metrics (all judged positions and decode
        alone), per-position KL(P_a||P_b), per-prompt positions, greedy results, controls, floor, ties, seconds."""
        return {
            "a": self.a, "b": self.b, "model": self.model, "status": self.status, "passed": self.passed,
            "reason": self.reason, "controls_ok": self.controls_ok, "exit_code": self.exit_code,
            "thresholds": self.thresholds.to_json(),
            "metrics": self.comparison.summary(),
            "decode_metrics": self.decode.summary() if self.decode is not None else None,
            "per_position_kl_ab": [float(x) for x in self.comparison.kl_ab],
            "per_prompt_positions": self.per_prompt_positions,
            "greedy": self.greedy, "controls": self.controls, "floor": self.floor, "ties": self.ties,
            "failed_prompts": self.failed_prompts, "decode_failed": self.decode_failed,
            "generation": self.generation, "generation_failed": self.generation_failed,
            "seconds": round(self.seconds, 3),
        }


def _greedy(backend, ids: Sequence[int], n: int) -> tuple[list[int], np.ndarray | None]:
    """Greedy continuation of ``n`` tokens through prefill + decode (the incremental path).

    Returns ``(tokens [n], decode logits [n - 1, V])``: the rows decode() returned for tokens 1..n-1 (the
    first token comes from the prefill's last row, which the prefill comparison already judges)."""
    if n <= 0:
        return [], None
    h = backend.new_sequence()
    try:
        logits = np.asarray(backend.prefill(h, list(ids)))
        out = [int(np.argmax(logits[-1]))]
        rows = []
        while len(out) < n:
            nxt = np.asarray(backend.decode([h], [out[-1]]))
            rows.append(nxt[0])
            out.append(int(np.argmax(nxt[0])))
        return out, (np.stack(rows) if rows else np.zeros((0, logits.shape[-1]), logits.dtype))
    finally:
        backend.free(h)


#: sequences the generation-path check keeps live at once (batched like generation; an engine's default
#: live-sequence capacity is 16, parity/backends/engine.py)
GENERATION_BATCH = 8


def generation_paths(a, b, prompts, truth_last, th: KLThresholds, greedy_tokens: int, decode_tokens=None) -> dict:
    """Judge b's generation path, the operations ``qwen4exp generate`` uses and the prefill/decode judgement
    never calls: ``prefill_last`` (:func:`parity.backends.base.prefill_last_of`) and ``decode_greedy``
    (:func:`parity.backends.base.decode_greedy_of`; a backend without them is judged through those defaults).

    * prefill_last: each prompt's returned row against ``truth_last[i]`` (the truth's last prompt row ``[V]``,
      the one b's prefill row was judged against), by :func:`verdict` -- the prefill thresholds;
    * decode_greedy: from the argmax of that row, ``greedy_tokens - 1`` greedy steps, the prompts decoded
      together in batches of :data:`GENERATION_BATCH` (at most a declared ``batched_decode`` limit's
      ``max_tokens``; one at a time when b declares batched decode unsupported), as generation does. Where the tokens equal ``decode_tokens[i]`` (b's own greedy
      continuation through decode(), whose rows are judged) nothing new is claimed; elsewhere each token is
      compared with the argmax of a's forward over the prompt and the tokens before it, a disagreement
      failing outside the near-tie band (:func:`top1_flips`, the kl row's rule).

    Returns ``{"ok", "faults": [{"prompt", "op", "position", "detail"}], "prefill_last_rows",
    "decode_greedy_tokens"`` (judged against the truth), ``"decode_greedy_as_decode"`` (equal to decode()'s
    argmax)``}`` (positions absolute in the prompt + continuation). A wrong shape or dtype is a fault, never an
    exception.
    """
    from parity.backends import one_shot_logits
    from parity.backends.base import capability, decode_greedy_of, prefill_last_of
    faults, rows_judged, toks_judged, toks_same = [], 0, 0, 0
    V = int(np.asarray(truth_last[0]).shape[-1]) if len(truth_last) else 0
    bd = capability(b, "batched_decode")   # a declared limit's max_tokens is the largest batch
    batch = max(1, min(GENERATION_BATCH, bd.max_tokens or GENERATION_BATCH)) if bd.usable else 1
    for g0 in range(0, len(prompts), batch):
        group = list(range(g0, min(g0 + batch, len(prompts))))
        hs, toks, live = [], {}, []
        try:
            for i in group:
                ids = [int(t) for t in prompts[i]]
                h = b.new_sequence()
                hs.append(h)
                row = prefill_last_of(b, h, ids)
                pos = len(ids) - 1
                if row.shape != (V,) or not np.issubdtype(row.dtype, np.floating):
                    faults.append({"prompt": i, "op": "prefill_last", "position": pos,
                                   "detail": f"returned shape {row.shape} dtype {row.dtype}, expected ({V},) float "
                                             f"= [vocab_size]"})
                    continue
                ok, why = verdict(compare_logits(np.asarray(truth_last[i])[None], row[None]), th, offset=pos)
                rows_judged += 1
                if not ok:
                    faults.append({"prompt": i, "op": "prefill_last", "position": pos, "detail": why})
                toks[i] = [int(np.argmax(row))]
                live.append((i, h))
            for step in range(max(0, greedy_tokens - 1)):
                if not live:
                    break
                dropped = []
                for k in range(0, len(live), batch):
                    part = live[k:k + batch]
                    nxt = decode_greedy_of(b, [h for _, h in part], [toks[i][-1] for i, _ in part]).reshape(-1)
                    if nxt.shape != (len(part),) or not np.issubdtype(nxt.dtype, np.integer):
                        for i, _ in part:
                            faults.append({"prompt": i, "op": "decode_greedy", "position": len(prompts[i]) + step,
                                           "detail": f"returned shape {nxt.shape} dtype {nxt.dtype} for a batch of "
                                                     f"{len(part)}, expected ({len(part)},) integer token ids"})
                        dropped += part
                        continue
                    for (i, _), t in zip(part, nxt):
                        toks[i].append(int(t))
                live = [x for x in live if x not in dropped]
        finally:
            for h in hs:
                b.free(h)
        for i in toks:
            got = toks[i]
            mine = list(decode_tokens[i]) if decode_tokens is not None and i < len(decode_tokens) else None
            if len(got) < 2 or (mine is not None and [int(t) for t in mine[:len(got)]] == got):
                toks_same += len(got) - 1
                continue   # the same tokens as b's decode() argmax, whose rows are judged
            ids = [int(t) for t in prompts[i]]
            truth = np.asarray(one_shot_logits(a, ids + got[:-1]))[len(ids):]   # rows predicting got[1:]
            pick = np.asarray(got[1:], dtype=np.int64)
            if (pick < 0).any() or (pick >= V).any():
                j = int(np.argmax((pick < 0) | (pick >= V)))
                faults.append({"prompt": i, "op": "decode_greedy", "position": len(ids) + j,
                               "detail": f"token id {int(pick[j])} at position {len(ids) + j}, expected ids in "
                                         f"[0, vocab_size {V})"})
                continue
            flips, best, gap, band = pick_faults(truth, pick, th)
            toks_judged += len(pick)
            if flips.any():
                j = int(np.argmax(flips))
                faults.append({"prompt": i, "op": "decode_greedy", "position": len(ids) + j,
                               "detail": f"greedy token {int(pick[j])} at position {len(ids) + j + 1} (row of position {len(ids) + j}), the truth's "
                                         f"argmax {int(best[j])} with gap {gap[j]:.3g} > near-tie 2 x tol x scale = "
                                         f"{band[j]:.3g}"})
    return {"ok": not faults, "faults": faults, "prefill_last_rows": rows_judged, "decode_greedy_tokens": toks_judged,
            "decode_greedy_as_decode": toks_same}


def generation_fault_text(f: dict) -> str:
    """One generation-path fault of :func:`generation_paths` as the kl row names it: the prompt, the operation
    and what differs (the prefill / decode rows of that prompt were judged separately)."""
    other = "prefill()" if f["op"] == "prefill_last" else "decode()"
    return (f"prompt {f['prompt']}: {f['op']} (the generation path): returned "
            f"{'logits' if f['op'] == 'prefill_last' else 'tokens'} differ: {f['detail']} (judged apart from the "
            f"{other} rows)")


def _weights_of(be):
    model = getattr(be, "model", None)
    return getattr(model, "weights", None)


def _call_perturbed(factory, scale):
    import inspect
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if "scale" in params:
        return factory(scale=scale)
    return factory() if scale == 1.0 else None


def _effect(pb_factory, scale, truths, prompts, logs=None):
    """``(LogitComparison of the perturbed backend at size scale against truths, forced)`` or ``(None, False)``
    for a factory without a size. ``logs``: the unperturbed truth's :class:`parity.harness.floor.SelectionLog`
    per prompt; when given and the perturbed backend exposes its reference model (``.model.selection_hook``),
    its every selection is forced to the truth's picks (``forced`` True): the effect is then the continuous
    response of the perturbation, never the jump of a selection flip."""
    pb = _call_perturbed(pb_factory, scale)
    if pb is None:
        return None, False
    from parity.backends import one_shot_logits
    from parity.harness.floor import forced_logits
    model = getattr(pb, "model", None)
    forced = logs is not None and hasattr(model, "selection_hook") and hasattr(model, "forward")
    try:
        rows = [forced_logits(model, ids, log) if forced else one_shot_logits(pb, ids)
                for ids, log in zip(prompts, logs if forced else [None] * len(prompts))]
        return LogitComparison.concat([compare_logits(t, r) for t, r in zip(truths, rows)]), forced
    finally:
        close = getattr(pb, "close", None)
        if close:
            close()


def _max_rel(c: LogitComparison) -> float:
    """max over positions of the relative logit error (inf when a row is non-finite; 0 when no position)."""
    rel = c.rel_err()
    if not rel.size:
        return 0.0
    return float("inf") if np.isnan(rel).any() else float(np.max(rel))


#: the negative control's measured effect may differ from the intended one by this factor before it is re-sized
#: once (from the response at the first size: a small perturbation's response is closer to linear than s = 1's);
#: an unforced control still beyond it after that fires through a jump, not the continuous response
CONTROL_RESIZE = 2.0


def negative_control(pb_factory, truths, prompts, th: KLThresholds, note: str = "", truth_model=None) -> dict:
    """The negative control, sized from the floor: the perturbation (``pb_factory(scale=s)``: a backend with one
    weight + s * rms * N(0, 1)) is first applied at full size (s = 1) to measure the model's response, then
    at the size whose effect is intended to be :data:`CONTROL_MARGIN` x the tolerance (linear response; re-sized
    once from the measured response when it is off by more than :data:`CONTROL_RESIZE`), and must be flagged
    there.

    The control must show the tolerance is tight for a CONTINUOUS error: with ``truth_model`` (the unperturbed
    float32 reference, whose picks the truths are) and a perturbed backend exposing its reference model, every
    discrete selection (QSA block top-k, MoE expert top-k) is forced to the truth's picks, as the floor is
    measured (:mod:`parity.harness.floor`); a flip would otherwise move the logits by ~0.3 of the scale at a
    perturbation sized for 7e-4 and "flag" it whatever the tolerance. A control that cannot be forced and whose
    effect stays far above the intended size (a discrete jump) is not counted as flagged.

    Returns a control dict: ``ok`` (flagged at the sized perturbation), ``inconclusive`` (not ok), ``scale``,
    ``intended_rel`` (CONTROL_MARGIN x tolerance), ``effect_rel`` (the measured effect at ``scale``, relative to
    the logit scale), ``full_effect_rel`` (at s = 1), ``forced`` (selections forced), ``max_kl``, ``detail``.
    """
    logs = None
    if truth_model is not None and hasattr(truth_model, "selection_hook"):
        from parity.harness.floor import logged_logits
        logs = [logged_logits(truth_model, [int(t) for t in ids])[1] for ids in prompts]
    full, forced = _effect(pb_factory, 1.0, truths, prompts, logs)
    pre = f"{note}: " if note else ""
    how = "selections forced to the truth's picks: the continuous effect" if forced else \
        "selections not forced (no reference model to force them on)"
    rel_full = _max_rel(full)
    intended = CONTROL_MARGIN * th.tol_rel
    flagged_full = not verdict(full, th)[0]
    if not flagged_full:
        return {"ok": False, "inconclusive": True, "scale": 1.0, "effect_rel": rel_full, "full_effect_rel": rel_full,
                "intended_rel": intended, "forced": forced, "max_kl": full.worst_kl(),
                "detail": pre + (f"NOT flagged even at full size (+ rms * N(0,1); {how}): its effect {rel_full:.3g} "
                                 f"of the logit scale <= tolerance {th.tol_rel:.3g}; this model does not resolve a "
                                 f"fault on that tensor")}
    scale = 1.0
    if np.isfinite(rel_full) and rel_full > 0:
        scale = min(1.0, intended / rel_full)
    sized = full
    if scale != 1.0:
        sized, _ = _effect(pb_factory, scale, truths, prompts, logs)
        if sized is None:   # a factory without a size: the full-size control is all there is
            sized, scale = full, 1.0
    rel_s = _max_rel(sized)
    resized = ""
    if scale != 1.0 and np.isfinite(rel_s) and rel_s > 0 and not (
            intended / CONTROL_RESIZE <= rel_s <= intended * CONTROL_RESIZE):
        s2 = min(1.0, scale * intended / rel_s)
        c2, _ = _effect(pb_factory, s2, truths, prompts, logs)
        if c2 is not None:
            resized = f" (re-sized from x{scale:.3g}, whose effect was {rel_s:.3g})"
            sized, scale, rel_s = c2, s2, _max_rel(c2)
    ok, why = verdict(sized, th)
    jump = not forced and np.isfinite(rel_s) and rel_s > CONTROL_RESIZE * intended and scale < 1.0
    flagged = (not ok) and not jump
    what = ("flagged (" + why + ")" if flagged else
            "NOT counted as flagged: its effect is far above the intended size, a discrete jump (a selection "
            "flip?) rather than the continuous response, which shows nothing about the tolerance (" + why + ")"
            if jump else "NOT flagged (" + why + ")")
    return {"ok": bool(flagged), "inconclusive": not flagged, "scale": scale, "effect_rel": rel_s,
            "full_effect_rel": rel_full, "intended_rel": intended, "forced": forced, "max_kl": sized.worst_kl(),
            "detail": pre + (f"sized x{scale:.3g}{resized}: measured effect {rel_s:.3g} of the logit scale, "
                             f"intended {intended:.3g} ({CONTROL_MARGIN:g}x the tolerance {th.tol_rel:.3g}; {how}): "
                             + what)}


def run_kl(a, b, prompts: Sequence[Sequence[int]], *, model: str = "", greedy_tokens: int = 8,
           floor_pair: tuple | None = None, perturbed_b: Callable[..., object] | None = None,
           perturbed_note: str = "", progress=True, floor=None, weights=None, thresholds=None) -> KLReport:
    """Run the KL harness: b against a over ``prompts`` (prefill rows and greedy decode rows) plus the controls.

    Args:
        a, b: open :class:`parity.backends.Backend` objects (a is the truth: the float32 reference).
        prompts: token-id lists (each ``[T]`` ints in ``[0, vocab)``).
        greedy_tokens: length of the greedy continuations; b's decode() rows along b's own continuation are
            judged against a's full forward over the same tokens (0 disables).
        floor: a measured :class:`parity.harness.floor.Floor` for b's activation stores
            (:func:`parity.harness.floor.stores_of`); None: measured here on ``weights`` (or a's /
            floor_pair's reference weights) over ``prompts``.
        floor_pair: (reference float32, reference float64) backends: their weights measure the floor.
        perturbed_b: ``f(scale=s) -> backend`` equal to b with one weight perturbed by ``s * rms * N(0,1)``
            (the negative control, see :func:`negative_control`; a zero-argument callable is used at full size).
        thresholds: the run's thresholds when already derived from ``floor`` (with its measured tap profile);
            None: :func:`thresholds_for` of b's precision and the floor.
        progress: ``"bar"`` / True (a tqdm bar), ``"lines"`` (a plain line per prompt, for a stderr that is not a
            terminal) or a false value (none): :func:`parity.harness.progress.progress_bar`.
    Returns:
        :class:`KLReport` (``status`` PASS / FAIL / INCONCLUSIVE, ``exit_code`` 0 / 1 / 3).
    Raises:
        InputError: empty prompt set.
    """
    from parity.backends import one_shot_logits
    from parity.harness.floor import measure_floor, stores_of

    if not prompts:
        raise InputError("prompts: expected at least one prompt, found none")
    t0 = time.perf_counter()
    prec = getattr(b, "precision", "float32")
    thresholds_for(prec)  # an unknown precision is an input error before anything runs
    controls = {}
    measured_here = None   # the weights, when the floor is measured in this run
    floor_ps = None
    if floor is None:
        w = weights if weights is not None else (_weights_of(floor_pair[1]) if floor_pair else None) or _weights_of(a)
        if w is not None:
            # the prompts plus the stream past the QSA bound: the same floor as ``qwen4exp parity`` measures
            # (parity.harness.floor.floor_prompts), so `kl` and `parity --scenario kl` judge alike
            from parity.harness.floor import floor_prompts
            floor_ps = floor_prompts(w.config, prompts)
            floor = measure_floor(w, floor_ps, stores_of(b))
            measured_here = w
    th = thresholds if thresholds is not None else thresholds_for(prec, floor)
    name_a, name_b = getattr(a, "name", type(a).__name__), getattr(b, "name", type(b).__name__)
    cmps, dcmps, det_ok, det_bad, greedy = [], [], True, [], []
    from parity.backends import capabilities_of
    # a backend claiming determinism must repeat bitwise; any other is allowed its own measured run-to-run noise
    claims_det = bool(capabilities_of(b).get("deterministic"))
    spread, spread_at = 0.0, None
    la_all, truth_last = [], []
    tie_rows, outside, per_prompt, unresolved = [], [], [], []
    from parity.harness.ties import MAX_RESOLUTIONS as MAX_RESOLUTIONS_NOTE
    truth_model = getattr(a, "model", None) if floor is not None else None
    from parity.harness.floor import unresolvable
    # a coarse floor: the logits may not show a pick outside the tie set, so the selections are read on every prompt
    coarse = floor is not None and unresolvable(th, floor) is not None
    from parity.harness.progress import progress_bar
    bar = progress_bar(len(prompts), f"kl {name_b} vs {name_a}", progress)
    for i, ids in enumerate(prompts):
        if i:
            bar.update(1)   # prompt i - 1 is finished (named by the label still set)
        bar.set_postfix_str(f"prompt {i + 1} of {len(prompts)} ({len(ids)} tokens)")
        ids = [int(t) for t in ids]
        la = one_shot_logits(a, ids)
        lb = one_shot_logits(b, ids)
        lb2 = one_shot_logits(b, ids)
        if lb.shape != lb2.shape or not np.array_equal(lb, lb2, equal_nan=True):
            det_bad.append(i)
            if claims_det:
                det_ok = False
            else:
                sp = rerun_spread(lb, lb2, la)
                if spread_at is None or not sp <= spread:
                    spread, spread_at = sp, i
        la_all.append(la)
        path, truth, be = ids, la, lb
        g = None
        if greedy_tokens:
            ga = _greedy(a, ids, greedy_tokens)[0]
            gb, rows = _greedy(b, ids, greedy_tokens)
            g = {"prompt": i, "a": ga, "b": gb, "agree": greedy_agreement(ga, gb)}
            if rows is not None and len(rows) and lb.ndim == 2 and rows.shape[-1] == lb.shape[-1]:
                # b's decode() rows along b's own continuation, judged against a's forward over the same tokens
                path = ids + gb[:-1]
                truth = one_shot_logits(a, path)
                be = np.concatenate([lb, rows], axis=0)
        c = compare_logits(truth, be)
        bad = position_faults(c, th)
        if bad.any() and truth_model is not None and hasattr(truth_model, "selection_hook"):
            from parity.harness.ties import judge_ties
            tj = judge_ties(truth_model, path, be, bad, th, floor, backend=b)
            if tj.outside:
                outside.append(f"prompt {i}: {tj.outside}")
            elif tj.logits is not None:
                # the truth under the backend's tie resolution (every override inside a tie set) judges it
                c2 = compare_logits(tj.logits, be)
                still = position_faults(c2, th)
                eq = [int(p) for p in np.nonzero(bad & ~still)[0]]
                tie_rows.append({"prompt": i, "how": tj.how, "positions": eq, "selection_positions": tj.positions})
                c, truth = c2, tj.logits
                if still.any() and tj.truncated and int(np.argmax(still)) >= min(tj.truncated):
                    unresolved.append(f"prompt {i}: rows from position {int(np.argmax(still))} follow a tie with more "
                                      f"than {MAX_RESOLUTIONS_NOTE} resolutions (position {min(tj.truncated)}): the "
                                      f"backend's choice cannot be searched; a backend with selection taps can be judged")
        elif coarse and truth_model is not None and hasattr(truth_model, "selection_hook"):
            from parity.harness.ties import outside_pick
            o = outside_pick(truth_model, path, be, th, b)
            if o:
                outside.append(f"prompt {i}: {o}")
        truth_last.append(np.asarray(truth)[len(ids) - 1])   # the truth b's last prompt row was judged against
        cmps.append(c.select(slice(0, len(ids))))
        dc = None
        if len(path) > len(ids):
            dc = c.select(slice(len(ids), len(path)))
            dcmps.append(dc)
            g["decode_faults"] = [int(x) for x in np.nonzero(position_faults(dc, th))[0]]
            g["decode_max_logit_err_rel"] = float(np.max(dc.rel_err()))
        if g is not None:
            greedy.append(g)
        per_prompt.append((cmps[-1], dc))
    bar.update(1)
    bar.close()
    pre = LogitComparison.concat(cmps)
    dec = LogitComparison.concat(dcmps) if dcmps else None
    cmp = LogitComparison.concat([pre] + ([dec] if dec is not None else []))
    passed, reason = verdict(cmp, th)
    failed_prompts = [i for i, (c_pre, c_dec) in enumerate(per_prompt)
                      if not verdict(c_pre, th)[0] or (c_dec is not None and not verdict(c_dec, th)[0])]
    failed_prompts = sorted(set(failed_prompts) | {int(o.split(":")[0].split()[1]) for o in outside})
    decode_failed = [i for i, (c_pre, c_dec) in enumerate(per_prompt)
                     if verdict(c_pre, th)[0] and c_dec is not None and not verdict(c_dec, th)[0]]
    if not passed:   # name the first failing prompt and its own position (prefill rows, then decode rows)
        for i, (c_pre, c_dec) in enumerate(per_prompt):
            ok_pre, why_pre = verdict(c_pre, th)
            ok_dec, why_dec = verdict(c_dec, th, offset=c_pre.n) if c_dec is not None else (True, "")
            if not ok_pre:
                reason = f"prompt {i}: {why_pre}"
                break
            if not ok_dec:
                reason = (f"prompt {i}: decode: {why_dec} (its prefill rows agree: the fault is in decode() or the "
                          f"state it carries)")
                break
    if outside:
        passed = False
        reason = outside[0] + ("" if len(outside) == 1 else f" (+{len(outside) - 1} more prompts)") + "; " + reason
    gen = generation_paths(a, b, prompts, truth_last, th, greedy_tokens, [g["b"] for g in greedy] if greedy else None)
    generation_failed = sorted({f["prompt"] for f in gen["faults"]} - set(failed_prompts))
    if gen["faults"]:   # prefill_last / decode_greedy (what generation runs) disagree with the truth
        first_gen = generation_fault_text(gen["faults"][0])
        reason = first_gen if passed else reason + "; " + first_gen
        passed = False
        failed_prompts = sorted(set(failed_prompts) | {f["prompt"] for f in gen["faults"]})
    ties_doc = {"tie_equivalent": tie_rows, "tie_equivalent_positions": sum(len(r["positions"]) for r in tie_rows),
                "outside_tie_set": outside}
    if floor is not None:
        ties_doc["truth"] = floor.ties.summary()
    noisy = False
    if claims_det:
        controls["determinism"] = {"ok": det_ok, "claimed": True, "spread_rel": 0.0 if det_ok else None,
                                   "detail": "b run twice: bitwise equal" if det_ok else
                                   f"b run twice differs on prompts {det_bad} (b declares deterministic: bitwise)"}
        if not det_ok:   # the prompts that did not repeat are failed cases (the row's count agrees with FAIL)
            failed_prompts = sorted(set(failed_prompts) | set(det_bad))
    else:
        noisy = not spread <= th.tol_rel   # nan/inf spread: not within tolerance
        if not det_bad:
            d = "b run twice: bitwise equal (b does not declare deterministic: its run-to-run noise is allowed)"
        else:
            d = (f"b run twice differs on prompts {det_bad} (b does not declare deterministic): run-to-run spread "
                 f"{spread:.3g} of the logit scale (prompt {spread_at}) "
                 + (f"> the tolerance {th.tol_rel:.3g}: the verdict cannot be trusted" if noisy else
                    f"<= the tolerance {th.tol_rel:.3g}: within what it is judged with"))
        controls["determinism"] = {"ok": not noisy, "claimed": False, "inconclusive": noisy, "spread_rel": spread,
                                   "tol_rel": th.tol_rel, "prompts_differing": det_bad, "detail": d}
    inconclusive = []
    if floor is None:
        controls["precision_floor"] = {"ok": False, "inconclusive": True,
                                       "detail": "not measured (no reference weights): nominal thresholds"}
        inconclusive.append("no measured precision floor")
    else:
        from parity.harness.floor import floor_breakdown, unresolvable
        why = unresolvable(th, floor)
        if why and measured_here is not None and not floor.by_kind:
            floor = floor_breakdown(measured_here, floor_ps, floor)   # which stores make it coarse
            why = unresolvable(th, floor)
        ok = why is None
        controls["precision_floor"] = {
            "ok": ok, "inconclusive": not ok, **floor.to_json(), "tol_rel": th.tol_rel,
            "detail": (f"{floor.precision} floor {th.floor_rel:.3g} of the logit scale (float32 floor "
                       f"{floor.f32_logit_rel:.3g}); " + (f"tolerance {th.multiple:g}x = {th.tol_rel:.3g}" if ok else why))}
        if not ok:
            inconclusive.append(controls["precision_floor"]["detail"])
    if perturbed_b is None:
        controls["negative_control"] = {"ok": False, "inconclusive": True, "detail": "not computed (no perturbed backend)"}
        inconclusive.append("negative control not computed")
    else:
        nc = negative_control(perturbed_b, la_all, prompts, th, perturbed_note,
                              truth_model=getattr(a, "model", None))
        controls["negative_control"] = nc
        if not nc["ok"]:
            inconclusive.append("negative control: " + nc["detail"])
    unresolved_prompts = {int(u.split(":")[0].split()[1]) for u in unresolved}
    if not passed and failed_prompts and set(failed_prompts) <= unresolved_prompts and not outside:
        passed = None   # judged neither way: the only failures follow an unsearchable tie
        inconclusive.insert(0, unresolved[0])
    if noisy:
        inconclusive.insert(0, "determinism: " + controls["determinism"]["detail"])
        if passed is False and not outside:
            # a failure the backend's own run-to-run noise can explain (within tolerance + spread) is not a verdict
            import dataclasses as _dc
            wide = _dc.replace(th, tol_rel=th.tol_rel + (spread if np.isfinite(spread) else np.inf))
            if np.isfinite(spread) and all(verdict(c_pre, wide)[0] and (c_dec is None or verdict(c_dec, wide)[0])
                                           for c_pre, c_dec in per_prompt):
                passed = None
    if passed is False or not det_ok:
        status = FAIL
        if not det_ok and passed:
            reason = controls["determinism"]["detail"]
    elif inconclusive:
        status, reason = INCONCLUSIVE, "; ".join(inconclusive)
        passed = bool(passed)
    else:
        status = PASS
    return KLReport(a=name_a, b=name_b, model=model, comparison=cmp,
                    per_prompt_positions=[c.n for c in cmps] + [c.n for c in dcmps], greedy=greedy, thresholds=th,
                    passed=passed, reason=reason, controls=controls, seconds=time.perf_counter() - t0,
                    status=status, decode=dec, floor=floor.to_json() if floor is not None else None,
                    ties=ties_doc, failed_prompts=failed_prompts, decode_failed=decode_failed, generation=gen,
                    generation_failed=generation_failed)


def decode_case(ids: Sequence[int], tokens: Sequence[int]):
    """A scenario :class:`~parity.harness.scenarios.common.Case` replaying one KL prompt and its greedy decode:
    prefill ``ids``, then decode ``tokens[:-1]`` one by one (the path the KL harness judged), so a decode
    failure is located through the scenario machinery (tap-diff, and the search through the state)."""
    from parity.harness.scenarios.common import Case
    ids, tokens = [int(t) for t in ids], [int(t) for t in tokens]

    def fn(run):
        s = run.new("kl")
        run.plan(ids + tokens[:-1])
        run.prefill(s, ids)
        for t in tokens[:-1]:
            run.decode([s], [t])
    return Case("greedy_decode", fn)


def dumps(report: KLReport) -> str:
    """The report as indented JSON text (nan/inf written as strings so the JSON stays standard)."""
    def clean(x):
        if isinstance(x, float) and not np.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(report.to_json()), indent=1)
