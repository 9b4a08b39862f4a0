"""The scenario suites: budget, chunk_boundary, snapshot_restore, speculative_rollback (against the truth)
and self_consistency (the backend against itself; ``truth`` may be None).

``run_scenario(name, open_backend, truth)`` runs every case of one scenario against a backend, at
each paged-cache page size the backend supports (sizes that do and do not divide the compress
ratio; the reference has no pages and runs once), and returns the per-case results.
``SUITES`` is the one list of suites (each module declares its :class:`~parity.harness.scenarios.suite.Suite`);
``SCENARIOS`` (their names, also accepted with dashes, in run order) and ``TRUTHLESS`` are derived from it.
"""
from __future__ import annotations

from typing import Callable

from reference.errors import InputError

from parity.harness.scenarios import budget, chunk_boundary, self_consistency, snapshot_restore, speculative_rollback
from parity.harness.scenarios.suite import Suite

__all__ = ["SUITES", "SCENARIOS", "scenario_names", "cases_for", "count_cases", "count_run_cases", "run_scenario",
           "page_sizes_unused", "summarize_results",
           "normalize_name", "meanings", "Suite"]

#: the scenario suites, one line each, in run order
SUITES: dict[str, Suite] = {s.name: s for s in (
    budget.SUITE,
    chunk_boundary.SUITE,
    snapshot_restore.SUITE,
    speculative_rollback.SUITE,
    self_consistency.SUITE,
)}
SCENARIOS = tuple(SUITES)
#: the suites that need no truth (run without the reference)
TRUTHLESS = tuple(n for n, s in SUITES.items() if not s.needs_truth)


def normalize_name(name: str) -> str:
    """'chunk-boundary' / 'chunk_boundary' -> 'chunk_boundary'. Raises InputError for unknown names."""
    n = name.strip().replace("-", "_")
    if n not in SCENARIOS:
        raise InputError(f"scenario {name!r}: expected one of {', '.join(s.replace('_', '-') for s in SCENARIOS)}, "
                         f"found {name!r}")
    return n


def meanings() -> dict[str, str]:
    """Suite label (``chunk-boundary``) -> its legend line (``Suite.meaning``), in run order."""
    return {s.label: s.meaning for s in SUITES.values()}


def scenario_names() -> list[str]:
    """The scenario names, in run order."""
    return list(SCENARIOS)


LEVELS = ("full", "ci", "long")


def cases_for(name: str, config, level: str = "full"):
    """The :class:`parity.harness.scenarios.common.Case` list of scenario ``name`` for a model config.

    ``level``: 'full' (every combination), 'ci' (the same situations with fewer redundant combinations) or
    'long' (:mod:`parity.harness.scenarios.long`: the real caps -- prompts crossing the bound, chunks over
    8192, positions past 32768 -- for a real-width model; self-consistency runs its 'ci' cases).
    """
    if level not in LEVELS:
        raise InputError(f"level: expected one of {LEVELS}, found {level!r}")
    suite = SUITES[normalize_name(name)]
    if level == "long" and suite.long_cases is not None:
        return suite.long_cases(config)
    return suite.cases(config, level="ci" if level == "long" else level)


def _page_plan(backend_caps, config, page_sizes):
    """The page sizes a suite runs its cases at: ``page_sizes`` (the user's) or the config's for a backend with a
    paged cache; ``[None]`` (each case once, without pages) for one without, whatever ``page_sizes`` says (its
    cases would otherwise run and count once per size, the same run each time): :func:`page_sizes_unused`."""
    from parity.harness.scenarios.common import page_sizes_for
    if backend_caps.get("page_sizes") is None:
        return [None]
    if page_sizes is not None:
        return list(page_sizes)
    return page_sizes_for(config)


def page_sizes_unused(backend_caps, page_sizes) -> str | None:
    """The note a suite row carries when the user's ``page_sizes`` do not apply (a backend without a paged cache),
    else None."""
    if page_sizes is None or backend_caps.get("page_sizes") is not None:
        return None
    return (f"page sizes {','.join(str(p) for p in page_sizes)} not applied: the backend has no paged cache (each "
            f"case ran once)")


def run_scenario(name: str, open_backend: Callable, truth, *, page_sizes=None, only: list[str] | None = None,
                 archive_dir=None, progress=None, locate_on_fail=True, level: str = "full", thresholds=None,
                 below_bound: bool = False, known=None):
    """Run scenario ``name``.

    Args:
        open_backend: ``f(**opts) -> Backend`` (called with ``page_size=`` per page size).
        truth: :class:`parity.harness.scenarios.common.TruthCache` of the reference model.
        page_sizes: override the page-size plan (None: from the backend's capabilities and the config).
        only: case names to run (None: all).
        level: 'full' or 'ci' (see :func:`cases_for`).
        archive_dir: where failing cases' tap archives go (None: not written).
        progress: a tqdm-like object with ``update()`` / ``set_postfix_str()`` (optional).
        thresholds: the run's :class:`parity.harness.kl.KLThresholds` (None: nominal, see ``run_case``).
        below_bound, known: see ``run_case`` (confine below the QSA bound; the ``--known`` baseline).
    Returns:
        list of :class:`parity.harness.scenarios.common.CaseResult`.
    """
    from parity.harness.scenarios.runner import run_case

    name = normalize_name(name)
    from parity.backends import capabilities_of
    probe = open_backend()
    caps = capabilities_of(probe)
    config = probe.config
    cases = cases_for(name, config, level)
    if only:
        cases = [c for c in cases if c.name in only]
    results = []
    plan = _page_plan(caps, config, page_sizes)
    for ps in plan:
        be = probe if ps is None else open_backend(page_size=ps)
        try:
            for case in cases:
                if progress is not None:
                    progress.set_postfix_str(f"{name}/{case.name}" + (f" page {ps}" if ps else ""))
                results.append(run_case(name, case, be, truth, page_size=ps, locate_on_fail=locate_on_fail,
                                        archive_dir=archive_dir, thresholds=thresholds, below_bound=below_bound,
                                        known=known))
                if progress is not None:
                    progress.update(1)
        finally:
            if be is not probe and hasattr(be, "close"):
                be.close()
    close = getattr(probe, "close", None)
    if close:
        close()
    return results


def count_cases(name: str, config, caps: dict, page_sizes=None, level: str = "full") -> int:
    """Number of case runs :func:`run_scenario` will make (for progress bars)."""
    return len(cases_for(name, config, level)) * len(_page_plan(caps, config, page_sizes))


def count_run_cases(scenarios, config, caps: dict, page_sizes=None, level: str = "full", kl_prompts: int = 0) -> int:
    """Cases a ``parity`` run's verdict table counts over ``scenarios`` (skipped ones included): the kl row one
    per prompt (``kl_prompts`` of them), each suite :func:`count_cases`. The total of the run's progress
    counter, so that its last step reads as many cases as the table."""
    return sum(int(kl_prompts) if s == "kl" else count_cases(s, config, caps, page_sizes, level) for s in scenarios)


def summarize_results(name: str, results, seconds: float, inconclusive: str | None = None):
    """One :class:`parity.harness.report.ScenarioRow` from a scenario's case results. ``inconclusive``: the
    reason the run's tolerance cannot resolve a useful fault (then a row that would pass is 'inconclusive')."""
    from parity.harness.report import ScenarioRow

    ran = [r for r in results if r.status != "skip"]
    known = [r for r in ran if r.status in ("fail", "error") and r.known]
    failed = [r for r in ran if r.status in ("fail", "error") and not r.known]
    # a skipped case never counts as a pass: a scenario whose every case was skipped is 'skip', not 'pass'
    status = "error" if any(r.status == "error" for r in failed) else ("fail" if failed else ("pass" if ran else "skip"))
    # an ERROR case compared nothing: never 'KL 0', which reads as perfect; nor does a case whose logits had the
    # wrong shape (worst_kl None): when no case produced figures the row shows '-' (None)
    compared = [r for r in ran if r.status != "error" and r.worst_kl is not None]
    nothing = float("nan") if ran and all(r.status == "error" for r in ran) else None  # none ran: '-'
    wk = max((r.worst_kl for r in compared), default=nothing)
    we = max((r.worst_logit_err for r in compared), default=nothing)
    wr = max((float(r.worst_logit_err_rel) for r in compared), default=None)  # the figure the limit judges
    tb = next((r.traceback for r in ran if r.status == "error" and r.traceback), None)
    first = next((r for r in failed), None)
    skipped = [r for r in results if r.status == "skip"]
    detail = "" if not first else f"{first.label}: {first.failure}" + (
        f" (not excused by --known: {first.known_note})" if first.known_note else "")
    where = None if not first else (f"{first.case}" + (f" [page {first.page_size}]" if first.page_size else "")
                                    + f": {first.divergence}")
    reasons = list(dict.fromkeys(r.failure for r in skipped))
    narrowed = [r for r in ran if r.narrowed]
    if narrowed:
        detail = (detail + "; " if detail else "") + f"{len(narrowed)} narrowed: {narrowed[0].narrowed[0]}"
    if skipped:
        detail = (detail + "; " if detail else "") + f"{len(skipped)} skipped: " + "; ".join(reasons[:3]) + (
            f"; and {len(reasons) - 3} more reasons" if len(reasons) > 3 else "")
    if known:
        detail = (detail + "; " if detail else "") + (f"{len(known)} failing only through a known root cause "
                                                      f"({known[0].root_cause['id']})")
    tie_eq = sum(len(p) for r in ran for (_op, _seq, p) in r.tie_equivalent)
    tie_at = [{"case": r.label, "op": op, "seq": seq, "positions": list(p)}
              for r in ran for (op, seq, p) in r.tie_equivalent]
    if status == "pass" and inconclusive:
        status, detail = "inconclusive", inconclusive + ("; " + detail if detail else "")
    notes = {}
    if any(r.case.startswith("mtp_") for r in ran):  # the MTP truth is a consensus, not an official one
        from parity.harness.scenarios.speculative_rollback import MTP_TRUTH_PROVENANCE
        notes["mtp_truth_provenance"] = MTP_TRUTH_PROVENANCE
    return ScenarioRow(scenario=name.replace("_", "-"), cases=len(ran), failed_cases=len(failed), worst_kl=wk,
                       worst_logit_err=we, worst_logit_err_rel=wr, first_divergence=where, seconds=seconds,
                       status=status, detail=detail, failures=[{**r.to_json(), "label": r.label}
                                                                for r in failed + known],
                       skipped=len(skipped), skips=[{"case": r.label, "reason": r.failure} for r in skipped]
                       + [{"case": r.label, "narrowed": n} for r in narrowed for n in r.narrowed], known=len(known),
                       tie_equivalent=tie_eq, tie_equivalent_at=tie_at, notes=notes, traceback=tb)


MAX_PAGE_SIZES = 16  # each page size re-opens the backend and re-runs every case: a bound on the plan's cost
# the KV a page size implies: the scenarios keep up to PLAN_LIVE_SEQS sequences live (the engine backend's
# max_seqs, parity/backends), each holding at least one page, in the PLAN_KV_TOKENS-token pool the engine
# allocates by default on the CPU (engine/engine.py); a larger page starves the pool and every batched case
# "fails" for want of pages (measured: 4096 passes every scenario on engine-cpu, 8192 and up do not)
PLAN_LIVE_SEQS = 16
PLAN_KV_TOKENS = 65536


def parse_page_sizes(text: str, max_positions: int | None = None, flag: str = "--page-sizes") -> list[int]:
    """``--page-sizes N,N,...`` -> the page sizes, checked before anything runs: positive integers, no
    empty item, no repeat, at most :data:`MAX_PAGE_SIZES` of them, each <= ``max_positions`` (the model's
    max_position_embeddings: a page is never larger than one sequence can be) and each small enough that
    :data:`PLAN_LIVE_SEQS` pages fit :data:`PLAN_KV_TOKENS` tokens (the KV the plan implies is bounded).

    Raises:
        InputError: naming ``flag``, what was expected and the first bad item.
    """
    from reference.errors import InputError
    items = str(text).split(",")
    out = []
    for n, x in enumerate(items):
        x = x.strip()
        if not x:
            raise InputError(f"{flag}: expected comma-separated positive integers, found an empty item at item {n} "
                             f"of {text!r}")
        try:
            v = int(x)
        except ValueError:
            raise InputError(f"{flag}: expected comma-separated positive integers, found {x[:40]!r} in "
                             f"{text!r}") from None
        if v <= 0:
            raise InputError(f"{flag}: expected comma-separated positive integers, found {v} in {text!r}")
        if max_positions is not None and v > max_positions:
            raise InputError(f"{flag}: expected page sizes <= the model's max_position_embeddings={max_positions}, "
                             f"found {v}")
        if v * PLAN_LIVE_SEQS > PLAN_KV_TOKENS:
            raise InputError(f"{flag}: expected page sizes <= {PLAN_KV_TOKENS // PLAN_LIVE_SEQS} (the scenarios' "
                             f"{PLAN_LIVE_SEQS} live sequences x one page each must fit a {PLAN_KV_TOKENS}-token KV "
                             f"pool), found {v}")
        if v in out:
            raise InputError(f"{flag}: expected distinct page sizes, found {v} twice in {text!r}")
        out.append(v)
    if len(out) > MAX_PAGE_SIZES:
        raise InputError(f"{flag}: expected at most {MAX_PAGE_SIZES} page sizes, found {len(out)}")
    return out
