"""Parity reports: the verdict table and the JSON document of ``qwen4exp parity`` / ``qwen4exp kl``.

One row per scenario (and one for the KL harness): scenario, cases, worst KL, worst logit error,
first divergence (if any), time, verdict. JSON files are written to a temporary name and renamed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any

__all__ = ["ScenarioRow", "ParityReport", "write_json_atomic", "render_table", "jsonable"]


def jsonable(x: Any):
    """A JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to strings ('nan', 'inf')."""
    try:
        import numpy as np
        if isinstance(x, np.generic):
            x = x.item()
        elif isinstance(x, np.ndarray):
            x = x.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json_atomic(path, obj) -> Path:
    """Write ``obj`` (made :func:`jsonable`) as indented JSON to ``path`` via a temp file + rename
    (:func:`reference.atomic.atomic_write_json`: mode per umask)."""
    from reference.atomic import atomic_write_json
    return atomic_write_json(path, jsonable(obj), indent=1)


@dataclass
class ScenarioRow:
    """One verdict-table row. ``status``: 'pass' | 'fail' | 'error' | 'skip' (every case skipped: not a pass).
    ``skips``: each skipped case with its reason (``{"case": label, "reason": ...}``)."""

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
    skips: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)  # e.g. {"mtp_truth_provenance": ...} when MTP cases ran

    def to_json(self) -> dict:
        """The row as a JSON-ready dict (``jsonable``)."""
        return jsonable(asdict(self))


@dataclass
class ParityReport:
    """The whole ``qwen4exp parity`` result. ``verdict``: 'fail' when any row is 'fail' or 'error', else
    'inconclusive' when no row passed (every row skipped, or none ran: nothing was judged), else 'pass'.
    ``exit_code``: 0 pass, 1 fail, 3 inconclusive (:data:`VERDICT_EXIT`; the CLI maps the verdict).

    A row's 'error' status means the backend under test raised inside a case (or the KL harness): that is
    a failed case (shown as ERROR in the table, counted among the failed cases), so the verdict is FAIL and
    the exit code 1 -- CI files it as a divergence, not as an infrastructure error. Exit 2 is left to
    usage/input errors (bad arguments, model, a backend that cannot be opened), which are raised before
    any report exists."""

    backend: str
    model: str
    rows: list[ScenarioRow] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """'fail' (any row 'fail' or 'error'), 'inconclusive' (no row passed: all skipped), else 'pass'."""
        if any(r.status in ("fail", "error") for r in self.rows):
            return "fail"
        if not any(r.status == "pass" for r in self.rows):
            return "inconclusive"
        return "pass"

    @property
    def exit_code(self) -> int:
        """The exit code of :attr:`verdict`: 0 pass, 1 fail, 3 inconclusive."""
        return VERDICT_EXIT[self.verdict]

    def to_json(self) -> dict:
        """The ``--json`` document: backend, model, exit code, verdict ('pass'/'fail'/'inconclusive'), meta and
        every row (each with its skipped cases and their reasons)."""
        return jsonable({"backend": self.backend, "model": self.model, "exit_code": self.exit_code,
                         "verdict": self.verdict, "meta": self.meta, "scenarios": [r.to_json() for r in self.rows]})


#: verdict -> exit code: 3 is "inconclusive" (nothing judged: every case skipped), distinct from pass and fail
VERDICT_EXIT = {"pass": 0, "fail": 1, "inconclusive": 3}


def _fmt(x: float) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return str(x)
    return f"{x:.2e}"


MIN_DIVERGENCE_WIDTH = 30  # narrowest "first divergence" column; longer text wraps onto more lines


def _cell_lines(text: str, width: int) -> list[str]:
    """One table cell as lines of at most ``width`` characters: whitespace collapsed, then wrapped at
    spaces (a word longer than ``width`` -- a long tap name -- is broken). Nothing is cut."""
    import textwrap
    t = " ".join(str(text).split())
    return textwrap.wrap(t, width=max(1, width), break_on_hyphens=False) or [""]


def _terminal_columns() -> int:
    """The terminal width (``shutil.get_terminal_size``: the COLUMNS variable, then the terminal, else 80)."""
    import shutil
    return shutil.get_terminal_size((80, 24)).columns


def render_table(report: ParityReport, console=None, columns: int | None = None) -> str:
    """Render the verdict table (rich when installed, else plain text); returns the plain-text form too.

    The plain text fits ``columns`` characters (default: the terminal width): the "first divergence"
    column takes the room the other columns leave (at least :data:`MIN_DIVERGENCE_WIDTH`) and long text
    wraps onto continuation lines -- it is never cut, so the table shows what the JSON report holds.
    """
    header = ["scenario", "cases", "worst KL", "worst logit err", "first divergence", "time", "verdict"]
    rows = []
    for r in report.rows:
        cases = f"{r.cases - r.failed_cases}/{r.cases}" + (f" (+{r.skipped} skipped)" if r.skipped else "")
        # a passing row with skipped or narrowed cases shows why (a skip is never silent)
        quiet = r.status == "pass" and not r.skipped and "narrowed" not in (r.detail or "")
        div = " ".join(str(r.first_divergence or ("-" if quiet else r.detail)).split())
        rows.append([r.scenario, cases, _fmt(r.worst_kl), _fmt(r.worst_logit_err), div, f"{r.seconds:.1f}s",
                     r.status.upper()])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    cols = _terminal_columns() if columns is None else int(columns)
    room = cols - (sum(widths) - widths[4]) - 2 * (len(header) - 1)
    widths[4] = max(len(header[4]), min(widths[4], max(room, MIN_DIVERGENCE_WIDTH)))
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for row in rows:
        cell = _cell_lines(row[4], widths[4])
        lines.append("  ".join(c.ljust(w) for c, w in zip([*row[:4], cell[0], *row[5:]], widths)).rstrip())
        pad = sum(widths[:4]) + 2 * 4
        lines += [" " * pad + more for more in cell[1:]]
    verdict = report.verdict.upper()
    lines.append(f"verdict: {verdict}  (backend {report.backend}, model {report.model})")
    text = "\n".join(lines)
    if console is not None:
        try:
            from rich.table import Table
            t = Table(title=f"qwen4exp parity: {report.backend} vs reference ({report.model})")
            for h in header:
                t.add_column(h, overflow="fold")
            style = {"PASS": "green", "FAIL": "red", "ERROR": "yellow", "SKIP": "cyan", "INCONCLUSIVE": "cyan"}
            for row in rows:
                t.add_row(*row[:-1], f"[{style[row[-1]]}]{row[-1]}[/]")
            console.print(t)
            console.print(f"verdict: [{style[verdict]}]{verdict}[/]")
        except ImportError:
            console.print(text)
    return text
