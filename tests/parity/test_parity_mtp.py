"""The speculative-rollback suite's MTP cases (the backend's own drafts against the reference MTP head):
the reference and the engine's CPU path pass them on both MTP fixtures; the injected MTP faults are caught
and located at the first divergent mtp.* tap; a backend without a head skips them; the report states the
truth's provenance (no official MTP implementation exists)."""
from __future__ import annotations

from pathlib import Path

import pytest

from parity.backends import opener, truth_model
from parity.harness.scenarios import cases_for, run_scenario, summarize_results
from parity.harness.scenarios.common import TruthCache
from parity.harness.scenarios.runner import run_case
from parity.harness.scenarios.speculative_rollback import MTP_TRUTH_PROVENANCE
from parity.suites import faults

REPO = Path(__file__).resolve().parents[2]
MTP_FIXTURES = ("tiny-mtp", "tiny-hc3-mtp")
_TRUTH: dict = {}


def truth_for(fx):
    if fx not in _TRUTH:
        _TRUTH[fx] = TruthCache(truth_model(REPO / "fixtures" / fx))
    return _TRUTH[fx]


def _mtp_names(config):
    return [c.name for c in cases_for("speculative_rollback", config, "ci") if c.name.startswith("mtp_")]


def _report(results) -> str:
    return "\n".join(f"{r.label}: {r.status}: {r.failure} | {r.divergence}" for r in results if r.status != "pass")


@pytest.mark.parametrize("backend", ["reference", "engine-cpu"])
@pytest.mark.parametrize("fx", MTP_FIXTURES)
def test_backends_pass_the_mtp_cases(fx, backend):
    op = opener(backend, REPO / "fixtures" / fx)
    cfg = op().config
    names = _mtp_names(cfg)
    assert len(names) == 3
    pages = None if backend == "reference" else [cfg.indexer_compress_ratio + 1]
    res = run_scenario("speculative_rollback", op, truth_for(fx), only=names, level="ci", page_sizes=pages)
    assert len(res) == 3 and all(r.status == "pass" for r in res), _report(res)
    assert all(r.checks > 5 for r in res)
    row = summarize_results("speculative_rollback", res, 0.0)
    assert row.notes["mtp_truth_provenance"] == MTP_TRUTH_PROVENANCE
    assert "no official implementation" in row.to_json()["notes"]["mtp_truth_provenance"]


def test_no_mtp_cases_without_a_head_and_skipped_without_the_capability():
    tiny = opener("reference", REPO / "fixtures" / "tiny")().config
    assert _mtp_names(tiny) == []  # a config without mtp_num_hidden_layers gets no MTP cases
    be = opener("engine-cpu", REPO / "fixtures" / "tiny-mtp")(mtp=False)  # the head not loaded
    assert not be.capabilities.get("mtp")
    case = [c for c in cases_for("speculative_rollback", be.config, "ci") if c.name == "mtp_accept_each_j"][0]
    r = run_case("speculative_rollback", case, be, truth_for("tiny-mtp"))
    assert r.status == "skip" and "mtp" in r.failure


@pytest.mark.parametrize("fx", MTP_FIXTURES)
@pytest.mark.parametrize("fault", list(faults.MTP_FAULTS), ids=lambda c: c.__name__)
def test_mtp_fault_is_caught_and_located(fault, fx):
    scenario, case_name, must_name = faults.MTP_FAULTS[fault]
    be = fault.open(REPO / "fixtures" / fx)
    case = [c for c in cases_for(scenario, be.config, "ci") if c.name == case_name][0]
    r = run_case(scenario, case, be, truth_for(fx))
    assert r.status == "fail", f"{fault.__name__} not caught: {r.status} {r.failure}"
    assert "reference MTP head" in r.failure and "no official implementation" in r.failure
    assert r.divergence and r.divergence.startswith("mtp draft step"), r.divergence
    assert must_name in r.divergence, f"{fault.__name__}: located at {r.divergence!r}, expected {must_name!r}"
    # control of the control: the same case passes on the correct reference
    ok = run_case(scenario, case, opener("reference", REPO / "fixtures" / fx)(), truth_for(fx))
    assert ok.status == "pass", ok.failure
