"""Logit comparison metrics: how far backend b's next-token distributions are from the truth's (backend a).

The metrics compare two backends' logits position by position. They work on plain arrays (``[T, V]``
logits, float32 or float64) and are computed in float64 so the metric itself adds no noise above the
backends'. Logit errors are judged relative to the model's logit scale (:func:`logit_scale`) with each
row's common offset removed (:func:`offset_free_error`: softmax ignores it). What counts as a fault is
decided by :mod:`parity.harness.thresholds`; the KL job that runs backends is :mod:`parity.harness.kl`.

Formula source: standard definitions (KL(P||Q) = sum_v P_v (log P_v - log Q_v)); the distribution is
the softmax of the LM-head logits as in the official ``Qwen4ExpForCausalLM.forward`` (modeling_qwen4_exp.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from reference.errors import InputError

__all__ = ["log_softmax", "kl_per_position", "kl_rounding_floor", "summarize", "topk_sets", "logit_scale",
           "LogitComparison", "offset_free_error", "rerun_spread", "compare_logits",
           "COMPARE_BLOCK_ELEMENTS", "greedy_agreement",
           "FLOOR_MAX_KL", "PERCENTILES"]

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


def _kl_rows(lp: np.ndarray, lq: np.ndarray, p: np.ndarray | None = None) -> np.ndarray:
    """``[T]`` sum_v P_v (log P_v - log Q_v) from log-probabilities, with the convention 0 log 0 = 0: a token P
    gives probability 0 (a -inf logit) adds nothing, so a row truncated to -inf by one side gives KL = inf in
    the direction that sees the truncation, not nan (nan only from a nan logit). ``p``: ``exp(lp)`` when the
    caller has it already."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lp) if p is None else p
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


def topk_sets(logits: np.ndarray, k: int) -> np.ndarray:
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


#: elements of one row block of :func:`compare_logits` (2 rows of a 248,320-token vocabulary): each block's
#: float64 temporaries (~4 MB) stay in the caches instead of ~4 GB each for a 2,100-row prefill (measured on a
#: 248,320-token vocabulary, 2 cores: 37.5 ms per row in blocks of 32 rows, 5.7 ms in blocks of 2)
COMPARE_BLOCK_ELEMENTS = 1 << 19


def compare_logits(logits_a: np.ndarray, logits_b: np.ndarray) -> LogitComparison:
    """Compare two ``[T, V]`` logit arrays position by position (see :class:`LogitComparison`; a is the truth).
    The logit error is judged after removing each row's common offset (:func:`offset_free_error`).

    Every figure is a function of its own row only, so the rows are compared in blocks of
    :data:`COMPARE_BLOCK_ELEMENTS` elements on :func:`reference.threads.host_threads` threads (NumPy releases the
    GIL in its loops) and concatenated: the result is bitwise that of one pass over the whole array, without its
    ``[T, V]`` float64 temporaries.

    Raises:
        InputError: shapes differ or are not 2-D float arrays.
    """
    a = _check_logits("logits_a", logits_a)
    b = _check_logits("logits_b", logits_b)
    if a.shape != b.shape:
        raise InputError(f"logits: expected equal shapes [T, V], found {a.shape} (a) and {b.shape} (b)")
    T, V = a.shape
    step = max(1, COMPARE_BLOCK_ELEMENTS // max(V, 1))
    if T <= step:
        return _compare_rows(a, b)
    spans = [(s, min(T, s + step)) for s in range(0, T, step)]
    from reference.threads import host_threads
    n = min(host_threads(), len(spans))
    if n == 1:
        return LogitComparison.concat([_compare_rows(a[s:e], b[s:e]) for s, e in spans])
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(n) as ex:
        parts = list(ex.map(lambda se: _compare_rows(a[se[0]:se[1]], b[se[0]:se[1]]), spans))
    return LogitComparison.concat(parts)


def _compare_rows(a: np.ndarray, b: np.ndarray) -> LogitComparison:
    """:func:`compare_logits` of two checked ``[T, V]`` arrays of equal shape in one pass."""
    la, lb = log_softmax(a), log_softmax(b)
    pa, pb = np.exp(la), np.exp(lb)
    kl_ab, kl_ba = _kl_rows(la, lb, pa), _kl_rows(lb, la, pb)
    kl_ab = np.where(np.isnan(kl_ab), np.nan, np.maximum(kl_ab, 0.0))
    kl_ba = np.where(np.isnan(kl_ba), np.nan, np.maximum(kl_ba, 0.0))
    t5a, t5b = topk_sets(a, 5), topk_sets(b, 5)
    ta, tb = t5a[:, 0], t5b[:, 0]   # the canonical order's first: topk_sets(x, 1) (value, then lower token id)
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
