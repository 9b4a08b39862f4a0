"""Capabilities that can be partial: each operation declared supported, limited (with its limit) or
unsupported; the suites skip or narrow the affected cases, every skip shows its reason in the row and in
report.json, a skipped case never counts as a pass, an all-skipped report is INCONCLUSIVE (exit 3), and a
declared limit never hides a bug inside it (negative controls)."""
from __future__ import annotations

import numpy as np
import pytest

from parity.backends import ReferenceBackend
from parity.backends.base import BackendError, Capability, CapabilityLimit, capability, capability_table
from parity.harness.report import ParityReport
from parity.harness.scenarios import run_scenario, summarize_results
from parity.harness.scenarios.common import TruthCache
from reference.paths import bundled_model

MODEL = bundled_model("tiny")


class LimitedRollback(ReferenceBackend):
    """Rollback of at most 2 tokens (refuses more with CapabilityLimit); no snapshots; no multi-token prefill."""

    capabilities = {**ReferenceBackend.capabilities, "rollback": {"status": "limited", "max_tokens": 2,
                                                                  "limit": "at most 2 tokens"},
                    "snapshot": False, "fork": False, "batched_prefill": "unsupported"}

    def rollback(self, h, n):
        if n > 2:
            raise CapabilityLimit(f"rollback of {n} > 2 tokens")
        super().rollback(h, n)

    def prefill(self, h, ids, chunk_size=None):
        if len(ids) > 1:
            raise CapabilityLimit("one token per call")
        return super().prefill(h, ids)


class LyingRollback(LimitedRollback):
    """Declares rollback supported but refuses beyond 2 tokens: a refusal of a supported operation fails."""

    capabilities = {**LimitedRollback.capabilities, "rollback": True}


class BuggyWithinLimit(LimitedRollback):
    """Limited to 2 tokens, and wrong inside the limit: keeps one rejected token in its state while reporting
    the right position -- the declared limit must not hide it."""

    def rollback(self, h, n):
        if n > 2:
            raise CapabilityLimit(f"rollback of {n} > 2 tokens")
        ReferenceBackend.rollback(self, h, max(0, n - 1))
        self._lag = {**getattr(self, "_lag", {}), h: getattr(self, "_lag", {}).get(h, 0) + (1 if n else 0)}

    def position(self, h):
        return super().position(h) - getattr(self, "_lag", {}).get(h, 0)


@pytest.fixture(scope="module")
def truth():
    from parity.backends import truth_model
    return TruthCache(truth_model(MODEL))


def _run(cls, scenario, truth):
    return run_scenario(scenario, lambda **kw: cls.open(MODEL, **kw), truth, level="ci", locate_on_fail=False)


def test_capability_declarations_normalise():
    """Booleans (the historical form) keep their meaning; strings, dicts and pairs are read; bad ones refused."""
    caps = {"rollback": True, "snapshot": False, "verify": "limited", "fork": ("limited", "same model only"),
            "taps": {"max_tokens": 4}}
    assert capability(caps, "rollback") == Capability("rollback", "supported")
    assert not capability(caps, "snapshot").usable
    assert capability(caps, "verify").status == "limited"
    assert capability(caps, "fork").limit == "same model only"
    assert capability(caps, "taps") == Capability("taps", "limited", None, 4)
    assert capability(caps, "batched_prefill").status == "supported"  # protocol default
    assert capability({}, "snapshot_file").status == "unsupported"    # protocol default
    assert "at most 4 tokens" in capability(caps, "taps").reason()
    for bad in ({"rollback": "maybe"}, {"rollback": 3}, {"rollback": {"status": "limited", "max_tokens": -1}}):
        with pytest.raises(BackendError, match="capabilities"):
            capability(bad, "rollback")
    table = capability_table(ReferenceBackend.open(MODEL))
    assert table["rollback"] == {"status": "supported"} and table["snapshot_file"] == {"status": "supported"}


def test_a_backend_without_sequences_supports_no_operation():
    """``sequences: False`` makes every operation unsupported, the protocol defaults (verify, fork,
    batched_prefill: supported) and a contradicting declaration included; a reason the backend gives is kept."""
    from parity.backends.base import NO_SEQUENCES, OPERATIONS
    caps = {"sequences": False, "batched_decode": True, "taps": ("unsupported", "no tap hooks in the server")}
    for op in OPERATIONS:
        c = capability(caps, op)
        assert not c.usable, c
        assert c.limit == ("no tap hooks in the server" if op == "taps" else NO_SEQUENCES), c
    assert capability({"sequences": True}, "verify").status == "supported"   # control: declared sequences


def test_limited_rollback_narrows_and_skips_with_reasons(truth):
    """Rollbacks within the limit run and pass, those beyond it are skipped (not passed) with the reason; the
    multi-token prefills are narrowed to one token at a time; snapshot cases are all skipped."""
    res = _run(LimitedRollback, "speculative_rollback", truth)
    ran = [r for r in res if r.status != "skip"]
    skipped = [r for r in res if r.status == "skip"]
    # each skip names its reason: the rollback limit, or an operation the fake declares unsupported
    assert any("rollback limited: at most 2 tokens" in r.failure for r in skipped)
    assert all(any(w in r.failure for w in ("rollback limited: at most 2 tokens", "snapshot unsupported",
                                            "fork unsupported")) for r in skipped), [r.failure for r in skipped]
    assert ran and all(r.status == "pass" for r in ran)
    # accept_each: j = 2..4 (rollback <= 2) judged, j = 0, 1 narrowed out with the reason
    acc = next(r for r in ran if r.case.startswith("accept_each"))
    assert len(acc.narrowed) == 2 and all("at most 2 tokens" in n for n in acc.narrowed)
    row = summarize_results("speculative_rollback", res, 0.0)
    assert row.skipped == len(skipped) and row.cases == len(ran)
    assert row.skips[0]["reason"] == skipped[0].failure and "skipped" in row.detail and "narrowed" in row.detail
    snap = summarize_results("snapshot_restore", _run(LimitedRollback, "snapshot_restore", truth), 0.0)
    assert snap.status == "skip" and snap.cases == 0 and snap.skipped > 0
    assert all(any(w in s["reason"] for w in ("snapshot unsupported", "snapshot_file", "fork unsupported",
                                              "rollback limited")) for s in snap.skips), snap.skips
    # prefill narrowed: budget cases run one token at a time and pass; chunked prefill cases are skipped
    chunk = _run(LimitedRollback, "chunk_boundary", truth)
    assert any(r.status == "skip" and "batched_prefill unsupported" in r.failure for r in chunk)
    assert all(r.status in ("pass", "skip") for r in chunk)


def test_refusing_an_operation_declared_supported_fails(truth):
    """Negative control: the same refusal from a backend that declared rollback supported is a failure."""
    res = _run(LyingRollback, "speculative_rollback", truth)
    assert any(r.status == "fail" and "declares supported" in r.failure for r in res)


def test_a_limit_does_not_hide_a_bug_inside_it(truth):
    """Negative control: a rollback wrong within the declared limit fails (state or logits), not skips."""
    res = _run(BuggyWithinLimit, "speculative_rollback", truth)
    assert any(r.status == "fail" for r in res), [(r.case, r.status, r.failure) for r in res]


def test_all_skipped_report_is_inconclusive_not_pass():
    """A report whose every row was skipped is INCONCLUSIVE (exit 3); a skip row next to a passing one keeps
    PASS; any failure is FAIL."""
    from parity.harness.report import ScenarioRow, render_table
    skip = ScenarioRow("snapshot-restore", 0, 0, 0.0, 0.0, None, 0.1, "skip", "9 skipped: snapshot unsupported",
                       skipped=9, skips=[{"case": "snapshot-restore/x", "reason": "snapshot unsupported"}])
    ok = ScenarioRow("budget", 7, 0, 0.0, 0.0, None, 0.1, "pass")
    bad = ScenarioRow("kl", 5, 1, 1.0, 1.0, "x", 0.1, "fail")
    rep = ParityReport("b", "m", [skip])
    assert rep.verdict == "inconclusive" and rep.exit_code == 3 and rep.to_json()["verdict"] == "inconclusive"
    text = render_table(rep, columns=200)
    assert "INCONCLUSIVE" in text and "snapshot unsupported" in text and "SKIP" in text
    assert rep.to_json()["scenarios"][0]["skips"][0]["reason"] == "snapshot unsupported"
    assert ParityReport("b", "m", [skip, ok]).verdict == "pass"
    partial = ScenarioRow("budget", 5, 0, 0.0, 0.0, None, 0.1, "pass", "2 skipped: rollback limited: at most 2 tokens",
                          skipped=2)
    assert "rollback limited: at most 2 tokens" in render_table(ParityReport("b", "m", [partial]), columns=200)
    assert ParityReport("b", "m", [skip, ok, bad]).exit_code == 1
    assert ParityReport("b", "m", []).verdict == "inconclusive"


class NothingWorks(ReferenceBackend):
    """Declares every stateful operation unsupported: nothing in the scenarios can be judged."""

    capabilities = {**ReferenceBackend.capabilities, "rollback": False, "snapshot": False, "fork": False,
                    "verify": False, "batched_prefill": False, "batched_decode": False}

    def decode(self, hs, ids):
        raise CapabilityLimit("decode refused")


def test_cli_all_skipped_exits_inconclusive(capsys):
    """End to end: ``qwen4exp parity`` on a backend that can run no case prints INCONCLUSIVE, exits 3, and
    report.json names every skip's reason."""
    import json

    from parity.cli import main
    rc = main(["parity", "tiny", "--backend", f"{__name__}:NothingWorks", "--scenario", "snapshot-restore",
               "speculative-rollback", "--level", "ci", "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 3 and doc["verdict"] == "inconclusive", doc
    assert all(r["status"] == "skip" and r["skips"] for r in doc["scenarios"])
    assert doc["meta"]["capabilities"]["rollback"] == {"status": "unsupported"}


def test_pass_verdict_line_says_how_many_cases_were_skipped(capsys):
    """A PASS with skipped cases says so on the verdict line ("S of T cases skipped"), keeping exit 0
    (docs/parity.md); the verdict line of a report that skipped nothing stays a bare PASS (negative control)."""
    import re

    from parity_fakes import _Wrap, reference_capabilities

    from parity.cli import main
    from parity.harness.report import ScenarioRow

    class NoRollback(_Wrap):
        capabilities = {**reference_capabilities("rollback"), "rollback": False}

    import parity_fakes
    parity_fakes.NoRollback = NoRollback  # importable as a --backend spec for this test only
    try:
        rc = main(["parity", "tiny", "--backend", "parity_fakes:NoRollback", "--scenario", "budget",
                   "speculative-rollback", "--level", "ci", "--format", "text", "--no-progress"])
    finally:
        del parity_fakes.NoRollback
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("verdict: "))
    m = re.match(r"verdict: PASS \((\d+) of (\d+) cases skipped; the reasons are listed under the table\)", line)
    assert rc == 0 and m, out
    assert 0 < int(m[1]) < int(m[2]) and "rollback" in out.split("skipped / narrowed cases")[1], out
    ok = ScenarioRow("budget", 7, 0, 0.0, 0.0, None, 0.1, "pass")
    assert ParityReport("b", "m", [ok]).verdict_line == "PASS"
    skip = ScenarioRow("snapshot-restore", 0, 0, 0.0, 0.0, None, 0.1, "skip", "9 skipped", skipped=9)
    assert ParityReport("b", "m", [ok, skip]).verdict_line.startswith("PASS (9 of 16 cases skipped")
