"""The top-k comparison of a server backend (the :class:`parity.backends.base.TopkServer` protocol: an
OpenAI-compatible server, parity.backends.openai and its subclasses) against the truth.

Per position the server's top-k (ids as the backend maps them, :meth:`TopkServer.mappable`) is compared with the
truth's full distribution coarse-grained to the same k ids plus one "tail" bucket: the KL of that
coarse-graining is a lower bound of the full KL (data-processing inequality), so a failure is a real
divergence; the tail mass is stated.

The limit follows the model like every other row's (:func:`position_limits`): per position the run's logit
tolerance ``tol_rel * scale`` (:class:`parity.harness.kl.KLThresholds`, the truth's logit scale) plus the
rounding of the server's own float32 log-probabilities, squared, never below the float64 rounding floor of the
KL (:func:`parity.harness.kl.kl_rounding_floor`). A lower bound that sees little of the distribution cannot
resolve a fault: where the truth's mass on the returned ids is too small for a fault of
:data:`parity.harness.kl.USEFUL_FAULT_REL` to push the bound past the limit (:func:`resolution_rel`), or where
nothing could be compared, the row is INCONCLUSIVE, never PASS.
"""
from __future__ import annotations

import math
import time

import numpy as np


def logprob_rounding(max_abs_logprob, vocab: int, precision: str = "float32") -> np.ndarray:
    """Absolute error bound of a log-probability a server computes in ``precision`` (float32: llama-cpp-python
    0.3.36's ``Llama.logits_to_logprobs``) as ``lp_v = (x_v - max) - log(sum_u exp(x_u - max))``.

    Each step rounds once (unit roundoff u): the subtraction of the max (``u |x_v - max| <= u |lp_v|``), the
    exp and the V-term sum (a relative error ``<= (ceil(log2 V) + 1) u`` of the sum, which the log turns into
    an absolute one), the log (``u |lse|``, ``0 <= lse <= ln V``) and the final subtraction (``u |lp_v|``):
    ``|err| <= u (2 |lp_v| + ln V + ceil(log2 V) + 2)``. On a model with a small logit scale this is larger
    than the tolerance itself (float32 spacing at ``lp ~ -ln V`` is ~5e-7, the logit scale of a near-uniform
    row can be ~1e-3), so a limit without it would fail a correct server there.

    Args:
        max_abs_logprob: the largest ``|logprob|`` the server returned at the position (nats; array or float).
        vocab: V >= 1. precision: a key of :data:`parity.harness.floor.UNIT_ROUNDOFF`.
    Returns:
        float64 array (nats) shaped like ``max_abs_logprob``.
    """
    from parity.harness.floor import UNIT_ROUNDOFF
    v = max(int(vocab), 1)
    u = UNIT_ROUNDOFF.get(precision, UNIT_ROUNDOFF["float32"])
    return u * (2.0 * np.asarray(max_abs_logprob, np.float64) + np.log(v) + np.ceil(np.log2(v)) + 2.0)


def position_limits(scale, max_abs_logprob, vocab: int, th, precision: str = "float32"):
    """``(tol, bound)`` per position, float64 arrays: the logit tolerance ``tol = tol_rel * scale +``
    :func:`logprob_rounding` (nats) and the KL limit ``bound = max(tol ** 2, kl_rounding_floor(V))`` -- the
    same second-order rule as :func:`parity.harness.kl.kl_bound` (KL ~ Var_P(delta)/2 <= max|delta|^2/2, a
    factor 2 for higher-order terms), with the server's log-probability rounding counted as logit error."""
    from parity.harness.kl import kl_rounding_floor
    tol = th.tol_rel * np.asarray(scale, np.float64) + logprob_rounding(max_abs_logprob, vocab, precision)
    return tol, np.maximum(tol ** 2, kl_rounding_floor(vocab))


def resolution_rel(bound, mass, scale) -> np.ndarray:
    """The smallest logit fault, relative to the logit scale, whose coarse-grained KL exceeds ``bound`` when the
    truth puts mass ``mass`` (``m``) on the returned ids: ``sqrt(2 bound / m) / scale`` (inf where m = 0).

    Why: a fault ``delta`` spread over the vocabulary, unrelated to which ids the server returns, with rms
    ``eps * scale``, has full KL ``~ Var_P(delta) / 2 = (eps scale)^2 / 2``. Coarse-graining to the k ids plus
    one tail bucket keeps the between-bucket variance only: ``Var_P(delta) = Var_buckets(mean delta) +
    (1 - m) Var_tail(delta)``, so the lower bound is ``~ [Var_P(delta) - (1 - m) Var_tail(delta)] / 2 =
    m (eps scale)^2 / 2``. It exceeds the bound iff ``eps > sqrt(2 bound / m) / scale``. A near-uniform row
    (a small random model: top-20 of a large vocabulary holding 0.3%) sees 0.3% of any such fault.
    """
    m = np.asarray(mass, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.sqrt(2.0 * np.asarray(bound, np.float64) / m) / np.asarray(scale, np.float64)
    return np.where(m > 0, r, np.inf)


def topk_compare(truth_logits: np.ndarray, rows, mappable=lambda i: True, thresholds=None,
                 precision: str = "float32") -> dict:
    """Coarse-grained KL(server || truth), its limit and top-1 per position.

    ``truth_logits`` [P, V] (row p: the distribution after position p); ``rows[p]``: {id: logprob} or None.
    Per position: the server's mapped top-k ids S, its tail mass 1 - sum(exp(S)); the truth's mass on each
    id of S and on the rest; KL over the |S|+1 buckets (a lower bound of the full KL); the limits of
    :func:`position_limits` under ``thresholds`` (:class:`parity.harness.kl.KLThresholds`; None: the nominal
    ones of ``precision``); the resolution :func:`resolution_rel`. Top-1: the server's best mapped id must
    be the truth's argmax, or within the near-tie band of it on the truth (``lt[argmax] - lt[pick] <= 2 tol``,
    as :func:`parity.harness.kl.top1_flips`); the truth's argmax in the top-k is required unless its string is
    ambiguous (several ids decode to it: it cannot be checked). Returns arrays ``kl``, ``top1``,
    ``tail_server``, ``tail_truth``, ``k``, ``scale``, ``bound``, ``resolution`` (NaN/-1 where the server gave
    no row) and ``fault`` (KL over the bound or top-1 wrong, False where no row).
    """
    from parity.harness.kl import logit_scale, thresholds_for
    th = thresholds or thresholds_for(precision)
    P, V = truth_logits.shape
    x = truth_logits.astype(np.float64)
    lt = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    sc = logit_scale(x)
    kl = np.full(P, np.nan)
    top1 = np.ones(P, bool)
    ts, tt, k = np.full(P, np.nan), np.full(P, np.nan), np.full(P, -1)
    bound, res = np.full(P, np.nan), np.full(P, np.nan)
    fault = np.zeros(P, bool)
    for p in range(P):
        r = rows[p] if p < len(rows) else None
        if not r:
            continue
        ids = np.array(list(r), int)
        ls = np.array([r[i] for i in ids], np.float64)
        ps, pt = np.exp(ls), np.exp(lt[p, ids])
        tail_s, tail_t = max(0.0, 1.0 - ps.sum()), max(0.0, 1.0 - pt.sum())
        v = float(np.sum(ps * (ls - lt[p, ids])))
        if tail_s > 1e-12:
            v += tail_s * (math.log(tail_s) - math.log(max(tail_t, 1e-300)))
        kl[p], ts[p], tt[p], k[p] = v, tail_s, tail_t, len(ids)
        tol, bound[p] = (float(a) for a in position_limits(sc[p], np.abs(ls).max(), V, th, precision))
        res[p] = float(resolution_rel(bound[p], 1.0 - tail_t, sc[p]))
        a = int(np.argmax(lt[p]))
        pick = int(ids[np.argmax(ls)])
        if a not in r and not mappable(a):
            top1[p] = True   # the argmax's string maps to several ids: the API cannot tell
        else:
            top1[p] = pick == a or lt[p, a] - lt[p, pick] <= 2.0 * tol
        fault[p] = not (v <= bound[p]) or not top1[p]
    return {"kl": kl, "top1": top1, "tail_server": ts, "tail_truth": tt, "k": k, "scale": sc, "bound": bound,
            "resolution": res, "fault": fault}


#: greedy tokens a server generates after each prompt (temperature 0), judged as the continuation's rows
GREEDY_TOKENS = 4


def run_topk(be, truth, prompts, *, n_new: int = GREEDY_TOKENS, thresholds=None, budget_s: float = 120.0,
             prefix_reuse: bool = True) -> dict:
    """The kl-topk row of a server backend ``be`` (:class:`parity.backends.base.TopkServer`; only its public
    members are read): every sendable prompt
    (at most ``be.max_requests`` requests, ``budget_s`` seconds), prompt positions and ``n_new`` greedy
    positions against the truth. With ``prefix_reuse``, one more request pattern: the first sendable prompt
    of >= 8 tokens is sent as its first half, then whole, so a server that reuses a cached prefix (as
    llama_cpp.server does) answers the second from it; both answers are judged.

    Returns a JSON-ready dict with ``passed``, ``first`` (prompt, pattern, position) of the first failing
    position, ``failed_prompts`` (indices of the prompts with a failing position in any pattern: the row's
    failed cases; a prompt whose echo the server drops or moves tokens of fails at that position, listed in
    ``echo_misaligned``), ``worst_kl``, tail masses, the measured row convention, the patterns run and the count of
    prompts skipped as unsendable.

    ``status``: 'fail' where a position's lower-bound KL exceeds its limit or top-1 is wrong (a divergence the
    lower bound proves, whatever the mass), or an echo is misaligned; else 'inconclusive' (``inconclusive``: the
    reason) when no position could be compared, or when some compared position cannot resolve a fault of
    :data:`parity.harness.kl.USEFUL_FAULT_REL` (``resolution_rel``: the largest :func:`resolution_rel` over the
    compared positions, the smallest fault the row resolves at every one; ``min_mass_truth``: the least truth
    mass on the returned ids); else 'pass'. ``passed`` is ``status == 'pass'``.

    ``thresholds``: the run's :class:`parity.harness.kl.KLThresholds`; None: measured here from the floor of
    ``truth``'s weights over the prompts (:func:`parity.harness.floor.thresholds_for_run`).
    """
    from parity.harness.kl import USEFUL_FAULT_REL
    if thresholds is None:
        from parity.harness.floor import thresholds_for_run
        thresholds = thresholds_for_run(truth.weights, be, [list(map(int, q)) for q in prompts])[0]
    th = thresholds
    prec = getattr(be, "precision", "float32")
    t0 = time.perf_counter()
    out = {"prompts": 0, "skipped_unsendable": 0, "positions": 0, "worst_kl": 0.0, "first": None,
           "max_tail_server": 0.0, "top1_mismatch": 0, "greedy_unmappable": 0, "patterns": {}, "failed_prompts": [],
           "echo_misaligned": [], "resolution_rel": 0.0, "min_mass_truth": float("nan"), "worst_kl_over_bound": 0.0,
           "unresolved_positions": 0}
    from parity.backends.base import EchoMisaligned

    def judge(pi, ids, pattern):
        try:
            rows, greedy, ids = be.prompt_topk(ids, n_new=n_new)  # ids: those the server ran
        except EchoMisaligned as e:  # the server's answer misplaces rows: a defect of its own, at that position
            out["patterns"][pattern] = out["patterns"].get(pattern, 0) + 1
            out["echo_misaligned"].append({"prompt": pi, "pattern": pattern, "position": e.position, "error": str(e)})
            if pi not in out["failed_prompts"]:
                out["failed_prompts"].append(pi)
            if out["first"] is None:
                out["first"] = {"prompt": pi, "pattern": pattern, "position": e.position, "kl": float("nan"),
                                "top1": False, "greedy_region": False, "echo": str(e)}
            return
        # a generated token whose string maps to no single id ends what can be judged of the continuation
        n_ok = next((j for j, g in enumerate(greedy) if g is None), len(greedy))
        seq = ids + greedy[:n_ok]
        rows = rows[:len(ids) + n_ok - 1] if n_ok < len(greedy) else rows
        out["greedy_unmappable"] += len(greedy) - n_ok
        tl = truth.forward(seq[:max(1, len(rows))])
        c = topk_compare(tl, rows, mappable=be.mappable, thresholds=th, precision=prec)
        ok = ~c["fault"]
        out["patterns"][pattern] = out["patterns"].get(pattern, 0) + 1
        judged = c["k"] >= 0
        out["positions"] += int(np.sum(judged))
        if judged.any():
            out["worst_kl"] = max(out["worst_kl"], float(np.nanmax(c["kl"])))
            out["worst_kl_over_bound"] = max(out["worst_kl_over_bound"], float(np.nanmax(c["kl"] / c["bound"])))
            out["max_tail_server"] = max(out["max_tail_server"], float(np.nanmax(c["tail_server"])))
            out["resolution_rel"] = max(out["resolution_rel"], float(np.nanmax(c["resolution"])))
            out["min_mass_truth"] = float(np.nanmin([out["min_mass_truth"], *(1.0 - c["tail_truth"][judged])]))
            out["unresolved_positions"] += int(np.sum(c["resolution"][judged] > USEFUL_FAULT_REL))
        out["top1_mismatch"] += int(np.sum(~c["top1"]))
        if not ok.all() and pi not in out["failed_prompts"]:  # a case is a prompt (any of its patterns failing)
            out["failed_prompts"].append(pi)
        if out["first"] is None and not ok.all():
            p = int(np.argmax(~ok))
            out["first"] = {"prompt": pi, "pattern": pattern, "position": p, "kl": float(c["kl"][p]),
                            "bound": float(c["bound"][p]), "top1": bool(c["top1"][p]),
                            "greedy_region": p >= len(ids) - 1}

    reuse_done = not prefix_reuse
    for pi, ids in enumerate(prompts):
        if time.perf_counter() - t0 > budget_s or be.requests >= be.max_requests:
            break
        ids = [int(t) for t in ids]
        if not be.sendable(ids):
            out["skipped_unsendable"] += 1
            continue
        judge(pi, ids, "fresh")
        out["prompts"] += 1
        half = ids[:len(ids) // 2]
        if not reuse_done and len(ids) >= 8 and be.sendable(half) and be.requests + 2 <= be.max_requests:
            judge(pi, half, "prefix-reuse: first half")
            judge(pi, ids, "prefix-reuse: whole after its first half")
            reuse_done = True
    out["inconclusive"] = None
    if out["first"] is not None:
        out["status"] = "fail"
    elif out["positions"] == 0:
        out["status"] = "inconclusive"
        out["inconclusive"] = (f"nothing compared: {out['prompts']} prompt(s) sent, {out['skipped_unsendable']} not "
                               f"sendable (a server that carries text cannot be sent a prompt whose ids do not "
                               f"survive decode -> encode), no top-k row mapped to an id")
    elif out["resolution_rel"] > USEFUL_FAULT_REL:
        out["status"] = "inconclusive"
        out["inconclusive"] = (f"the top-{getattr(be, 'topk', '?')} logprobs hold too little of the truth's "
                               f"probability (as little as {out['min_mass_truth']:.3g} at a position; "
                               f"{out['unresolved_positions']} of {out['positions']} positions unresolved) for "
                               f"their lower-bound KL to catch a fault of {USEFUL_FAULT_REL:g} of the logit scale: "
                               f"the smallest fault caught at every position is {out['resolution_rel']:.3g} "
                               f"(sqrt(2 x limit / mass) / scale)")
    else:
        out["status"] = "pass"
    out["passed"] = out["status"] == "pass"
    out["convention"] = be.convention
    out["requests"] = be.requests
    out["retokenized_by_server"] = getattr(be, "retokenized", 0)
    out["threshold_kl"] = th.max_kl
    out["thresholds"] = th.to_json()
    return out
