"""Every scenario case against the backend given by ``--qwen4exp-backend`` (fixtures: parity/suites/plugin.py)."""
from __future__ import annotations

import pytest


def test_scenario_case(qwen4exp_case, qwen4exp_settings, qwen4exp_backends, qwen4exp_truth, qwen4exp_thresholds):
    """Run one scenario case on the chosen backend against the limits ``qwen4exp parity`` would use
    (measured on this model, ``qwen4exp_thresholds``); it must pass (skipped when the case is skipped)."""
    from parity.backends import BackendError
    from parity.harness.scenarios import cases_for
    from parity.harness.scenarios.runner import run_case
    name, case_name, ps = qwen4exp_case
    try:
        be = qwen4exp_backends(ps)
    except BackendError as e:
        pytest.fail(f"backend {qwen4exp_settings[0]!r} could not be opened: {e}", pytrace=False)
    case = next(c for c in cases_for(name, be.config, qwen4exp_settings[2]) if c.name == case_name)
    res = run_case(name, case, be, qwen4exp_truth, page_size=ps, thresholds=qwen4exp_thresholds(be))
    if res.status == "skip":
        pytest.skip(res.failure)
    assert res.status == "pass", (f"{res.label}: {res.status}: {res.failure}\n"
                                  f"  first divergence: {res.divergence}\n"
                                  f"  worst KL {_g(res.worst_kl)}, worst logit error {_g(res.worst_logit_err)}")


def _g(x) -> str:
    """A figure as ``.3g``; ``-`` for a case that produced none (logits of the wrong shape)."""
    return "-" if x is None else f"{x:.3g}"
