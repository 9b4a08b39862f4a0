"""Name the first divergence of a failing scenario case (automatic tap-diff).

Steps (all replays of the case on the same backend instance):

0. the case is replayed as it was: a replay that passes or fails differently names the fault
   nondeterministic; one that fails earlier names state leaking between runs (and that failure is located);
1. a failing *batched* decode is replayed one sequence at a time: if every row is then correct,
   the fault is in batching (the batched call is then recorded as a batch and tap-diffed too);
2. the case is replayed with taps recorded around the failing operation, for the failing sequence
   and positions only;
3. the truth (the reference's single full forward over that sequence's history) is recorded for the
   same positions;
4. ``taps.diff`` compares the two archives and names the first tap (in forward order) that
   disagrees beyond its tolerance.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from parity.backends import capabilities_of, one_shot_logits
from parity.backends.base import declares_tap
from parity.harness.floor import stores_of, tap_floor_profile
from parity.harness.metrics import compare_logits, offset_free_error
from parity.harness.scenarios.common import CaseFailure, Run
from parity.harness.thresholds import position_faults, thresholds_for, tie_band
from reference import atomic
from taps.archive import ArchiveWriter
from taps.diff import diff_archives as _diff
from taps.diff import judging_profile, profile_toml
from taps.recorder import Recorder, format_ranges, position_ranges

__all__ = ["locate", "diff_archives", "locate_one_shot"]


#: how a failing case's ``archives`` entry reads when its tap archives could not be written (the verdict
#: stands without them); ``qwen4exp parity`` reports these (parity/cli/parity.py)
NOT_WRITTEN = "(archives not written: "


def not_written(e: BaseException) -> str:
    """The ``archives`` entry recording that a case's archives could not be written, and why."""
    return f"{NOT_WRITTEN}{type(e).__name__}: {e})"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _replay(case, backend, truth, th, **kw) -> Run | CaseFailure | Exception:
    run = Run(backend, truth, th, **kw)
    try:
        case.fn(run)
        run.finish()
        return run
    except CaseFailure as f:
        f.run = run
        return f
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return e
    finally:
        run.close()


def _returned_vs_tap(be_arc, returned, positions, precision: str) -> str | None:
    """When every tap agrees with the truth, the fault is in the logits the backend RETURNED (after its last
    tap). Compares ``returned`` (``[k, V]`` rows for ``positions``) with the backend's own ``logits`` tap, each
    row's common offset removed (:func:`parity.harness.kl.offset_free_error`).

    Tolerance: the returned logits are the tap's values handed back, so a float backend must match them to
    rounding (rel 1e-6 of the row's scale: a float32 copy is exact, a recomputation differs by ~1e-7);
    bf16/fp8 backends may round on the way out: 1e-2 (8 mantissa bits ~4e-3 per rounding).
    Returns ``(message or None, compared)``: ``compared`` is True when a logits tap was compared with
    the returned rows (then a None message means they match and the truth comparison adds nothing).
    """
    if returned is None or not len(positions):
        return None, False
    ret = np.asarray(returned, dtype=np.float64)
    ret = ret.reshape(-1, ret.shape[-1]) if ret.ndim else ret
    pos = [int(p) for p in positions][:ret.shape[0]]
    has = be_arc.has("logits") if hasattr(be_arc, "has") else "logits" in be_arc.names()
    if has:
        tap_pos = [int(p) for p in be_arc.positions("logits")]
        tap = np.asarray(be_arc.get("logits"), dtype=np.float64)
        rows = {p: tap[i].reshape(-1) for i, p in enumerate(tap_pos)}  # the last emit of a position wins
        rel = 1e-2 if precision in ("bf16", "fp8") else 1e-6
        for i, p in enumerate(pos):
            t = rows.get(p)
            if t is None or t.shape != ret[i].shape:
                continue
            scale = max(float(np.max(np.abs(t))) if t.size else 0.0, 1e-30)
            # a per-row offset is no difference (softmax ignores it): the kl harness's own error measure
            err = float(offset_free_error(t[None, :], ret[i][None, :])[0][0])
            bad = ~np.isfinite(ret[i]).all() or not err <= rel * scale
            if bad:
                return (f"returned logits differ from the backend's own logits tap (all recorded taps agree with "
                        f"the truth), first at position {p}"), True
        return None, True
    return None, False


def diff_archives(truth_arc, be_arc, precision: str = "float32", returned=None, positions=None,
                  truth_logits=None, thresholds=None, profile=None, backend=None) -> str:
    """First divergence between two tap archives as one line, via ``taps.diff.diff_archives``.

    Args:
        truth_arc, be_arc: tap sources (the truth's and the backend's recording of the same positions).
        precision: the backend's precision; picks the tolerance profile ('fp32' or 'bf16').
        returned, positions: optional ``[k, V]`` logits the backend returned for absolute ``positions``;
            when every tap agrees they name the position where the returned logits leave the backend's own
            ``logits`` tap (or, without such a tap, where they leave ``truth_logits`` beyond ``thresholds``).
            The first failing position (``truth_logits`` vs ``returned``) confines the diff to positions at or
            before it: a cause lies there.
        profile: the tap-diff profile (default :func:`judging_profile_of` of ``thresholds``).
        backend: the backend under test: taps it does not declare (``Backend.produces_taps``) are never
            listed as missing in it.
    Returns:
        e.g. ``first divergence layers.1.ple.out at position 17 (max_rel 3.1e-01; last agreeing
        layers.1.ple.gate)``, or a line saying why no tap-diff could be made.
    """
    if not be_arc.names():
        outside = ((getattr(be_arc, "manifest", None) or {}).get("outside_positions") or {}).get("positions")
        if outside:   # it did emit, at positions other than the ones asked for
            want = (be_arc.manifest.get("filters") or {}).get("positions")
            want_s = format_ranges(position_ranges(want)) if want else "?"
            return (f"backend emitted taps at positions {format_ranges(outside)}, expected {want_s} "
                    f"(position bookkeeping wrong?)")
        return "backend emitted no taps (tap-diff needs a backend that emits the registry's taps)"
    first_bad = _first_bad_vs_truth(returned, positions, truth_logits, thresholds)
    rep = _diff(truth_arc, be_arc, profile=profile or judging_profile_of(thresholds, precision), force=True,
                until_position=first_bad)
    cover = _coverage(rep, backend)
    return _line(rep, truth_arc, be_arc, precision, returned, positions, first_bad) + \
        (f" [{cover}]" if cover else "")


def _coverage(rep, backend) -> str:
    """The tap-coverage clause of a located cell: the taps the backend should have recorded (it declares them,
    ``parity.backends.base.declares_tap``) but did not, and any it recorded the truth has not."""
    if not hasattr(rep, "coverage_note"):
        return ""
    missing = [n for n in rep.missing_in_b if backend is None or declares_tap(backend, n)]
    show = 4
    parts = []
    if missing:
        parts.append("missing in the backend: " + ", ".join(missing[:show])
                     + (f" (+{len(missing) - show} more)" if len(missing) > show else ""))
    if rep.missing_in_a:
        extra = rep.missing_in_a
        parts.append("extra in the backend (not in the truth): " + ", ".join(extra[:show])
                     + (f" (+{len(extra) - show} more)" if len(extra) > show else ""))
    return "; ".join(parts)


_FLOOR_CACHE: dict = {}


def judging_profile_of(thresholds, precision: str = "float32", model=None, ids=None, backend=None, positions=None):
    """The tap-diff profile of every automatic location (:func:`taps.diff.judging_profile`): ``multiple`` x each
    tap's own floor measured on THE SAME history ``ids`` (``parity.harness.floor.tap_floor_profile``: the float32
    truth, or the store-rounding one of ``backend``'s stores, against float64, selections forced to float64's),
    joined with the run's measured profile (``thresholds.tap_profile``). Without a ``model`` to measure on and
    no run profile: the bundled profile of ``precision``. One rule for the failing operation, the kl row and
    the locate-through-state search: a tap counts as diverged only beyond it (saved as ``profile.toml`` beside
    the archives, so ``qwen4exp taps diff --profile profile.toml`` judges the same way). ``positions``: the rows
    of ``ids`` the comparison judges, when not all of them (a decode step's row): the floor then also covers those
    rows alone (:func:`parity.harness.floor.tap_floor_profile`).

    Tolerance: the multiple is the run's (``thresholds.multiple``, 8 for float32), the one the logits are judged
    at. Measured on the chunk-boundary cases of tiny (the reference prefilling in chunks of 1..79 vs its one-shot
    forward, the engine on CPU): every tap within 0.41 of this limit, while a 3e-3 lm_head fault is 1.8e5 over it."""
    here = None
    weights = getattr(model, "weights", None)
    mult = float(getattr(thresholds, "multiple", float("nan")))
    if weights is not None and ids and mult == mult:
        stores = stores_of(backend) if backend is not None else None
        rows = None
        if positions is not None and sorted(int(p) for p in positions) != list(range(len(ids))):
            rows = tuple(int(p) for p in positions)
        key = (id(weights), tuple(int(t) for t in ids), tuple(sorted((stores or {}).items())), mult,
               getattr(thresholds, "score_rel", None), rows)
        here = _FLOOR_CACHE.get(key)
        if here is None:
            try:
                here = tap_floor_profile(weights, list(ids), stores, mult, tie_band(thresholds), rows=rows)
            except Exception:  # noqa: BLE001 - the run's profile (or the bundled one) still judges
                here = None
            if here is not None:
                if len(_FLOOR_CACHE) > 32:
                    _FLOOR_CACHE.clear()
                _FLOOR_CACHE[key] = here
    return judging_profile(precision, here, getattr(thresholds, "tap_profile", None))


def _line(rep, truth_arc, be_arc, precision, returned, positions, first_bad=None) -> str:
    """The divergence clause of :func:`diff_archives` (without the tap-coverage note). ``first_bad``: the first
    position whose returned logits fail (the diff was confined to positions at or before it)."""
    if rep.first_divergence is None:
        msg, compared = _returned_vs_tap(be_arc, returned, positions or [], precision)
        if msg is not None:
            return msg
        if first_bad is not None and not compared:
            return (f"all recorded taps agree within the profile: the divergence is in the returned logits, after "
                    f"the last tap, first at position {first_bad}")
        if first_bad is not None:   # no tap, the logits tap included, diverges beyond tolerance: the output layer
            return (f"no recorded tap diverges beyond the tap-diff tolerance ({rep.profile}) at or before the first "
                    f"failing position: the divergence is in the returned logits (the output layer: final norm, "
                    f"lm_head, the logits returned), first at position {first_bad}")
        return "tap-diff: all recorded taps agree within the profile (divergence below tap resolution)"
    r = rep.result(rep.first_divergence)
    m = r.metrics if r is not None else {}
    metric = next((f"{k} {m[k]:.3g}" for k in ("max_rel", "rel_l2", "exact_match") if isinstance(m.get(k), float)), "")
    out = f"first divergence {rep.first_divergence}"
    if r is not None and r.first_position is not None:
        out += f" at position {r.first_position}"
    extras = [x for x in (metric, f"last agreeing {rep.last_agreeing}" if rep.last_agreeing else "",
                          f"possibly explained by the flip at {rep.explained_by_flip}" if rep.explained_by_flip
                          else "") if x]
    return out + (f" ({'; '.join(extras)})" if extras else "")


def _first_bad_vs_truth(returned, positions, truth_logits, thresholds) -> int | None:
    """First absolute position whose returned logits fail the KL threshold (or are non-finite) against
    the truth's rows; None when not computable or none fails."""
    if returned is None or truth_logits is None or thresholds is None or not positions:
        return None
    ret, tl = np.asarray(returned), np.asarray(truth_logits)
    k = min(len(ret), len(tl), len(positions))
    if not k:
        return None
    cmp = compare_logits(tl[:k], ret[:k])
    bad = position_faults(cmp, thresholds)
    return int(list(positions)[int(np.argmax(bad))]) if bad.any() else None


def locate(scenario: str, case, backend, truth, th, failed_op: int | None, failed_seq: str | None, *,
           archive_dir=None, page_size=None, first_failure: str | None = None) -> tuple[str, list[str]]:
    """Replay a failing case to name its first divergence. Returns (divergence line, archive paths).

    ``first_failure``: the first run's failure message; a replay on the same instance failing otherwise (or
    passing) is reported as nondeterminism, one failing EARLIER as state leaking between runs (that earlier
    failure is then located). All replays run on the same backend instance, after its whole history."""
    if failed_op is None:
        return "no failing operation recorded", []
    archives: list[str] = []
    prefix = ""
    # 0. determinism: a second identical run on the same instance must fail the same way
    again = _replay(case, backend, truth, th)
    if isinstance(again, CaseFailure) and again.op < failed_op:
        # it fails EARLIER now: state left behind by the first run leaks into the second (slot reuse, a
        # cache shared across requests); locate that earlier, reproducible failure
        prefix = (f"state leaks between runs: an identical replay on the same backend instance fails earlier "
                  f"(op {again.op}, first run op {failed_op}); at the replay's failure: ")
        failed_op, failed_seq = again.op, again.seq
        # a leak repeats: every later identical run fails at that earlier op (a backend whose outputs vary run
        # to run -- random tie-breaking, a race -- fails somewhere else or passes in one of them)
        for _ in range(CONFIRM_REPLAYS):
            again2 = _replay(case, backend, truth, th)
            if not (isinstance(again2, CaseFailure) and again2.op == failed_op and again2.seq == failed_seq):
                return (f"nondeterministic: identical runs of the case on the same backend instance fail at "
                        f"different operations (op {failed_op} in the first, then {_outcome(again)}, then "
                        f"{_outcome(again2)}): outputs that vary run to run (e.g. random tie-breaking), not "
                        f"state leaking between runs"), archives
    elif not (isinstance(again, CaseFailure) and again.op == failed_op and again.seq == failed_seq
              and (first_failure is None or not _deterministic(backend) or again.what == first_failure)):
        got = ("passes" if isinstance(again, Run) else
               f"fails at op {again.op}: {again.what}" if isinstance(again, CaseFailure) else
               f"raises {type(again).__name__}: {again}")
        return (f"nondeterministic: a second identical run of the case on the same backend instance differs "
                f"(first run failed at op {failed_op}, seq {failed_seq or '?'}; the replay {got})"), archives
    # 1. batching?
    probe = _replay(case, backend, truth, th, unbatch_at=failed_op)
    if _passes_op(probe, failed_op):
        # batching only if it repeats: batched it fails again there, alone it passes again (a backend whose
        # outputs vary run to run would pass alone, or fail batched, by chance)
        for _ in range(CONFIRM_REPLAYS):
            batched, alone = _replay(case, backend, truth, th), _replay(case, backend, truth, th, unbatch_at=failed_op)
            if not (isinstance(batched, CaseFailure) and batched.op == failed_op and batched.seq == failed_seq) \
                    or not _passes_op(alone, failed_op):
                return (prefix + f"nondeterministic: identical runs of the case on the same backend instance "
                        f"differ at op {failed_op} (batched: {_outcome(batched)}; one sequence at a time: "
                        f"{_outcome(alone)}): outputs that vary run to run (e.g. random tie-breaking), not "
                        f"batching"), archives
    if _passes_op(probe, failed_op):
        alone = "prefilled alone (its own prefill_batch call)" if _is_prefill_batch(probe) else "decoded alone"
        where = (f"batching: sequence {failed_seq or '?'} is correct when {alone} at op {failed_op}, "
                 f"wrong in the batch")
        inside = _locate_recorded(case, backend, truth, th, failed_op, failed_seq, scenario, archive_dir, page_size,
                                  record_batched=True, first_failure=first_failure)
        return prefix + where + (f"; in the batch, {inside[0]}" if inside[0] else ""), inside[1]
    if capabilities_of(backend).get("taps", True) is False:  # no taps: the failing check itself locates it
        what = probe.what if isinstance(probe, CaseFailure) else f"op {failed_op}"
        return prefix + f"{what} (backend records no taps: located by operation and position only)", archives
    out = _locate_recorded(case, backend, truth, th, failed_op, failed_seq, scenario, archive_dir, page_size,
                           first_failure=first_failure)
    return (prefix + out[0] if out[0] else prefix + "could not record the failing operation"), out[1]


#: extra identical replays that must repeat a claim of batching or of state leaking between runs before it is
#: made: a backend whose outputs vary run to run (a coin flip per run) survives k of them with chance 2**-k
CONFIRM_REPLAYS = 2


def _passes_op(probe, op: int) -> bool:
    """Whether a replay passed operation ``op`` (it passed, or failed only later)."""
    return isinstance(probe, Run) or (isinstance(probe, CaseFailure) and probe.op > op)


def _outcome(r) -> str:
    """A replay's outcome in a few words."""
    if isinstance(r, Run):
        return "passes"
    if isinstance(r, CaseFailure):
        return f"fails at op {r.op}" + (f", seq {r.seq}" if r.seq else "")
    return f"raises {type(r).__name__}"


def _is_prefill_batch(probe) -> bool:
    """Whether the unbatched replay ``probe`` ran the failing op as a ragged ``prefill_batch``."""
    run = getattr(probe, "run", probe if isinstance(probe, Run) else None)
    return getattr(run, "unbatched_kind", None) == "prefill_batch"


def _deterministic(backend) -> bool:
    """Whether the backend claims bitwise-identical reruns (then even the failure message must repeat; for
    others, whose reductions may reorder run to run, the failing operation and sequence must)."""
    return bool(capabilities_of(backend).get("deterministic"))


def _locate_recorded(case, backend, truth, th, failed_op, failed_seq, scenario, archive_dir, page_size,
                     record_batched: bool = False, first_failure: str | None = None) -> tuple[str, list[str]]:
    """Steps 2-4 of :func:`locate`: record the failing op (``record_batched``: a batched decode as the batch,
    the failing sequence's position only), record the truth, tap-diff. Returns (line, archive paths)."""
    archives: list[str] = []
    if capabilities_of(backend).get("taps", True) is False:
        return "", archives  # nothing to record: the caller's line stands alone
    # 2. record the backend
    rep = _replay(case, backend, truth, th, record_at=failed_op, record_seq=failed_seq, record_batched=record_batched)
    run = getattr(rep, "run", rep if isinstance(rep, Run) else None)
    if run is None or run.recorded is None:
        if isinstance(rep, Exception) and not isinstance(rep, CaseFailure):
            return f"replay with taps raised {type(rep).__name__}: {rep}", archives
        return "could not record the failing operation (replay diverged from the first run)", archives
    be_arc, label, positions, hist = run.recorded
    # 3. record the truth
    try:
        with Recorder(None, positions=positions, meta={"backend": "truth", "token_ids": list(hist)}) as rec:
            truth.model.forward(list(hist[:max(positions) + 1]))
        truth_arc = rec.archive()
    except Exception as e:  # noqa: BLE001
        return f"could not record the truth's taps: {type(e).__name__}: {e}", archives
    prec = getattr(backend, "precision", "float32")
    hk = list(hist[:max(positions) + 1])
    prof = judging_profile_of(th, prec, truth.model, hk, backend, positions=positions)
    if archive_dir is not None:
        try:   # token ids + model on both sides, so `tap-diff --replay` can use the saved archives
            meta = {"token_ids": [int(t) for t in hk], "model": _model_meta(backend, truth)}
            archives = _save(archive_dir, scenario, case.name, page_size, truth_arc, be_arc, meta=meta, profile=prof)
        except Exception as e:  # noqa: BLE001 - the verdict stands without the archives
            archives = [not_written(e)]
    where = f"op {failed_op}, seq {label}, positions {positions[0]}..{positions[-1]}: "
    try:
        tl = truth.logits(list(hist[:max(positions) + 1]))[list(positions)]
        if (first_failure and "logit error" in first_failure and run.recorded_out is not None
                and not (isinstance(rep, CaseFailure) and rep.op == failed_op and rep.seq == failed_seq)
                and _first_bad_vs_truth(run.recorded_out, positions, tl, th) is None):
            return (where + "nondeterministic: the replay recording the taps passes this operation, which the "
                    "first run failed (outputs that vary run to run, e.g. random tie-breaking; or recording taps "
                    "changes the backend's path)"), archives
        line = diff_archives(truth_arc, be_arc, prec, returned=run.recorded_out, positions=positions,
                             truth_logits=tl, thresholds=th, profile=prof, backend=backend)
    except Exception as e:  # noqa: BLE001
        return where + f"tap-diff failed: {type(e).__name__}: {e}", archives
    entered = None
    if positions[0] > 0:   # the sequence had earlier operations: the error may have entered through its state
        try:
            entered = entry_point(case, backend, truth, th, label, failed_op)
        except Exception:  # noqa: BLE001 - the located surface stands
            entered = None
    if entered is not None and entered[0] < failed_op:
        op_k, pos_k, text, arcs = entered
        if archive_dir is not None:   # the claimed op's archives, so the claim can be replayed (`taps diff`)
            try:
                t_k, b_k, hist_k, prof_k = arcs
                meta = {"token_ids": [int(t) for t in hist_k], "model": _model_meta(backend, truth)}
                archives += _save(archive_dir, scenario, case.name, page_size, t_k, b_k, meta=meta,
                                  profile=prof_k, sub=f"entered-op{op_k}")
            except Exception as e:  # noqa: BLE001 - the verdict stands without the archives
                archives.append(not_written(e))
        return (f"error entered at op {op_k}, seq {label}, position {pos_k}: {text}; it surfaced at " + where
                + line), archives
    return where + line, archives


def entry_point(case, backend, truth, th, label: str, failed_op: int):
    """Locate through state: replay the case recording EVERY operation of sequence ``label`` and tap-diff each
    against the truth (the reference's forward over that history); the first operation with a divergent tap
    is where the error entered (e.g. a GDN recurrent-state fault several positions before the failing decode).

    A tap counts as divergent under the same rule as the failing operation's location: beyond the judging
    profile (:func:`judging_profile_of`, each tap's floor measured on that op's own history), so an op whose
    taps differ only at the float32 noise level is never named.

    Returns ``(op, position, divergence line, (truth archive, backend archive, history, profile))`` of the earliest
    divergent operation (its archives, so the claim can be saved and replayed), or None (nothing diverges
    before the failing operation, or the replay could not record).
    """
    rep = _replay(case, backend, truth, th, record_all=label)
    run = getattr(rep, "run", rep if isinstance(rep, Run) else None)
    if run is None or not run.recorded_all:
        return None
    prec = getattr(backend, "precision", "float32")
    for op, be_arc, positions, hist in run.recorded_all:
        if op >= failed_op:   # the failing operation itself is located by the caller
            break
        if not be_arc.names():
            return None
        hk = list(hist[:max(positions) + 1])
        with Recorder(None, positions=positions, meta={"backend": "truth", "token_ids": hk}) as rec:
            truth.model.forward(hk)
        t_arc = rec.archive()
        profile = judging_profile_of(th, prec, truth.model, hk, backend, positions=positions)
        d = _diff(t_arc, be_arc, profile=profile, force=True)
        if d.first_divergence is not None:
            r = d.result(d.first_divergence)
            pos = r.first_position if r is not None and r.first_position is not None else positions[0]
            m = r.metrics if r is not None else {}
            metric = next((f" ({k} {m[k]:.3g})" for k in ("rel_l2", "max_rel") if isinstance(m.get(k), float)), "")
            return (op, int(pos), f"first divergence {d.first_divergence} at position {pos}{metric}",
                    (t_arc, be_arc, hk, profile))
    return None


def _model_meta(backend, truth) -> dict:
    """Manifest ``model`` fields of the harness's archives: the truth's config hash and the model path
    (the backend's ``model_path``, else the truth's checkpoint root), where known."""
    model = getattr(truth, "model", truth)
    out = {}
    try:
        out["config_hash"] = model.config.config_hash()
    except Exception:  # noqa: BLE001 - identity is best effort; tap-diff reports it as unverified
        pass
    try:  # the truth's weights: what `tap-diff --replay MODEL` must be given
        out["weights_fingerprint"] = model.weights.fingerprint()
    except Exception:  # noqa: BLE001 - best effort, as the config hash
        pass
    path = getattr(backend, "model_path", None) or getattr(getattr(model, "weights", None), "root", None)
    if isinstance(path, (str, Path)):
        out["path"] = str(path)
    return out


def _save(root, scenario, case, page_size, *arcs, meta: dict | None = None, profile=None,
          sub: str | None = None) -> list[str]:
    """Write the in-memory archives under ``root/<scenario>/<case>[-page<N>][/<sub>]/{truth,backend}.taps``;
    ``meta`` fields (token ids, model) are set in both manifests. ``profile``: the tap-diff profile the location
    judged with, written beside them as ``profile.toml`` (``qwen4exp taps diff truth.taps backend.taps --profile
    profile.toml`` then judges exactly as the location did)."""
    out = []
    d = Path(root) / _safe(scenario) / (_safe(case) + (f"-page{page_size}" if page_size else ""))
    if sub:
        d = d / _safe(sub)
    d.mkdir(parents=True, exist_ok=True)
    if profile is not None:
        names = sorted(set().union(*(a.names() for a in arcs)))
        atomic.atomic_write_bytes(d / "profile.toml", profile_toml(profile, names).encode())
    for tag, arc in zip(("truth", "backend"), arcs):
        path = d / f"{tag}.taps"
        w = ArchiveWriter(path, overwrite=True)
        try:
            for name in arc.names():
                info = arc.info(name)
                w.add(name, arc.get(name), arc.positions(name), kind=getattr(info, "kind", "activation"))
            w.close({**_manifest_fields(arc), **(meta or {})})
        except BaseException:
            w.abort()
            raise
        out.append(str(path))
    return out


def _manifest_fields(arc) -> dict:
    m = dict(getattr(arc, "manifest", {}) or {})
    keep = {k: m[k] for k in ("backend", "dtype", "model", "token_ids", "positions", "scenario",
                                              "outside_positions") if k in m}
    return keep


def locate_one_shot(backend, truth_model, ids, *, archive_dir=None, label="kl", thresholds=None) -> tuple[str, list[str]]:
    """tap-diff of one prompt's one-shot logits: the backend's ``logits(ids)`` against the truth's full
    forward, all positions recorded. Returns (divergence line, archive paths)."""

    ids = [int(t) for t in ids]
    if capabilities_of(backend).get("taps", True) is False:  # no taps: the first divergent position only
        th = thresholds_for(getattr(backend, "precision", "float32"))
        first = _first_bad_vs_truth(one_shot_logits(backend, ids), list(range(len(ids))),
                                    truth_model.forward(ids), th)
        return (f"first divergent position {first} of {len(ids)} (backend records no taps: located by "
                f"position only)"), []
    try:
        with backend.taps(None, meta={"token_ids": ids}) as rec_b:
            returned = one_shot_logits(backend, ids)
        be_arc = rec_b.archive()
        with Recorder(None, meta={"backend": "truth", "token_ids": ids}) as rec_t:
            truth_logits = truth_model.forward(ids)
        truth_arc = rec_t.archive()
    except Exception as e:  # noqa: BLE001
        return f"could not record taps: {type(e).__name__}: {e}", []
    archives: list[str] = []
    prec = getattr(backend, "precision", "float32")
    if archive_dir is not None:
        try:
            archives = _save(archive_dir, label, "worst_prompt", None, truth_arc, be_arc,
                             meta={"token_ids": ids, "model": _model_meta(backend, truth_model)},
                             profile=judging_profile_of(thresholds or thresholds_for(prec), prec, truth_model, ids,
                                                        backend))
        except Exception as e:  # noqa: BLE001
            archives = [not_written(e)]
    th = thresholds or thresholds_for(prec)
    return diff_archives(truth_arc, be_arc, prec, returned=returned, positions=list(range(len(ids))),
                         truth_logits=truth_logits, thresholds=th,
                         profile=judging_profile_of(th, prec, truth_model, ids, backend), backend=backend), archives
