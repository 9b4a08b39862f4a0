"""Verdict thresholds and the rules that apply them: what a logit comparison must stay within to PASS.

Every threshold is a multiple of a precision floor MEASURED on the model and prompts of the run
(:mod:`parity.harness.floor`), relative to the model's logit scale (:func:`parity.harness.metrics.logit_scale`):
no constant depends on one checkpoint (docs/parity.md, "Thresholds"). The rules (:func:`verdict`,
:func:`position_faults`, :func:`top1_flips`, :func:`pick_faults`) judge a
:class:`parity.harness.metrics.LogitComparison`; :func:`tie_band` is the selection-score band of the tie
judgement (:mod:`parity.harness.ties`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from parity.harness.metrics import LogitComparison, logit_scale, topk_sets
from reference.errors import InputError

__all__ = ["fault_positions", "UNIT_ROUNDOFF", "USEFUL_FAULT_REL", "FLOOR_MULTIPLE", "FLOOR_OF", "NOMINAL_GROWTH", "KLThresholds",
           "thresholds_for", "tie_band", "top1_flips", "pick_faults", "kl_bound", "position_faults", "verdict"]

#: unit roundoff 2^-(p) of each format (p = mantissa bits + 1 -> u = 2^-p): the smallest meaningful relative
#: floor (a measured floor below it means the logits happened to be exact, not that an engine can do better)
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11,
                 "fp8": 2.0 ** -4}
#: the size of fault the harness must be able to resolve on a model, relative to the logit scale: the
#: range of faults that matter (a wrong constant, a stale state entry, a tie broken outside its set) moves logits
#: by 1e-3..1e-2 of max |logit|, i.e. up to ~4e-2 of the scale (max |logit| is ~4 std on these models). A model
#: and precision whose tolerance is above it cannot tell such a fault from rounding: the verdict is INCONCLUSIVE.
USEFUL_FAULT_REL = 1e-2
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
    best = topk_sets(truth_rows, 1)[:, 0] if len(picks) else np.zeros(0, np.int64)
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


def fault_positions(cmp: LogitComparison, th: KLThresholds, offset: int = 0) -> tuple[int | None, int]:
    """``(first, worst)``: the first position failing :func:`verdict`'s rules (None when none does) and the position
    of the worst logit error (a NaN counts as the worst), each plus ``offset`` (the comparison's first position)."""
    bad = position_faults(cmp, th)
    rel = np.where(np.isnan(cmp.rel_err()), np.inf, cmp.rel_err())
    return (offset + int(np.argmax(bad)) if bad.any() else None), offset + int(np.argmax(rel))


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


def tie_band(th) -> float:
    """The near-tie band, relative to a selection layer's score scale (its largest |score|): ``2 * multiple * score floor`` (a
    backend whose scores are within ``multiple`` floors of the truth's may order two candidates this close
    either way). ``th``: the run's :class:`KLThresholds` (``score_rel``: the score floor of
    the floor they come from: float32, or the store-rounding one of the backend's stores)."""
    sr = th.score_rel if np.isfinite(th.score_rel) else UNIT_ROUNDOFF["float32"]
    return 2.0 * th.multiple * max(float(sr), UNIT_ROUNDOFF["float32"])
