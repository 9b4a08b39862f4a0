"""Logit-KL metrics and the KL harness (``qwen4exp kl``).

The metrics compare two backends' next-token distributions position by position. They work on
plain arrays (``[T, V]`` logits, float32 or float64) and are computed in float64 so the metric
itself adds no noise above the backends'. The harness (:func:`run_kl`) runs both backends over a
prompt set, adds greedy continuations, and computes three controls in the same run:

* **determinism** -- backend b run twice on every prompt: its logits must be bitwise equal;
* **precision floor** -- the reference in float32 against the reference in float64: the noise any
  float32 engine is allowed (reported, and checked to be small: a reference that disagrees with
  itself beyond :data:`FLOOR_MAX_KL` makes every verdict meaningless);
* **negative control** -- backend b with one weight tensor perturbed must be flagged by the same
  thresholds that judge b.

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

__all__ = ["log_softmax", "kl_per_position", "summarize", "compare_logits", "LogitComparison",
           "greedy_agreement", "KLThresholds", "thresholds_for", "run_kl", "KLReport", "FLOOR_MAX_KL",
           "PERCENTILES"]

PERCENTILES = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9), ("max", 100.0))

# The float32 reference against the float64 reference on the tiny fixtures gives max KL ~1e-12..1e-9 (float32
# rounding, ~1e-7 relative, squared by KL's second-order behaviour). 1e-6 is far above that and far below what a
# real fault does (the negative controls give >= 1e-3), so a floor above it means the reference itself is unstable.
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
    with np.errstate(invalid="ignore", over="ignore"):
        kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return np.where(np.isnan(kl), np.nan, np.maximum(kl, 0.0))


def summarize(values: np.ndarray) -> dict:
    """mean, median, p90, p99, p99.9, max of a 1-D array (float64; nan-propagating: a nan is a fault)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        return {k: float("nan") for k, _ in PERCENTILES}
    out = {}
    for key, q in PERCENTILES:
        out[key] = float(np.mean(v)) if q is None else float(np.percentile(v, q))
    if np.isnan(v).any():
        out = {k: float("nan") for k in out}
    return out


def _topk_sets(logits: np.ndarray, k: int) -> np.ndarray:
    k = min(k, logits.shape[-1])
    # stable order: value descending, then lower token id (the canonical tie-break of the project)
    return np.argsort(-logits, axis=-1, kind="stable")[:, :k]


@dataclass
class LogitComparison:
    """Per-position comparison of backend a against backend b over one set of positions.

    All arrays are ``[T]``: ``kl_ab`` = KL(P_a||P_b), ``kl_ba`` = KL(P_b||P_a), ``top1`` (bool),
    ``top5_overlap`` (fraction in [0, 1]), ``top_prob_diff`` = P_b(t) - P_a(t) for a's top token t,
    ``max_abs_err`` = max_v |logit_a - logit_b|.
    """

    kl_ab: np.ndarray
    kl_ba: np.ndarray
    top1: np.ndarray
    top5_overlap: np.ndarray
    top_prob_diff: np.ndarray
    max_abs_err: np.ndarray

    @staticmethod
    def concat(items: Sequence["LogitComparison"]) -> "LogitComparison":
        """Concatenate several comparisons position-wise (an empty one when ``items`` is empty)."""
        if not items:
            z = np.zeros(0)
            return LogitComparison(z, z, z.astype(bool), z, z, z)
        return LogitComparison(*[np.concatenate([getattr(i, f.name) for i in items])
                                 for f in dataclasses.fields(LogitComparison)])

    @property
    def n(self) -> int:
        """Number of positions compared."""
        return int(self.kl_ab.size)

    def summary(self) -> dict:
        """JSON-ready summary: KL stats both directions, top-1 agreement, top-5 overlap, prob-diff RMS/max,
        worst logit error."""
        n = self.n
        return {
            "positions": n,
            "kl_ab": summarize(self.kl_ab),
            "kl_ba": summarize(self.kl_ba),
            "top1_agreement": float(np.mean(self.top1)) if n else float("nan"),
            "top5_overlap": float(np.mean(self.top5_overlap)) if n else float("nan"),
            "top_prob_diff_rms": float(np.sqrt(np.mean(self.top_prob_diff ** 2))) if n else float("nan"),
            "top_prob_diff_max": float(np.max(np.abs(self.top_prob_diff))) if n else float("nan"),
            "max_logit_err": float(np.max(self.max_abs_err)) if n else float("nan"),
        }

    def worst_kl(self) -> float:
        """max over positions of max(KL(a||b), KL(b||a)); nan/inf when any row is non-finite."""
        if not self.n:
            return 0.0
        both = np.maximum(self.kl_ab, self.kl_ba)
        return float(np.nan) if np.isnan(both).any() else float(np.max(both))


def compare_logits(logits_a: np.ndarray, logits_b: np.ndarray) -> LogitComparison:
    """Compare two ``[T, V]`` logit arrays position by position (see :class:`LogitComparison`).

    Raises:
        InputError: shapes differ or are not 2-D float arrays.
    """
    a = _check_logits("logits_a", logits_a)
    b = _check_logits("logits_b", logits_b)
    if a.shape != b.shape:
        raise InputError(f"logits: expected equal shapes [T, V], found {a.shape} (a) and {b.shape} (b)")
    la, lb = log_softmax(a), log_softmax(b)
    with np.errstate(invalid="ignore", over="ignore"):
        pa, pb = np.exp(la), np.exp(lb)
        kl_ab = np.sum(pa * (la - lb), axis=-1)
        kl_ba = np.sum(pb * (lb - la), axis=-1)
    kl_ab = np.where(np.isnan(kl_ab), np.nan, np.maximum(kl_ab, 0.0))
    kl_ba = np.where(np.isnan(kl_ba), np.nan, np.maximum(kl_ba, 0.0))
    ta, tb = _topk_sets(a, 1)[:, 0], _topk_sets(b, 1)[:, 0]
    t5a, t5b = _topk_sets(a, 5), _topk_sets(b, 5)
    k = t5a.shape[1]
    overlap = np.array([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(t5a, t5b)], dtype=np.float64)
    rows = np.arange(a.shape[0])
    diff = pb[rows, ta] - pa[rows, ta]
    with np.errstate(invalid="ignore"):
        err = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), axis=-1)
    return LogitComparison(kl_ab, kl_ba, ta == tb, overlap, diff, err)


def greedy_agreement(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> int:
    """Length of the common prefix of two greedy continuations."""
    n = 0
    for x, y in zip(tokens_a, tokens_b):
        if int(x) != int(y):
            break
        n += 1
    return n


@dataclass(frozen=True)
class KLThresholds:
    """Pass thresholds for one backend precision.

    ``max_kl``: the largest per-position KL (either direction) allowed; ``min_top1``: the smallest
    top-1 agreement allowed (a near-tie may flip, so it is not 1.0 for low precisions).
    """

    max_kl: float
    min_top1: float


# Tolerances per declared backend precision. float64/float32: a correct float32 engine differs from the float32
# reference by accumulation order only (relative ~1e-6 on logits; KL ~1e-10 on the tiny fixtures); 1e-5 leaves two
# decades of margin above that while the negative controls produce KL >= 1e-3. bf16: 8 mantissa bits give logit
# errors of ~1e-2 relative and KL ~1e-4..1e-3 on real checkpoints (the usual bf16-engine acceptance is mean KL
# < 1e-3); 5e-2 max KL still flags a perturbed weight or a state bug (KL >~ 0.1 on the first affected position).
_THRESHOLDS = {
    "float64": KLThresholds(max_kl=1e-5, min_top1=1.0),
    "float32": KLThresholds(max_kl=1e-5, min_top1=0.98),
    "bf16": KLThresholds(max_kl=5e-2, min_top1=0.90),
    "fp8": KLThresholds(max_kl=1e-1, min_top1=0.85),
}


def thresholds_for(precision: str) -> KLThresholds:
    """The :class:`KLThresholds` of a backend precision ('float64', 'float32', 'bf16', 'fp8').

    Raises:
        InputError: unknown precision.
    """
    try:
        return _THRESHOLDS[precision]
    except KeyError:
        raise InputError(f"backend precision: expected one of {sorted(_THRESHOLDS)}, found {precision!r}") from None


def verdict(cmp: LogitComparison, th: KLThresholds, top1: bool = True) -> tuple[bool, str]:
    """(passed, reason) of a comparison against thresholds; non-finite logits always fail.

    ``top1=False`` judges by KL alone (used per operation in the scenarios, where a single row's top-1 is
    all-or-nothing and a near-tie flip within the KL tolerance is not a fault)."""
    s = cmp.summary()
    worst = cmp.worst_kl()
    if not np.isfinite(worst):
        return False, "non-finite KL (nan/inf logits)"
    if worst > th.max_kl:
        return False, f"max KL {worst:.3g} > {th.max_kl:.3g}"
    if top1 and s["top1_agreement"] < th.min_top1:
        return False, f"top-1 agreement {s['top1_agreement']:.3f} < {th.min_top1:.3f}"
    return True, f"max KL {worst:.3g} <= {th.max_kl:.3g}"


# ----------------------------------------------------------------------------------------------- the harness

@dataclass
class KLReport:
    """Everything ``qwen4exp kl`` reports. ``to_json()`` is the ``--json`` document."""

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

    @property
    def controls_ok(self) -> bool:
        """True when every control has ``ok`` set (also when there are no controls)."""
        return all(c.get("ok") for c in self.controls.values())

    @property
    def exit_code(self) -> int:
        """0: b agrees and every control passed; 1: b disagrees or a control failed."""
        return 0 if (self.passed and self.controls_ok) else 1

    def to_json(self) -> dict:
        """The ``--json`` document: verdict, thresholds, summary metrics, per-position KL(P_a||P_b), per-prompt
        positions, greedy results, controls and seconds."""
        return {
            "a": self.a, "b": self.b, "model": self.model, "passed": self.passed, "reason": self.reason,
            "controls_ok": self.controls_ok, "exit_code": self.exit_code,
            "thresholds": dataclasses.asdict(self.thresholds),
            "metrics": self.comparison.summary(),
            "per_position_kl_ab": [float(x) for x in self.comparison.kl_ab],
            "per_prompt_positions": self.per_prompt_positions,
            "greedy": self.greedy, "controls": self.controls, "seconds": round(self.seconds, 3),
        }


def _greedy(backend, ids: Sequence[int], n: int) -> list[int]:
    """Greedy continuation of ``n`` tokens through prefill + decode (the incremental path)."""
    if n <= 0:
        return []
    h = backend.new_sequence()
    try:
        logits = np.asarray(backend.prefill(h, list(ids)))
        out = [int(np.argmax(logits[-1]))]
        while len(out) < n:
            nxt = np.asarray(backend.decode([h], [out[-1]]))
            out.append(int(np.argmax(nxt[0])))
        return out
    finally:
        backend.free(h)


def run_kl(a, b, prompts: Sequence[Sequence[int]], *, model: str = "", greedy_tokens: int = 8,
           floor_pair: tuple | None = None, perturbed_b: Callable[[], object] | None = None,
           perturbed_note: str = "", progress: bool = True) -> KLReport:
    """Run the KL harness: b against a over ``prompts`` plus the three controls.

    Args:
        a, b: open :class:`parity.backends.Backend` objects (a is usually the reference).
        prompts: token-id lists (each ``[T]`` ints in ``[0, vocab)``).
        greedy_tokens: length of the greedy continuations compared (0 disables).
        floor_pair: (reference float32 backend, reference float64 backend) for the precision floor;
            None reports the control as failed ("not computed").
        perturbed_b: callable returning an open backend equal to b with one weight perturbed (the
            negative control); None reports the control as failed ("not computed").
    Returns:
        :class:`KLReport` (``exit_code`` 0 pass / 1 fail).
    Raises:
        InputError: empty prompt set.
    """
    from tqdm.auto import tqdm

    from parity.backends import one_shot_logits

    if not prompts:
        raise InputError("prompts: expected at least one prompt, found none")
    t0 = time.perf_counter()
    th = thresholds_for(getattr(b, "precision", "float32"))
    name_a, name_b = getattr(a, "name", type(a).__name__), getattr(b, "name", type(b).__name__)
    cmps, det_ok, det_bad, greedy = [], True, [], []
    la_all, lb_all = [], []
    for i, ids in enumerate(tqdm(prompts, desc=f"kl {name_b} vs {name_a}", disable=not progress, leave=False)):
        la = one_shot_logits(a, ids)
        lb = one_shot_logits(b, ids)
        lb2 = one_shot_logits(b, ids)
        if lb.shape != lb2.shape or not np.array_equal(lb, lb2, equal_nan=True):
            det_ok = False
            det_bad.append(i)
        la_all.append(la)
        lb_all.append(lb)
        cmps.append(compare_logits(la, lb))
        if greedy_tokens:
            ga, gb = _greedy(a, ids, greedy_tokens), _greedy(b, ids, greedy_tokens)
            greedy.append({"prompt": i, "a": ga, "b": gb, "agree": greedy_agreement(ga, gb)})
    cmp = LogitComparison.concat(cmps)
    passed, reason = verdict(cmp, th)
    controls = {"determinism": {"ok": det_ok, "detail": "b run twice: bitwise equal" if det_ok
                                else f"b run twice differs on prompts {det_bad}"}}
    # precision floor
    if floor_pair is None:
        controls["precision_floor"] = {"ok": False, "detail": "not computed (no float32/float64 reference pair)"}
    else:
        r32, r64 = floor_pair
        fl = LogitComparison.concat([compare_logits(one_shot_logits(r64, ids), one_shot_logits(r32, ids))
                                     for ids in prompts])
        worst = fl.worst_kl()
        ok = bool(np.isfinite(worst) and worst <= FLOOR_MAX_KL)
        controls["precision_floor"] = {"ok": ok, "max_kl": worst, "max_logit_err": fl.summary()["max_logit_err"],
                                       "detail": f"reference float32 vs float64: max KL {worst:.3g}"
                                       + ("" if ok else f" > {FLOOR_MAX_KL:g} (reference unstable)")}
    # negative control
    if perturbed_b is None:
        controls["negative_control"] = {"ok": False, "detail": "not computed (no perturbed backend)"}
    else:
        pb = perturbed_b()
        try:
            nc = LogitComparison.concat([compare_logits(l_a, one_shot_logits(pb, ids))
                                         for l_a, ids in zip(la_all, prompts)])
        finally:
            close = getattr(pb, "close", None)
            if close:
                close()
        flagged, why = verdict(nc, th)
        controls["negative_control"] = {"ok": not flagged, "max_kl": nc.worst_kl(),
                                        "detail": (f"{perturbed_note}: " if perturbed_note else "")
                                        + ("flagged (" + why + ")" if not flagged else "NOT flagged (" + why + ")")}
    return KLReport(a=name_a, b=name_b, model=model, comparison=cmp,
                    per_prompt_positions=[c.n for c in cmps], greedy=greedy, thresholds=th, passed=passed,
                    reason=reason, controls=controls, seconds=time.perf_counter() - t0)


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
