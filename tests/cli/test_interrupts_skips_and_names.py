"""Interrupts, skipped rows and the names in error messages:

* a KeyboardInterrupt the backend raises in the KL harness with no signal received is an ERROR row (exit 1);
  only a received SIGINT means "interrupted" (exit 130);
* a fully skipped row shows '-' for KL and logit error (nothing was compared), and a passing row's skip
  reasons are listed under the table, not in its first-divergence column;
* a backend's unknown ``precision`` names the backend, the attribute and the valid precisions; ``taps
  record --ids`` with an out-of-range id names --ids and the file; ``bench --backend engine:device=cuda``
  without a GPU names that spec.
"""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from parity.backends import ReferenceBackend
from parity.cli import main
from reference.paths import bundled_model

MODEL = bundled_model("tiny")


class KbIntInDecode(ReferenceBackend):
    """decode raises KeyboardInterrupt itself (no signal behind it), as the tester's mybe:KbInt."""

    def decode(self, hs, ids):
        raise KeyboardInterrupt


class SigintInDecode(ReferenceBackend):
    """decode delivers a real SIGINT to this process (what Ctrl-C does)."""

    def decode(self, hs, ids):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):   # the handler runs between bytecodes: it raises here
            np.zeros(1).sum()
        raise AssertionError("SIGINT was not delivered")


def test_keyboardinterrupt_raised_in_the_kl_harness_is_an_error_row(capsys):
    rc = main(["parity", str(MODEL), "--backend", f"{__name__}:KbIntInDecode", "--scenario", "kl", "budget",
               "--level", "ci", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    rows = {r["scenario"]: r for r in doc["scenarios"]}
    assert rc == 1 and "interrupted" not in err, err
    assert rows["kl"]["status"] == "error" and "no signal was received" in rows["kl"]["first_divergence"]
    assert rows["budget"]["status"] == "error"   # the run went on after the kl row
    assert "KeyboardInterrupt:" not in rows["budget"]["detail"]   # no empty message after the type


def test_a_received_sigint_still_interrupts_with_130(capsys):
    """Negative control: the same place with a real SIGINT stops the run, exit 130 'interrupted'."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is handled by the test runner here")
    rc = main(["parity", str(MODEL), "--backend", f"{__name__}:SigintInDecode", "--scenario", "kl",
               "--level", "ci", "--json", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted" in err, err


# ---------------------------------------------------------------- 12: the table
def _rows():
    from parity.harness.report import ScenarioRow
    from parity.harness.scenarios import summarize_results
    from parity.harness.scenarios.common import CaseResult
    skipped = summarize_results("snapshot_restore", [CaseResult("snapshot_restore", "a", None, "skip",
                                                                failure="needs snapshot unsupported")], 0.1)
    passing = ScenarioRow("self-consistency", 12, 0, 0.0, 0.0, None, 1.0, "pass",
                          "3 skipped: needs dense_logits unsupported", skipped=3,
                          skips=[{"case": f"self_consistency/c{i}", "reason": "needs dense_logits unsupported"}
                                 for i in range(3)])
    return skipped, passing


def test_skipped_row_shows_dash_and_skip_reasons_go_under_the_table():
    from parity.harness.report import HEADER, ParityReport, _row_cells, render_table
    skipped, passing = _rows()
    assert skipped.worst_kl is None and skipped.worst_logit_err is None   # nothing compared: no figure
    rep = ParityReport("b", "m", [skipped, passing])
    cells = {r[0]: dict(zip(HEADER, r)) for r in _row_cells(rep)}
    assert cells["snapshot-restore"]["worst KL"] == "-" and cells["snapshot-restore"]["worst logit err"] == "-"
    assert cells["self-consistency"]["first divergence"] == "-"
    assert cells["snapshot-restore"]["first divergence"] == "-"
    text = render_table(rep, columns=200)
    notes = text.split("skipped / narrowed cases", 1)[1]
    assert "self-consistency: 3 skipped: needs dense_logits unsupported" in notes
    assert "snapshot-restore: 1 skipped: needs snapshot unsupported" in notes
    assert "(+3 skipped)" in text   # the cases column counts them


def test_a_failing_row_still_shows_its_divergence():
    """Negative control: a failing row's first divergence stays in its column."""
    from parity.harness.report import HEADER, ParityReport, ScenarioRow, _row_cells
    bad = ScenarioRow("kl", 5, 1, 1.0, 1.0, "prompt 0: first divergence layers.1.mlp.out", 0.1, "fail")
    cells = dict(zip(HEADER, _row_cells(ParityReport("b", "m", [bad]))[0]))
    assert cells["first divergence"] == "prompt 0: first divergence layers.1.mlp.out"
    assert cells["worst KL"] == "1.00e+00"


# ---------------------------------------------------------------- 13: errors
class BadPrecision(ReferenceBackend):
    precision = "banana"

    @classmethod
    def open(cls, model_path, **opts):
        be = super().open(model_path, **opts)
        be.precision = "banana"
        return be


def test_unknown_backend_precision_names_the_backend_and_the_attribute(capsys):
    from parity.backends.base import PRECISIONS
    from parity.harness.kl import FLOOR_MULTIPLE
    assert set(PRECISIONS) == set(FLOOR_MULTIPLE)   # one list of precisions: each has its thresholds
    spec = f"{__name__}:BadPrecision"
    assert main(["parity", str(MODEL), "--backend", spec, "--scenario", "kl", "--level", "ci", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--backend {spec!r}" in err and "'precision' attribute" in err and "'banana'" in err
    assert "float64, float32, bf16, fp16, fp8" in err and "rounding format" not in err


def test_taps_record_out_of_range_id_names_the_ids_file(tmp_path, capsys):
    ids = tmp_path / "ids_oor.json"
    ids.write_text("[1, 2, 9999]")
    rc = main(["taps", "record", str(MODEL), "--ids", str(ids), "--out", str(tmp_path / "t.taps")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--ids {str(ids)!r}" in err and "9999" in err and "vocab_size" in err, err
    assert not (tmp_path / "t.taps").exists()
    # the same reader as `logits`: one message for one mistake
    assert main(["logits", str(MODEL), "--ids", str(ids), "--out", str(tmp_path / "l.npy")]) == 2
    assert capsys.readouterr().err.split("error: ", 1)[1] == err.split("error: ", 1)[1]


def test_bench_without_gpu_names_the_backend_spec(capsys):
    from engine.backend import gpu_available
    if gpu_available():
        pytest.skip("a GPU is present: device=cuda is not refused")
    assert main(["bench", "--backend", "engine:device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "--backend 'engine:device=cuda'" in err and "--device cuda" not in err, err
    assert main(["bench", "--backend", "engine", "--device", "cuda"]) == 2   # the flag given is the one named
    assert "--device cuda" in capsys.readouterr().err
