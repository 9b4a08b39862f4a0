"""Every scenario case against the backend given by ``--backend`` (see parity/suites/conftest.py)."""
from __future__ import annotations

import pytest


def test_scenario_case(parity_case, parity_settings, parity_backends, parity_truth):
    """Run one scenario case on the chosen backend; it must pass (skipped when the case is skipped)."""
    from parity.backends import BackendError
    from parity.harness.scenarios import cases_for
    from parity.harness.scenarios.runner import run_case
    name, case_name, ps = parity_case
    try:
        be = parity_backends(ps)
    except BackendError as e:
        pytest.fail(f"backend {parity_settings[0]!r} could not be opened: {e}", pytrace=False)
    case = next(c for c in cases_for(name, be.config, parity_settings[2]) if c.name == case_name)
    res = run_case(name, case, be, parity_truth, page_size=ps)
    if res.status == "skip":
        pytest.skip(res.failure)
    assert res.status == "pass", (f"{res.label}: {res.status}: {res.failure}\n"
                                  f"  first divergence: {res.divergence}\n"
                                  f"  worst KL {res.worst_kl:.3g}, worst logit error {res.worst_logit_err:.3g}")
