"""``--known`` baselines are precise and bound: a known cause is
its root cause id AND where it failed AND how large it was AND whether the top-1 token flipped there; a baseline
of another model or backend is refused. Negative controls: a different fault at another position, a larger fault
at the same position, a second fault next to the known one and a new top-1 flip each FAIL, named."""
from __future__ import annotations

import json

import pytest

from known_fakes import Faulty
from parity.backends.base import truth_model
from parity.harness.causes import KNOWN_BAND, group_causes, read_known, write_known
from parity.harness.kl import thresholds_for
from parity.harness.scenarios import summarize_results
from parity.harness.scenarios.common import Case, TruthCache, token_stream
from parity.harness.scenarios.runner import run_case
from reference.errors import InputError
from reference.paths import bundled_model

TINY = bundled_model("tiny")


def _case():
    def fn(run):
        s = run.new("s")
        ids = token_stream(run.config, 12, seed=3)
        run.prefill(s, ids[:10])
        run.decode([s], ids[10:11])
    return Case("prefill10_decode", fn)


@pytest.fixture(scope="module")
def truth():
    return TruthCache(truth_model(TINY))


def _backend(monkeypatch, noise=None, flip=()):
    monkeypatch.setattr(Faulty, "noise", dict(noise or {}))
    monkeypatch.setattr(Faulty, "flip", tuple(flip))
    return Faulty.open(TINY)


TH = thresholds_for("float32")   # nominal thresholds: far below the 1e-3 x max|logit| faults used here
META = {"model": {"config_hash": "h", "weights_fingerprint": "w"}, "backend_spec": "test:Faulty"}


def _baseline(tmp_path, truth, be):
    res = [run_case("t", _case(), be, truth, thresholds=TH)]
    assert res[0].status == "fail", res[0]
    causes = group_causes([summarize_results("t", res, 0.0)])
    return read_known(write_known(tmp_path / "known.json", causes, {**META, "tol_rel": TH.tol_rel})), res[0]


def test_the_same_fault_is_excused_and_other_faults_fail_naming_what_is_new(tmp_path, truth, monkeypatch):
    """Noise at position 5 is the baseline. Re-run: excused (known). The tester's repro -- a wrong argmax at
    position 7 -- fails (new position); so does 3x the noise at 5 (larger), and the known noise plus a flip at
    7 (the prefill op fails at 5 and 7: one known place does not excuse the other)."""
    known, base = _baseline(tmp_path, truth, _backend(monkeypatch, noise={5: 1e-3}))
    assert base.fault and list(base.fault) == ["position 5"] and base.fault["position 5"][1] is False
    doc = json.loads((tmp_path / "known.json").read_text())
    assert doc["causes"][0]["worst_logit_err_rel"] == pytest.approx(base.fault["position 5"][0])

    same = run_case("t", _case(), _backend(monkeypatch, noise={5: 1e-3}), truth, thresholds=TH, known=known)
    assert same.status == "fail" and same.known and same.known_note is None
    row = summarize_results("t", [same], 0.0)
    assert row.status == "pass" and row.known == 1 and row.failed_cases == 0

    flip = run_case("t", _case(), _backend(monkeypatch, flip=(7,)), truth, thresholds=TH, known=known)
    assert flip.status == "fail" and not flip.known
    assert "new failing position(s) position 7" in flip.known_note and "position 5" in flip.known_note
    assert flip.fault["position 7"][1] is True      # the wrong argmax is recorded as a top-1 flip
    row = summarize_results("t", [flip], 0.0)
    assert row.status == "fail" and row.known == 0 and "not excused by --known" in row.detail

    larger = run_case("t", _case(), _backend(monkeypatch, noise={5: 3e-3}), truth, thresholds=TH, known=known)
    assert larger.status == "fail" and not larger.known
    assert "larger than the known one" in larger.known_note and "position 5" in larger.known_note

    both = run_case("t", _case(), _backend(monkeypatch, noise={5: 1e-3}, flip=(7,)), truth, thresholds=TH,
                    known=known)
    assert both.status == "fail" and not both.known and "position 7" in both.known_note
    assert summarize_results("t", [both], 0.0).status == "fail"


def test_judge_bounds_size_by_one_tolerance_band_and_refuses_new_flips(tmp_path):
    """The rule itself, on recorded figures: within recorded + one band (the run's tol_rel) is excused, past it
    is not; a top-1 flip where the baseline had none is new; an unknown id is named."""
    doc = {"version": 2, **META, "tol_rel": 1e-4,
           "causes": [{"id": "returned logits | prefill | below the QSA bound",
                       "positions": {"position 5": [0.01, False], "position 9": [0.02, True]}}]}
    (tmp_path / "k.json").write_text(json.dumps(doc))
    k = read_known(tmp_path / "k.json")
    rc = {"id": "returned logits | prefill | below the QSA bound", "position": 5}
    band = KNOWN_BAND * 1e-4
    assert k.judge(rc, {"position 5": [0.01 + 0.9 * band, False]}, 1e-4) == (True, "")
    ok, why = k.judge(rc, {"position 5": [0.01 + 1.1 * band, False]}, 1e-4)
    assert not ok and "larger" in why
    ok, why = k.judge(rc, {"position 5": [0.01, True]}, 1e-4)
    assert not ok and "top-1 flips the baseline did not have at position 5" in why
    assert k.judge(rc, {"position 9": [0.02, True]}, 1e-4)[0]       # a recorded flip stays excused
    ok, why = k.judge({**rc, "id": "layers.0.mlp | decode | below the QSA bound"}, {"position 5": [0.01, False]}, 1e-4)
    assert not ok and "not in the --known baseline" in why
    # a failure without compared logits (a refusal, an error) is placed by its root cause's position
    assert k.judge(rc, None, 1e-4) == (True, "")
    ok, why = k.judge({**rc, "position": 7}, None, 1e-4)
    assert not ok and "new failing position(s) position 7" in why


def test_baseline_of_another_model_or_backend_or_version_is_refused(tmp_path):
    """check_identity names both models (config hash / weights fingerprint) or both backend specs; a version-1
    baseline (bare ids) is refused with what to do."""
    doc = {"version": 2, "model": {"config_hash": "aaa", "weights_fingerprint": "bbb", "path": "/m/tiny"},
           "backend_spec": "engine", "causes": []}
    (tmp_path / "k.json").write_text(json.dumps(doc))
    k = read_known(tmp_path / "k.json")
    k.check_identity({"config_hash": "aaa", "weights_fingerprint": "bbb"}, "engine")   # same: accepted
    with pytest.raises(InputError, match=r"weights_fingerprint ccc.*another model \(/m/tiny: weights_fingerprint bbb"):
        k.check_identity({"config_hash": "aaa", "weights_fingerprint": "ccc"}, "engine", model_path="/m/other")
    with pytest.raises(InputError, match=r"backend 'reference', found one of backend 'engine'"):
        k.check_identity({"config_hash": "aaa", "weights_fingerprint": "bbb"}, "reference")
    (tmp_path / "v1.json").write_text(json.dumps({"version": 1, "causes": [{"id": "x"}]}))
    with pytest.raises(InputError, match="found version 1.*write it again with --write-known"):
        read_known(tmp_path / "v1.json")
    (tmp_path / "noid.json").write_text(json.dumps({"version": 2, "causes": []}))
    with pytest.raises(InputError, match="'model' identity and 'backend_spec'"):
        read_known(tmp_path / "noid.json")


def test_kl_row_excuses_only_the_recorded_prompts_and_positions(truth, monkeypatch):
    """The KL harness's row: a baseline of noise at position 5 (every prompt) excuses the same run (its cases
    counted as known) and not a wrong argmax at position 7."""
    from parity.harness.causes import KnownCauses
    from parity.harness.run import kl_row
    prompts = [token_stream(truth.model.config, 9, seed=s) for s in (1, 2)]
    spec = "known_fakes:Faulty"

    def row(noise=None, flip=(), known=None):
        monkeypatch.setattr(Faulty, "noise", dict(noise or {}))
        monkeypatch.setattr(Faulty, "flip", tuple(flip))
        return kl_row(TINY, spec, prompts, False, 0.0, truth=truth, known=known)
    base = row(noise={5: 1e-3})
    assert base.status == "fail" and base.known == 0
    assert sorted(base.failures[0]["fault"]) == ["prompt 0 position 5", "prompt 1 position 5"]
    known = KnownCauses("k.json", {**META, "causes": [{"id": c["id"], "positions": c["fault"]}
                                                      for c in group_causes([base])]})
    again = row(noise={5: 1e-3}, known=known)
    assert again.status == "pass" and again.known == 2 and again.failed_cases == 0
    flip = row(flip=(7,), known=known)
    assert flip.status == "fail" and flip.known == 0 and "not excused by --known: new failing position" in flip.detail
