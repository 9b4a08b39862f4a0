"""The KL harness (``qwen4exp kl``): backend b against the truth a over a prompt set, with its controls.

The harness (:func:`run_kl`) runs both backends over a prompt set, judges the prefill rows, the greedy decode
rows and the generation path (:func:`generation_paths`) with the comparison metrics of
:mod:`parity.harness.metrics` and the rules and thresholds of :mod:`parity.harness.thresholds` (a multiple of
the precision floor MEASURED on the model and prompts of the run, :mod:`parity.harness.floor`), and computes
three controls in the same run:

* **determinism** -- backend b run twice on every prompt: bitwise equal when b declares ``deterministic``;
  otherwise its run-to-run spread is measured and must be within the tolerance (else INCONCLUSIVE);
* **precision floor** -- the floor that sets the thresholds (float32 vs float64 reference, or the rounding
  reference of b's precision); a tolerance above :data:`USEFUL_FAULT_REL` makes the run INCONCLUSIVE;
* **negative control** -- b with one weight perturbed, sized from the floor to move the logits by
  :data:`CONTROL_MARGIN` x the tolerance with every selection forced to the truth's picks (a continuous
  effect), must be flagged (else INCONCLUSIVE, never a backend FAIL).

The metric and threshold names are re-exported here for the callers that import them from this module.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from parity.backends import capabilities_of, one_shot_logits
from parity.backends.base import BackendOutputError, capability, decode_greedy_of, owned, prefill_last_of
from parity.harness.floor import (floor_breakdown, floor_prompts, forced_logits, logged_logits, measure_floor,
                                  stores_of, unresolvable)
from parity.harness.metrics import (FLOOR_MAX_KL, PERCENTILES, LogitComparison, compare_logits,  # noqa: F401
                                    greedy_agreement, kl_per_position, kl_rounding_floor, log_softmax, logit_scale,
                                    offset_free_error, rerun_spread, summarize)
from parity.harness.progress import progress_bar
from parity.harness.scenarios.case import Case
from parity.harness.thresholds import (FLOOR_MULTIPLE, FLOOR_OF, NOMINAL_GROWTH, USEFUL_FAULT_REL,  # noqa: F401
                                       KLThresholds, fault_positions, kl_bound, pick_faults, position_faults,
                                       thresholds_for, top1_flips, verdict)
from parity.harness.ties import MAX_RESOLUTIONS, judge_ties, outside_pick
from reference.errors import InputError

__all__ = ["log_softmax", "kl_per_position", "summarize", "compare_logits", "LogitComparison", "logit_scale",
           "offset_free_error", "rerun_spread",
           "greedy_agreement", "KLThresholds", "thresholds_for", "verdict", "position_faults", "run_kl", "KLReport",
           "FLOOR_MAX_KL", "FLOOR_MULTIPLE", "PERCENTILES", "PASS", "FAIL", "INCONCLUSIVE"]

#: the three verdicts a judgement can reach (``qwen4exp`` exit codes 0 / 1 / 3: parity/cli)
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"

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


def _truth_logits(a, ids: list[int]):
    """``(a's one-shot logits of ids, their SelectionLog or None)``: for the reference backend (whose one-shot
    logits are its model's full forward) the forward runs with its selections logged, so the negative control
    reads them instead of a forward of its own; any other backend: its one-shot logits and None."""
    from parity.backends.reference import ReferenceBackend
    if isinstance(a, ReferenceBackend) and type(a).logits is ReferenceBackend.logits:
        return logged_logits(a.model, ids)
    return one_shot_logits(a, ids), None


class KLTruth:
    """The truth side of the KL harness, shareable by every backend judged in one process on the same prompts.

    Holds the truth backend ``a`` and memoises what depends on it alone: :meth:`logged` -- a's one-shot logits
    ``[T, V]`` over a token list with their :class:`parity.harness.floor.SelectionLog` (:func:`_truth_logits`:
    one forward), the truth's greedy continuation per prompt (:meth:`continuation`) and the negative control per
    key (:meth:`control`). A backend whose greedy continuation equals another's is judged against the very same
    arrays; one with a continuation of its own gets the forward over its own path (a causal model's rows at the
    prompt positions of any such forward are an equally valid truth). ``forwards``: the forwards of a run here
    (token lists), in order.
    """

    def __init__(self, a):
        self.a = a
        self._truths: dict[tuple, tuple] = {}
        self._greedy: dict[tuple, list[int]] = {}
        self._controls: dict[str, dict] = {}
        self.forwards: list[int] = []

    def logged(self, ids: Sequence[int]):
        """``(logits [T, V], SelectionLog or None)`` of a over ``ids`` (a's forward with its selections logged,
        :func:`_truth_logits`), computed once; a kept forward over a longer token list that begins with ``ids``
        answers with its first ``len(ids)`` rows and selections (:meth:`parity.harness.floor.SelectionLog.prefix`)."""
        key = tuple(int(t) for t in ids)
        hit = self._truths.get(key)
        if hit is not None:
            return hit
        n = len(key)
        for k, (lg, log) in self._truths.items():
            if len(k) > n and k[:n] == key:
                r = getattr(getattr(getattr(self.a, "model", None), "config", None), "indexer_compress_ratio", 1)
                return lg[:n], (log.prefix(n, r) if log is not None else None)
        self.forwards.append(n)
        got = _truth_logits(self.a, list(key))
        self._truths[key] = got
        return got

    def continuation(self, ids: Sequence[int], n: int, path_rows=None, path_tokens=None) -> list[int]:
        """The truth's greedy continuation of ``n`` tokens after ``ids`` (the first per prompt is kept: the same
        tokens for every backend). From ``path_rows`` (a's rows at positions ``len(ids) - 1 ..`` of a forward over
        ``ids + path_tokens[:-1]``) while the truth's picks equal ``path_tokens``; past the first difference (or
        without rows) through a's own prefill_last + decode (:func:`_greedy`)."""
        key = (tuple(int(t) for t in ids), int(n))
        hit = self._greedy.get(key)
        if hit is not None:
            return list(hit)
        out = []
        if path_rows is not None and path_tokens is not None:
            rows = np.asarray(path_rows)
            for k in range(min(n, len(rows))):
                out.append(int(np.argmax(rows[k])))
                if k >= len(path_tokens) or out[-1] != int(path_tokens[k]):
                    break
        if len(out) < n:
            more = _greedy(self.a, list(key[0]) + out, n - len(out), last_only=True)[0] if out else \
                _greedy(self.a, list(key[0]), n, last_only=True)[0]
            out = out + list(more)
        self._greedy[key] = list(out)
        return out

    def control(self, key: str, compute: Callable[[], dict]) -> dict:
        """The negative control under ``key`` (its thresholds' numbers, note and truths' token lists), computed
        once by ``compute()``; a copy is returned (a reuse says so in its ``shared`` field)."""
        if key in self._controls:
            return {**copy.deepcopy(self._controls[key]),
                    "shared": "computed once in this process for every backend judged on the same truths"}
        self._controls[key] = compute()
        return copy.deepcopy(self._controls[key])


def _check_shape(rows, n: int, a, name: str, what: str) -> None:
    """Raise :class:`parity.backends.base.BackendOutputError` when the backend's answer to ``n`` ids is not
    ``[n, vocab_size]`` (a padded vocabulary, a missing row): the backend's defect, named as such -- before, the
    comparison refused it as an input error that the kl row reported as raised by the backend."""
    v = getattr(getattr(a, "config", None), "vocab_size", None)
    shape = tuple(np.shape(rows))
    if len(shape) != 2 or shape[0] != n or (v is not None and shape[1] != int(v)):
        raise BackendOutputError(f"backend {name!r} returned logits of shape {list(shape)} for {what}() of {n} ids, "
                                 f"expected [{n}, {v if v is not None else 'vocab_size'}] = [tokens, vocab_size]")


def _greedy(backend, ids: Sequence[int], n: int, last_only: bool = False) -> tuple[list[int], np.ndarray | None]:
    """Greedy continuation of ``n`` tokens through prefill + decode (the incremental path).

    Returns ``(tokens [n], decode logits [n - 1, V])``: the rows decode() returned for tokens 1..n-1 (the
    first token comes from the prefill's last row, which the prefill comparison already judges).
    ``last_only``: the prefill through ``prefill_last`` (only its last row is formed: the reference's own
    continuation, whose prefill rows nothing reads; the backend under test keeps prefill())."""
    if n <= 0:
        return [], None
    h = backend.new_sequence()
    try:
        if last_only:
            logits = np.asarray(prefill_last_of(backend, h, list(ids))).reshape(1, -1)
        else:
            logits = owned(backend.prefill(h, list(ids)))
        out = [int(np.argmax(logits[-1]))]
        rows = []
        while len(out) < n:
            nxt = owned(backend.decode([h], [out[-1]]))
            rows.append(nxt[0])
            out.append(int(np.argmax(nxt[0])))
        return out, (np.stack(rows) if rows else np.zeros((0, logits.shape[-1]), logits.dtype))
    finally:
        backend.free(h)


#: sequences the generation-path check keeps live at once (batched like generation; an engine's default
#: live-sequence capacity is 16, parity/backends/engine.py)
GENERATION_BATCH = 8


def generation_paths(a, b, prompts, truth_last, th: KLThresholds, greedy_tokens: int, decode_tokens=None,
                     truth_of: Callable | None = None) -> dict:
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
      failing outside the near-tie band (:func:`top1_flips`, the kl row's rule). ``truth_of(ids) -> [T, V]``: a's
      forward over a token list (default :func:`parity.backends.one_shot_logits` of a; the harness passes its
      :class:`KLTruth`'s, which answers a continuation already forwarded without a forward of its own).

    Returns ``{"ok", "faults": [{"prompt", "op", "position", "detail"}], "prefill_last_rows",
    "decode_greedy_tokens"`` (judged against the truth), ``"decode_greedy_as_decode"`` (equal to decode()'s
    argmax)``}`` (positions absolute in the prompt + continuation). A wrong shape or dtype is a fault, never an
    exception.
    """
    faults, rows_judged, toks_judged, toks_same = [], 0, 0, 0
    last_rel = 0.0   # the worst judged error of a prefill_last row (relative to its logit scale)
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
                cmp = compare_logits(np.asarray(truth_last[i])[None], row[None])
                ok, why = verdict(cmp, th, offset=pos)
                rows_judged += 1
                last_rel = max(last_rel, float(np.max(cmp.rel_err())))
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
            fwd = truth_of(ids + got[:-1]) if truth_of is not None else one_shot_logits(a, ids + got[:-1])
            truth = np.asarray(fwd)[len(ids):]   # rows predicting got[1:]
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
    return {"ok": not faults, "faults": faults, "prefill_last_rows": rows_judged, "prefill_last_max_rel": last_rel,
            "decode_greedy_tokens": toks_judged,
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


def negative_control(pb_factory, truths, prompts, th: KLThresholds, note: str = "", truth_model=None,
                     logs=None) -> dict:
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

    ``logs``: the truth's :class:`parity.harness.floor.SelectionLog` per prompt when the caller logged them with
    ``truths`` (one forward, :func:`_truth_logits`); None: logged here on ``truth_model``.

    Returns a control dict: ``ok`` (flagged at the sized perturbation), ``inconclusive`` (not ok), ``scale``,
    ``intended_rel`` (CONTROL_MARGIN x tolerance), ``effect_rel`` (the measured effect at ``scale``, relative to
    the logit scale), ``full_effect_rel`` (at s = 1), ``forced`` (selections forced), ``max_kl``, ``detail``.
    """
    if logs is None and truth_model is not None and hasattr(truth_model, "selection_hook"):
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


def _first_failing(cmp: LogitComparison, th: KLThresholds, offset: int = 0) -> str:
    """The suffix naming a failing comparison's first failing position and the position of its worst logit error
    (``verdict`` names the worst one only), in the words of the scenarios (parity.harness.scenarios.common)."""
    first, worst = fault_positions(cmp, th, offset)
    return "" if first is None else f" (first failing position {first}, worst logit error at position {worst})"


def run_kl(a, b, prompts: Sequence[Sequence[int]], *, model: str = "", greedy_tokens: int = 8,
           floor_pair: tuple | None = None, perturbed_b: Callable[..., object] | None = None,
           perturbed_note: str = "", progress=True, floor=None, weights=None, thresholds=None,
           control_weights=None, kl_truth: KLTruth | None = None, control_note: str | None = None) -> KLReport:
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
        control_weights: the reference weights ``perturbed_b`` perturbs, when it perturbs the reference (not b):
            the control is then a function of the weights, the truths' token lists (each prompt + the judged
            continuation), the thresholds' numbers and the code: kept in ``kl_truth`` for the other backends of
            this process and, with ``$QWEN4EXP_FLOOR_CACHE`` set, there for a later run
            (:func:`parity.harness.floor_cache.control_material`).
        control_note: what identifies the control's computation (its target and tensor) when ``perturbed_note``
            adds words of this backend's own (None: ``perturbed_note``); the shared control's detail is worded
            with ``perturbed_note``.
        kl_truth: a :class:`KLTruth` of ``a`` shared with other backends judged on the same prompts (their
            truth forwards, the truth's continuations and negative controls are reused); None: one of this run.
        progress: ``"bar"`` / True (a tqdm bar), ``"lines"`` (a plain line per prompt, for a stderr that is not a
            terminal) or a false value (none): :func:`parity.harness.progress.progress_bar`.
    Returns:
        :class:`KLReport` (``status`` PASS / FAIL / INCONCLUSIVE, ``exit_code`` 0 / 1 / 3).
    Raises:
        InputError: empty prompt set.
    """
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
            floor_ps = floor_prompts(w.config, prompts)
            floor = measure_floor(w, floor_ps, stores_of(b))
            measured_here = w
    th = thresholds if thresholds is not None else thresholds_for(prec, floor)
    name_a, name_b = getattr(a, "name", type(a).__name__), getattr(b, "name", type(b).__name__)
    cmps, dcmps, det_ok, det_bad, greedy = [], [], True, [], []
    # a backend claiming determinism must repeat bitwise; any other is allowed its own measured run-to-run noise
    claims_det = bool(capabilities_of(b).get("deterministic"))
    spread, spread_at = 0.0, None
    la_all, truth_last, logs_a, paths = [], [], [], []
    kl_truth = kl_truth if kl_truth is not None else KLTruth(a)
    ratio = getattr(getattr(getattr(a, "model", None), "config", None), "indexer_compress_ratio", 1) or 1
    tie_rows, outside, per_prompt, unresolved = [], [], [], []
    truth_model = getattr(a, "model", None) if floor is not None else None
    # a coarse floor: the logits may not show a pick outside the tie set, so the selections are read on every prompt
    coarse = floor is not None and unresolvable(th, floor) is not None
    bar = progress_bar(len(prompts), f"kl {name_b} vs {name_a}", progress)
    for i, ids in enumerate(prompts):
        if i:
            bar.update(1)   # prompt i - 1 is finished (named by the label still set)
        # numbered as the report numbers prompts (its "prompt" fields, parity's kl/prompt N cases): from 0; the
        # counter beside the label ([done/total]) says how many there are
        bar.set_postfix_str(f"prompt {i} ({len(ids)} tokens)")
        ids = [int(t) for t in ids]
        lb = one_shot_logits(b, ids)
        _check_shape(lb, len(ids), a, name_b, "logits")
        lb2 = one_shot_logits(b, ids)
        path, be, gb = ids, lb, None
        if greedy_tokens:
            gb, rows = _greedy(b, ids, greedy_tokens)
            if rows is not None and len(rows) and lb.ndim == 2 and rows.shape[-1] == lb.shape[-1]:
                # b's decode() rows along b's own continuation, judged against a's forward over the same tokens
                path = ids + gb[:-1]
                be = np.concatenate([lb, rows], axis=0)
        # ONE forward of a per prompt: over the prompt and b's continuation, its selections logged; its prompt rows
        # are the prompt's truth (the model is causal), its selections at those positions the negative control's
        truth, log_path = kl_truth.logged(path)
        la = truth[:len(ids)]
        log_a = log_path.prefix(len(ids), ratio) if log_path is not None and len(path) > len(ids) else log_path
        logs_a.append(log_a)
        paths.append(path)
        if lb.shape != lb2.shape or not np.array_equal(lb, lb2, equal_nan=True):
            det_bad.append(i)
            if claims_det:
                det_ok = False
            else:
                sp = rerun_spread(lb, lb2, la)
                if spread_at is None or not sp <= spread:
                    spread, spread_at = sp, i
        la_all.append(la)
        g = None
        if greedy_tokens:
            ga = kl_truth.continuation(ids, greedy_tokens, truth[len(ids) - 1:], gb)
            g = {"prompt": i, "a": ga, "b": gb, "agree": greedy_agreement(ga, gb)}
        c = compare_logits(truth, be)
        bad = position_faults(c, th)
        if bad.any() and truth_model is not None and hasattr(truth_model, "selection_hook"):
            tj = judge_ties(truth_model, path, be, bad, th, floor, backend=b,
                            canon_log=(truth, log_path) if log_path is not None else None)
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
                                      f"than {MAX_RESOLUTIONS} resolutions (position {min(tj.truncated)}): the "
                                      f"backend's choice cannot be searched; a backend with selection taps can be judged")
        elif coarse and truth_model is not None and hasattr(truth_model, "selection_hook"):
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
                reason = f"prompt {i}: {why_pre}{_first_failing(c_pre, th)}"
                break
            if not ok_dec:
                reason = (f"prompt {i}: decode: {why_dec}{_first_failing(c_dec, th, c_pre.n)} (its prefill rows "
                          f"agree: the fault is in decode() or the state it carries)")
                break
    if outside:
        passed = False
        reason = outside[0] + ("" if len(outside) == 1 else f" (+{len(outside) - 1} more prompts)") + "; " + reason
    gen = generation_paths(a, b, prompts, truth_last, th, greedy_tokens, [g["b"] for g in greedy] if greedy else None,
                           truth_of=lambda ids: kl_truth.logged(ids)[0])
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
        from parity.harness import floor_cache
        # a control perturbing the reference is the same for every backend judged with these thresholds on these
        # prompts: it is a function of the weights, the truths (the token lists they were computed over: each
        # prompt + the judged continuation), the thresholds' numbers and the code -- computed once per process for
        # every backend with the same key (kl_truth), and kept in $QWEN4EXP_FLOOR_CACHE (control_weights: given
        # only for such a control)
        cnote = control_note if control_note is not None else perturbed_note

        def measure():
            mat = (floor_cache.control_material(control_weights, paths, th, cnote)
                   if floor_cache.cache_dir() else None)
            hit = floor_cache.load_control(mat) if mat is not None else None
            if hit is not None:
                return {**hit[0], "source": f"read from {hit[1]}"}
            tm = getattr(a, "model", None)
            if not hasattr(tm, "selection_hook"):
                # a is no reference (e.g. --a engine): the perturbed reference's selections are forced to the
                # unperturbed reference's picks, so its effect is the continuous response (plus a's own distance
                # from the reference, floor-sized), not the jump of a flipped pick
                from reference.model import ReferenceModel
                tm = ReferenceModel(control_weights, dtype=np.float32)
            got = negative_control(perturbed_b, la_all, prompts, th, cnote, truth_model=tm,
                                   logs=logs_a if all(lg is not None for lg in logs_a) else None)
            if mat is not None:
                got["source"] = f"measured, kept in {floor_cache.store_control(mat, got)}"
            return got
        if control_weights is not None:
            key = json.dumps([[list(map(int, p)) for p in paths], float(th.tol_rel), float(th.floor_rel),
                              float(th.multiple), float(th.score_rel), str(cnote)])
            nc = kl_truth.control(key, measure)
            if cnote != perturbed_note and nc["detail"].startswith(cnote):   # this backend's own wording
                nc["detail"] = perturbed_note + nc["detail"][len(cnote):]
        else:   # b itself perturbed: b's own control, never shared
            nc = negative_control(perturbed_b, la_all, prompts, th, perturbed_note,
                                  truth_model=getattr(a, "model", None),
                                  logs=logs_a if all(lg is not None for lg in logs_a) else None)
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
            wide = dataclasses.replace(th, tol_rel=th.tol_rel + (spread if np.isfinite(spread) else np.inf))
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
