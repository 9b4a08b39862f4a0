"""The streaming accumulators of tap-diff: position alignment of two recordings, the per-row statistics of
an activation tap (one fused Numba pass, float64 accumulation) and the set comparison of an index tap with
its near-tie / error verdicts (the metrics are defined in :mod:`taps.diff`)."""
from __future__ import annotations

import math

import numpy as np

from taps import registry

__all__ = ["align_positions", "ActivationAccumulator", "IndexAccumulator"]


def align_positions(pa: np.ndarray, pb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Align two recorded position lists (emit order, may repeat: a position recorded twice -- e.g.
    after a rollback -- counts by its LAST row).

    Returns: ``(positions [n], rows_a [n], rows_b [n])``: the common positions in ascending order and
    the row index holding each in A and in B.
    """
    pa = np.asarray(pa, dtype=np.int64)
    pb = np.asarray(pb, dtype=np.int64)

    def last_rows(p):
        # unique positions with the index of their last occurrence
        rev = p[::-1]
        u, first_in_rev = np.unique(rev, return_index=True)
        return u, (len(p) - 1 - first_in_rev).astype(np.int64)

    ua, ra = last_rows(pa)
    ub, rb = last_rows(pb)
    common, ia, ib = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    return common.astype(np.int64), ra[ia], rb[ib]


# ---------------------------------------------------------------- activation comparison
_ROW_KERNEL = None


def _row_kernel():
    """The fused per-row statistics kernel (Numba, compiled on first use, cached on disk)."""
    global _ROW_KERNEL
    if _ROW_KERNEL is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def rows_stats(a, b, rtol, out, out_i):
            # out[r] = d2, a2, b2, ab, excess, max_abs, max_rel ; out_i[r] = nonfinite, n_finite, argmax col
            n, m = a.shape
            for r in range(n):
                d2 = 0.0
                a2 = 0.0
                b2 = 0.0
                ab = 0.0
                exc = -np.inf
                mx = -1.0
                mxc = 0
                mr = 0.0
                bad = 0
                nf = 0
                for c in range(m):
                    x = np.float64(a[r, c])
                    y = np.float64(b[r, c])
                    if np.isfinite(x) and np.isfinite(y):
                        nf += 1
                        d = abs(y - x)
                        ax = abs(x)
                        d2 += d * d
                        a2 += x * x
                        b2 += y * y
                        ab += x * y
                        e = d - rtol * ax
                        if e > exc:
                            exc = e
                        if d > mx:
                            mx = d
                            mxc = c
                        den = max(ax, abs(y))
                        if den > 0.0 and d / den > mr:
                            mr = d / den
                    else:
                        if not (x == y):
                            bad += 1
                        if 0.0 > exc:
                            exc = 0.0
                        if mx < 0.0:
                            mx = 0.0
                            mxc = c
                out[r, 0] = d2
                out[r, 1] = a2
                out[r, 2] = b2
                out[r, 3] = ab
                out[r, 4] = exc
                out[r, 5] = max(mx, 0.0)
                out[r, 6] = mr
                out_i[r, 0] = bad
                out_i[r, 1] = nf
                out_i[r, 2] = mxc
        _ROW_KERNEL = rows_stats
    return _ROW_KERNEL


class ActivationAccumulator:
    """Streaming accumulator for one activation tap (per-row statistics from one fused pass)."""

    def __init__(self, n_rows: int, rtol: float):
        self.rtol = rtol
        self.n = 0
        self.nonfinite = 0
        self.max_abs = 0.0
        self.max_abs_at = None
        self.max_rel = 0.0
        self.d2 = self.a2 = self.b2 = self.ab = 0.0
        self.row_excess = np.zeros(n_rows)   # max over the row of |d| - rtol*|a|
        self.row_nonfinite = np.zeros(n_rows, dtype=bool)
        self.row_d2 = np.zeros(n_rows)
        self.row_a2 = np.zeros(n_rows)

    def add(self, r0: int, a: np.ndarray, b: np.ndarray, pos: np.ndarray):
        """Accumulate rows ``r0 .. r0 + n`` of the tap: ``a``/``b`` ``[n, ...]`` (flattened to ``[n, -1]``; compared
        in float64 when the dtypes differ or are not floating), ``pos`` int ``[n]`` their positions."""
        a = np.ascontiguousarray(a.reshape(len(a), -1))
        b = np.ascontiguousarray(b.reshape(len(b), -1))
        if a.dtype != b.dtype:
            a, b = a.astype(np.float64), b.astype(np.float64)
        n = len(a)
        if n == 0:
            return
        if a.dtype.kind != "f":
            a, b = a.astype(np.float64), b.astype(np.float64)
        out = np.empty((n, 7))
        out_i = np.empty((n, 3), dtype=np.int64)
        _row_kernel()(a, b, float(self.rtol), out, out_i)
        self.nonfinite += int(out_i[:, 0].sum())
        self.row_nonfinite[r0:r0 + n] = out_i[:, 0] > 0
        self.n += int(out_i[:, 1].sum())
        k = int(np.argmax(out[:, 5]))
        if out[k, 5] > self.max_abs or self.max_abs_at is None:
            self.max_abs = float(out[k, 5])
            self.max_abs_at = (int(pos[k]), int(out_i[k, 2]))
        self.max_rel = max(self.max_rel, float(out[:, 6].max()))
        self.row_excess[r0:r0 + n] = out[:, 4]
        self.row_d2[r0:r0 + n] = out[:, 0]
        self.row_a2[r0:r0 + n] = out[:, 1]
        self.d2 += float(out[:, 0].sum())
        self.a2 += float(out[:, 1].sum())
        self.b2 += float(out[:, 2].sum())
        self.ab += float(out[:, 3].sum())

    def finish(self, tol: dict, positions: np.ndarray) -> tuple[dict, bool, int | None, str]:
        """Judge the accumulated statistics against profile tolerances ``tol`` (keys ``rel_l2``, ``rtol``,
        ``atol``, ``atol_rms``, ``cos_min``); ``positions [n_rows]`` maps rows to positions.

        Returns:
            ``(metrics, diverged, first_position or None, reasons joined by '; ')``.
        """
        na, nb = math.sqrt(self.a2), math.sqrt(self.b2)
        nd = math.sqrt(self.d2)
        rel_l2 = 0.0 if nd == 0 else (nd / na if na > 0 else math.inf)
        cos = 1.0 if na == 0 and nb == 0 else (self.ab / (na * nb) if na > 0 and nb > 0 else 0.0)
        rms = math.sqrt(self.a2 / self.n) if self.n else 0.0
        bound = tol["atol_rms"] * rms + tol["atol"]
        elem_bad = self.row_excess > bound
        mean_row_a = math.sqrt(self.a2 / max(1, len(self.row_a2)))
        row_rel = np.sqrt(self.row_d2) / mean_row_a if mean_row_a > 0 else np.where(self.row_d2 > 0, np.inf, 0.0)
        reasons = []
        if self.nonfinite:
            reasons.append(f"{self.nonfinite} non-finite mismatches")
        if rel_l2 > tol["rel_l2"]:
            reasons.append(f"rel_l2 {rel_l2:.3g} > {tol['rel_l2']:.3g}")
        if elem_bad.any():
            reasons.append(f"{int(elem_bad.sum())} positions with |b-a| > {tol['rtol']:.3g}|a| + {bound:.3g}")
        if cos < tol["cos_min"]:
            reasons.append(f"cosine {cos:.7f} < {tol['cos_min']}")
        diverged = bool(reasons)
        first = None
        if diverged:
            bad_rows = elem_bad | self.row_nonfinite | (row_rel > tol["rel_l2"])
            if bad_rows.any():
                first = int(positions[np.nonzero(bad_rows)[0][0]])
        metrics = {"max_abs": self.max_abs, "max_abs_at": self.max_abs_at, "max_rel": self.max_rel,
                   "rel_l2": rel_l2, "cosine": cos, "nonfinite": self.nonfinite, "rms_a": rms,
                   "bad_positions": int(elem_bad.sum())}
        # how close to the profile's limits (1.0 = at a limit): the largest of the three ratios
        ex = float(self.row_excess.max()) if len(self.row_excess) else 0.0
        ratios = [rel_l2 / tol["rel_l2"] if tol["rel_l2"] > 0 else (math.inf if rel_l2 > 0 else 0.0),
                  (ex / bound if bound > 0 else (math.inf if ex > 0 else 0.0)) if ex > 0 else 0.0,
                  ((1 - cos) / (1 - tol["cos_min"]) if tol["cos_min"] < 1 else (math.inf if cos < 1 else 0.0))]
        metrics["limit_ratio"] = math.inf if self.nonfinite else max(0.0, *ratios)
        return metrics, diverged, first, "; ".join(reasons)


# ---------------------------------------------------------------- index comparison
_OWN_EPS = 1e-6  # ~8 float32 ulps: B's picks are judged against its own scores up to this relative slack
                 # (a selection made on, e.g., softmax probabilities can order two logits that close
                 # either way); exact ties must follow the canonical lower-index rule.


def _beats(s: np.ndarray, x: int, y: int) -> bool:
    """Does item ``x`` rank clearly before ``y`` under scores ``s`` (canonical: higher score, then lower index)?"""
    sx, sy = float(s[x]), float(s[y])
    if sx == sy:
        return x < y
    if math.isnan(sx) or math.isnan(sy):
        return False
    if math.isinf(sx) or math.isinf(sy):
        return sx > sy
    return sx - sy > _OWN_EPS * max(abs(sx), abs(sy))


def _canonical_violation(taken: np.ndarray, scores: np.ndarray) -> tuple[int, int] | None:
    """Is the set ``taken`` (a -1 padded row of picks, any order: a selection is compared as a set) the
    canonical top-k of ``scores`` (score descending, then lower index), up to a relative slack of ``_OWN_EPS``
    between unequal scores?

    Returns: a violating ``(better_item, item_B_put_in_its_place)`` pair, or None.
    """
    items = list(registry.selection_ids(taken))
    n = scores.shape[-1]
    if any(x >= n for x in items):
        return (items[-1], items[-1])  # out of range: certainly wrong
    if not items:
        return None
    # the weakest pick (lowest score; among equal scores the highest index) against every unpicked
    # visible candidate, vectorised
    sc = np.asarray(scores, dtype=np.float64)
    j = max(items, key=lambda t: (-sc[t], t))
    sj = sc[j]
    cand = np.ones(n, dtype=bool)
    cand[items] = False
    cand &= np.isfinite(sc)
    idx = np.arange(n)
    with np.errstate(invalid="ignore"):
        clear = sc - sj > _OWN_EPS * np.maximum(np.abs(sc), abs(sj)) if math.isfinite(sj) else sc > sj
    hit = cand & (clear | ((sc == sj) & (idx < j)))
    if hit.any():
        return (int(np.nonzero(hit)[0][0]), int(j))
    return None


class IndexAccumulator:
    """Streaming accumulator for one index tap (with optional companion scores)."""

    def __init__(self, tol: dict, max_examples: int = 20, as_set: bool = True):
        self.tol = tol
        self.as_set = as_set  # rows are selections (registry.is_selection): compared as sets of valid ids
        self.max_examples = max_examples
        self.rows = 0
        self.exact = 0
        self.overlap = 0.0
        self.n_flips = 0
        self.n_errors = 0
        self.n_unjudged = 0
        self.flips: list[dict] = []
        self.errors: list[dict] = []
        self.first_error_pos = None
        self.first_flip_pos = None
        self.max_flip_margin = 0.0

    def _tol(self, x, y):
        return self.tol["score_atol"] + self.tol["score_rtol"] * max(abs(x), abs(y))

    def add(self, a, b, pos, sa=None, sb=None):
        """Accumulate index rows ``a``/``b`` ``[n, ...]`` (flattened to ``[n, -1]``; negative entries are padding) at
        positions ``pos [n]``; ``sa``/``sb``: optional companion scores per row, used to judge each differing row as a
        near-tie flip or an error."""
        a = a.reshape(len(a), -1)
        b = b.reshape(len(b), -1)
        # rows agree when their valid ids agree as sets (registry.selection_ids): identical rows take the fast
        # path; the rest (another order, another padded width) are compared id set by id set
        same = (a == b).all(axis=1) if a.shape == b.shape else np.zeros(len(a), dtype=bool)
        if self.as_set:
            for r in np.nonzero(~same)[0]:
                same[r] = registry.same_selection(a[r], b[r])
        n_same = int(same.sum())
        self.rows += n_same
        self.exact += n_same
        self.overlap += n_same
        for r in np.nonzero(~same)[0]:
            self.rows += 1
            ar, br = a[r], b[r]
            sA = set(registry.selection_ids(ar))
            sB = set(registry.selection_ids(br))
            self.overlap += (len(sA & sB) / len(sA)) if sA else (1.0 if not sB else 0.0)
            p = int(pos[r])
            verdict = self._judge(ar, br, sA, sB, None if sa is None else sa[r], None if sb is None else sb[r])
            verdict["position"] = p
            if verdict["kind"] == "flip":
                self.n_flips += 1
                self.max_flip_margin = max(self.max_flip_margin, verdict["margin"])
                if self.first_flip_pos is None:
                    self.first_flip_pos = p
                if len(self.flips) < self.max_examples:
                    self.flips.append(verdict)
            else:
                self.n_errors += 1
                if verdict.get("unjudged"):
                    self.n_unjudged += 1
                if self.first_error_pos is None:
                    self.first_error_pos = p
                if len(self.errors) < self.max_examples:
                    self.errors.append(verdict)

    def _judge(self, ar, br, sA, sB, sa, sb) -> dict:
        dropped, taken = sorted(sA - sB), sorted(sB - sA)
        base = {"a": [int(x) for x in ar], "b": [int(x) for x in br], "dropped": dropped, "taken": taken}
        na, nb = len(registry.selection_ids(ar)), len(registry.selection_ids(br))
        if na != nb:
            return {**base, "kind": "error", "why": f"A picked {na} items, B {nb}"}
        if not dropped or not taken:  # same count, yet no id swapped for another
            return {**base, "kind": "error", "why": ("an id picked more than once" if self.as_set else
                                                     "the same ids in other places (this tap is positional)")}
        if sb is not None:
            v = _canonical_violation(br, np.asarray(sb, dtype=np.float64))
            if v is not None:
                better, worse = v
                tie = float(sb[better]) == float(sb[worse]) if better < len(sb) and worse < len(sb) else False
                why = (f"B's pick contradicts its own scores: item {better} ranks before {worse}"
                       + (" (tie: the lower index wins)" if tie else ""))
                return {**base, "kind": "error", "why": why, "tie_break": tie}
        if sa is None:
            return {**base, "kind": "error", "unjudged": True, "why": "no companion scores to judge the pick by"}
        sa = np.asarray(sa, dtype=np.float64)
        x = max(dropped, key=lambda i: sa[i])
        y = min(taken, key=lambda i: sa[i])
        margin, t = float(sa[x] - sa[y]), self._tol(sa[x], sa[y])
        pair = (x, y)
        if math.isnan(margin) or margin == math.inf:
            return {**base, "kind": "error", "why": f"non-finite score margin ({margin})", "margin": margin}
        if margin > t:
            return {**base, "kind": "error", "why": f"dropped item {pair[0]} beats taken item {pair[1]} by "
                    f"{margin:.4g} > tolerance {t:.3g} (A's scores)", "margin": margin, "tolerance": t}
        return {**base, "kind": "flip", "margin": max(margin, 0.0), "tolerance": t, "pair": list(pair) if pair else None}

    def finish(self):
        """Returns ``(metrics, status, first_position or None, note)``; ``status`` is 'diverged' (any
        selection error), 'flip' (only near-tie flips) or 'agree'."""
        metrics = {"exact_match": self.exact / self.rows if self.rows else 1.0,
                   "set_overlap": self.overlap / self.rows if self.rows else 1.0,
                   "flips": self.n_flips, "errors": self.n_errors, "unjudged": self.n_unjudged,
                   "max_flip_margin": self.max_flip_margin}
        if self.n_errors:
            status, first = "diverged", self.first_error_pos
            note = f"{self.n_errors} selection errors" + (f", {self.n_flips} flips" if self.n_flips else "")
            if self.errors:
                note += f"; first at position {self.errors[0]['position']}: {self.errors[0]['why']}"
        elif self.n_flips:
            status, first = "flip", self.first_flip_pos
            note = f"{self.n_flips} near-tie flips (max margin {self.max_flip_margin:.3g})"
        else:
            status, first, note = "agree", None, ""
        return metrics, status, first, note
