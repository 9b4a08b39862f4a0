"""``qwen4exp parity`` / ``kl`` / ``logits`` against faulty plug-in backends wrapping the reference:

* a backend raising inside the KL harness or a case: an ERROR row, table + report.json, verdict FAIL, exit 1;
* a fault after the last tap (in the returned logits) is named as such, with its FIRST bad position;
* every scenario case checks top-1 agreement (bf16: >= 99%; float: every flip a near-tie); the KL row's
  case count reflects the failing prompts;
* the table's "first divergence" column uses the terminal width and wraps instead of cutting;
* ``--out DIR`` whose report.json is a directory: refused before anything runs;
* ``logits --out``: the parent must exist, an existing file needs --overwrite; ``kl --b bogus`` names --b;
* docs: the README table shows the separator row; module:Class needs to be importable (PYTHONPATH).
"""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from parity.backends import Backend, ReferenceBackend
from parity.cli import main
from reference.paths import REPO_ROOT


# ----------------------------------------------------------------------------------------------- faulty backends


def _parity(capsys, *args):
    rc = main(["parity", *args, "--level", "ci", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, json.loads(out)


# ----------------------------------------------------------------------------------------------- 1 / 3


def test_error_rows_are_failures_exit_1_and_shown_as_error():
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    rep = ParityReport("b", "m", [ScenarioRow("budget", 3, 1, 0.0, 0.0, "x: RuntimeError: boom", 0.1, "error")])
    assert rep.exit_code == 1 and rep.to_json()["verdict"] == "fail"
    text = render_table(rep, columns=120)
    assert "ERROR" in text and "verdict: FAIL" in text and "2/3" in text


# ----------------------------------------------------------------------------------------------- 2


def test_all_taps_agree_without_a_logits_tap_names_the_returned_logits():
    """No ``logits`` tap in the backend's archive: the truth comparison names the first bad position."""
    from parity.harness.kl import thresholds_for
    from parity.harness.scenarios.locate import diff_archives
    from parity.backends import truth_model
    from taps.recorder import Recorder
    model = truth_model(REPO_ROOT / "fixtures" / "tiny")
    ids = list(range(3, 17))
    with Recorder(None, meta={"backend": "truth"}) as rt:
        truth = np.asarray(model.forward(ids))
    with Recorder(None, meta={"backend": "b"}, include=["layers.*"]) as rb:
        model.forward(ids)
    arc_b = rb.archive()
    assert "logits" not in arc_b.names() and arc_b.names()
    ret = truth.copy()
    ret[12:, ::7] += 0.5
    msg = diff_archives(rt.archive(), arc_b, "float32", returned=ret, positions=list(range(len(ids))),
                        truth_logits=truth, thresholds=thresholds_for("float32"))
    assert "divergence is in the returned logits, after the last tap, first at position 12" in msg, msg
    # control: the untouched logits are not blamed
    ok = diff_archives(rt.archive(), arc_b, "float32", returned=truth, positions=list(range(len(ids))),
                       truth_logits=truth, thresholds=thresholds_for("float32"))
    assert "returned logits" not in ok, ok


# ----------------------------------------------------------------------------------------------- 4


class _FakeModel:
    """A truth whose logits are given: ``forward(ids) -> table[:len(ids)]``."""

    def __init__(self, table, config):
        self.table = table
        self.config = config

    def forward(self, ids):
        return self.table[:len(ids)]


class _FakeBackend:
    """Returns given logits rows from prefill (position bookkeeping only)."""

    def __init__(self, table, config, precision):
        self.table, self.config, self.precision = table, config, precision
        self.capabilities = {"page_sizes": None, "state_arrays": False}
        self.pos = {}

    def new_sequence(self):
        h = len(self.pos)
        self.pos[h] = 0
        return h

    def prefill(self, h, ids, chunk_size=None):
        p = self.pos[h]
        self.pos[h] += len(ids)
        return self.table[p:p + len(ids)]

    def position(self, h):
        return self.pos[h]

    def free(self, h):
        pass


def _run_top1(config, truth_rows, be_rows, precision):
    from parity.harness.kl import thresholds_for
    from parity.harness.scenarios.common import Case, TruthCache
    from parity.harness.scenarios.runner import run_case
    be = _FakeBackend(be_rows, config, precision)

    def fn(run):
        s = run.new("s")
        run.prefill(s, [1] * len(truth_rows))
    return run_case("t", Case("top1", fn), be, TruthCache(_FakeModel(truth_rows, config)), locate_on_fail=False)


def _flat_rows(config, n, seed=0):
    """Near-uniform logits (spread 0.1) with a clear top token per row: a swap of the top two changes KL
    only by ~p * gap^2-order amounts (p ~ 1/V), far below the float32 KL bound 1e-5 for gaps <= 1e-2."""
    rng = np.random.default_rng(seed)
    t = (0.1 * rng.random((n, config.vocab_size))).astype(np.float32)
    t[:, 5] = 0.5
    return t


def test_top1_flip_fails_unless_a_near_tie_relative_to_the_logit_scale():
    """A swap of two tokens whose truth gap is within the near-tie gap (2 x tol x scale) passes; ten times the
    tolerance fails, at float32 and bf16 alike (no fraction of flips is excused)."""
    from parity.harness.kl import logit_scale, thresholds_for
    from reference.config import load_config
    cfg = load_config(REPO_ROOT / "fixtures" / "tiny")
    truth = _flat_rows(cfg, 6)
    for prec in ("float32", "bf16"):
        th = thresholds_for(prec)
        tol = th.tol_rel * float(logit_scale(truth[3:4])[0])
        for gap, want in ((tol / 4, "pass"), (10 * tol, "fail")):
            tr = truth.copy()
            tr[3, 9] = tr[3, 5] - gap           # truth: 5 beats 9 by `gap`
            be = tr.copy()
            be[3, 5], be[3, 9] = tr[3, 9], tr[3, 5]   # the backend swaps them: argmax flips at position 3
            res = _run_top1(cfg, tr, be, prec)
            assert res.status == want, (prec, gap, res.failure)
            if want == "fail":
                assert "position 3" in res.failure and ("top-1" in res.failure or "logit error" in res.failure)



# ----------------------------------------------------------------------------------------------- 6
def test_table_uses_the_terminal_width_and_wraps_never_cuts(monkeypatch):
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    long = ("chunk_inside-compress-block_5: op 0, seq chunk5, positions 0..79: first divergence "
            "layers.1.ple.ple_embedding.ngram_ids at position 5 (last agreeing layers.0.mlp_hyper_connection.combine)")
    rep = ParityReport("b", "m", [ScenarioRow("chunk-boundary", 8, 7, 0.58, 4.2, long, 1.0, "fail")])
    monkeypatch.setenv("COLUMNS", "300")
    wide = render_table(rep)
    assert long in wide and "..." not in wide
    monkeypatch.setenv("COLUMNS", "110")
    narrow = render_table(rep)
    assert all(len(ln) <= 110 for ln in narrow.splitlines()[:-1]), narrow
    body = narrow.splitlines()[2:-1]
    assert len(body) > 1  # wrapped onto continuation lines, indented to the column
    pad = len(body[1]) - len(body[1].lstrip())
    first = body[0][pad:].rsplit(None, 2)[0]  # without the time and verdict cells
    # nothing lost; each line break is at a space or right after a separator inside a long name
    from parity.harness.report import _SEPARATORS
    cells = [first.strip()] + [ln.strip() for ln in body[1:]]
    assert "".join(cells).replace(" ", "") == long.replace(" ", "")
    for a, b in zip(cells, cells[1:]):
        assert f"{a} {b}" in long or (a[-1] in _SEPARATORS and a + b in long), (a, b)


# ----------------------------------------------------------------------------------------------- 8


# ----------------------------------------------------------------------------------------------- 12


# ----------------------------------------------------------------------------------------------- 13


# ----------------------------------------------------------------------------------------------- 15
def test_docs_show_the_separator_row_and_the_plugin_import_rule():
    readme = (REPO_ROOT / "README.md").read_text()
    lines = readme.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("scenario ") and "verdict" in ln)
    assert set(lines[i + 1].split()) == {"-" * len(w) for w in lines[i + 1].split()} and lines[i + 1].strip()
    assert lines[i + 1].strip().startswith("-" * len("scenario"))
    doc = (REPO_ROOT / "docs" / "parity.md").read_text()
    assert "PYTHONPATH" in doc and "exit 1" in doc.lower()
