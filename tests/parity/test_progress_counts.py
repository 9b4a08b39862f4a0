"""The ``parity`` progress counter against the verdict table: both count the same cases (the kl row one per
prompt, each suite its case runs), and a job with its own bar (the KL harness) can count its steps on the run's
counter (parity/harness/progress.py SubProgress, parity/harness/scenarios count_run_cases)."""
from __future__ import annotations

import io
import json
import re

import pytest

from parity.harness.progress import LineProgress, SubProgress, progress_bar

FIXTURE = "tiny"
SCENARIOS = ["kl", "budget"]


class _Pipe(io.StringIO):
    def isatty(self):
        return False


def test_sub_progress_counts_a_jobs_steps_on_the_run_counter():
    """A job handed a SubProgress as its progress mode gets it back from progress_bar: its steps advance the
    run's counter under the job's prefix, and closing it leaves the run's counter running."""
    now = [0.0]
    out = _Pipe()
    run = LineProgress(4, "parity", file=out, every=0, clock=lambda: now[0])
    run.set_postfix_str("budget/a")
    run.update(1)
    sub = SubProgress(run, "kl")
    bar = progress_bar(2, "kl engine vs reference", sub)   # what the KL harness does with its progress mode
    assert bar is sub and sub.n == 0
    for i in (0, 1):
        bar.set_postfix_str(f"prompt {i} (4 tokens)")
        bar.update(1)
    bar.close()
    assert sub.n == 2
    run.update(0)   # the owner topping up a part that counted all its steps: no line, nothing finished
    run.set_postfix_str("budget/b")
    run.update(1)
    run.close()
    assert out.getvalue().splitlines() == ["parity: [1/4] finished budget/a, elapsed 0s",
                                           "parity: [2/4] finished kl/prompt 0 (4 tokens), elapsed 0s",
                                           "parity: [3/4] finished kl/prompt 1 (4 tokens), elapsed 0s",
                                           "parity: [4/4] finished budget/b, elapsed 0s"]


@pytest.fixture(scope="module")
def kl_budget_run(tmp_path_factory):
    """``qwen4exp parity tiny --backend reference --scenario kl budget --level ci``: (report rows, stderr)."""
    import contextlib
    from parity.cli import main
    out = tmp_path_factory.mktemp("progress") / "o"
    err = _Pipe()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["parity", FIXTURE, "--backend", "reference", "--scenario", *SCENARIOS, "--level", "ci",
                   "--out", str(out)])
    assert rc == 0, err.getvalue()
    return json.loads((out / "report.json").read_text())["scenarios"], err.getvalue()


def _table_cases(rows) -> int:
    """The cases the verdict table counts: run + skipped, every row ('3 of 137 cases skipped')."""
    return sum(r["cases"] + r["skipped"] for r in rows)


def test_count_run_cases_is_the_verdict_tables_case_count(kl_budget_run):
    from parity.backends import capabilities_of, open_backend
    from parity.harness.scenarios import count_run_cases
    from parity.prompts import load_prompts
    from reference.paths import resolve_model
    rows, _err = kl_budget_run
    be = open_backend("reference", resolve_model(FIXTURE))
    prompts = load_prompts(None, resolve_model(FIXTURE), be.config.vocab_size, be.config.max_position_embeddings)
    kl = next(r for r in rows if r["scenario"] == "kl")
    assert kl["cases"] == len(prompts) > 1   # the kl row counts its prompts as cases
    n = count_run_cases(SCENARIOS, be.config, capabilities_of(be), level="ci", kl_prompts=len(prompts))
    assert n == _table_cases(rows), (n, rows)


def test_progress_total_is_the_verdict_tables_case_count(kl_budget_run):
    rows, err = kl_budget_run
    done = [(int(a), int(b)) for a, b in re.findall(r"^parity: \[(\d+)/(\d+)\] finished ", err, re.M)]
    assert done, err
    assert done[-1][0] == done[-1][1] == _table_cases(rows), (done[-1], _table_cases(rows))
