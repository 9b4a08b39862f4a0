"""Logit-KL metrics (properties on synthetic logits, checked against scipy as an independent oracle)
and the KL harness with its three controls, including faults that each control must catch."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from parity.harness.kl import (LogitComparison, compare_logits, greedy_agreement, kl_per_position, log_softmax, run_kl,
                       summarize, thresholds_for, verdict)
from reference.errors import InputError

FIX = "fixtures/tiny"

logits_2d = st.integers(1, 6).flatmap(lambda t: st.integers(2, 40).flatmap(
    lambda v: arrays(np.float64, (t, v), elements=st.floats(-30, 30, allow_nan=False, width=64))))


@settings(max_examples=60, deadline=None)
@given(logits_2d, st.floats(-50, 50))
def test_kl_nonnegative_zero_on_self_and_shift_invariant(x, c):
    kl = kl_per_position(x, x)
    # KL(P||P) is exactly 0 up to float64 rounding of the log-softmax (~1e-15 per term, V <= 40 terms)
    assert np.all(kl <= 1e-12)
    y = x[::-1].copy() if x.shape[0] > 1 else x * 0.5
    assert np.all(kl_per_position(x, y) >= 0)
    # softmax is invariant to adding a constant per row: the metric must be too (same 1e-12 rounding bound,
    # scaled by the logit magnitude |c| + 30)
    assert np.allclose(kl_per_position(x + c, y), kl_per_position(x, y), atol=1e-10 * (abs(c) + 30))


@settings(max_examples=40, deadline=None)
@given(logits_2d)
def test_kl_matches_scipy_rel_entr(x):
    from scipy.special import rel_entr, softmax
    rng = np.random.default_rng(0)
    y = x + rng.normal(0, 1, x.shape)
    p, q = softmax(x, axis=-1), softmax(y, axis=-1)
    want = rel_entr(p, q).sum(-1)
    # two float64 evaluations of the same sum: agree to ~1e-12 relative (allow 1e-9 for exp underflow paths)
    assert np.allclose(kl_per_position(x, y), want, rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(logits_2d)
def test_log_softmax_normalised(x):
    # probabilities sum to 1 within float64 rounding over <= 40 terms
    assert np.allclose(np.exp(log_softmax(x)).sum(-1), 1.0, atol=1e-12)


def test_top1_top5_probdiff_on_constructed_case():
    a = np.array([[5.0, 4, 3, 2, 1, 0, -1], [0, 1, 2, 3, 4, 5, 6]])
    b = a.copy()
    b[0, [0, 1]] = b[0, [1, 0]]          # row 0: top-1 swapped, same top-5 set
    b[1, 0] = 100.0                        # row 1: new top-1 from outside a's top-5
    c = compare_logits(a, b)
    assert c.top1.tolist() == [False, False]
    assert c.top5_overlap.tolist() == [1.0, 0.8]
    # row 0: b gives a's top token (0) the probability a gave token 1
    pa = np.exp(log_softmax(a))
    assert c.top_prob_diff[0] == pytest.approx(pa[0, 1] - pa[0, 0])
    # the logit error is judged with each row's mean offset removed: row 0's swap has mean 0 (error 1); row 1's
    # +100 on one of 7 entries has offset 100/7, residual 100 * 6/7
    assert c.max_abs_err == pytest.approx([1.0, 100.0 * 6 / 7])
    assert c.offset == pytest.approx([0.0, 100.0 / 7])


def test_summary_percentiles_and_nan_propagation():
    v = np.arange(1001, dtype=np.float64)
    s = summarize(v)
    assert s["median"] == 500 and s["max"] == 1000 and s["p90"] == pytest.approx(900)
    assert s["p99.9"] == pytest.approx(999)
    v[3] = np.nan
    assert all(np.isnan(x) for x in summarize(v).values())  # a nan is a fault, never averaged away


def test_verdict_flags_and_passes():
    rng = np.random.default_rng(1)
    a = rng.normal(0, 3, (8, 64))
    th = thresholds_for("float32")
    ok, _ = verdict(compare_logits(a, a + rng.normal(0, 1e-6, a.shape)), th)   # float32-level noise
    bad, why = verdict(compare_logits(a, a + rng.normal(0, 0.3, a.shape)), th)  # a real fault
    nan, why_nan = verdict(compare_logits(a, np.where(np.arange(64) == 3, np.nan, a)), th)
    assert ok and not bad and "logit error" in why
    assert not nan and "non-finite" in why_nan


def test_greedy_agreement():
    assert greedy_agreement([1, 2, 3], [1, 2, 4]) == 2
    assert greedy_agreement([], [1]) == 0
    assert greedy_agreement([7, 8], [7, 8]) == 2


def test_bad_shapes_are_one_clear_error():
    with pytest.raises(InputError, match=r"equal shapes"):
        compare_logits(np.zeros((2, 5)), np.zeros((3, 5)))
    with pytest.raises(InputError, match=r"\[T, V\]"):
        kl_per_position(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))
    with pytest.raises(InputError, match="float"):
        compare_logits(np.zeros((2, 5), dtype=np.int64), np.zeros((2, 5), dtype=np.int64))
    with pytest.raises(InputError, match="precision"):
        thresholds_for("int4")


# ----------------------------------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def refs():
    from parity.backends import open_backend
    return open_backend("reference", FIX), open_backend("reference-f64", FIX)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [440, 5, 9, 77, 440, 3, 2, 100, 200, 300, 17, 18]]


def _perturbed():
    from parity.backends import open_backend
    from parity.harness.run import perturbation
    return open_backend("reference", FIX, perturb=("layers.0.linear_attn.out_proj.weight", perturbation()))


def test_harness_reference_vs_itself_passes_with_controls(refs):
    r32, r64 = refs
    rep = run_kl(r32, r32, PROMPTS, greedy_tokens=3, floor_pair=(r32, r64), perturbed_b=_perturbed, progress=False)
    assert rep.passed and rep.controls_ok and rep.exit_code == 0
    # prefill rows: the same reference (over the prompt vs over prompt + continuation): within the float32 floor
    n_prefill = sum(rep.per_prompt_positions[:len(PROMPTS)])
    assert rep.comparison.rel_err()[:n_prefill].max() <= rep.thresholds.floor_rel
    assert all(g["agree"] == 3 for g in rep.greedy)
    assert rep.decode is not None and rep.decode.n == 2 * 2   # 2 decode rows per prompt (greedy 3) are judged
    nc = rep.controls["negative_control"]
    assert nc["ok"] and nc["effect_rel"] > rep.thresholds.tol_rel   # sized from the floor, and flagged


def test_harness_flags_a_perturbed_b(refs):
    r32, r64 = refs
    rep = run_kl(r32, _perturbed(), PROMPTS, greedy_tokens=0, floor_pair=(r32, r64), perturbed_b=_perturbed,
                 progress=False)
    assert not rep.passed and rep.exit_code == 1


def test_determinism_control_catches_a_nondeterministic_b(refs):
    from parity.backends import ReferenceBackend
    r32, r64 = refs

    class Noisy(ReferenceBackend):
        calls = 0

        def logits(self, ids):
            Noisy.calls += 1
            out = super().logits(ids)
            out[0, 0] += np.float32(1e-6) * Noisy.calls   # below any KL threshold, but not bitwise
            return out
    noisy = Noisy(r32.model, "noisy", FIX)
    rep = run_kl(r32, noisy, PROMPTS, greedy_tokens=0, floor_pair=(r32, r64), perturbed_b=_perturbed,
                 progress=False)
    assert rep.passed  # the comparison itself is fine ...
    assert not rep.controls["determinism"]["ok"] and rep.exit_code == 1  # ... the control is not


def test_negative_control_fails_when_perturbation_is_not_flagged(refs):
    """A 'perturbed' backend that is in fact unperturbed must make the control (and the report) fail."""
    from parity.backends import open_backend
    r32, r64 = refs
    rep = run_kl(r32, r32, PROMPTS, greedy_tokens=0, floor_pair=(r32, r64),
                 perturbed_b=lambda: open_backend("reference", FIX), progress=False)
    assert not rep.controls["negative_control"]["ok"] and "NOT flagged" in rep.controls["negative_control"]["detail"]
    # the harness cannot vouch for its thresholds: INCONCLUSIVE (exit 3), never a backend FAIL
    assert rep.status == "INCONCLUSIVE" and rep.exit_code == 3 and "negative control" in rep.reason


def test_a_floor_too_coarse_for_a_useful_fault_is_inconclusive(refs):
    """A floor whose tolerance exceeds USEFUL_FAULT_REL cannot resolve a fault of useful size: INCONCLUSIVE."""
    import dataclasses

    from parity.harness.floor import measure_floor
    from parity.harness.kl import USEFUL_FAULT_REL
    r32, _ = refs
    fl = measure_floor(r32.model.weights, PROMPTS[:1])
    coarse = dataclasses.replace(fl, logit_rel=USEFUL_FAULT_REL)   # 8x of it is far above the useful size
    rep = run_kl(r32, r32, PROMPTS[:1], greedy_tokens=0, floor=coarse, perturbed_b=_perturbed, progress=False)
    assert not rep.controls["precision_floor"]["ok"] and rep.status == "INCONCLUSIVE" and rep.exit_code == 3


def test_missing_controls_are_inconclusive(refs):
    r32, _ = refs
    rep = run_kl(r32, r32, PROMPTS[:1], greedy_tokens=0, progress=False)
    assert rep.passed and not rep.controls_ok and rep.exit_code == 3


def test_concat_empty():
    assert LogitComparison.concat([]).n == 0


def test_topk_sets_partition_equals_the_stable_sort():
    """The partition path of the top-k sets (used on [T, V] rows of long prefills) gives exactly the stable
    argsort's first k: value descending, lower token id first -- exact ties at the cut, uniform rows, NaN and
    +-inf rows included (those take the sort itself); a reversed tie-break would differ."""
    from parity.harness.metrics import topk_sets
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        a = np.round(rng.standard_normal((500, 300)), 1).astype(dt)  # ~60 distinct values: ties everywhere
        a[5, 3] = np.nan
        a[6] = 1.0
        a[7, :10] = a[7].max()
        a[8, 100] = np.inf
        a[9] = -np.inf
        for k in (1, 5, 299, 300):
            assert np.array_equal(topk_sets(a, k), np.argsort(-a, axis=-1, kind="stable")[:, :k]), (dt, k)
    assert topk_sets(a, 5)[6].tolist() == [0, 1, 2, 3, 4]
    assert (299 - np.argsort(-a[6, ::-1], kind="stable")[:5]).tolist() != [0, 1, 2, 3, 4]  # negative control


# ------------------------------------------------------- per-row offset, -inf rows, run-to-run noise, controls
def test_a_per_row_offset_is_no_error_and_its_size_is_reported():
    """logits + c (per row) and log-probabilities are the same distribution: no logit error, the offset a figure.
    Negative controls: an offset that differs across a row's entries, and an offset plus a real error, fail."""
    rng = np.random.default_rng(3)
    a = rng.normal(0, 3, (6, 200))
    th = thresholds_for("float32")
    c = compare_logits(a, a + rng.normal(0, 5, (6, 1)))            # a different offset on every row
    assert verdict(c, th)[0] and c.max_abs_err.max() < 1e-12       # float64 rounding of (a + c) - a - c
    assert c.summary()["max_removed_offset"] == pytest.approx(np.abs(c.offset).max()) and c.offset_rel() > 0.1
    lp = compare_logits(a, log_softmax(a))
    ok, why = verdict(lp, th)
    assert ok and "offset" in why                                  # reported, not a failure
    ramp = a + 3.0 + np.linspace(0, 1e-3, 200) * np.abs(a).max()   # the offset varies across the entries
    assert not verdict(compare_logits(a, ramp), th)[0]
    # residual of a ramp of range r about its mean: r / 2 (the offset removal keeps at least half any real error)
    assert compare_logits(a, ramp).max_abs_err == pytest.approx(0.5e-3 * np.abs(a).max(), rel=1e-6)
    noisy = a + 3.0
    noisy[2] += 1e-3 * np.abs(a[2]).max() * rng.standard_normal(200)
    bad, why = verdict(compare_logits(a, noisy), th)
    assert not bad and "logit error" in why and "position 2" in why


def test_minus_inf_tail_gives_kl_inf_not_nan():
    """A top-k truncated row (-inf tail) has KL = inf (probability 0 where the truth has > 0), never nan; both
    sides excluding the same tokens agree; a nan logit stays nan."""
    rng = np.random.default_rng(4)
    a = rng.normal(0, 2, (3, 100))
    b = a.copy()
    b[1, np.argsort(b[1])[:-10]] = -np.inf
    c = compare_logits(a, b)
    assert np.isinf(c.kl_ab[1]) and np.isfinite(c.kl_ba[1]) and c.worst_kl() == np.inf
    assert np.isinf(c.max_abs_err[1]) and c.max_abs_err[0] == 0.0
    ok, why = verdict(c, thresholds_for("float32"))
    assert not ok and "KL inf at position 1" in why
    same = compare_logits(b, b + 1.0)   # the same -inf entries on both sides, a per-row offset
    assert same.worst_kl() < 1e-12 and same.max_abs_err.max() < 1e-12 and same.offset == pytest.approx(1.0)
    n = a.copy()
    n[0, 3] = np.nan
    assert np.isnan(compare_logits(a, n).worst_kl())
    assert np.isinf(kl_per_position(a, b)[1])
    st = summarize(c.kl_ab)   # percentiles over an inf entry: inf where it is reached, never nan
    assert st["max"] == np.inf and not any(np.isnan(x) for x in st.values()) and np.isfinite(st["median"])


def _kl(refs, cls, **kw):
    from kl_fakes import __dict__ as fakes
    r32, r64 = refs
    b = fakes[cls].open(FIX)
    return run_kl(r32, b, PROMPTS, greedy_tokens=kw.pop("greedy_tokens", 2), floor_pair=(r32, r64),
                  perturbed_b=_perturbed, progress=False, **kw)


@pytest.mark.parametrize("cls", ["RowShift", "LogProbs"])
def test_harness_passes_a_softmax_invariant_shift(refs, cls):
    rep = _kl(refs, cls)
    assert rep.status == "PASS" and rep.exit_code == 0, rep.reason
    assert rep.comparison.summary()["max_removed_offset"] > 1.0   # the removed offset is reported as a figure


@pytest.mark.parametrize("cls, where", [("RampShift", "prompt 0"), ("ShiftPlusNoiseAt5", "position 5")])
def test_harness_fails_an_offset_with_a_real_error(refs, cls, where):
    rep = _kl(refs, cls)
    assert rep.status == "FAIL" and rep.exit_code == 1 and where in rep.reason, rep.reason


def test_the_reason_names_the_first_failing_position_not_only_the_worst(refs):
    rep = _kl(refs, "SmallAt3LargeAt9", greedy_tokens=0)
    assert rep.status == "FAIL" and rep.exit_code == 1, rep.reason
    assert rep.reason.startswith("prompt 0: ") and "at position 9" in rep.reason, rep.reason
    assert "first failing position 3, worst logit error at position 9" in rep.reason, rep.reason


def test_harness_top_k_tail_fails_with_kl_inf(refs):
    rep = _kl(refs, "TopKTail", greedy_tokens=0)
    assert rep.status == "FAIL" and "KL inf" in rep.reason and rep.comparison.worst_kl() == np.inf


def test_run_to_run_noise_of_a_backend_not_claiming_determinism_is_measured_and_allowed(refs):
    rep = _kl(refs, "Jitter")
    det = rep.controls["determinism"]
    assert rep.status == "PASS" and rep.exit_code == 0, rep.reason
    assert det["ok"] and det["claimed"] is False and 0 < det["spread_rel"] <= rep.thresholds.tol_rel
    assert det["prompts_differing"] == [0, 1] and "run-to-run spread" in det["detail"]


def test_run_to_run_noise_above_the_tolerance_is_inconclusive(refs):
    rep = _kl(refs, "JitterLarge")
    det = rep.controls["determinism"]
    assert not det["ok"] and det["spread_rel"] > rep.thresholds.tol_rel
    assert rep.status == "INCONCLUSIVE" and rep.exit_code == 3 and "run-to-run spread" in rep.reason, rep.reason


def test_a_fault_beyond_the_noise_of_a_noisy_backend_still_fails(refs):
    """Negative control of the INCONCLUSIVE rule: an error far beyond tolerance + spread is a FAIL."""
    rep = _kl(refs, "JitterLargeFaultAt5")
    assert rep.controls["determinism"]["spread_rel"] > rep.thresholds.tol_rel
    assert rep.status == "FAIL" and rep.exit_code == 1 and "position 5" in rep.reason, rep.reason


def test_claimed_determinism_must_be_bitwise_and_its_prompts_are_failed_cases(refs):
    rep = _kl(refs, "JitterClaimsDeterministic")
    assert rep.passed and rep.status == "FAIL" and rep.exit_code == 1
    assert not rep.controls["determinism"]["ok"] and rep.failed_prompts == [0, 1]


def test_kl_row_cases_agree_with_a_failed_control():
    """The kl row of a claimed-deterministic backend that does not repeat: FAIL with 0/N cases, naming the control."""
    import time

    from parity.harness.report import ParityReport, render_table
    from parity.harness.run import kl_row
    row = kl_row(FIX, "kl_fakes:JitterClaimsDeterministic", PROMPTS, False, time.perf_counter())
    assert row.status == "fail" and row.failed_cases == row.cases == len(PROMPTS)
    text = render_table(ParityReport(backend="b", model=FIX, rows=[row]), columns=400)  # the divergence in its column
    line = next(ln for ln in text.splitlines() if ln.startswith("kl "))
    assert f"0/{len(PROMPTS)}" in line and line.rstrip().endswith("FAIL"), line
    assert "controls failed: b run twice differs on prompts [0, 1]" in line, line


def test_negative_control_is_forced_to_the_truths_selections_and_sized_as_intended(refs):
    """The control's effect is the continuous response (selections forced to the truth's picks), measured within
    CONTROL_RESIZE of the intended CONTROL_MARGIN x tolerance, and reported as measured vs intended."""
    from parity.harness.kl import CONTROL_MARGIN, CONTROL_RESIZE
    r32, r64 = refs
    from parity.backends import open_backend
    from parity.harness.run import perturbation

    def sized(scale=1.0):
        return open_backend("reference", FIX, perturb=("layers.0.linear_attn.out_proj.weight",
                                                       perturbation(scale=scale)))
    rep = run_kl(r32, r32, PROMPTS, greedy_tokens=0, floor_pair=(r32, r64), perturbed_b=sized, progress=False)
    nc = rep.controls["negative_control"]
    intended = CONTROL_MARGIN * rep.thresholds.tol_rel
    assert nc["ok"] and nc["forced"] and nc["intended_rel"] == pytest.approx(intended)
    assert intended / CONTROL_RESIZE <= nc["effect_rel"] <= intended * CONTROL_RESIZE, nc["detail"]
    assert "measured effect" in nc["detail"] and "intended" in nc["detail"] and "forced" in nc["detail"]


def test_negative_control_firing_only_through_a_jump_is_not_counted():
    """A control whose effect does not scale (a discrete jump, as a selection flip: here a fixed 0.3 x scale error
    at one position whatever the size) and cannot be forced is not counted as flagged: INCONCLUSIVE."""
    from parity.harness.kl import negative_control
    rng = np.random.default_rng(6)
    a = rng.normal(0, 1, (4, 64))
    th = thresholds_for("float32")

    class Jump:
        def __init__(self, scale):
            self.s = scale

        def logits(self, ids):
            out = a + self.s * 1e-2 * rng.standard_normal(a.shape) * 0   # no continuous response ...
            out[2, 5] += 0.3 + self.s                                     # ... only a jump
            return out
    nc = negative_control(lambda scale=1.0: Jump(scale), [a], [[1, 2, 3, 4]], th)
    assert not nc["ok"] and nc["inconclusive"] and not nc["forced"] and "discrete jump" in nc["detail"], nc["detail"]


def test_the_floor_does_not_depend_on_the_selected_scenarios(monkeypatch):
    """The thresholds of `parity` are measured on the KL prompts whatever --scenario selects (the floor was
    measured on 20 positions for `--scenario chunk-boundary` alone, 211 for a full run). The suites themselves
    are stubbed: only the floor each selection measures is compared."""
    import parity.harness.scenarios as S
    import parity.harness.run as R
    from parity.harness.report import ScenarioRow
    from parity.harness.run import run_parity
    monkeypatch.setattr(S, "run_scenario", lambda name, *a, **k: [])
    monkeypatch.setattr(S, "summarize_results", lambda name, *a, **k: ScenarioRow(name, 0, 0, 0.0, 0.0, None, 0.0,
                                                                                   "skip"))
    monkeypatch.setattr(R, "kl_row", lambda *a, **k: ScenarioRow("kl", 0, 0, 0.0, 0.0, None, 0.0, "skip"))
    metas = [run_parity(FIX, "reference", sel, level="ci", progress=False).meta
             for sel in (["chunk_boundary"], ["kl", "budget"], ["budget", "chunk_boundary", "snapshot_restore"])]
    from parity.prompts import load_prompts
    from reference.config import load_config
    n_kl = sum(len(p) for p in load_prompts(None, FIX, load_config(FIX).vocab_size))
    assert all(m["floor"]["positions"] > n_kl for m in metas)          # the KL prompts plus the stream, always
    assert len({(m["thresholds"]["tol_rel"], m["floor"]["positions"]) for m in metas}) == 1


def test_kl_row_of_a_backend_noisier_than_the_tolerance_is_inconclusive_and_says_why():
    import time

    from parity.harness.run import kl_row
    row = kl_row(FIX, "kl_fakes:JitterLarge", PROMPTS, False, time.perf_counter())
    assert row.status == "inconclusive", (row.status, row.first_divergence)
    assert "run-to-run spread" in row.detail and "cannot be trusted" in row.detail
    assert row.first_divergence is None or row.first_divergence.startswith("judged neither way") or \
        "run-to-run spread" in row.first_divergence


def test_kl_row_of_a_top_k_truncated_backend_shows_inf_not_nan():
    import time

    from parity.harness.report import ParityReport, render_table
    from parity.harness.run import kl_row
    row = kl_row(FIX, "kl_fakes:TopKTail", PROMPTS[:1], False, time.perf_counter())
    assert row.status == "fail" and row.worst_kl == np.inf
    line = next(ln for ln in render_table(ParityReport(backend="b", model=FIX, rows=[row]), columns=None).splitlines()
                if ln.startswith("kl "))
    assert " inf " in line and "nan" not in line, line


def test_the_truth_side_runs_one_full_forward_per_prompt_and_the_same_controls(refs, monkeypatch):
    # ONE pass of a per prompt: its forward over the prompt + b's continuation, selections logged; its prompt rows
    # are the prompt's truth and its selections there the negative control's; a's own greedy continuation is read
    # from the same rows (no prefill_last, no decode of a) while it equals b's
    from parity.backends import open_backend
    from parity.harness import kl as K
    from parity.harness.floor import logged_logits
    r32, r64 = refs
    a, b = open_backend("reference", FIX), open_backend("reference", FIX)
    passes = []
    real = a.model._run

    def counted(state, ids, logits="all", residual_out=None):
        passes.append((len(ids), logits, state.position))
        return real(state, ids, logits, residual_out)
    monkeypatch.setattr(a.model, "_run", counted)
    seen = {}
    nc_real = K.negative_control

    def nc(*args, **kw):
        seen["logs"], seen["truths"] = kw.get("logs"), args[1]
        return nc_real(*args, **kw)
    monkeypatch.setattr(K, "negative_control", nc)
    rep = run_kl(a, b, PROMPTS, greedy_tokens=3, floor_pair=(r32, r64), perturbed_b=_perturbed, progress=False)
    assert rep.passed and rep.controls_ok
    assert passes == [(len(p) + 2, "all", 0) for p in PROMPTS], passes   # three passes per prompt before
    assert seen["logs"] is not None and len(seen["logs"]) == len(PROMPTS)
    monkeypatch.setattr(a.model, "_run", real)
    for ids, g, lg, tr in zip(PROMPTS, rep.greedy, seen["logs"], seen["truths"]):
        full, ref = logged_logits(a.model, ids + g["b"][:-1])   # the very forward, its prompt part
        assert np.array_equal(tr, full[:len(ids)])
        assert all(np.array_equal(lg.moe_ids[k], ref.moe_ids[k][:len(ids)]) for k in ref.moe_ids)
        assert all(np.array_equal(lg.qsa_sel[k], ref.qsa_sel[k][:len(ids)]) for k in ref.qsa_sel)
        own = logged_logits(a.model, ids)[1]   # a forward over the prompt alone selects the same here
        assert all(np.array_equal(lg.moe_ids[k], own.moe_ids[k]) for k in own.moe_ids)
        assert all(np.array_equal(lg.qsa_sel[k], own.qsa_sel[k]) for k in own.qsa_sel)
    # the control with the logs handed over equals the control logging them itself (negative-control twin)
    th = rep.thresholds
    kept = nc_real(_perturbed, [a.logits(p) for p in PROMPTS], PROMPTS, th, truth_model=a.model, logs=seen["logs"])
    own = nc_real(_perturbed, [a.logits(p) for p in PROMPTS], PROMPTS, th, truth_model=a.model)
    assert kept == own
    assert [g["a"] for g in rep.greedy] == [g["b"] for g in rep.greedy]   # prefill_last continues as prefill


def test_the_truths_continuation_is_its_own_when_b_continues_otherwise(refs):
    # b (a perturbed reference) continues with tokens of its own: a's continuation, read from the forward over b's
    # path up to the first difference, then a's own greedy from there, equals a's greedy run alone
    from parity.backends import open_backend
    from parity.harness import kl as K
    from parity.harness.run import perturbation
    r32, r64 = refs
    b = open_backend("reference", FIX, perturb=("layers.0.linear_attn.out_proj.weight", perturbation(scale=30.0)))
    rep = run_kl(r32, b, PROMPTS, greedy_tokens=4, floor_pair=(r32, r64), perturbed_b=_perturbed, progress=False)
    assert any(g["agree"] < 4 for g in rep.greedy), rep.greedy   # the case under test: b continues otherwise
    for ids, g in zip(PROMPTS, rep.greedy):
        assert g["a"] == K._greedy(r32, ids, 4, last_only=True)[0]
