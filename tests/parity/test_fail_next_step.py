"""A FAIL says what to do next, and one bug is one root cause.

* after the table of a FAIL: the ``taps diff TRUTH BACKEND --profile PROFILE --replay MODEL`` command of the worst
  failing case, on its archives under ``--out`` (they exist, and the command runs); without ``--out``: re-run
  with --out DIR; a PASS prints none (negative control);
* the worst logit error column is the judged figure (relative to the logit scale, as the limit beside it);
* a one-block MLP bug (parity.suites.faults.SharedExpertDownScaledOneLayer) met by the kl prompts and every
  budget case is ONE root cause at ``layers.1.mlp``, without a regime label (it shows below the bound);
* the regime label only where the bound matters: every failure of the cause past the QSA bound;
* a selection outside the tie set explained by an earlier divergence is that divergence's cause;
* a located cell lists as missing only the taps the backend declares (``Backend.produces_taps``).
"""
from __future__ import annotations

import copy
import math
import shlex
from pathlib import Path

import numpy as np
import pytest

from parity.harness.causes import group_causes, root_cause
from parity.harness.report import ParityReport, ScenarioRow, next_step, render_table

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "fixtures" / "tiny"
FAULT = "parity.suites.faults:SharedExpertDownScaledOneLayer"
_CACHE: dict = {}


def _report(tmp_path_factory):
    if "rep" not in _CACHE:
        from parity.harness.run import run_parity
        out = tmp_path_factory.mktemp("out")
        _CACHE["rep"] = run_parity(TINY, FAULT, ["kl", "budget"], level="ci", out_dir=out, progress=False), out
    return _CACHE["rep"]


def test_fail_prints_the_taps_diff_command_of_the_worst_case(tmp_path_factory):
    rep, out = _report(tmp_path_factory)
    assert rep.exit_code == 1
    nx = next_step(rep)
    worst = max((f for r in rep.rows for f in r.failures), key=lambda f: f["worst_logit_err_rel"])
    assert nx["case"] == worst["label"], (nx, worst["label"])
    argv = shlex.split(nx["command"])
    assert argv[:3] == ["qwen4exp", "taps", "diff"] and argv[-2:] == ["--replay", str(TINY)], argv
    truth, backend, profile = argv[3], argv[4], argv[argv.index("--profile") + 1]
    for p in (truth, backend, profile):
        assert Path(p).exists() and Path(p).is_relative_to(out), p
    text = render_table(rep, columns=None)
    assert "next: the worst failing case is " + worst["label"] in text and nx["command"] in text, text
    # the command runs and names the same block as the table
    from parity.cli import main
    assert main(argv[1:]) == 1


def test_without_out_the_advice_is_to_keep_the_archives(tmp_path_factory):
    rep, _ = _report(tmp_path_factory)
    bare = copy.deepcopy(rep)
    for r in bare.rows:
        for f in r.failures:
            f["archives"] = []
    nx = next_step(bare)
    assert nx["command"] is None and "re-run with --out DIR" in nx["advice"]
    assert "re-run with --out DIR to keep the tap archives" in render_table(bare, columns=None)


def test_a_pass_prints_no_next_step():
    row = ScenarioRow("budget", 3, 0, 1e-12, 1e-6, None, 0.1, "pass", worst_logit_err_rel=2e-6,
                      thresholds={"tol_rel": 6.5e-5})
    rep = ParityReport("reference", str(TINY), rows=[row])
    assert next_step(rep) is None and "next:" not in render_table(rep, columns=None)


def test_the_error_column_is_the_judged_relative_error_beside_the_limit(tmp_path_factory):
    rep, _ = _report(tmp_path_factory)
    lines = render_table(rep, columns=None).splitlines()
    budget = next(ln for ln in lines if ln.startswith("budget "))
    row = next(r for r in rep.rows if r.scenario == "budget")
    assert row.worst_logit_err_rel == pytest.approx(max(f["worst_logit_err_rel"] for f in row.failures))
    assert f"{row.worst_logit_err_rel:.2e}xscale" in budget and f"{row.worst_logit_err:.2e}" not in budget, budget


def test_a_one_block_mlp_bug_is_one_root_cause(tmp_path_factory):
    rep, _ = _report(tmp_path_factory)
    causes = group_causes(rep.rows)
    assert len(causes) == 1, [c["id"] for c in causes]
    c = causes[0]
    assert c["tap"].startswith("layers.1.mlp"), c["id"]
    assert {"kl", "prefill"} <= set(c["operations"]) and c["position"] == 0, c
    assert c["regime"] is None, c          # it shows below the bound: the bound does not matter
    text = render_table(rep, columns=None)
    assert "root causes (1):" in text and "QSA bound" not in text.split("root causes")[1].split("next:")[0], text


def _row(failures):
    return ScenarioRow("budget", len(failures), len(failures), 0.0, 0.0, None, 0.0, "fail", failures=failures)


def _fail(label, failure, divergence, cfg):
    return {"label": label, "failure": failure, "root_cause": root_cause(failure, divergence, cfg)}


def test_regime_label_only_where_every_failure_is_past_the_bound():
    from parity.backends.reference import ReferenceBackend
    from parity.harness.scenarios.common import sizes
    cfg = ReferenceBackend.open(TINY).config
    b = sizes(cfg).bound
    f = "decode batch of 1: seq a: logit error 1 of the logit scale > 1e-5 (first failing position {p}, worst {p})"
    d = "first divergence layers.2.self_attn.indexer.selected_blocks at position {p} (max_rel 1)"
    past = [_fail(f"c{p}", f.format(p=p), d.format(p=p), cfg) for p in (b, b + 3)]
    (c,) = group_causes([_row(past)])
    assert c["regime"] == "past the QSA bound" and c["position"] == b, c
    mixed = past + [_fail("below", f.format(p=b - 2), d.format(p=b - 2), cfg)]
    (c,) = group_causes([_row(mixed)])       # negative control: one failure below the bound drops the label
    assert c["regime"] is None and c["position"] == b - 2 and len(c["cases"]) == 3, c


def test_a_pick_outside_the_tie_set_after_an_earlier_divergence_is_that_divergence():
    failure = ("prefill 80 tokens at position 0 in chunks of 5: seq chunk5: MoE experts of layer 5 at position 33: "
               "backend keeps [0, 2], truth [1, 2], tie set []: a pick outside the tie set (score 0.19 vs the cut "
               "0.192); logit error 0.144 of the logit scale > 6.51e-05 at position 33 (first failing position 0)")
    earlier = "op 0, seq chunk5, positions 0..79: first divergence layers.1.mlp.out at position 0 (max_rel 1.98)"
    assert root_cause(failure, earlier)["tap"] == "layers.1.mlp.out"
    # negative control: the divergence IS the selection (or comes after it): the selection is the cause
    later = "op 0, seq chunk5, positions 0..79: first divergence layers.5.mlp.out at position 40 (max_rel 1)"
    assert root_cause(failure, later)["tap"] == "layers.5.mlp.gate.topk_ids"


class _Few:
    """A backend that declares three taps."""
    produces_taps = ("embed_tokens.out", "layers.{i}.mlp.out", "logits")


def _arcs():
    from taps.recorder import Recorder
    rng = np.random.default_rng(0)
    names = ["embed_tokens.out", "layers.0.mlp.out", "layers.0.self_attn.out", "layers.1.mlp.out", "logits"]
    vals = {n: rng.standard_normal((2, 8)).astype(np.float32) for n in names}
    with Recorder(None) as t:
        for n in names:
            t.emit(n, vals[n], positions=[0, 1])
    with Recorder(None) as b:       # the backend records embed, layer 0's mlp and the logits only
        for n in ("embed_tokens.out", "layers.0.mlp.out", "logits"):
            b.emit(n, vals[n], positions=[0, 1])
    return t.archive(), b.archive()


def test_a_located_cell_lists_only_the_taps_the_backend_declares():
    from parity.harness.scenarios.locate import diff_archives
    truth, be = _arcs()
    line = diff_archives(truth, be, backend=_Few())
    assert "missing in the backend: layers.1.mlp.out" in line, line    # declared, not recorded: a real gap
    assert "self_attn" not in line, line                                # not declared: never listed
    undeclared = diff_archives(truth, be, backend=object())             # no declaration: every registry tap
    assert "layers.0.self_attn.out" in undeclared and "layers.1.mlp.out" in undeclared, undeclared


class _RaisesInRollback:
    """The reference, except that rollback raises (a backend's own crash)."""

    @classmethod
    def open(cls, model_path, **opts):
        from parity.backends.reference import ReferenceBackend

        class Raises(ReferenceBackend):
            def rollback(self, h, n):
                raise RuntimeError("rollback exploded")
        return Raises.open(model_path, **opts)


def test_a_backend_that_raises_is_one_cause_named_by_its_operation_with_the_traceback_advice(tmp_path):
    """An ERROR case's cause is the exception in the operation that raised (not 'logits ... met in check'), and
    the next step points at the stack trace, not at tap archives that no ERROR case writes."""
    import sys
    import types
    from parity.harness.run import run_parity
    mod = types.ModuleType("raises_in_rollback_backend")
    mod.B = _RaisesInRollback
    sys.modules[mod.__name__] = mod
    try:
        rep = run_parity(TINY, f"{mod.__name__}:B", ["speculative_rollback"], level="ci", out_dir=tmp_path,
                         progress=False)
    finally:
        del sys.modules[mod.__name__]
    causes = group_causes(rep.rows)
    assert rep.exit_code == 1 and [c["id"] for c in causes] == ["backend raised"], [c["id"] for c in causes]
    assert causes[0]["operation"] == "rollback", causes[0]
    nx = next_step(rep)
    assert nx["command"] is None and "--traceback" in nx["advice"] and "rollback exploded" in nx["advice"], nx
    assert "re-run with --out" not in nx["advice"]


def test_returned_logits_cause_gets_no_taps_diff_that_would_say_agree(tmp_path):
    from parity.harness.run import run_parity
    rep = run_parity(TINY, "parity.suites.faults:NanInReturnedLogits", ["kl"], level="ci", out_dir=tmp_path,
                     progress=False)
    nx = next_step(rep)
    assert rep.exit_code == 1 and nx["command"] is None, nx
    assert "every recorded tap agrees" in nx["advice"], nx


def test_the_regime_label_is_printed_only_for_a_qsa_tap():
    """A late-position MLP cause (all its failures past the bound) prints no QSA-bound label; a QSA tap's does."""
    from parity.backends.reference import ReferenceBackend
    from parity.harness.scenarios.common import sizes
    cfg = ReferenceBackend.open(TINY).config
    b = sizes(cfg).bound
    f = "decode batch of 1: seq a: logit error 1 of the logit scale > 1e-5 (first failing position {p}, worst {p})"
    for tap, shown in (("layers.2.self_attn.indexer.selected_blocks", True), ("layers.1.mlp.out", False)):
        d = "first divergence " + tap + " at position {p} (max_rel 1)"
        rep = ParityReport("b", "m", [_row([_fail(f"c{p}", f.format(p=p), d.format(p=p), cfg) for p in (b, b + 3)])])
        text = render_table(rep, columns=400)
        assert ("past the QSA bound only" in text) == shown, (tap, text)


def test_a_state_check_failure_does_not_ask_for_out(tmp_path):
    """A FAIL whose only failures are state checks (a rollback leaving the KV length one token long) has no tap
    archive even with --out: the next step names the check, never 're-run with --out DIR' (which keeps nothing)."""
    f = {"scenario": "speculative_rollback", "case": "accept_each_j_all_drafts", "status": "fail",
         "worst_logit_err_rel": 8.7e-7, "archives": [], "label": "speculative_rollback/accept_each_j_all_drafts",
         "failure": "accept 0/4, roll back 4: seq right-accept0: position 10, expected 9 (KV length)",
         "divergence": "sequence length (KV length) 10 != 9",
         "root_cause": root_cause("accept 0/4, roll back 4: seq right-accept0: position 10, expected 9 (KV length)",
                                  "sequence length (KV length) 10 != 9")}
    assert f["root_cause"]["tap"] == "sequence length"
    row = ScenarioRow("speculative-rollback", 5, 1, 1e-13, 1e-6, f["divergence"], 0.1, "fail",
                      failures=[f], worst_logit_err_rel=8.7e-7, thresholds={"tol_rel": 7.9e-5})
    rep = ParityReport("faults", str(TINY), rows=[row])
    nx = next_step(rep)
    assert nx["command"] is None and "--out" not in nx["advice"] and "state check" in nx["advice"], nx
    text = render_table(rep, columns=None)
    assert "re-run with --out" not in text and "state check" in text, text
