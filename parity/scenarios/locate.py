"""Name the first divergence of a failing scenario case (automatic tap-diff).

Steps (all deterministic replays of the case):

1. a failing *batched* decode is replayed one sequence at a time: if every row is then correct,
   the fault is in batching and that is the answer;
2. the case is replayed with taps recorded around the failing operation, for the failing sequence
   and positions only;
3. the truth (the reference's single full forward over that sequence's history) is recorded for the
   same positions;
4. ``taps.diff`` compares the two archives and names the first tap (in forward order) that
   disagrees beyond its tolerance.
"""
from __future__ import annotations

from pathlib import Path

from parity.scenarios.common import CaseFailure, Run

__all__ = ["locate", "diff_archives", "locate_one_shot"]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _replay(case, backend, truth, th, **kw) -> Run | CaseFailure | Exception:
    run = Run(backend, truth, th, **kw)
    try:
        case.fn(run)
        return run
    except CaseFailure as f:
        f.run = run
        return f
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return e
    finally:
        run.close()


def diff_archives(truth_arc, be_arc, precision: str = "float32") -> str:
    """First divergence between two tap archives as one line, via ``taps.diff.diff_archives``.

    Args:
        truth_arc, be_arc: tap sources (the truth's and the backend's recording of the same positions).
        precision: the backend's precision; picks the tolerance profile ('fp32' or 'bf16').
    Returns:
        e.g. ``first divergence layers.1.ple.out at position 17 (max_rel 3.1e-01; last agreeing
        layers.1.ple.gate)``, or a line saying why no tap-diff could be made.
    """
    try:
        from taps.diff import diff_archives as _diff
    except ImportError as e:
        return f"tap-diff unavailable (taps.diff: {e})"
    if not be_arc.names():
        return "backend emitted no taps (tap-diff needs a backend that emits the registry's taps)"
    profile = "bf16" if precision in ("bf16", "fp8") else "fp32"
    rep = _diff(truth_arc, be_arc, profile=profile, force=True)
    if rep.first_divergence is None:
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


def locate(scenario: str, case, backend, truth, th, failed_op: int | None, failed_seq: str | None, *,
           archive_dir=None, page_size=None) -> tuple[str, list[str]]:
    """Replay a failing case to name its first divergence. Returns (divergence line, archive paths)."""
    if failed_op is None:
        return "no failing operation recorded", []
    archives: list[str] = []
    # 1. batching?
    probe = _replay(case, backend, truth, th, unbatch_at=failed_op)
    if isinstance(probe, Run) or (isinstance(probe, CaseFailure) and probe.op > failed_op):
        return (f"batching: sequence {failed_seq or '?'} is correct when decoded alone at op {failed_op}, "
                f"wrong in the batch"), archives
    # 2. record the backend
    rep = _replay(case, backend, truth, th, record_at=failed_op, record_seq=failed_seq)
    run = getattr(rep, "run", rep if isinstance(rep, Run) else None)
    if run is None or run.recorded is None:
        if isinstance(rep, Exception) and not isinstance(rep, CaseFailure):
            return f"replay with taps raised {type(rep).__name__}: {rep}", archives
        return "could not record the failing operation (replay diverged from the first run)", archives
    be_arc, label, positions, hist = run.recorded
    # 3. record the truth
    try:
        from taps.recorder import Recorder
        with Recorder(None, positions=positions, meta={"backend": "truth", "token_ids": list(hist)}) as rec:
            truth.model.forward(list(hist[:max(positions) + 1]))
        truth_arc = rec.archive()
    except Exception as e:  # noqa: BLE001
        return f"could not record the truth's taps: {type(e).__name__}: {e}", archives
    if archive_dir is not None:
        try:   # token ids + model on both sides, so `tap-diff --replay` can use the saved archives
            meta = {"token_ids": [int(t) for t in hist[:max(positions) + 1]], "model": _model_meta(backend, truth)}
            archives = _save(archive_dir, scenario, case.name, page_size, truth_arc, be_arc, meta=meta)
        except Exception as e:  # noqa: BLE001 - the verdict stands without the archives
            archives = [f"(archives not written: {type(e).__name__}: {e})"]
    where = f"op {failed_op}, seq {label}, positions {positions[0]}..{positions[-1]}: "
    try:
        return where + diff_archives(truth_arc, be_arc, getattr(backend, "precision", "float32")), archives
    except Exception as e:  # noqa: BLE001
        return where + f"tap-diff failed: {type(e).__name__}: {e}", archives


def _model_meta(backend, truth) -> dict:
    """Manifest ``model`` fields of the harness's archives: the truth's config hash and the model path
    (the backend's ``model_path``, else the truth's checkpoint root), where known."""
    model = getattr(truth, "model", truth)
    out = {}
    try:
        out["config_hash"] = model.config.config_hash()
    except Exception:  # noqa: BLE001 - identity is best effort; tap-diff reports it as unverified
        pass
    path = getattr(backend, "model_path", None) or getattr(getattr(model, "weights", None), "root", None)
    if isinstance(path, (str, Path)):
        out["path"] = str(path)
    return out


def _save(root, scenario, case, page_size, *arcs, meta: dict | None = None) -> list[str]:
    """Write the in-memory archives under ``root/<scenario>/<case>[-page<N>]/{truth,backend}.taps``;
    ``meta`` fields (token ids, model) are set in both manifests."""
    out = []
    d = Path(root) / _safe(scenario) / (_safe(case) + (f"-page{page_size}" if page_size else ""))
    d.mkdir(parents=True, exist_ok=True)
    try:
        from taps.archive import ArchiveWriter
    except ImportError:
        return out
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
    keep = {k: m[k] for k in ("backend", "dtype", "model", "token_ids", "positions", "scenario") if k in m}
    return keep


def locate_one_shot(backend, truth_model, ids, *, archive_dir=None, label="kl") -> tuple[str, list[str]]:
    """tap-diff of one prompt's one-shot logits: the backend's ``logits(ids)`` against the truth's full
    forward, all positions recorded. Returns (divergence line, archive paths)."""
    from taps.recorder import Recorder

    ids = [int(t) for t in ids]
    try:
        with backend.taps(None, meta={"token_ids": ids}) as rec_b:
            from parity.backend import one_shot_logits
            one_shot_logits(backend, ids)
        be_arc = rec_b.archive()
        with Recorder(None, meta={"backend": "truth", "token_ids": ids}) as rec_t:
            truth_model.forward(ids)
        truth_arc = rec_t.archive()
    except Exception as e:  # noqa: BLE001
        return f"could not record taps: {type(e).__name__}: {e}", []
    archives: list[str] = []
    if archive_dir is not None:
        try:
            archives = _save(archive_dir, label, "worst_prompt", None, truth_arc, be_arc,
                             meta={"token_ids": ids, "model": _model_meta(backend, truth_model)})
        except Exception as e:  # noqa: BLE001
            archives = [f"(archives not written: {type(e).__name__}: {e})"]
    return diff_archives(truth_arc, be_arc, getattr(backend, "precision", "float32")), archives
