"""The scenario-suite entry: what one suite module declares about itself (its ``SUITE``), listed once in
:data:`parity.harness.scenarios.SUITES`; the names, the run order, the suites needing no truth, the report's
legend lines and the ``--level long`` cases are all read from these entries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Suite:
    """One scenario suite.

    Fields: ``name`` (the module name, ``snake_case``; the CLI and the report spell it with dashes,
    :attr:`label`); ``cases`` (``cases(config, level='full'|'ci') -> [Case]``); ``meaning`` (one line for the
    report's legend: what the suite checks); ``needs_truth`` (False: the backend is judged against itself and
    the suite runs without the reference); ``long_cases`` (``long_cases(config) -> [Case]`` for ``--level
    long``; None: the suite's 'ci' cases run at that level)."""

    name: str
    cases: Callable
    meaning: str
    needs_truth: bool = True
    long_cases: Callable | None = None

    @property
    def label(self) -> str:
        """The name as the CLI and the report write it (``chunk-boundary``)."""
        return self.name.replace("_", "-")
