"""Measured precision floors and selection ties: what a CORRECT engine's logits may differ by, on this model.

Every verdict threshold of the harness is a multiple of a floor measured here, on the model under test
and the prompts of the run (docs/parity.md, "Thresholds"):

* the **float32 floor**: the reference in float32 against the reference in float64, as the envelope
  (maximum) over several float32 evaluation orders (:data:`FLOOR_ORDERS`, :mod:`reference.order`). Any
  correct float32 engine computes the same function with the same unit roundoff, so its error against
  float64 is of the same order; only the order of its roundings differs, and one order's max over positions
  is one sample of that noise, which another order exceeds at some position;
* a **reduced-precision floor** (``bf16``, ``fp16``, ``fp8``): the float32 reference with its activations
  rounded to that format at the points an engine stores them (:data:`STORE_KINDS`: the residual stream,
  each block's input and output, the attention KV and indexer keys; GDN/PLE state stays float32 as
  engines keep it), against float64. It is the noise of a correct engine at that precision on this model.

Both floors are measured with every discrete selection (QSA block top-k, MoE expert top-k) FORCED to the
float64 run's, so a floor is continuous rounding noise and never the jump of a selection flip (on the
verdict-matrix models the all-BF16 store rounding left to pick for itself flips 1..30 rows and errs 1.5..4x
more). Selections are judged separately, with ties (:func:`tie_report`): a backend may pick differently only
inside a tie set at the cut (exact ties, or scores within the tie band of this floor's score floor,
:func:`parity.harness.thresholds.tie_band`).

A store floor is dominated by the stores on the residual path: on the verdict-matrix models every store kind
in BF16 gives 0.087..0.40 of the logit scale, the KV stores alone ~1.5e-3 (:func:`floor_breakdown`; the
reason of a run too coarse to resolve a useful fault names them, :func:`unresolvable`).

Logit errors are measured relative to the model's logit scale, :func:`parity.harness.metrics.logit_scale`
(the per-position standard deviation of the truth's logits).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from parity.harness.metrics import compare_logits
from parity.harness.sizes import sizes, token_stream
from parity.harness.thresholds import UNIT_ROUNDOFF, USEFUL_FAULT_REL, thresholds_for, tie_band
from reference import taphook
from reference.errors import InputError
from reference.order import ALTERNATIVES, NATIVE, evaluation_order
from taps import registry
from taps.diff import Profile

__all__ = ["FLOOR_ORDERS", "STORE_KINDS", "ROUNDINGS", "rounder", "stores_of", "stores_label", "SelectionLog", "Floor", "measure_floor", "tie_report",
           "TieReport", "forced_logits", "measure_floors", "thresholds_for_runs", "UNIT_ROUNDOFF", "floor_prompts", "thresholds_for_run", "tap_floor_profile",
           "with_tap_profile", "floor_breakdown", "unresolvable", "tap_floors", "tap_profile_of"]

#: where the reduced-precision floor rounds (``reference.model.ReferenceModel.store_round`` kinds)
STORE_KINDS = ("residual", "block_io", "kv")
#: the formats a reduced-precision floor can round to
ROUNDINGS = ("bf16", "fp16", "fp8")
_E4M3_MAX = 448.0
#: the float32 evaluation orders a float32 floor is the envelope (maximum) of: the reference's own and the
#: alternatives of :mod:`reference.order` (split-K accumulations, both forms of the gated delta rule). One
#: order's floor is one rounding sequence's noise; another correct float32 engine (other GEMM tiling, the
#: other delta-rule form, fused kernels) rounds in another sequence: on ``tiny`` the official model's worst
#: prefill error against float64 is 1.89e-5 of the logit scale, 2.4x the native order's floor (8.0e-6) and
#: 1.8x the envelope's (1.05e-5) -- within the limit's 8x with a factor >= 4 (docs/parity.md, "The floor").
FLOOR_ORDERS = (NATIVE,) + tuple(ALTERNATIVES)


def stores_of(backend) -> dict:
    """The activation stores a backend rounds: ``{kind: format}`` over :data:`STORE_KINDS`.

    A backend declares them as ``capabilities["stores"]`` (e.g. ``{}`` for an engine whose activations,
    accumulation and state are float32 whatever its weight precision, as ``engine-cpu``/``engine-cuda``). Without
    a declaration: none for 'float32'/'float64', and every store kind in the declared format otherwise (the
    conservative reading of "a bf16 engine": it may round everything it stores).
    """
    caps = getattr(backend, "capabilities", None) or {}
    if caps.get("stores") is not None:
        return dict(caps["stores"])
    prec = getattr(backend, "precision", "float32")
    return {} if prec in ("float32", "float64") else {k: prec for k in STORE_KINDS}


def stores_label(stores: dict) -> str:
    """'float32' for no stores, else e.g. 'bf16[residual,block_io,kv]' (kinds grouped per format)."""
    if not stores:
        return "float32"
    by = {}
    for k, f in stores.items():
        by.setdefault(f, []).append(k)
    return "+".join(f"{f}[{','.join(ks)}]" for f, ks in sorted(by.items()))


def rounder(fmt, kinds: Sequence[str] = STORE_KINDS):
    """A ``store_round`` hook ``(kind, array) -> array`` rounding ``kinds`` to ``fmt`` (round-to-nearest-even
    via ml_dtypes) and back to the array's dtype; other kinds pass unchanged.

    ``fp8`` is E4M3 with a dynamic per-row scale ``amax / 448`` (the ``activation_scheme: dynamic`` of FP8
    checkpoints: each token's activations are scaled into range before the cast).

    ``fmt`` may also be a ``{kind: format}`` dict (each kind its own format; ``kinds`` is then ignored).

    Raises:
        InputError: unknown format or kind.
    """
    import ml_dtypes   # over 1 s to import: only where a rounding floor is measured

    per = dict(fmt) if isinstance(fmt, dict) else {k: fmt for k in kinds}
    for k, f in per.items():
        if f not in ROUNDINGS:
            raise InputError(f"rounding format: expected one of {ROUNDINGS}, found {f!r}")
        if k not in STORE_KINDS:
            raise InputError(f"store kind: expected one of {STORE_KINDS}, found {k!r}")
    dts = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8": ml_dtypes.float8_e4m3fn}

    def fn(kind, a):
        fmt = per.get(kind)
        if fmt is None:
            return a
        dt = dts[fmt]
        a = np.asarray(a)
        if fmt != "fp8":
            with np.errstate(over="ignore"):
                return a.astype(dt).astype(a.dtype)
        flat = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
        amax = np.max(np.abs(flat), axis=1, keepdims=True)
        s = np.where(amax > 0, amax / _E4M3_MAX, 1.0).astype(a.dtype)
        return ((flat / s).astype(dt).astype(a.dtype) * s).reshape(a.shape)
    fn.stores = per
    return fn


# ----------------------------------------------------------------------------------------------- selections
@dataclass
class SelectionLog:
    """Every discrete selection of one full forward: per QSA layer the block scores ``[T, NB]`` and the
    selected blocks ``[T, k]`` (-1 padded); per MoE layer the router probabilities ``[T, E]`` and the expert
    ids ``[T, k]``. Filled by :meth:`record` hooks; replayed by :meth:`force` hooks."""

    qsa_scores: dict = field(default_factory=dict)
    qsa_sel: dict = field(default_factory=dict)
    moe_probs: dict = field(default_factory=dict)
    moe_ids: dict = field(default_factory=dict)

    def install_record(self, model):
        """Make ``model`` log its selections here (its own picks unchanged)."""
        def q(layer, pos, scores, sel):
            self.qsa_scores[layer] = np.array(scores, dtype=np.float64)
            self.qsa_sel[layer] = np.array(sel)
            return sel

        def m(layer, pos, probs, ids):
            self.moe_probs[layer] = np.array(probs, dtype=np.float64)
            self.moe_ids[layer] = np.array(ids)
            return ids
        model.selection_hook, model.expert_hook = q, m

    def install_force(self, model, log_into: "SelectionLog | None" = None):
        """Make ``model`` take this log's selections (same token ids and positions 0..T-1); its own scores
        are logged into ``log_into`` when given."""
        def q(layer, pos, scores, sel):
            if log_into is not None:
                log_into.qsa_scores[layer] = np.array(scores, dtype=np.float64)
                log_into.qsa_sel[layer] = np.array(sel)
            return self.qsa_sel[layer][np.asarray(pos)] if layer in self.qsa_sel else sel

        def m(layer, pos, probs, ids):
            if log_into is not None:
                log_into.moe_probs[layer] = np.array(probs, dtype=np.float64)
                log_into.moe_ids[layer] = np.array(ids)
            return self.moe_ids[layer][np.asarray(pos)] if layer in self.moe_ids else ids
        model.selection_hook, model.expert_hook = q, m

    def prefix(self, n: int, compress_ratio: int) -> "SelectionLog":
        """The log of the first ``n`` positions (a causal model's forward over a prefix selects the same way from
        the same scores): rows ``[:n]``, QSA block scores cut to the ``n // compress_ratio`` blocks a prefix of
        ``n`` tokens completes. Arrays are views of this log's."""
        r = int(compress_ratio or 1)
        return SelectionLog(qsa_scores={i: a[:n, :n // r] for i, a in self.qsa_scores.items()},
                            qsa_sel={i: a[:n] for i, a in self.qsa_sel.items()},
                            moe_probs={i: a[:n] for i, a in self.moe_probs.items()},
                            moe_ids={i: a[:n] for i, a in self.moe_ids.items()})


def _uninstall(model):
    model.selection_hook = model.expert_hook = None


def forced_logits(model, ids, log: SelectionLog, log_into: SelectionLog | None = None) -> np.ndarray:
    """``model.forward(ids)`` with every selection forced to ``log``'s (hooks removed afterwards)."""
    log.install_force(model, log_into)
    try:
        return np.asarray(model.forward(list(ids)))
    finally:
        _uninstall(model)


def logged_logits(model, ids) -> tuple[np.ndarray, SelectionLog]:
    """``(model.forward(ids), its SelectionLog)``."""
    log = SelectionLog()
    log.install_record(model)
    try:
        return np.asarray(model.forward(list(ids))), log
    finally:
        _uninstall(model)


def _layer_scale(y: np.ndarray) -> float:
    """A selection layer's score scale: the largest finite |score| over all its rows (one scale per layer, so
    rows with small scores -- early positions, near-zero relu sums -- do not inflate relative errors)."""
    fin = np.isfinite(y)
    return float(np.max(np.abs(y[fin]))) if fin.any() else 0.0


def _score_rel(a: dict, b: dict) -> float:
    """max over layers of max |a - b| / the layer's score scale (:func:`_layer_scale` of b), finite entries."""
    worst = 0.0
    for k, y in b.items():
        x = a.get(k)
        if x is None or x.shape != y.shape:
            continue
        fin = np.isfinite(y) & np.isfinite(x)
        sc = _layer_scale(y)
        if not fin.any() or sc <= 0:
            continue
        worst = max(worst, float(np.max(np.abs(x[fin] - y[fin]))) / sc)
    return worst


@dataclass
class TieReport:
    """Ties at every selection cut of one truth forward.

    ``cuts``: one entry per (kind, layer, position) where the cut has a tie set larger than the slots it
    decides: ``{"kind": "qsa"|"moe", "layer", "position", "exact": bool, "gap": kth - next (>= 0),
    "tie_set": [ids whose score is within tol of the k-th], "inside": [those the truth keeps]}``.
    """

    cuts: list = field(default_factory=list)

    @property
    def exact(self) -> int:
        """Number of cuts with an exact tie (equal scores straddling the cut)."""
        return sum(1 for c in self.cuts if c["exact"])

    @property
    def near(self) -> int:
        """Number of cuts with a floor-level near tie (not exact)."""
        return sum(1 for c in self.cuts if not c["exact"])

    def at(self, kind: str, layer: int, position: int):
        """The cut entry of (kind, layer, position), or None when that cut is not tied."""
        for c in self.cuts:
            if c["kind"] == kind and c["layer"] == layer and c["position"] == position:
                return c
        return None

    def summary(self) -> dict:
        """JSON-ready counts per kind and the first few cuts."""
        out = {"exact": self.exact, "near": self.near}
        for kind in ("qsa", "moe"):
            out[kind] = sum(1 for c in self.cuts if c["kind"] == kind)
        out["first"] = self.cuts[:5]
        return out


def _cut_ties(kind, layer, scores, sel, k, tol_rel, positions, out):
    """Append the tied cuts of one layer's selection (scores ``[T, N]``, canonical sel ``[T, k]``); the band
    is ``tol_rel`` of the layer's score scale (:func:`_layer_scale`)."""
    tol = tol_rel * _layer_scale(scores)
    T, N = scores.shape
    if N <= k:
        return  # every candidate of every row is selected: no cut
    # the rows whose k-th and (k+1)-th values lie within the band, found by a partition over row blocks (the
    # per-row loop below then visits only those: 32768 rows of 8192 blocks otherwise cost a sort each)
    cand = []
    step = max(1, (1 << 23) // N)
    for s0 in range(0, T, step):
        blk = scores[s0:s0 + step]
        fin = np.isfinite(blk)
        vals = np.where(fin, blk, -np.inf)
        part = -np.partition(-vals, (k - 1, k), axis=1)
        with np.errstate(invalid="ignore"):
            far = (part[:, k - 1] - part[:, k]) > tol
        cand.extend((s0 + np.nonzero((fin.sum(axis=1) > k) & ~far)[0]).tolist())
    for t in cand:
        row = scores[t]
        fin = np.isfinite(row)
        vals = np.where(fin, row, -np.inf)
        order = np.argsort(-vals, kind="stable")
        kth, nxt = vals[order[k - 1]], vals[order[k]]
        if kth - nxt > tol:
            continue
        tie = np.nonzero(fin & (np.abs(vals - kth) <= tol))[0]
        keep = set(int(x) for x in sel[t] if x >= 0)
        out.append({"kind": kind, "layer": int(layer), "position": int(positions[t]), "exact": bool(kth == nxt),
                    "gap": float(kth - nxt), "tie_set": [int(x) for x in tie],
                    "inside": sorted(int(x) for x in tie if int(x) in keep)})


def tie_report(log: SelectionLog, config, score_tol_rel: float = 0.0) -> TieReport:
    """Exact ties (equal scores at the k-th / (k+1)-th place) and near ties (within ``score_tol_rel`` of the
    layer's score scale) at every QSA block top-k and MoE expert top-k cut of a logged forward."""
    rep = TieReport()
    for layer, sc in sorted(log.qsa_scores.items()):
        _cut_ties("qsa", layer, sc, log.qsa_sel[layer], config.block_topk, score_tol_rel, np.arange(sc.shape[0]),
                  rep.cuts)
    for layer, pr in sorted(log.moe_probs.items()):
        _cut_ties("moe", layer, pr, log.moe_ids[layer], config.num_experts_per_tok, score_tol_rel,
                  np.arange(pr.shape[0]), rep.cuts)
    rep.cuts.sort(key=lambda c: (c["position"], c["kind"] != "qsa", c["layer"]))
    return rep


# ----------------------------------------------------------------------------------------------- floors
@dataclass
class Floor:
    """A measured floor (see the module docstring). Relative errors are max over positions of
    ``max_v |logit - logit_f64| / logit_scale``.

    ``precision``: 'float32' or a rounding format; ``logit_rel``, ``kl``: that floor's worst relative logit
    error and KL; ``score_rel``: its worst relative selection-score error (QSA block scores, MoE router
    probabilities); ``f32_logit_rel``/``f32_score_rel``: the float32 floor (always measured); ``positions``;
    ``ties``: the float64 truth's :class:`TieReport` (near ties at the float32 score floor).
    """

    precision: str
    logit_rel: float
    kl: float
    score_rel: float
    f32_logit_rel: float
    f32_score_rel: float
    positions: int
    ties: TieReport = field(default_factory=TieReport)
    stores: tuple = ()
    #: ``{store kind: logit_rel}``: the floor of each store kind rounded alone (:func:`floor_breakdown`), or
    #: empty when not measured; it says which stores make a floor coarse
    by_kind: dict = field(default_factory=dict)
    #: ``{evaluation order name: logit_rel}``: the float32 floor of each order of :data:`FLOOR_ORDERS` (the
    #: float32 floor is their maximum)
    by_order: dict = field(default_factory=dict)
    #: where this floor came from: "measured" or, with $QWEN4EXP_FLOOR_CACHE set, the cache entry it was read
    #: from / written to (parity.harness.floor_cache); not part of the measurement
    source: str = "measured"
    #: ``{tap: (rel_l2, atol_rms)}`` recorded from this floor's own forwards (:func:`measure_floor`'s ``tap_ids``),
    #: else None; not part of :meth:`to_json`
    tap_floors: dict | None = None

    def to_json(self) -> dict:
        """JSON-ready fields (tie cuts summarised)."""
        return {"precision": self.precision, "logit_rel": self.logit_rel, "kl": self.kl, "score_rel": self.score_rel,
                "f32_logit_rel": self.f32_logit_rel, "f32_score_rel": self.f32_score_rel,
                "positions": self.positions, "stores": list(self.stores), "by_kind": dict(self.by_kind),
                "by_order": dict(self.by_order), "ties": self.ties.summary(), "source": self.source}


def _rel_err(x: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    c = compare_logits(ref, x)
    rel = c.rel_err()
    return (float(np.max(rel)) if rel.size else 0.0), c.worst_kl()


def _stores_of_precision(precision) -> dict:
    """``{kind: format}`` of a floor precision argument (see :func:`measure_floor`).

    Raises:
        InputError: an unknown precision.
    """
    if isinstance(precision, dict):
        return dict(precision)
    if precision in ("float32", "float64"):
        return {}
    if precision in ROUNDINGS:
        return {k: precision for k in STORE_KINDS}
    raise InputError(f"floor precision: expected float32/float64 or one of {ROUNDINGS}, found {precision!r}")


def measure_floor(weights, prompts: Sequence[Sequence[int]], precision="float32",
                  tap_ids: Sequence[int] | None = None) -> Floor:
    """Measure a floor on ``weights`` (a Checkpoint/DictWeights) over ``prompts`` (token-id lists).

    Args:
        precision: 'float32'/'float64' (the float32 floor), a format of :data:`ROUNDINGS` (every store kind
            rounded to it), or a ``{kind: format}`` dict (:func:`stores_of`; ``{}`` = the float32 floor).
    The float32 floor is the envelope over :data:`FLOOR_ORDERS`: per order the worst error over the prompts,
    then the largest order (``Floor.by_order`` keeps each order's figure).
    Cost: per prompt one float64, one float32 forward per order of :data:`FLOOR_ORDERS` and (reduced precision)
    one rounded float32 forward.
    tap_ids: one of ``prompts`` whose forwards also give the per-tap floors (:func:`tap_floors` of those ids,
        kept in ``Floor.tap_floors``): for the float32 floor (no stores) they are the same forwards, so the tap
        profile costs no forward of its own; with stores, or ids not among the prompts, nothing is recorded.
    Returns:
        :class:`Floor` (``precision`` = :func:`stores_label` of the stores rounded).
    Raises:
        InputError: an unknown precision.
    """
    return measure_floors(weights, prompts, [precision], tap_ids=tap_ids)[0]


def measure_floors(weights, prompts: Sequence[Sequence[int]], precisions: Sequence,
                   tap_ids: Sequence[int] | None = None) -> list[Floor]:
    """The floors of several store sets over the same ``prompts`` in one pass: :func:`measure_floor` of each
    element of ``precisions``, bitwise, with the backend-independent forwards run once -- per prompt one float64
    forward (its selections force every other) and one float32 forward per order of :data:`FLOOR_ORDERS` (the
    float32 envelope every floor carries); then per distinct non-empty store set one rounded float32 forward.

    Args:
        weights: a Checkpoint/DictWeights. prompts: token-id lists.
        precisions: each as :func:`measure_floor`'s ``precision`` (equal store sets are measured once).
        tap_ids: as :func:`measure_floor`: the per-tap float32 floors, recorded from the same forwards, are kept
            in the float32 floors (those with no stores) only.
    Returns:
        ``[Floor]`` in the order of ``precisions`` (distinct objects, also for equal store sets).
    Raises:
        InputError: an unknown precision.
    """
    from reference.model import ReferenceModel   # imports Numba (seconds): only where a model is built
    sets = [_stores_of_precision(p) for p in precisions]
    labels = list(dict.fromkeys(stores_label(st) for st in sets if st))   # distinct rounded store sets, in order
    rounded_of = {stores_label(st): st for st in sets if st}
    m64 = ReferenceModel(weights, dtype=np.float64)
    m32 = ReferenceModel(weights, dtype=np.float32)
    mrs = {}
    for lab in labels:
        mr = ReferenceModel(weights, dtype=np.float32)
        mr.store_round = rounder(rounded_of[lab])
        mrs[lab] = mr
    f32_rel = f32_kl = f32_srel = 0.0
    r_fig = {lab: [0.0, 0.0, 0.0] for lab in labels}   # per store set: logit_rel, kl, score_rel
    n = 0
    logs = []
    by_order = {}
    want_taps = None if tap_ids is None or all(sets) else [int(t) for t in tap_ids]
    tap_fl = None
    for ids in prompts:
        keep = want_taps is not None and [int(t) for t in ids] == want_taps
        if keep:   # these forwards are tap_floors' own: their taps kept (the float64 ones are its reference)
            ref, (l64, log) = _captured(lambda: logged_logits(m64, ids))  # noqa: B023 - called at once
            tap_fl = {}
        else:
            l64, log = logged_logits(m64, ids)
        logs.append(log)
        for o in FLOOR_ORDERS:   # the envelope over legitimate float32 evaluation orders
            s32 = SelectionLog()
            with evaluation_order(o):
                if keep:
                    got, l32 = _captured(lambda: forced_logits(m32, ids, log, s32))  # noqa: B023
                    _merge_tap_floors(tap_fl, ref, got)
                    del got
                else:
                    l32 = forced_logits(m32, ids, log, s32)
            e, k = _rel_err(l32, l64)
            by_order[o.name] = max(by_order.get(o.name, 0.0), e)
            f32_rel, f32_kl = max(f32_rel, e), max(f32_kl, k)
            f32_srel = max(f32_srel, _score_rel(s32.qsa_scores, log.qsa_scores),
                           _score_rel(s32.moe_probs, log.moe_probs))
        for lab, mr in mrs.items():
            sr = SelectionLog()
            lr = forced_logits(mr, ids, log, sr)
            e, k = _rel_err(lr, l64)
            fig = r_fig[lab]
            fig[0], fig[1] = max(fig[0], e), max(fig[1], k)
            fig[2] = max(fig[2], _score_rel(sr.qsa_scores, log.qsa_scores), _score_rel(sr.moe_probs, log.moe_probs))
        n += len(ids)
    out = []
    for st in sets:
        if not st:
            fl = Floor("float32", f32_rel, f32_kl, f32_srel, f32_rel, f32_srel, n, TieReport(), ())
            if tap_fl is not None:
                fl.tap_floors = dict(tap_fl)
        else:
            r_rel, r_kl, r_srel = r_fig[stores_label(st)]
            fl = Floor(stores_label(st), r_rel, r_kl, r_srel, f32_rel, f32_srel, n, TieReport(), tuple(sorted(st)))
        fl.by_order = dict(by_order)
        # the truth's ties are reported at the band a backend of these stores is judged with (parity.harness.ties):
        # exact ties, and floor-level near ties within 2 x multiple x this floor's score floor
        band = tie_band(thresholds_for("bf16" if st else "float32", fl))
        for i, log in enumerate(logs):
            rep = tie_report(log, weights.config, band)
            for c in rep.cuts:
                c["prompt"] = i
            fl.ties.cuts.extend(rep.cuts)
        out.append(fl)
    return out


def floor_breakdown(weights, prompts: Sequence[Sequence[int]], floor: Floor) -> Floor:
    """``floor`` with :attr:`Floor.by_kind` measured: the floor of each of its store kinds rounded alone (same
    prompts, selections forced to float64's). Says which stores make a floor coarse (on the verdict-matrix
    models the BF16 KV stores alone are ~1e-3 of the logit scale, the residual and block stores 0.05..0.3).
    Cost: one :func:`measure_floor` per store kind. A float32 floor or a one-kind floor is returned as is."""
    if len(floor.stores) < 2:
        return floor
    fmt = dict(_parse_label(floor.precision))
    by = {k: measure_floor(weights, prompts, {k: fmt[k]}).logit_rel for k in floor.stores}
    return dataclasses.replace(floor, by_kind=by)


def _parse_label(label: str):
    """``[(kind, format)]`` of a :func:`stores_label` ('bf16[kv,residual]+fp8[block_io]')."""
    out = []
    for part in label.split("+"):
        if "[" in part:
            f, ks = part.rstrip("]").split("[", 1)
            out += [(k, f) for k in ks.split(",") if k]
    return out


def unresolvable(th, floor: Floor | None = None) -> str | None:
    """Why a run under thresholds ``th`` cannot resolve a fault of useful size
    (:data:`parity.harness.thresholds.USEFUL_FAULT_REL`), or None when it can: the tolerance is at or above that size.
    The reason names the floor and, when ``floor.by_kind`` is measured (:func:`floor_breakdown`), each store
    kind's own floor and which of them alone would be resolvable."""
    if np.isfinite(th.tol_rel) and th.tol_rel < USEFUL_FAULT_REL:
        return None
    prec = floor.precision if floor is not None else th.precision
    why = (f"tolerance {th.tol_rel:.3g} of the logit scale ({th.multiple:g}x the {prec} floor {th.floor_rel:.3g}) >= "
           f"{USEFUL_FAULT_REL:g}: this model at this precision cannot resolve a fault of useful size")
    if floor is not None and floor.by_kind:
        parts = ", ".join(f"{k} alone {v:.3g}" for k, v in sorted(floor.by_kind.items()))
        ok = sorted(k for k, v in floor.by_kind.items() if th.multiple * v < USEFUL_FAULT_REL)
        why += f" (store floors: {parts}" + (f"; resolvable with only {', '.join(ok)} rounded)" if ok else ")")
    return why


def with_tap_profile(th, weights, ids, stores: dict | None = None):
    """``th`` with its ``tap_profile`` measured (:func:`tap_floor_profile` at ``th.multiple``, index flips
    within the tie band): tap-diff then localises against this model's own per-tap floor."""
    prof = tap_floor_profile(weights, ids, stores, th.multiple, tie_band(th))
    return dataclasses.replace(th, tap_profile=prof)


def floor_prompts(config, prompts: Sequence[Sequence[int]] | None = None, seed: int = 1234) -> list[list[int]]:
    """The prompts a run's floor is measured on: ``prompts`` (the KL set) plus one deterministic token stream
    reaching two compress blocks past the QSA bound (the scenarios' sparse regime, where the selection cuts
    are), with EOS ids inside (the PLE reset). A prompt equal to that stream is not measured twice (the floor is
    a maximum over prompts: a repeat adds nothing but its forwards)."""
    s = sizes(config)
    n = min(s.bound + 2 * s.ratio + 1, int(getattr(config, "max_position_embeddings", 1 << 30)))
    out = [list(map(int, p)) for p in (prompts or [])]
    stream = token_stream(config, n, seed, eos_every=max(2, s.ratio + 1))
    if stream not in out:
        out.append(stream)
    return out


def _floor_payload(fl: Floor, taps: dict) -> dict:
    """The JSON entry of a measured floor and its per-tap floors (:mod:`parity.harness.floor_cache`)."""
    d = {f.name: getattr(fl, f.name) for f in dataclasses.fields(fl) if f.name not in ("ties", "tap_floors")}
    d["stores"], d["ties"] = list(fl.stores), list(fl.ties.cuts)
    return {"floor": d, "tap_floors": [[k, [float(v[0]), float(v[1])]] for k, v in taps.items()]}


def _cached_floor(material: dict):
    """``(Floor, tap floors, path)`` of the cache entry of ``material``, or None (none, or one lacking a field)."""
    from parity.harness import floor_cache
    got = floor_cache.load(material)
    if got is None:
        return None
    doc, path = got
    try:
        d = doc["floor"]
        names = {f.name for f in dataclasses.fields(Floor)} - {"tap_floors"}   # kept beside the floor
        if set(d) != names:
            return None
        fl = Floor(**{**d, "stores": tuple(d["stores"]), "ties": TieReport(cuts=list(d["ties"]))})
        taps = {str(k): (float(v[0]), float(v[1])) for k, v in doc["tap_floors"]}
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    return fl, taps, path


def thresholds_for_run(weights, backend, prompts: Sequence[Sequence[int]] | None = None):
    """Measure the floor of ``backend``'s stores (:func:`stores_of`) on ``weights`` over :func:`floor_prompts`
    and derive the run's thresholds.

    Returns:
        ``(KLThresholds, Floor, inconclusive)``: ``inconclusive`` is None, or the reason the tolerance cannot
        resolve a fault of useful size (:data:`parity.harness.thresholds.USEFUL_FAULT_REL`) -- then a passing row
        is INCONCLUSIVE, never PASS.
    """
    return thresholds_for_runs(weights, [backend], prompts)[0]


def thresholds_for_runs(weights, backends: Sequence, prompts: Sequence[Sequence[int]] | None = None) -> list:
    """:func:`thresholds_for_run` of several backends judged on the same weights and prompts, their floors measured
    together (:func:`measure_floors`: the float64 and float32-order forwards once, one rounded forward per
    distinct store set); each floor read from / kept in ``$QWEN4EXP_FLOOR_CACHE`` as a run of its own would.
    Backends of equal stores get equal floors (distinct objects); thresholds follow each backend's precision.

    Returns:
        ``[(KLThresholds, Floor, inconclusive)]`` in the order of ``backends``.
    """
    from parity.harness import floor_cache
    fps = floor_prompts(weights.config, prompts)
    stream = floor_prompts(weights.config, None)[-1]
    stores = [stores_of(b) for b in backends]
    labels = [stores_label(st) for st in stores]
    got = {}   # store label -> (Floor, tap floors, source)
    for st, lab in zip(stores, labels):
        if lab in got:
            continue
        # the same weights, prompts, stores and code measure the same floor: kept once in $QWEN4EXP_FLOOR_CACHE
        material = (floor_cache.key_material(weights, fps, st, stream, FLOOR_ORDERS) if floor_cache.cache_dir()
                    else None)
        hit = _cached_floor(material) if material is not None else None
        got[lab] = (hit[0], hit[1], f"read from {hit[2]}", material) if hit is not None else (None, None, None,
                                                                                            material)
    missing = [lab for lab, v in got.items() if v[0] is None]
    if missing:
        first = {lab: st for st, lab in zip(stores, labels)}
        fls = measure_floors(weights, fps, [first[lab] for lab in missing], tap_ids=stream)  # the stream is one of fps
        for lab, fl in zip(missing, fls):
            st = first[lab]
            taps = fl.tap_floors if fl.tap_floors is not None else tap_floors(weights, stream, st)
            material = got[lab][3]
            src = (f"measured, kept in {floor_cache.store(material, _floor_payload(fl, taps))}"
                   if material is not None else "measured")
            got[lab] = (fl, taps, src, material)
    out = []
    for b, st, lab in zip(backends, stores, labels):
        fl0, taps, src, _ = got[lab]
        fl = dataclasses.replace(fl0, ties=TieReport(cuts=list(fl0.ties.cuts)), by_order=dict(fl0.by_order),
                                 by_kind=dict(fl0.by_kind), source=src)
        th = thresholds_for(getattr(b, "precision", "float32"), fl)
        th = dataclasses.replace(th, tap_profile=tap_profile_of(taps, th.multiple, tie_band(th), st, len(stream)))
        if unresolvable(th, fl):   # a coarse floor: say which stores make it so (one floor per store kind)
            fl = floor_breakdown(weights, fps, fl)
        out.append((th, fl, unresolvable(th, fl)))
    return out


def tap_floor_profile(weights, ids: Sequence[int], stores: dict | None = None, multiple: float = 8.0,
                      score_rel: float | None = None, rows: Sequence[int] | None = None):
    """A tap-diff tolerance profile measured on this model: per activation tap, ``multiple`` x that tap's own
    floor (the float32 reference, or the store-rounding one for ``stores``, against float64 over ``ids``, all
    selections forced to the float64 run's).

    Each tap's floor is the envelope (maximum) over the float32 evaluation orders of :data:`FLOOR_ORDERS`,
    the rule of the logit floor. Per tap: ``rel_l2`` = multiple x the floor's rel_l2; the element rule ``|b - a| <= atol_rms * rms(a)``
    with ``atol_rms`` = multiple x the floor's max |delta| / rms (``rtol`` 0); ``cos_min`` = 1 - rel_l2^2 / 2
    (the cosine a relative error rel_l2 allows). A tap whose floor is below the float32 unit roundoff gets
    that. Index taps (selections): a flip within ``score_rel`` (the tie band, parity.harness.ties) of the
    row's scores is a near tie. Returns a :class:`taps.diff.Profile`; the per-tap figures are in its
    ``source`` text's companion attribute ``floors`` (``{tap: (rel_l2, atol_rms)}``).

    ``rows``: the positions a comparison will judge (e.g. the one row of a decode step), when not all of ``ids``:
    each tap's figures are then the larger of the whole history's and those rows' alone (same forwards). A
    relative error over all rows can sit far below that of the last rows, where the error has accumulated
    (measured on tiny: layers.4.linear_attn.norm.out at 1.04e-6 over 39 rows, while the reference's own decode of
    the 39th row is 9.0e-6 off its one-shot forward): judged at the whole history's floor, a correct decode step
    was named as the divergence's entry. The rows' own floor is the same rule applied to what is compared.
    """
    return tap_profile_of(tap_floors(weights, ids, stores, rows), multiple, score_rel, stores, len(ids))


def tap_floors(weights, ids: Sequence[int], stores: dict | None = None, rows: Sequence[int] | None = None) -> dict:
    """Per activation tap of one forward over ``ids``, its floor ``(rel_l2, atol_rms)``: the float32 reference
    (store-rounded for ``stores``) against float64, selections forced to the float64 run's, the envelope
    over :data:`FLOOR_ORDERS` (each at least the float32 unit roundoff). The measurement behind
    :func:`tap_floor_profile` (:func:`tap_profile_of` turns it into a profile); :func:`measure_floor` records
    the same figures from its own forwards when asked (``tap_ids``). ``rows``: positions judged alone later; each
    figure is then also at least those rows' own (:func:`tap_floor_profile` says why). Cost: one float64 and one
    float32 forward per order, every tap kept in float64."""
    from reference.model import ReferenceModel   # imports Numba (seconds): only where a model is built

    ref, (_, log) = _captured(lambda: logged_logits(ReferenceModel(weights, dtype=np.float64), ids))
    m = ReferenceModel(weights, dtype=np.float32)
    if stores:
        m.store_round = rounder(stores)
    floors = {}
    for o in FLOOR_ORDERS:   # per tap, the envelope over the float32 evaluation orders (as the logit floor)
        with evaluation_order(o):
            got, _ = _captured(lambda: forced_logits(m, ids, log))  # noqa: B023 - called at once
        _merge_tap_floors(floors, ref, got)
        if rows is not None:
            _merge_tap_floors(floors, ref, got, rows=[int(r) for r in rows], n=len(ids))
    return floors


class _Keep:
    """A tap recorder keeping every emitted value in float64 (for the per-tap floors)."""

    def __init__(self):
        self.v = {}

    def emit(self, name, value, positions=None, **_):
        self.v.setdefault(name, []).append(_float64_copy(value))


def _float64_copy(value) -> np.ndarray:
    """A float64 copy of ``value`` (a tap); a large one in row blocks on :func:`reference.threads.host_threads`
    threads (a real-width logits tap of 2060 tokens is 511M values; NumPy's cast releases the GIL)."""
    a = np.asarray(value)
    if a.size < (1 << 22) or a.ndim == 0 or a.shape[0] < 2:
        return np.array(a, dtype=np.float64, copy=True)
    from concurrent.futures import ThreadPoolExecutor

    from reference.threads import host_threads
    out = np.empty(a.shape, dtype=np.float64)
    n = host_threads()
    step = max(1, -(-a.shape[0] // (4 * n)))

    def put(s0):
        out[s0:s0 + step] = a[s0:s0 + step]
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(put, range(0, a.shape[0], step)))
    return out


def _captured(fn):
    """``(taps, fn())``: ``fn`` (a reference forward) run with every tap it emits kept, ``taps`` =
    ``{name: [rows, ...] float64}``."""
    cap = _Keep()
    tok = taphook.set_current(cap)
    try:
        out = fn()
    finally:
        taphook.reset_current(tok)
    return {k: v[0] if len(v) == 1 else np.concatenate(v, axis=0) for k, v in cap.v.items()}, out


#: elements per block of :func:`_tap_err_stats` (fixed, so the sums' order does not depend on the thread count)
_TAP_BLOCK_ELEMENTS = 1 << 18


def _tap_err_stats(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float, bool]:
    """``(sum a^2, sum (b - a)^2, max |b - a|, any finite)`` over the entries finite on both sides of two float64
    arrays of one shape, in row blocks of :data:`_TAP_BLOCK_ELEMENTS` on :func:`reference.threads.host_threads`
    threads (a real-width tap of 2060 tokens is ~100M values; the logits 511M): each block's float64 sums, then the blocks'
    in their order."""
    from reference.threads import host_threads
    if a.size == 0:
        return 0.0, 0.0, 0.0, False
    a2 = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    b2 = b.reshape(a2.shape)
    step = max(1, _TAP_BLOCK_ELEMENTS // max(a2.shape[1], 1))

    def part(s0):
        x, y = a2[s0:s0 + step], b2[s0:s0 + step]
        fin = np.isfinite(x) & np.isfinite(y)
        with np.errstate(invalid="ignore"):
            d = np.where(fin, y - x, 0.0)
        xx = np.where(fin, x, 0.0)
        return float(np.sum(xx * xx)), float(np.sum(d * d)), float(np.max(np.abs(d))) if d.size else 0.0, \
            bool(fin.any())
    starts = range(0, a2.shape[0], step)
    n = min(host_threads(), len(starts))
    if n > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(n) as ex:
            parts = list(ex.map(part, starts))
    else:
        parts = [part(s0) for s0 in starts]
    sa = sd = md = 0.0
    for pa, pd, pm, _ in parts:
        sa, sd, md = sa + pa, sd + pd, max(md, pm)
    return sa, sd, md, any(p[3] for p in parts)


def _merge_tap_floors(floors: dict, ref: dict, got: dict, rows: list[int] | None = None, n: int = 0) -> None:
    """Fold one float32 order's taps ``got`` into ``floors`` (``{tap: (rel_l2, atol_rms)}``, the maximum over the
    orders) against the float64 taps ``ref`` (activation taps only; each figure at least the float32 unit
    roundoff). ``rows``: only those positions of the taps laid out one row per position (first axis ``n``, the
    history's length); other taps whole."""
    u = UNIT_ROUNDOFF["float32"]
    for name, a in ref.items():
        spec = registry.spec_for(name)
        b = got.get(name)
        if b is None or b.shape != a.shape or (spec is not None and getattr(spec, "kind", "activation") != "activation"):
            continue
        if rows is not None and a.ndim >= 1 and a.shape[0] == n and all(0 <= r < n for r in rows):
            a, b = a[rows], b[rows]
        sa, sd, md, any_fin = _tap_err_stats(a, b)
        if not any_fin:
            continue
        na = float(np.sqrt(sa))
        rms = float(np.sqrt(sa / a.size)) or 1.0
        rel = max(float(np.sqrt(sd)) / na if na else 0.0, u)
        at = max(md / rms, u)
        r0, a0 = floors.get(name, (0.0, 0.0))
        floors[name] = (max(r0, rel), max(a0, at))


def tap_profile_of(floors: dict, multiple: float, score_rel: float | None, stores: dict | None, positions: int):
    """The tap-diff :class:`taps.diff.Profile` of measured per-tap ``floors`` (:func:`tap_floors`) at
    ``multiple``, index flips within ``score_rel`` near ties (:func:`tap_floor_profile` says how)."""
    u = UNIT_ROUNDOFF["float32"]
    overrides = []
    for name, (rel, at) in floors.items():
        r = multiple * rel
        overrides.append({"pattern": name, "rel_l2": r, "rtol": 0.0, "atol_rms": multiple * at, "atol": 0.0,
                          "cos_min": max(0.0, 1.0 - r * r / 2.0)})
    sr = max(float(score_rel if score_rel is not None else u), u)
    prof = Profile(name=f"floor x{multiple:g} ({stores_label(stores or {})})",
                   activation={"rel_l2": multiple * u * 64, "rtol": 0.0, "atol_rms": multiple * u * 64, "atol": 0.0,
                               "cos_min": 1.0 - (multiple * u * 64) ** 2 / 2},
                   index={"score_rtol": sr, "score_atol": 0.0}, overrides=overrides,
                   source=f"measured on this model over {positions} positions")
    prof.floors = floors
    return prof
