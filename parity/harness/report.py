"""Parity reports: the verdict table and the JSON document of ``qwen4exp parity`` / ``qwen4exp kl``.

One row per scenario (and one for the KL harness): scenario, cases, worst KL, worst logit error,
first divergence (if any), time, verdict. JSON files are written to a temporary name and renamed.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field, asdict
from pathlib import Path

from parity.harness.causes import group_causes
from parity.harness.jsonio import jsonable, write_json_atomic  # noqa: F401 (re-exported: callers import them here)
from parity.harness.scenarios.locate import NOT_WRITTEN
from reference.errors import EXIT_DIVERGENCE, EXIT_ENVIRONMENT, EXIT_INCONCLUSIVE, EXIT_OK

__all__ = ["ScenarioRow", "ParityReport", "write_json_atomic", "render_table", "jsonable", "next_step",
           "next_step_lines", "worst_exit_code", "EXIT_SEVERITY"]


@dataclass
class ScenarioRow:
    """One verdict-table row. ``status``: 'pass' | 'fail' | 'error' | 'inconclusive' (the run cannot resolve a
    fault of useful size on this model, or a control could not vouch for the thresholds) | 'skip' | 'refused' (an
    outside engine refused the checkpoint; ``detail`` holds the offer, ``first_divergence`` its own message)."""

    scenario: str
    cases: int
    failed_cases: int
    worst_kl: float
    worst_logit_err: float
    first_divergence: str | None
    seconds: float
    status: str
    detail: str = ""
    failures: list = field(default_factory=list)
    skipped: int = 0
    skips: list = field(default_factory=list)  # each skipped / narrowed case with its reason
    notes: dict = field(default_factory=dict)  # e.g. {"mtp_truth_provenance": ...} when MTP cases ran
    thresholds: dict = field(default_factory=dict)  # the row's pass limits (KLThresholds.to_json())
    traceback: str | None = None                    # the first backend failure's stack trace (ERROR rows)
    known: int = 0           # cases failing only through a --known root cause (not counted as failed)
    tie_equivalent: int = 0  # positions passing only under the backend's tie resolution (parity.harness.ties)
    #: where: one entry per case (or kl prompt) with tie-equivalent positions: {"case", "op", "seq", "positions"}
    tie_equivalent_at: list = field(default_factory=list)
    #: the largest logit error over the row's compared positions in units of the logit scale there (what
    #: ``thresholds['tol_rel']`` judges; inf for a non-finite row); None where the row has no such figure
    worst_logit_err_rel: float | None = None

    def to_json(self) -> dict:
        """The row as a JSON-ready dict (``jsonable``)."""
        return jsonable(asdict(self))


@dataclass
class ParityReport:
    """The whole ``qwen4exp parity`` result. ``exit_code``: 0 all pass, 1 any row 'fail' or 'error'.

    A row's 'error' status means the backend under test raised inside a case (or the KL harness): that is
    a failed case (shown as ERROR in the table, counted among the failed cases), so the verdict is FAIL and
    the exit code 1 -- CI files it as a divergence, not as an infrastructure error. Exit 2 is left to
    usage/input errors (bad arguments, model, a backend that cannot be opened), which are raised before
    any report exists."""

    backend: str
    model: str
    rows: list[ScenarioRow] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    #: the command line that produced this report, shell-quoted (set by the CLI; None for an API call)
    reproduce: str | None = None

    @property
    def exit_code(self) -> int:
        """:data:`reference.errors.EXIT_DIVERGENCE` (1) when any row's status is 'fail' or 'error', else
        :data:`~reference.errors.EXIT_INCONCLUSIVE` (3) when any row is 'inconclusive', else 0."""
        if any(r.status in ("fail", "error", "refused") for r in self.rows):  # refused: the engine's defect
            return EXIT_DIVERGENCE
        # a skipped case never counts as a pass: a report with no passing row judged nothing
        if any(r.status == "inconclusive" for r in self.rows) or not any(r.status == "pass" for r in self.rows):
            return EXIT_INCONCLUSIVE
        return EXIT_OK

    @property
    def known_cases(self) -> int:
        """Cases failing only through a cause of the ``--known`` baseline (excused: not counted as failed)."""
        return sum(int(r.known or 0) for r in self.rows)

    @property
    def verdict_line(self) -> str:
        """The verdict as the table prints it: ``PASS`` / ``FAIL`` / ... and, when the ``--known`` baseline
        excused any case, ``" (with N known divergences)"``; when any case was skipped, ``" (S of T cases
        skipped; ...)"`` (T counts run and skipped cases of every row) -- never a bare PASS that reads as a
        clean, complete one. The exit code is not changed by skips (docs/parity.md)."""
        v = "REFUSED" if self.verdict == "refused" else \
            {0: "PASS", 1: "FAIL", 2: "ERROR", 3: "INCONCLUSIVE", 4: "ERROR"}.get(self.exit_code, "FAIL")
        n = self.known_cases
        v += f" (with {n} known divergence{'s' if n != 1 else ''} excused by --known)" if n else ""
        skipped = sum(int(r.skipped or 0) for r in self.rows)
        if skipped:  # e.g. a backend declaring rollback unsupported: most scenario cases never ran
            total = skipped + sum(int(r.cases or 0) for r in self.rows)
            v += f" ({skipped} of {total} cases skipped; the reasons are listed under the table)"
        return v

    @property
    def verdict(self) -> str:
        """'pass' | 'fail' | 'inconclusive' | 'refused' (an outside engine refused a valid checkpoint: its
        converter or loader rejected it -- the engine's defect, exit 1 like a divergence)."""
        if any(r.status == "refused" for r in self.rows):
            return "refused"
        return {0: "pass", 1: "fail", 2: "error", 3: "inconclusive"}.get(self.exit_code, "fail")

    def to_json(self) -> dict:
        """The ``--json`` document: backend, model, exit code, verdict ('pass'/'fail'), meta and every row."""
        return jsonable({"backend": self.backend, "model": self.model, "reproduce": self.reproduce,
                         "exit_code": self.exit_code,
                         "verdict": self.verdict, "verdict_line": self.verdict_line,
                         "known_cases": self.known_cases,
                         "meta": self.meta, "root_causes": group_causes(self.rows),
                         "tie_equivalent_positions": sum(r.tie_equivalent for r in self.rows),
                         "next_step": next_step(self), "scenarios": [r.to_json() for r in self.rows]})


def _fmt(x: float) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return str(x)
    return f"{x:.2e}"


# what each scenario checks, in plain words (the legend under the table)
KL_MEANING = ("logit-KL harness over the prompt set (one case per prompt), with determinism, precision-floor and "
              "negative controls")


REFUSED_LEGEND = ("REFUSED: the outside engine's converter or loader rejected a checkpoint the reference runs -- "
                  "the engine's defect, in its own words (exit 1); the row's detail names a function-preserving "
                  "re-parameterisation when one exists (docs/outside-engines.md)")

LEGEND = [
    "cases: passed/run; one case is one scripted run of the backend (kl: one prompt; the suites: a sequence of "
    "prefill / decode / verify / rollback / snapshot calls at one page size)",
    "worst KL: the largest per-position KL divergence, in nats, between the reference's and the backend's "
    "next-token distributions, the larger of KL(reference||backend) and KL(backend||reference)",
    "limits: the row's pass threshold, measured on this model: at every position the worst logit error <= tol x "
    "the logit scale (the std of the reference's logits there), tol a multiple of the precision floor (KL and "
    "top-1 near ties follow from it; docs/parity.md, Thresholds)",
    "worst logit err: the largest |backend - reference| logit over every position and token, each row's common "
    "offset removed (softmax ignores it), in units of the logit scale at its position ('xscale'): the figure the "
    "limit beside it judges (a bare number: the absolute error, for a row judged otherwise)",
    "INCONCLUSIVE: nothing failed, but the run cannot vouch for a pass (a floor too coarse for a useful fault, an "
    "unflagged negative control, or a tie too large to search); known: failing only through a --known root "
    "cause at the positions the baseline recorded, no larger than recorded + one tolerance band, no new top-1 "
    "flip (excused, not failed; the verdict then says 'with N known divergences'); tie-eq pos: positions passing "
    "under the backend's resolution of a tie",
    "ERROR: the backend raised inside a case (counted as a failed case; stack traces in report.json, and on "
    "stderr with --traceback)",
]


def _where(cause: dict) -> str:
    """Where a root cause is and how large (its fault, parity.harness.causes.group_causes), in a few words."""
    fault = cause.get("fault") or {}
    locs = [k for k in fault if k != "unlocated"]
    if not locs:
        return ""
    e = cause.get("worst_logit_err_rel")
    return (f"at {', '.join(locs[:3])}" + (f" and {len(locs) - 3} more" if len(locs) > 3 else "")
            + (f", worst err {float(e):.2g}xscale" if e is not None else "")
            + (", top-1 flipped" if cause.get("top1_flip") else ""))


def _worst_failure(report: ParityReport) -> dict | None:
    """The failing case with the largest judged error (``worst_logit_err_rel``; a non-finite one first), those
    with tap archives before those without; None when nothing failed."""
    fails = [f for r in report.rows if r.status in ("fail", "error") for f in (r.failures or [])
             if isinstance(f, dict) and not f.get("known")]
    if not fails:
        return None

    def size(f):
        e = f.get("worst_logit_err_rel")
        try:
            e = float(e)
        except (TypeError, ValueError):
            e = -1.0
        return (bool(_archive_pair(f)), float("inf") if e != e else e)
    return max(fails, key=size)


def _archive_pair(f: dict):
    """``(truth archive, backend archive, profile.toml)`` of a failing case as written under ``--out`` (the first
    pair: the failing operation's), or None when it has none (no ``--out``, not written, no taps)."""
    arcs = [a for a in (f.get("archives") or []) if isinstance(a, str) and not a.startswith(NOT_WRITTEN)]
    truth = next((a for a in arcs if Path(a).name == "truth.taps"), None)
    if truth is None:
        return None
    backend = str(Path(truth).with_name("backend.taps"))
    if backend not in arcs:
        return None
    return truth, backend, str(Path(truth).with_name("profile.toml"))


def next_step(report: ParityReport) -> dict | None:
    """What to run next after a FAIL: ``{"case", "worst_logit_err_rel", "command"}`` with ``command`` the
    ``qwen4exp taps diff TRUTH BACKEND --profile PROFILE --replay MODEL`` of the worst failing case
    (:func:`_worst_failure`) on its archives under ``--out`` (the profile the location judged with), or
    ``command`` None and ``advice`` saying to re-run with ``--out DIR`` when no archives were kept. None when
    nothing failed."""
    f = _worst_failure(report)
    if f is None:
        return None
    label = f.get("label") or f"{f.get('scenario', '?')}/{f.get('case', '?')}"
    # an ERROR case compared nothing: no error figure (0 would read as perfect)
    err = None if f.get("status") == "error" else f.get("worst_logit_err_rel")
    out = {"case": label, "worst_logit_err_rel": err, "command": None}
    if f.get("status") == "error":
        out["advice"] = ("the backend raised (" + str(f.get("failure") or "?") + "): its stack trace is in "
                         "report.json and on stderr with --traceback; a case that raises is judged no further")
        return out
    tap = str((f.get("root_cause") or {}).get("tap") or "")
    if tap == "returned logits":
        # every tap agreed with the truth: a tap diff would say AGREE; the fault is after the last tap
        out["advice"] = ("every recorded tap agrees with the truth, the returned logits do not: the fault is in "
                         "what the backend returns after its last tap (the lm_head output's copy, slicing, batching "
                         "or dtype), not in a block; compare the backend's logits tap with its returned rows")
        return out
    pair = _archive_pair(f)
    if pair is None and (tap in ("sequence length", "refused") or tap.startswith("state ")):
        # a state check (a position / KV length, a refused operation): no logits were wrong, so no tap archive
        # exists or would help -- re-running with --out (given or not) keeps nothing for it
        out["advice"] = (f"the failure is a state check, not a logit divergence ({f.get('failure') or tap}): no tap "
                         f"archive locates it; reproduce the case's operations (report.json: its failure, "
                         f"failed_op) against the backend's {tap} bookkeeping")
        return out
    if pair is None:
        out["advice"] = f.get("advice") or ("re-run with --out DIR to keep the tap archives of the failing cases, "
                                            "then diff them with qwen4exp taps diff")
        return out
    truth, backend, profile = pair
    cmd = ["qwen4exp", "taps", "diff", truth, backend]
    if Path(profile).is_file():
        cmd += ["--profile", profile]
    out["command"] = shlex.join(cmd + ["--replay", str(report.model)])
    return out


def next_step_lines(report: ParityReport) -> list[str]:
    """The lines after the table of a FAIL (:func:`next_step`); none otherwise."""
    nx = next_step(report)
    if nx is None:
        return []
    e = nx.get("worst_logit_err_rel")
    size = ""
    if e is not None:
        try:
            size = f" (worst logit err {float(e):.2e}xscale)"
        except (TypeError, ValueError):
            size = f" (worst logit err {e}xscale)"
    head = f"next: the worst failing case is {nx['case']}{size}; "
    if nx["command"] is None:
        return [head + nx["advice"]]
    return [head + "bisect its first divergence with:", "  " + nx["command"]]


def _limits(th: dict) -> str:
    if not th:
        return "-"
    if th.get("tol_rel") is not None:   # measured thresholds (parity.harness.kl.KLThresholds.to_json)
        return f"err<={th['tol_rel']:.1e}xscale"
    parts = []
    if th.get("max_kl") is not None:
        parts.append(f"KL<={th['max_kl']:.0e}")
    if th.get("min_top1") is not None:
        parts.append(f"top1>={th['min_top1']:g}")
    return " ".join(parts) or "-"


MIN_DIVERGENCE_WIDTH = 30  # narrowest "first divergence" column; below it the text goes on its own lines
_SEPARATORS = "./:,;=-_)]"


def _split_word(word: str, width: int) -> list[str]:
    """A word longer than ``width`` (a tap name) broken only after separators (``.`` ``/`` ``:`` ...),
    never inside a name part; only a part longer than ``width`` itself (no separator at all) is cut."""
    parts, cur = [], ""
    for ch in word:
        cur += ch
        if ch in _SEPARATORS:
            parts.append(cur)
            cur = ""
    if cur:
        parts.append(cur)
    lines, line = [], ""
    for part in parts:
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        while len(part) > width:  # no separator in sight (not an identifier: a run of one character): cut
            lines.append(part[:width])
            part = part[width:]
        line += part
    if line:
        lines.append(line)
    return lines


def _cell_lines(text: str, width: int | None) -> list[str]:
    """One table cell as lines of at most ``width`` characters (None: one line): whitespace collapsed,
    wrapped at spaces, a long word broken only after a separator (:func:`_split_word`). Nothing is cut and
    no identifier is split."""
    words = " ".join(str(text).split()).split(" ")
    if width is None:
        return [" ".join(words)]
    lines, line = [], ""
    for w in words:
        pieces = _split_word(w, width) if len(w) > width else [w]
        for k, piece in enumerate(pieces):
            sep = " " if line and k == 0 else ""
            if line and len(line) + len(sep) + len(piece) > width:
                lines.append(line)
                line, sep = "", ""
            line += sep + piece
    lines.append(line)
    return lines or [""]


def _terminal_columns() -> int | None:
    """The width to fit: the COLUMNS variable when set, else the terminal's when stdout is a terminal; None
    for a pipe or a file (CI logs): rows are then never wrapped, so names stay whole for grep."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size((80, 24)).columns


def skip_notes(report: ParityReport) -> list[str]:
    """One line per row with skipped or narrowed cases: ``scenario: N skipped: reason; ...; narrowed: ...``
    (the notes under the verdict table; the cases column counts the skips). Reasons come from the row's
    ``skips`` (each case with its reason), else from its detail (rows built without per-case skips)."""
    out = []
    for r in report.rows:
        reasons = list(dict.fromkeys(s["reason"] for s in r.skips if "reason" in s))
        narrowed = list(dict.fromkeys(s["narrowed"] for s in r.skips if "narrowed" in s))
        if not reasons and not narrowed:
            if r.skipped or "narrowed" in (r.detail or ""):
                out.append(f"{r.scenario}: {' '.join(str(r.detail).split())}")
            continue
        parts = ([f"{r.skipped} skipped: " + "; ".join(reasons)] if reasons else []) + (
            [f"narrowed: " + "; ".join(narrowed)] if narrowed else [])
        out.append(f"{r.scenario}: " + "; ".join(parts))
    return out


def _row_cells(report: ParityReport) -> list[list[str]]:
    rows = []
    for r in report.rows:
        cases = (f"{r.cases - r.failed_cases}/{r.cases}" + (f" (+{r.skipped} skipped)" if r.skipped else "")
                 + (f" ({r.known} known)" if r.known else "")
                 + (f" ({r.tie_equivalent} tie-eq pos)" if r.tie_equivalent else ""))
        # a passing or skipped row diverged nowhere: '-'; why cases were skipped or narrowed is said under the
        # table (skip_notes: a skip is never silent, and never reads as a divergence)
        quiet = r.status in ("pass", "skip")
        div = " ".join(str(r.first_divergence or ("-" if quiet else r.detail)).split())
        def value(x):  # an all-ERROR scenario compared nothing: ERROR, never a KL that reads as perfect;
            # a skipped row compared nothing either: '-'
            if r.status == "skip":
                return "-"
            return "ERROR" if r.status == "error" and (x is None or not math.isfinite(x)) else _fmt(x)
        kl, err = value(r.worst_kl), value(r.worst_logit_err)
        if r.worst_logit_err_rel is not None and err not in ("-", "ERROR"):   # the judged figure, beside its limit
            rel = float(r.worst_logit_err_rel)
            err = f"{rel:.2e}xscale" if math.isfinite(rel) else str(rel)
        rows.append([r.scenario, cases, kl, _limits(r.thresholds), err, div, f"{r.seconds:.1f}s", r.status.upper()])
    return rows


#: which exit code of several reports is the worst (a run judging several backends exits with it): an environment
#: failure, then a divergence (a verdict against a backend), then inconclusive, then pass
EXIT_SEVERITY = (EXIT_ENVIRONMENT, EXIT_DIVERGENCE, EXIT_INCONCLUSIVE, EXIT_OK)


def worst_exit_code(codes) -> int:
    """The worst of several exit codes by :data:`EXIT_SEVERITY` (a code not listed there counts as a
    divergence); 0 for none."""
    codes = [int(c) for c in codes]
    for c in EXIT_SEVERITY:
        if c in codes:
            return c
    return EXIT_DIVERGENCE if codes else 0


HEADER = ["scenario", "cases", "worst KL", "limits", "worst logit err", "first divergence", "time", "verdict"]
_DIV = HEADER.index("first divergence")
_LIM = HEADER.index("limits")


def render_table(report: ParityReport, console=None, columns: int | None = None, legend: bool = False,
                 meanings: dict[str, str] | None = None) -> str:
    """Render the verdict table, with ``legend`` its legend (:data:`LEGEND`, the meaning of each scenario
    shown: :data:`KL_MEANING` and ``meanings``, row name -> line, given by the caller from the suite registry,
    :func:`parity.harness.scenarios.meanings`), and the verdict line; returns the plain-text form (and prints a rich table on ``console``).

    Plain text: on a terminal it fits ``columns`` (default: the terminal width): the "first divergence"
    column takes the room the others leave and wraps at separators; when under :data:`MIN_DIVERGENCE_WIDTH`
    it is printed under each row instead. For a pipe (``columns`` None, not a terminal) nothing wraps.
    Text is never cut and identifiers are never split.

    Rich (``console``): within the console's width; the notes wrap to it, the first divergence goes under the table
    as in plain text, and a console narrower than the other columns gets three: scenario, the figures (one cell
    wrapped at spaces) and verdict.
    """
    rows = _row_cells(report)
    header = HEADER
    if console is not None and columns is None:   # rich: the notes fit the console's width
        columns = getattr(console, "width", None)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    cols = _terminal_columns() if columns is None else int(columns)
    below = False     # the first divergence under each row (too narrow for its column)
    lim_below = False  # the limits under each row too (the fixed columns alone do not fit)
    if cols is not None:
        room = cols - (sum(widths) - widths[_DIV]) - 2 * (len(header) - 1)
        if room < MIN_DIVERGENCE_WIDTH:
            below = True
            lim_below = sum(widths) - widths[_DIV] + 2 * (len(header) - 2) > cols
        else:
            widths[_DIV] = max(len(header[_DIV]), min(widths[_DIV], room))
    keep = [i for i in range(len(header)) if not (below and i == _DIV) and not (lim_below and i == _LIM)]
    div_cells = [_cell_lines(row[_DIV], widths[_DIV] if cols is not None else None) for row in rows]
    if not below and rows:   # wrapped into the room left: as wide as its longest line, not the whole room
        widths[_DIV] = max(len(header[_DIV]), *(len(ln) for cell in div_cells for ln in cell))
    lines = ["  ".join(header[i].ljust(widths[i]) for i in keep).rstrip(),
             "  ".join("-" * widths[i] for i in keep)]
    for row, cell in zip(rows, div_cells):
        if below:
            lines.append("  ".join(row[i].ljust(widths[i]) for i in keep).rstrip())
            if lim_below:
                lines.append("    limits: " + row[_LIM])
            if row[_DIV] != "-":
                lines += ["    " + t for t in _cell_lines("first divergence: " + row[_DIV], max(20, cols - 4))]
            continue
        lines.append("  ".join(c.ljust(w) for c, w in zip([*row[:_DIV], cell[0], *row[_DIV + 1:]], widths)).rstrip())
        pad = sum(widths[:_DIV]) + 2 * _DIV
        lines += [" " * pad + more for more in cell[1:]]
    verdict = report.verdict_line.split(" (")[0]
    notes = []
    causes = group_causes(report.rows)
    skips = skip_notes(report)
    if skips:   # the reasons of every skip and narrowing (the cases column counts them)
        width = cols if cols is not None else 10_000
        notes.append("skipped / narrowed cases (never counted as passed):")
        for ln in skips:
            notes += ["  " + t for t in _cell_lines(ln, max(20, width - 4))]
    if causes:   # one root cause at a time: each listed once with the cases it explains
        notes.append(f"root causes ({len(causes)}):")
        for k, c in enumerate(causes, 1):
            where = _where(c)
            met = ", ".join(str(o) for o in (c.get("operations") or [c.get("operation")]) if o)
            first = f", first at position {c['position']}" if c.get("position") is not None else ""
            # the QSA bound matters only to a QSA layer's taps; elsewhere a late position is no regime
            regime = f" ({c['regime']} only)" if c.get("regime") and "self_attn" in str(c.get("tap")) else ""
            notes.append(f"  [{k}] {c['id']}{regime}{' (known)' if c['known'] else ''}: {len(c['cases'])} case(s), "
                         f"e.g. {c['cases'][0]}" + (f"; met in {met}{first}" if met else "")
                         + (f"; {where}" if where else "")
                         + (f"; not excused by --known: {c['known_note']}" if c.get("known_note") else ""))
    findings = report.meta.get("engine_findings") or []
    if findings:   # what the engine (or the file it runs) leaves out or changes: the reader needs it to act
        notes.append(f"engine findings ({len(findings)}):")
        for f in findings:
            notes.append(f"  {f.get('id')}: {f.get('message')} ({f.get('where')})")
    notes += next_step_lines(report)
    if legend:
        width = cols if cols is not None else 10_000
        notes.append("legend:")
        extra = [REFUSED_LEGEND] if report.verdict == "refused" else []
        for item in LEGEND + extra:
            notes += ["  " + t for t in _cell_lines(item, max(20, width - 4))]
        meaning = {"kl": KL_MEANING, **(meanings or {})}
        for name in dict.fromkeys(r.scenario for r in report.rows):
            if name in meaning:
                notes += ["  " + t for t in _cell_lines(f"{name}: {meaning[name]}", max(20, width - 4))]
    sf = report.meta.get("smallest_fault_rel")
    if sf is not None:   # the run's resolution: what a fault must move to be caught
        notes.append(f"resolution: the smallest fault this run can catch moves a logit by {sf:.2g} of the logit scale "
                     f"(the limit; a useful fault is {report.meta.get('useful_fault_rel', 0.01):g})")
    tail = f"verdict: {report.verdict_line}  (backend {report.backend}, model {report.model})"
    text = "\n".join(lines + notes + [tail])
    if console is not None:
        try:
            from rich.table import Table
            t = Table(title=f"qwen4exp parity: {report.backend} vs reference ({report.model})")
            from rich.markup import escape
            # within the console's width, nothing cropped: every column but the divergence at its full width, the
            # divergence pre-wrapped at separators into the room left (under 30: printed below the table); a console
            # narrower than the other columns gets three: scenario, the figures (one cell, wrapped at spaces), verdict
            width = getattr(console, "width", 120) or 120
            fixed = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
            room = width - (sum(fixed) - fixed[_DIV]) - (3 * len(header) + 1)
            cols_shown = [i for i in range(len(header)) if i != _DIV or room >= MIN_DIVERGENCE_WIDTH]
            # (the divergence shown: the rest fits with 30 columns to spare, so only a table without it is compact)
            compact = _DIV not in cols_shown and sum(fixed[i] for i in cols_shown) + 3 * len(cols_shown) + 1 > width
            figures = [i for i in cols_shown if i not in (0, len(header) - 1)]
            if compact:
                cols_shown = [0, len(header) - 1]
                t.add_column(header[0], no_wrap=True, min_width=fixed[0])
                t.add_column("figures", overflow="fold")
                t.add_column(header[-1], no_wrap=True, min_width=fixed[-1])
            else:
                for i in cols_shown:
                    t.add_column(header[i], no_wrap=True, overflow="ignore", min_width=None if i == _DIV else fixed[i])
            style = {"PASS": "green", "FAIL": "red", "ERROR": "yellow", "INCONCLUSIVE": "magenta", "REFUSED": "magenta",
                     "SKIP": "dim"}
            for row in rows:
                cells = [escape(c) for c in row]
                if _DIV in cols_shown:
                    cells[_DIV] = "\n".join(escape(x) for x in _cell_lines(row[_DIV], room))
                cells[-1] = f"[{style.get(row[-1], 'red')}]{row[-1]}[/]"
                shown = [cells[i] for i in cols_shown]
                if compact:
                    shown.insert(1, escape("; ".join(f"{header[i]} {row[i]}" for i in figures)))
                t.add_row(*shown)
            console.print(t)
            if _DIV not in cols_shown:
                for row in rows:
                    if row[_DIV] not in ("-", ""):
                        for ln in _cell_lines(f"{row[0]}: first divergence: {row[_DIV]}", max(20, width - 4)):
                            console.print("  " + ln, markup=False, highlight=False)
            for n in notes:
                console.print(n, markup=False, highlight=False)
            console.print(f"verdict: [{style.get(verdict, 'red')}]{escape(report.verdict_line)}[/]  (backend "
                          f"{report.backend}, model {report.model})")
        except ImportError:
            console.print(text)
    return text
