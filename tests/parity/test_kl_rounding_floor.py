"""The KL rule on a model with a small logit scale (a tester's false FAIL).

``small`` = the bundled ``tiny`` with ``lm_head.weight`` x 1e-4: logits near uniform, logit scale ~1e-4. Before
the fix ``parity small --scenario kl`` FAILed the reference itself: its worst logit error was within the logit
rule, but "KL 8.26e-16 > (tol x scale)^2 = 4.15e-17" -- a bound below the float64 rounding floor at which the
KL of two near-uniform distributions can be computed at all (parity.harness.kl.kl_rounding_floor). The KL rule
is now never below that floor; a real fault on the same model still fails (negative control).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from parity.cli import main
from parity.harness.kl import KLThresholds, compare_logits, kl_rounding_floor, verdict
from parity_fakes import _Wrap, reference_capabilities
from reference.checkpoint import Checkpoint, write_safetensors
from reference.paths import bundled_model


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """tiny with lm_head.weight x 1e-4 (golden files left out: the reference is the truth). Written with the
    reference's own safetensors reader/writer (stored dtypes kept, bfloat16 through ml_dtypes): no torch."""
    src = bundled_model("tiny")
    dst = tmp_path_factory.mktemp("small") / "small"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("golden") and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    with Checkpoint.open(src) as ck:
        w = {ck.stored_name(n): np.array(ck.get_raw(n)) for n in ck.names()}
    lm = w["lm_head.weight"]
    w["lm_head.weight"] = (lm.astype(np.float32) * np.float32(1e-4)).astype(lm.dtype)
    write_safetensors(dst / "model.safetensors", w)
    return dst


class BumpOneLogit(_Wrap):
    """The reference with +0.5 x the row's logit scale on one logit (the row's argmax) of the RETURNED row at
    position 10 only: a fault 0.5 / tol_rel (~7000) times the tolerance, on a row whose KL is near the floor."""

    name = "bump-one"
    capabilities = reference_capabilities("deterministic", "batch_invariant", "perturb")
    passthrough = ("last_logits", "dense_logits")

    def _fix(self, lg, p0, op):
        lg = np.array(lg, dtype=np.float32, copy=True)
        for r in range(lg.shape[0]):
            if p0 + r == 10:
                row = lg[r].astype(np.float64)
                lg[r, int(np.argmax(row))] += np.float32(0.5 * np.std(row))
        return lg


def _kl(capsys, model, backend):
    rc = main(["parity", str(model), "--backend", backend, "--scenario", "kl", "--level", "ci", "--json",
               "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    return rc, next(s for s in doc["scenarios"] if s["scenario"] == "kl")


def test_the_small_scale_model_passes_with_the_reference(small, capsys):
    rc, row = _kl(capsys, small, "reference")
    assert row["status"] == "pass", row
    assert rc == 0


def test_a_real_fault_on_the_small_scale_model_still_fails(small, capsys):
    rc, row = _kl(capsys, small, f"{__name__}:BumpOneLogit")
    assert rc == 1 and row["status"] == "fail", row
    # caught by the logit rule (0.5 x scale >> tol) and located at the perturbed position
    assert "logit error" in row["detail"] and "at position 10" in row["detail"], row["detail"]


def test_the_floor_bounds_the_rounding_of_near_uniform_rows_and_nothing_more():
    """KL of two float32 roundings of the same near-uniform rows (no real difference: the true KL is ~delta^2 ~
    1e-18) stays under the floor; at a normal scale (tol x scale)^2 is far above the floor, so the KL rule is
    unchanged there, and a KL above the floor with a tiny tolerance still fails by the KL rule."""
    rng = np.random.default_rng(0)
    V = 512
    base = rng.standard_normal((64, V)) * 1e-4
    a = base.astype(np.float32)
    b = (base * (1 + 1e-7)).astype(np.float32)
    c = compare_logits(a, b)
    f = kl_rounding_floor(V)
    assert np.all(np.maximum(c.kl_ab, c.kl_ba) <= f)
    assert np.all(c.kl_floor == f)
    th = KLThresholds(7.5e-5)
    assert (7.5e-5 * 1.0) ** 2 > 100 * f          # a unit-scale model: the second-order bound rules
    ok, why = verdict(c, th)
    assert ok, why
    # negative control: a KL well above the floor, with a logit error inside an (artificially wide) logit rule
    d = a.astype(np.float64).copy()
    d[:, 0] += 50 * np.std(d, axis=-1)
    c2 = compare_logits(a, d.astype(np.float32))
    ok, why = verdict(c2, KLThresholds(1e3))
    assert ok, why                                 # (tol x scale)^2 huge: passes, KL rule not binding
    c2.scale = np.full(c2.n, 1e-30)                # a scale that puts (tol x scale)^2 below the floor
    c2.max_abs_err = np.zeros(c2.n)                # keep the logit rule out of it
    ok, why = verdict(c2, KLThresholds(1e3))
    assert not ok and "float64 rounding floor of the KL" in why, why
