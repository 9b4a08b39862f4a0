"""The top-k comparison of an OpenAI-compatible server (``parity.backends.openai``) against the truth.

Per position the server's top-k (ids mapped back through the model's tokenizer) is compared with the
truth's full distribution coarse-grained to the same k ids plus one "tail" bucket: the KL of that
coarse-graining is a lower bound of the full KL (data-processing inequality), so a failure is a real
divergence; the tail mass is stated.
"""
from __future__ import annotations

import math
import time

import numpy as np


def topk_compare(truth_logits: np.ndarray, rows, mappable=lambda i: True) -> dict:
    """Coarse-grained KL(server || truth) and top-1 per position.

    ``truth_logits`` [P, V] (row p: the distribution after position p); ``rows[p]``: {id: logprob} or None.
    Per position: the server's mapped top-k ids S, its tail mass 1 - sum(exp(S)); the truth's mass on each
    id of S and on the rest; KL over the |S|+1 buckets (a lower bound of the full KL). Returns arrays
    ``kl``, ``top1`` (server's best mapped id == truth argmax), ``tail_server``, ``tail_truth``, ``k``
    (NaN/-1 where the server gave no row).
    """
    P = truth_logits.shape[0]
    x = truth_logits.astype(np.float64)
    lt = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    kl = np.full(P, np.nan)
    top1 = np.ones(P, bool)
    ts, tt, k = np.full(P, np.nan), np.full(P, np.nan), np.full(P, -1)
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
        # top-1 on what the API can tell: the truth's argmax must be in the server's mapped top-k and
        # within a near-tie (1e-4 nats: the JSON floats' and float32 noise) of its best mapped entry;
        # an argmax whose string is ambiguous (several ids decode to it) cannot be checked
        a = int(np.argmax(lt[p]))
        if a in r:
            top1[p] = r[a] >= ls.max() - 1e-4
        else:
            top1[p] = not mappable(a)
    return {"kl": kl, "top1": top1, "tail_server": ts, "tail_truth": tt, "k": k}


def run_topk(be, truth, prompts, *, n_new: int = 4, thresholds=None, budget_s: float = 120.0,
             prefix_reuse: bool = True) -> dict:
    """The kl-topk row of an :class:`parity.backends.openai.OpenAIBackend` ``be``: every sendable prompt
    (at most ``be.max_requests`` requests, ``budget_s`` seconds), prompt positions and ``n_new`` greedy
    positions against the truth. With ``prefix_reuse``, one more request pattern: the first sendable prompt
    of >= 8 tokens is sent as its first half, then whole, so a server that reuses a cached prefix (as
    llama_cpp.server does) answers the second from it; both answers are judged.

    Returns a JSON-ready dict with ``passed``, ``first`` (prompt, pattern, position) of the first failing
    position, ``failed_prompts`` (indices of the prompts with a failing position in any pattern: the row's
    failed cases; a prompt whose echo the server drops or moves tokens of fails at that position, listed in
    ``echo_misaligned``), ``worst_kl``, tail masses, the measured row convention, the patterns run and the count of
    prompts skipped as unsendable."""
    from parity.harness.kl import thresholds_for
    th = thresholds or thresholds_for("float32")
    t0 = time.perf_counter()
    out = {"prompts": 0, "skipped_unsendable": 0, "positions": 0, "worst_kl": 0.0, "first": None,
           "max_tail_server": 0.0, "top1_mismatch": 0, "greedy_unmappable": 0, "patterns": {}, "failed_prompts": [],
           "echo_misaligned": []}
    ids_ok = set(be._str2id.values())

    def judge(pi, ids, pattern):
        from parity.backends.openai import EchoMisaligned
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
        c = topk_compare(tl, rows, mappable=lambda i: i in ids_ok)
        ok = ~(np.nan_to_num(c["kl"], nan=0.0) > th.max_kl) & c["top1"]
        out["patterns"][pattern] = out["patterns"].get(pattern, 0) + 1
        judged = c["k"] >= 0
        out["positions"] += int(np.sum(judged))
        if judged.any():
            out["worst_kl"] = max(out["worst_kl"], float(np.nanmax(c["kl"])))
            out["max_tail_server"] = max(out["max_tail_server"], float(np.nanmax(c["tail_server"])))
        out["top1_mismatch"] += int(np.sum(~c["top1"]))
        if not ok.all() and pi not in out["failed_prompts"]:  # a case is a prompt (any of its patterns failing)
            out["failed_prompts"].append(pi)
        if out["first"] is None and not ok.all():
            p = int(np.argmax(~ok))
            out["first"] = {"prompt": pi, "pattern": pattern, "position": p, "kl": float(c["kl"][p]),
                            "top1": bool(c["top1"][p]), "greedy_region": p >= len(ids) - 1}

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
    out["passed"] = out["prompts"] > 0 and out["first"] is None
    out["convention"] = be.convention
    out["requests"] = be.requests
    out["retokenized_by_server"] = getattr(be, "retokenized", 0)
    out["threshold_kl"] = th.max_kl
    return out
