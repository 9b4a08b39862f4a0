"""A scenario case and its outcome: :class:`Case` (a function driving a :class:`parity.harness.scenarios.common.Run`),
:class:`CaseResult`, and the exceptions a case stops with (failure, skip, confinement below the QSA bound)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from parity.harness.jsonio import jsonable

__all__ = ["Case", "CaseResult", "CaseFailure", "CaseConfined", "CaseSkip"]


class CaseConfined(Exception):
    """Raised when a case would reach past the QSA bound in a run confined below it (the case is skipped)."""


class CaseFailure(Exception):
    """Raised inside a case at its first failing check (caught by :func:`parity.harness.scenarios.runner.run_case`)."""

    def __init__(self, op: int, what: str, divergence: str | None = None, seq: str | None = None):
        super().__init__(what)
        self.op = op
        self.seq = seq
        self.what = what
        self.divergence = divergence


class CaseSkip(Exception):
    """Raised inside a case when it needs an operation the backend declares unsupported, or beyond the limit
    it declares (:func:`parity.backends.base.capability`); ``reason`` says which and why. The case is recorded
    as skipped -- never as a pass -- even when its earlier checks passed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Case:
    """One scenario case: ``fn(run)``; ``needs``: backend capabilities it requires (e.g. 'snapshot_file')."""

    name: str
    fn: Callable[[object], None]   # called with the case's parity.harness.scenarios.common.Run
    needs: tuple[str, ...] = ()
    batch: bool = False  # drives several concurrent sequences


@dataclass
class CaseResult:
    """Outcome of one case at one page size. ``status``: 'pass' | 'fail' | 'error' | 'skip' (``failure`` then
    holds the skip reason; a skipped case is never counted as passed)."""

    scenario: str
    case: str
    page_size: int | None
    status: str
    checks: int = 0
    worst_kl: float = 0.0
    worst_logit_err: float = 0.0
    worst_logit_err_rel: float = 0.0  # relative to the logit scale (what the verdict judges)
    tie_flips: int = 0                # argmax flips inside the near-tie gap (allowed)
    tie_equivalent: list = field(default_factory=list)  # [op, seq, positions]: passed under a tie resolution
    root_cause: dict | None = None    # parity.harness.causes.root_cause of a failure
    fault: dict | None = None         # its failing positions, error / scale, top-1 flips (causes.fault_of)
    known_note: str | None = None     # why the --known baseline does not excuse it (what is new)
    known: bool = False               # failed only through a root cause of the --known baseline
    failure: str | None = None
    failed_op: int | None = None
    failed_seq: str | None = None
    divergence: str | None = None
    archives: list = field(default_factory=list)
    seconds: float = 0.0
    narrowed: list = field(default_factory=list)  # parts left out for declared limits (the rest was judged)
    traceback: str | None = None  # the backend's stack trace when status is 'error'

    @property
    def label(self) -> str:
        """``scenario/case``, with `` [page N]`` when a page size is set."""
        ps = "" if self.page_size is None else f" [page {self.page_size}]"
        return f"{self.scenario}/{self.case}{ps}"

    def to_json(self) -> dict:
        """The result as a JSON-ready dict (``jsonable``)."""
        return jsonable(self.__dict__)
