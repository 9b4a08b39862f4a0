"""Runs one scenario case against a backend and, on failure, locates its first divergence
(:mod:`parity.harness.scenarios.locate`)."""
from __future__ import annotations

import time
import traceback

from parity.backends.base import CapabilityLimit, SUPPORTED, capability
from parity.harness.thresholds import thresholds_for
from parity.harness.scenarios.common import Case, CaseConfined, CaseFailure, CaseResult, CaseSkip, Run, TruthCache
from parity.harness.scenarios.locate import locate
from reference.errors import InconclusiveError, UserError


# ----------------------------------------------------------------------------------------------- runner
def run_case(scenario: str, case: Case, backend, truth: TruthCache, *, page_size=None, locate_on_fail=True,
             archive_dir=None, thresholds=None, below_bound: bool = False, known=None) -> CaseResult:
    """Run one case; on failure replay it with taps to name the first divergence.

    ``thresholds``: the run's :class:`parity.harness.kl.KLThresholds` (from the floor measured on this model,
    :func:`parity.harness.floor.thresholds_for_run`); None: the nominal thresholds of the backend's precision.
    ``below_bound``: confine the case below the QSA bound (a case reaching past it is skipped). ``known``: the
    ``--known`` baseline (:class:`parity.harness.causes.KnownCauses`): a failure it excuses is marked ``known``,
    one it does not carries ``known_note`` (what is new).
    Returns a :class:`CaseResult`; never raises for a backend fault (errors become status 'error').

    Partial capabilities (:func:`parity.backends.base.capability`): a case needing (``case.needs``) an
    operation the backend declares unsupported is skipped before it runs; inside a case, a use of an
    operation outside its declared limit is skipped (:class:`CaseSkip`), and so is a
    :class:`CapabilityLimit` the backend raises for an operation it declared limited or unsupported -- for
    one it declared supported that is a refusal and the case fails. A skip carries its reason in
    ``failure`` and never counts as a pass. Failures are located by tap replay only when the backend
    declares taps usable.
    """
    t0 = time.perf_counter()
    th = thresholds if thresholds is not None else thresholds_for(getattr(backend, "precision", "float32"))
    res = CaseResult(scenario, case.name, page_size, "pass")
    missing = [capability(backend, c) for c in case.needs]
    missing = [c for c in missing if not c.usable]
    if missing:
        res.status = "skip"
        res.failure = "needs " + "; ".join(c.reason() for c in missing)
        return res
    run = Run(backend, truth, th)
    if below_bound:
        from parity.harness.scenarios.common import sizes
        sz = sizes(backend.config)
        run.limit = sz.bound if sz.has_qsa else None   # at most `bound` visible tokens: the last position is bound-1
    try:
        case.fn(run)
        run.finish()
    except CaseConfined as c:
        res.status = "skip"
        res.failure = str(c)
    except CaseSkip as sk:
        res.status = "skip"
        res.failure = sk.reason
    except CapabilityLimit as e:
        c = capability(backend, run.current_op) if run.current_op else None
        if c is not None and c.status != SUPPORTED:
            res.status = "skip"
            res.failure = f"{c.reason()}: the backend refused: {e}"
        else:
            res.status = "fail"
            res.failure = (f"backend refused an operation it declares supported ({run.current_op}): "
                           f"{type(e).__name__}: {e}")
            res.failed_op = run.ops - 1
            res.divergence = f"refused: {e}"
    except CaseFailure as f:
        res.status = "fail"
        res.failure = f.what
        res.failed_op = f.op
        res.failed_seq = f.seq
        res.divergence = f.divergence
    except KeyboardInterrupt as e:
        from reference.atomic import real_interrupt
        if real_interrupt():
            raise  # the user's Ctrl-C / a termination signal: the run stops (exit 128+N)
        res.status = "error"  # raised by the backend's code, no signal behind it: a crash of the case
        from parity.backends.base import describe_exception
        res.failure = f"{describe_exception(e)} (raised by the backend, no signal was received)"
        res.divergence = res.failure
        res.traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        res.failed_op = run.ops - 1
    except InconclusiveError:
        raise  # the truth itself is invalid (NaN logits): no case can be judged, the run is inconclusive
    except UserError as e:
        res.status = "fail"
        res.failure = f"backend refused an operation the model allows: {type(e).__name__}: {e}"
        res.failed_op = run.ops - 1
        res.divergence = f"refused: {e}"
    except (Exception, SystemExit) as e:  # a backend's sys.exit() is a crash of the case, never the run's exit code
        res.status = "error"
        res.failure = f"{type(e).__name__}: {e}" + (f" (raised in {run.current_op})" if run.current_op else "")
        res.divergence = "".join(traceback.format_exception_only(type(e), e)).strip()
        res.traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        res.failed_op = run.ops - 1
    finally:
        run.close()
    res.checks, res.worst_kl, res.worst_logit_err = run.checks, run.worst_kl, run.worst_err
    res.worst_logit_err_rel, res.tie_flips = run.worst_rel, run.tie_flips
    res.tie_equivalent = [list(x) for x in run.tie_equivalent]
    if getattr(run, "shape_mismatch", False):  # logits of the wrong shape: no KL or error figure describes this case
        res.worst_kl = res.worst_logit_err = res.worst_logit_err_rel = None
    res.narrowed = list(run.narrowed)
    if res.status == "fail" and res.divergence is None and locate_on_fail and not capability(backend, "taps").usable:
        res.divergence = f"not located: {capability(backend, 'taps').reason()} (no tap replay)"
    if res.status == "fail" and res.divergence is None and locate_on_fail:
        res.divergence, res.archives = locate(scenario, case, backend, truth, th, res.failed_op, res.failed_seq,
                                              archive_dir=archive_dir, page_size=page_size,
                                              first_failure=res.failure)
    if res.status in ("fail", "error"):
        from parity.harness.causes import root_cause
        res.root_cause = root_cause(res.failure, res.divergence, backend.config, scenario,
                                    raised_in=(run.current_op or "?") if res.status == "error" else None)
        res.fault = run.fault
        if known is not None:   # excused only by the same cause at the same places, no larger, no new top-1 flip
            res.known, why = known.judge(res.root_cause, res.fault, th.tol_rel)
            res.known_note = why or None
    res.seconds = time.perf_counter() - t0
    return res
