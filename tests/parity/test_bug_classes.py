"""Every in-scope class of the public bug list (/work/shared/bug-classes.md, mapped in docs/parity.md) is an
injected fault (parity/suites/faults/ BUG_CLASSES) that ONE named case catches and locates at the block
holding it. Each fault runs against exactly that case (fast); the control of the control: the same cases
pass on the clean reference (tests/parity/test_parity_scenarios.py runs every case on it)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.backends import open_backend, truth_model
from parity.harness.scenarios import cases_for
from parity.harness.scenarios.common import TruthCache
from parity.harness.scenarios.runner import run_case
from parity.suites import faults

REPO = Path(__file__).resolve().parents[2]
_TRUTH: dict = {}


def _truth(fx):
    if fx not in _TRUTH:
        _TRUTH[fx] = TruthCache(truth_model(REPO / "fixtures" / fx))
    return _TRUTH[fx]


def _case(scenario, cfg, prefix):
    found = [c for c in cases_for(scenario, cfg, "ci") if c.name.startswith(prefix)]
    assert found, f"no {scenario} case starting with {prefix!r}"
    return found[0]


@pytest.mark.parametrize("entry", faults.BUG_CLASSES, ids=lambda e: f"{'+'.join(e[0])}-{e[1].__name__}")
def test_bug_class_fault_is_caught_and_located(entry):
    ids, fault, scenario, prefix, fx, located = entry
    be = fault.open(REPO / "fixtures" / fx)
    case = _case(scenario, be.config, prefix)
    truth = None if scenario == "self_consistency" else _truth(fx)
    r = run_case(scenario, case, be, truth)
    if fault is faults.TopkTiesHigherIndex:
        # the tie rule: a pick that differs only INSIDE an exact tie set is a valid resolution (the official
        # implementation's own CPU top-k does this); it is judged tie-equivalent against the reference forced to
        # it, never failed. A pick outside the tie set still fails (tests/parity/test_verdict_matrix.py).
        assert r.status == "pass" and r.tie_equivalent, (r.status, r.failure, r.tie_equivalent)
        return
    assert r.status == "fail", f"{fault.__name__} ({ids}) not caught by {r.label}: {r.status} {r.failure}"
    assert located in (r.divergence or ""), f"{fault.__name__}: located at {r.divergence!r}, expected {located!r}"


def test_every_mapped_class_has_a_fault_or_a_reason():
    """docs/parity.md maps R01..R44: each either names a fault of BUG_CLASSES (or the bad-input check below) or
    states why it is out of scope."""
    text = (REPO / "docs" / "parity.md").read_text()
    table = text.split("<!-- bug-classes -->")[1]
    faulted = {i for e in faults.BUG_CLASSES for i in e[0]}
    for n in range(1, 45):
        rid = f"R{n:02d}"
        line = next((ln for ln in table.splitlines() if ln.startswith(f"| {rid} ")), None)
        assert line is not None, f"{rid} missing from docs/parity.md"
        cells = [c.strip() for c in line.strip("|").split("|")]
        if rid in faulted:
            names = {e[1].__name__ for e in faults.BUG_CLASSES if rid in e[0]}
            assert any(nm in line for nm in names), f"{rid}: the doc row names none of {names}"
        else:
            assert "out of scope" in line or "bad-input" in line, f"{rid}: neither a fault nor a reason: {line}"
            assert len(cells[-1]) > 20, f"{rid}: the reason is too short: {cells[-1]!r}"


def test_r38_zero_ple_conv_kernel_is_refused_at_config_load(tmp_path):
    """R38 (bad-input): ple_conv_kernel_size = 0 is one clear ConfigError naming the field, before any kernel."""
    from reference.config import ConfigError, ModelConfig
    raw = json.loads((REPO / "fixtures" / "tiny" / "config.json").read_text())
    raw["ple_conv_kernel_size"] = 0
    with pytest.raises(ConfigError, match="ple_conv_kernel_size"):
        ModelConfig.from_dict(raw)


def test_clean_reference_passes_the_bug_class_cases():
    """Control of the control for the cases added with the bug classes (the fixtures they run on)."""
    seen = set()
    for _ids, _fault, scenario, prefix, fx, _loc in faults.BUG_CLASSES:
        if (scenario, prefix, fx) in seen:
            continue
        seen.add((scenario, prefix, fx))
        be = open_backend("reference", REPO / "fixtures" / fx)
        r = run_case(scenario, _case(scenario, be.config, prefix), be,
                     None if scenario == "self_consistency" else _truth(fx))
        assert r.status == "pass", f"{r.label} on {fx}: {r.failure} | {r.divergence}"
