"""Tie-aware truth: a backend whose selections differ from the reference's only inside a tie set is
*tie-equivalent* (docs/parity.md, "Ties").

QSA keeps the ``block_topk`` best blocks by relu-summed dot products and the MoE router the
``num_experts_per_tok`` best experts; at a cut where the k-th and the (k+1)-th candidates tie (exactly, or
within the score floor), which one is kept is arbitrary: the official implementation itself keeps different
blocks on CPU and CUDA. The reference's canonical rule (higher score, then the lower index) is one valid
resolution. A backend is judged against the reference under the resolution it took:

* **with selection taps** (``indexer.selected_blocks`` / ``gate.topk_ids``): every differing selection must
  lie inside the tie set at that cut of the truth *under the backend's upstream choices* (else FAIL: "pick
  outside the tie set"): a pick inside a tie changes every later layer and position, so the differences are
  judged in dataflow order (layer by layer), forcing each group of tie-set picks into the reference and
  re-running it before the next layer is compared; the backend's logits are judged against the final re-run;
* **without**: the reference is re-run under each resolution of the tied cuts, position by position (the
  resolution whose row matches the backend's best is kept), and the backend is judged against the result.

The tie band at a cut is ``2 x multiple x score floor`` of the layer's largest |score| (the score floor of the
backend's stores, measured: two correct engines each within the multiple of it may order candidates that close
either way); exact ties are always inside.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from parity.backends import one_shot_logits
from parity.harness.floor import SelectionLog, TieReport, logged_logits, tie_report
from parity.harness.metrics import compare_logits
from parity.harness.thresholds import position_faults, tie_band  # noqa: F401 (tie_band: re-exported here)
from reference.taphook import layer_of
from taps import registry

__all__ = ["SELECTION_TAPS", "TieJudgement", "tie_band", "judge_ties", "backend_selections", "outside_pick"]

SELECTION_TAPS = ("layers.*.self_attn.indexer.selected_blocks", "layers.*.mlp.gate.topk_ids")
MAX_RESOLUTIONS = 256  # resolutions tried per tied position (each one forward: beyond it a backend needs selection taps)


@dataclass
class TieJudgement:
    """Outcome of :func:`judge_ties` for one prompt.

    ``logits``: the truth under the backend's resolution (``[T, V]``, or None when no resolution was
    needed or found); ``positions``: the positions whose selection differs from the canonical one inside a
    tie set; ``outside``: a description of a pick outside the tie set (FAIL), or None; ``how``: 'taps' or
    'search'; ``cuts``: the truth's tied cuts."""

    logits: np.ndarray | None = None
    positions: list = field(default_factory=list)
    outside: str | None = None
    how: str = ""
    cuts: TieReport = field(default_factory=TieReport)
    truncated: list = field(default_factory=list)  # tied positions with more than MAX_RESOLUTIONS resolutions


def backend_selections(backend, ids) -> SelectionLog | None:
    """The backend's QSA / MoE selections over one full prefill of ``ids`` from its taps, or None when it
    emits none (then only the resolution search applies)."""
    try:
        with backend.taps(None, include=list(SELECTION_TAPS)) as rec:
            one_shot_logits(backend, ids)
        arc = rec.archive()
    except Exception:  # noqa: BLE001 - a backend without taps is judged by the search
        return None
    log = SelectionLog()
    for name in arc.names():
        i = layer_of(name)
        if i is None or not name.endswith(("indexer.selected_blocks", "gate.topk_ids")):
            continue  # the companion score taps ride along; only the selections are read
        a = np.asarray(arc.get(name)).astype(np.int64)
        if name.endswith("indexer.selected_blocks"):
            log.qsa_sel[i] = a.reshape(a.shape[0], -1)
        elif name.endswith("gate.topk_ids"):
            log.moe_ids[i] = a.reshape(a.shape[0], -1)
    return log if (log.qsa_sel or log.moe_ids) else None


def _diff_in_ties(kind, truth_sel: dict, be_sel: dict, ties: TieReport, scores: dict):
    """(positions differing inside tie sets, description of the first pick outside one or None)."""
    inside, outside = [], None
    for layer, ts in sorted(truth_sel.items()):
        bs = be_sel.get(layer)
        if bs is None or bs.shape[0] != ts.shape[0]:
            continue
        rows = range(ts.shape[0])
        if bs.shape == ts.shape:  # equal sorted rows are equal sets: only the others are walked (32768 rows)
            rows = np.nonzero((np.sort(np.asarray(ts), axis=1) != np.sort(np.asarray(bs), axis=1)).any(axis=1))[0]
        for t in (int(x) for x in rows):
            a = set(registry.selection_ids(ts[t]))
            b = set(registry.selection_ids(bs[t]))
            if a == b:
                continue
            cut = ties.at(kind, layer, t)
            tie = set(cut["tie_set"]) if cut else set()
            if (a ^ b) <= tie and len(a) == len(b):
                inside.append(t)
                continue
            if outside is None:
                sc = scores.get(layer)
                extra = sorted(b - a - tie)
                gap = ""
                if sc is not None and extra:
                    row = sc[t]
                    kth = np.sort(row[np.isfinite(row)])[::-1][len(a) - 1] if len(a) else float("nan")
                    gap = f" (score {row[extra[0]]:.6g} vs the cut {kth:.6g})"
                what = "QSA blocks" if kind == "qsa" else "MoE experts"
                outside = (f"{what} of layer {layer} at position {t}: backend keeps {sorted(b)}, truth {sorted(a)}, "
                           f"tie set {sorted(tie) or '[]'}: a pick outside the tie set{gap}")
    return inside, outside


def _n_resolutions(cut) -> int:
    """How many ways the cut's tied slots can be filled: C(|tie set|, |kept from it|)."""
    return math.comb(len(cut["tie_set"]), len(cut["inside"]))


def _resolutions(cut):
    """Every way to fill the cut's tied slots from its tie set (the canonical one first)."""
    tie, inside = cut["tie_set"], cut["inside"]
    m = len(inside)
    rest = (c for c in itertools.combinations(tie, m) if tuple(sorted(c)) != tuple(inside))
    return [tuple(inside)] + list(itertools.islice(rest, MAX_RESOLUTIONS - 1))


def _resolved_row(row, cut, chosen):
    """The selection row of a tied cut with its tied slots filled by ``chosen`` (the rest kept)."""
    keep = [int(x) for x in row if x >= 0 and int(x) not in cut["tie_set"]]
    new = keep + [int(x) for x in chosen]
    if cut["kind"] == "qsa":
        new = sorted(new)
    out = np.full(np.asarray(row).shape, -1, dtype=np.int64)
    out[:len(new)] = new
    return out


def _with_overrides(model, ids, overrides: dict):
    """``(logits, SelectionLog)`` of ``model.forward(ids)`` where the selections at ``overrides``
    (``{(kind, layer, position): row}``) are replaced and every other selection is the model's own (computed
    live, so a changed block choice also changes what the later selections see)."""
    log = SelectionLog()

    def q(layer, pos, scores, sel):
        sel = np.array(sel)
        for t, p in enumerate(np.asarray(pos)):
            r = overrides.get(("qsa", layer, int(p)))
            if r is not None:
                sel[t] = r
        log.qsa_scores[layer], log.qsa_sel[layer] = np.array(scores, dtype=np.float64), sel
        return sel

    def m(layer, pos, probs, ids_):
        ids_ = np.array(ids_)
        for t, p in enumerate(np.asarray(pos)):
            r = overrides.get(("moe", layer, int(p)))
            if r is not None:
                ids_[t] = r
        log.moe_probs[layer], log.moe_ids[layer] = np.array(probs, dtype=np.float64), ids_
        return ids_
    model.selection_hook, model.expert_hook = q, m
    try:
        return np.asarray(model.forward(list(ids))), log
    finally:
        model.selection_hook = model.expert_hook = None


def _row_like(be_row, like) -> np.ndarray:
    """The backend's selection row in the truth's layout (valid ids, -1 padded to the truth row's width)."""
    valid = [int(x) for x in np.asarray(be_row).reshape(-1) if x >= 0]
    out = np.full(np.asarray(like).shape, -1, dtype=np.int64)
    out[:len(valid)] = valid
    return out


def _judge_taps(truth_model, ids, canon, log: SelectionLog, be_sel: SelectionLog, band: float):
    """Judge the backend's tapped selections causally: ``(outside, forced positions, truth logits or None)``.

    A selection differing inside a tie set changes everything downstream of it (later layers, later positions),
    so a later layer's pick is judged against the truth *under the backend's earlier choices*, never against
    the canonical run: in dataflow order (layer by layer; in a layer the QSA blocks before the MoE experts,
    every position at once, since a layer's scores depend only on the layers before it), the first group with a
    differing selection is checked against the current truth's tie sets (a pick outside one: FAIL), those picks
    are forced, and the truth is re-run live (every other selection recomputed) before the next group is
    compared. At most one re-run per selection layer and kind."""
    overrides: dict = {}
    cur_logits, cur_log = canon, log
    forced_pos: set = set()
    groups = sorted([(layer, 0, "qsa") for layer in log.qsa_sel] + [(layer, 1, "moe") for layer in log.moe_ids])
    for _ in range(len(groups) + 1):
        ties = tie_report(cur_log, truth_model.config, band)
        step = None
        for layer, _o, kind in groups:
            truth_sel = cur_log.qsa_sel if kind == "qsa" else cur_log.moe_ids
            be = (be_sel.qsa_sel if kind == "qsa" else be_sel.moe_ids)
            scores = cur_log.qsa_scores if kind == "qsa" else cur_log.moe_probs
            if layer not in be or layer not in truth_sel:
                continue
            inside, outside = _diff_in_ties(kind, {layer: truth_sel[layer]}, {layer: be[layer]}, ties, scores)
            if outside is not None:
                return outside, sorted(forced_pos), None
            if inside:
                step = [((kind, layer, t), _row_like(be[layer][t], truth_sel[layer][t])) for t in inside]
                break
        if step is None:
            break
        for key, row in step:
            overrides[key] = row
            forced_pos.add(key[2])
        cur_logits, cur_log = _with_overrides(truth_model, ids, overrides)
    return None, sorted(forced_pos), (cur_logits if overrides else None)


def judge_ties(truth_model, ids: Sequence[int], be_logits: np.ndarray, bad: np.ndarray, th, floor=None,
               backend=None, be_sel: SelectionLog | None = None, canon_log=None) -> TieJudgement:
    """Find the tie resolution the backend took on one prompt and the truth under it.

    Args:
        truth_model: the float32 :class:`reference.model.ReferenceModel`.
        be_logits: the backend's ``[T, V]`` logits of ``ids`` (rows of nan: not known, never judged);
            bad: ``[T]`` positions failing the canonical truth.
        th: the run's thresholds (their score floor sets the tie band); floor: unused (kept for callers).
        backend: the backend (for its selection taps), or None.
        be_sel: the selections the backend took over ``ids`` as the case ran them (recorded from its taps op by
            op: a chunked prefill may resolve a near tie otherwise than one full prefill), or None: read them from
            one full prefill of ``backend``.
        canon_log: ``(logits [T, V], SelectionLog)`` of the truth's canonical forward over ``ids`` when already
            computed (:meth:`parity.harness.scenarios.common.TruthCache.logged`), or None: computed here.
    Returns:
        :class:`TieJudgement`; ``logits`` is None when the prompt has no tied cut at or before a failing position.
    """
    canon, log = canon_log if canon_log is not None else logged_logits(truth_model, ids)
    ties = tie_report(log, truth_model.config, tie_band(th))
    out = TieJudgement(cuts=ties)
    bad_pos = np.nonzero(bad)[0]
    if not len(bad_pos) or not ties.cuts or min(c["position"] for c in ties.cuts) > int(bad_pos[-1]):
        return out
    if be_sel is None:
        be_sel = backend_selections(backend, ids) if backend is not None else None
    if be_sel is not None:
        out.how = "taps"
        out.outside, out.positions, out.logits = _judge_taps(truth_model, ids, canon, log, be_sel, tie_band(th))
        return out
    # search: walk the tied positions in order; at each, keep the resolution whose row matches the backend best.
    # Only the tied cuts are overridden: every other selection is recomputed under the resolution so far.
    out.how = "search"
    band = tie_band(th)
    known = np.isfinite(be_logits).all(axis=-1)
    overrides, cur_logits, cur_log = {}, canon, log
    changed, done = [], set()
    last = int(bad_pos[-1])
    while True:
        cuts_now = [c for c in tie_report(cur_log, truth_model.config, band).cuts
                    if c["position"] <= last and c["position"] not in done]
        if not cuts_now:
            break
        p = min(c["position"] for c in cuts_now)
        done.add(p)
        if not known[p] or not position_faults(compare_logits(cur_logits[p:p + 1], be_logits[p:p + 1]), th)[0]:
            continue
        cuts = [c for c in cuts_now if c["position"] == p]
        best = None
        n_res = 1
        for c in cuts:
            n_res *= _n_resolutions(c)
        if n_res > MAX_RESOLUTIONS:
            out.truncated.append(p)
        for combo in itertools.islice(itertools.product(*[_resolutions(c) for c in cuts]), MAX_RESOLUTIONS):
            trial = dict(overrides)
            for c, ch in zip(cuts, combo):
                sel = (cur_log.qsa_sel if c["kind"] == "qsa" else cur_log.moe_ids)[c["layer"]][p]
                trial[(c["kind"], c["layer"], p)] = _resolved_row(sel, c, ch)
            lg, lgl = _with_overrides(truth_model, ids, trial)
            # judged on row p: a cut at p decides row p; later rows are resolved at their own cuts in turn
            err = float(compare_logits(lg[p:p + 1], be_logits[p:p + 1]).rel_err()[0])
            if best is None or err < best[0]:
                best = (err, trial, lg, lgl, combo)
        err, trial, lg, lgl, combo = best
        if any(tuple(sorted(ch)) != tuple(c["inside"]) for c, ch in zip(cuts, combo)):
            overrides, cur_logits, cur_log = trial, lg, lgl
            changed.append(p)
    if changed:
        out.positions, out.logits = changed, cur_logits
    return out


def outside_pick(truth_model, ids: Sequence[int], be_logits: np.ndarray, th, backend) -> str | None:
    """The pick outside the tie set of a backend with selection taps over one prompt, whatever its logits, or
    None (no taps, or every differing pick inside a tie set).

    For a run whose tolerance cannot resolve a fault of useful size (a coarse store floor), a pick outside the
    tie set may leave the logits within tolerance; the selections are then read for every prompt so that such
    a pick still FAILs. Judged as :func:`judge_ties` judges a failing prompt (every row treated as failing);
    where the truth has no tied cut at all, every differing pick is outside.
    Cost: the backend's selection taps over ``ids`` (twice) and the truth's forward(s)."""
    be_sel = backend_selections(backend, ids)
    if be_sel is None:
        return None
    tj = judge_ties(truth_model, ids, be_logits, np.ones(len(ids), dtype=bool), th, backend=backend)
    if tj.outside or tj.how == "taps":
        return tj.outside
    _, log = logged_logits(truth_model, ids)   # no tied cut: judge_ties returned before reading the taps
    none = TieReport()
    return (_diff_in_ties("qsa", log.qsa_sel, be_sel.qsa_sel, none, log.qsa_scores)[1]
            or _diff_in_ties("moe", log.moe_ids, be_sel.moe_ids, none, log.moe_probs)[1])
