"""A located cause is a real divergence.

* a tap counts as diverged only beyond the run's multiple of its own floor measured on the same history
  (saved beside the archives as profile.toml; ``taps diff`` with it, or with the bundled default, agrees),
  and only when it is first beyond tolerance at or before the first failing logit position;
* no internal tap beyond tolerance: the cause is the returned logits / the output layer;
* ragged ``prefill_batch``: the failing request's taps are recorded alone (rows of requests sharing
  positions no longer mix);
* the QSA bound counts visible tokens (position p sees p + 1): the regime label and ``--below-bound``.

Test backends (copied from the testers' /work/tb/mybe.py, narrowed): wrappers around the reference that perturb
what they return, and the engine (CPU) with only ``lm_head.weight`` perturbed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.backends.reference import ReferenceBackend
from parity.harness.causes import root_cause
from parity.harness.scenarios import cases_for
from parity.harness.scenarios.common import Case, TruthCache, sizes, token_stream
from parity.harness.scenarios.runner import run_case
from parity_fakes import _Wrap, reference_capabilities
from taps.diff import diff_archives, load_profile

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "fixtures" / "tiny"
_CACHE: dict = {}


def _truth() -> TruthCache:
    if "truth" not in _CACHE:
        from parity.backends import truth_model
        _CACHE["truth"] = TruthCache(truth_model(TINY))
    return _CACHE["truth"]


def _th():
    """The thresholds `qwen4exp parity` measures for a float32 backend on tiny (with its per-tap profile)."""
    if "th" not in _CACHE:
        from parity.harness.floor import thresholds_for_run
        be = ReferenceBackend.open(TINY)
        _CACHE["th"] = thresholds_for_run(be.model.weights, be)[0]
    return _CACHE["th"]


def _case(scenario: str, prefix: str, config) -> Case:
    found = [c for c in cases_for(scenario, config, "ci") if c.name.startswith(prefix)]
    assert found, f"no {scenario} case starting with {prefix!r}"
    return found[0]


def _noise(row, rel, seed):
    rng = np.random.default_rng(seed)
    return row + rel * np.abs(row).max() * rng.standard_normal(row.shape).astype(row.dtype)


class Wrap(_Wrap):
    """The reference, its returned rows passed through ``_fix(rows, start, op)`` (tests/parity_fakes.py
    ``_Wrap``); declares what the reference does but determinism and batch invariance, passes its state arrays,
    fork and last logits through."""

    name = "test:Wrap"
    capabilities = reference_capabilities("deterministic", "batch_invariant")
    passthrough = ("state_arrays", "fork", "last_logits")


class NoiseAtPos(Wrap):
    """1e-3 x max|logit| noise in the RETURNED logits at absolute position 5, in every op (after every tap)."""

    def _fix(self, rows, start, op):
        i = 5 - start
        if 0 <= i < rows.shape[0]:
            rows[i] = _noise(rows[i], 1e-3, 0)
        return rows


class VerifyWrong(Wrap):
    """The last verify row returned with 1e-3 x max|logit| noise."""

    def _fix(self, rows, start, op):
        if op == "verify":
            rows[-1] = _noise(rows[-1], 1e-3, start)
        return rows


class BatchMixesRequests(Wrap):
    """A native ragged prefill_batch whose first request's rows are wrong whenever it shares the call."""

    def prefill_batch(self, hs, id_lists, chunk_size=None):
        outs = [np.array(o, copy=True) for o in self.ref.prefill_batch(hs, id_lists, chunk_size=chunk_size)]
        if len(hs) > 1:
            outs[0] = _noise(outs[0], 1e-3, 1)
        return outs


def _weight_fault(name: str, rel: float):
    def fn(w):
        rng = np.random.default_rng(1)
        return w + rel * np.sqrt((w ** 2).mean()) * rng.standard_normal(w.shape).astype(np.float32)
    return (name, fn)


def _engine_lm_head_fault():
    """The project's own engine (CPU) with only lm_head.weight perturbed (3e-3 of its rms)."""
    from parity.backends.engine import EngineBackend
    return EngineBackend.open(TINY, perturb=_weight_fault("lm_head.weight", 3e-3))


def _agree_with_taps_diff(r) -> None:
    """The saved archives: `taps diff` agrees with the location, with the saved profile and with the default."""
    truth, backend = r.archives[:2]
    d = Path(truth).parent
    prof = load_profile(d / "profile.toml")
    for p in (prof, "fp32"):
        assert diff_archives(truth, backend, p, force=True).agree, (r.label, p)


@pytest.mark.parametrize("prefix", ["chunk_gdn-chunk_64", "chunk_one_1", "ragged_prefill_batch"])
def test_noise_in_the_returned_logits_is_located_there_not_at_noise_level_taps(prefix, tmp_path):
    """Before: chunk_gdn-chunk_64 -> layers.4.linear_attn.norm.out at position 14, chunk_one_1 -> an HC
    injection weight at position 62 (both after the failing position 5, max_rel 3e-4 / 1e-6), ragged ->
    embed_tokens.out at position 0 (the four requests' rows mixed)."""
    be = NoiseAtPos.open(TINY)
    r = run_case("chunk_boundary", _case("chunk_boundary", prefix, be.config), be, _truth(), thresholds=_th(),
                 archive_dir=tmp_path)
    assert r.status == "fail" and "first failing position 5" in r.failure, r.failure
    assert "first divergence" not in r.divergence and "error entered" not in r.divergence, r.divergence
    assert r.root_cause["tap"] == "returned logits" and r.root_cause["position"] == 5, r.root_cause
    # the operation that returned the failing rows (before: a ragged batch's was "check")
    want = "prefill_batch" if prefix == "ragged_prefill_batch" else "chunked prefill"
    assert r.root_cause["operation"] == want, r.root_cause
    _agree_with_taps_diff(r)


@pytest.mark.parametrize("prefix", ["chunk_inside-compress-block_5", "ragged_prefill_batch"])
def test_engine_lm_head_fault_is_located_at_the_logits(prefix, tmp_path):
    """Before: 4 of 6 root causes were inner GDN taps (engine reduction-order noise) or embed_tokens.out."""
    be = _engine_lm_head_fault()
    r = run_case("chunk_boundary", _case("chunk_boundary", prefix, be.config), be, _truth(), thresholds=_th(),
                 archive_dir=tmp_path)
    assert r.status == "fail", (r.status, r.failure)
    assert r.root_cause["tap"] == "logits", r.divergence
    assert "first divergence logits at position" in r.divergence, r.divergence


def test_inner_weight_fault_in_a_ragged_batch_is_located_at_its_block(tmp_path):
    """Negative control of the per-request recording: a real fault in layer 3's GDN output projection is named
    there (before: embed_tokens.out at position 0, every tap diverged from mixed rows)."""
    be = ReferenceBackend.open(TINY, perturb=_weight_fault("layers.3.linear_attn.out_proj.weight", 1e-2))
    r = run_case("chunk_boundary", _case("chunk_boundary", "ragged_prefill_batch", be.config), be, _truth(),
                 thresholds=_th(), archive_dir=tmp_path)
    assert r.status == "fail"
    assert r.root_cause["tap"].startswith("layers.3.linear_attn."), r.divergence
    assert r.root_cause["position"] == 0, r.root_cause


def test_a_batching_fault_of_prefill_batch_is_named_batching():
    be = BatchMixesRequests.open(TINY)
    r = run_case("chunk_boundary", _case("chunk_boundary", "ragged_prefill_batch", be.config), be, _truth(),
                 thresholds=_th())
    assert r.status == "fail"
    assert r.divergence.startswith("batching: sequence ragged0-len80 is correct when prefilled alone"), r.divergence
    # the wrong rows leave the batched call after every tap: in the batch, the returned logits differ; the cause
    # is the batching itself (one cause per tap: a batching divergence is the batching cause)
    assert "in the batch, " in r.divergence and "returned logits" in r.divergence, r.divergence
    assert r.root_cause["tap"] == "batching", r.root_cause
    assert r.root_cause["operation"] == "prefill_batch", r.root_cause   # before: "check"


def test_root_cause_names_the_prefill_batch_operation():
    """Each wording of a prefill_batch failure (the Run's, chunked, the self-consistency suite's) names the
    operation prefill_batch, also behind a batching divergence (before: "check", and "batched decode" for
    batching); a batched decode's batching failure is still "batched decode" (negative control)."""
    cfg = ReferenceBackend.open(TINY).config
    err = ": seq s: logit error 1 of the logit scale > 1e-5 (first failing position 5, worst 5)"
    for failure, want in (("ragged prefill_batch of 2 requests (lengths [12, 3])" + err, "prefill_batch"),
                          ("ragged prefill_batch of 2 requests (lengths [12, 3]) in chunks of 4" + err,
                           "chunked prefill_batch"),
                          ("ragged prefill_batch request 0 (length 14) vs alone: rows differ", "prefill_batch")):
        for divergence in ("returned logits differ from the backend's own logits tap, first at position 5",
                           "batching: sequence s is correct when prefilled alone (its own prefill_batch call)"):
            rc = root_cause(failure, divergence, cfg)
            # the operation is named; the cause id is the tap alone (one bug is one cause across operations)
            assert rc["operation"] == want and rc["id"] == rc["tap"], (failure, divergence, rc)
    d = root_cause("decode batch of 3: seq b0: logit error 1 at position 20", "batching: sequence b0 is correct "
                   "when decoded alone", cfg)
    assert d["tap"] == "batching" and d["operation"] == "batched decode", d
    assert root_cause("prefill 12 tokens" + err, "returned logits differ", cfg)["operation"] == "prefill"


@pytest.mark.parametrize("prefix", ["fork_after_rollback", "accept_each_j_all"])
def test_verify_fault_is_located_at_the_returned_logits_not_in_earlier_state(prefix):
    """Before: fork_after_rollback -> layers.1.ple.gate at position 10 (max_rel 8e-4) while the fault is at 12."""
    be = VerifyWrong.open(TINY)
    r = run_case("speculative_rollback", _case("speculative_rollback", prefix, be.config), be, _truth(),
                 thresholds=_th())
    assert r.status == "fail"
    assert "error entered" not in r.divergence and "first divergence" not in r.divergence, r.divergence
    assert r.root_cause["tap"] == "returned logits", r.root_cause


def test_regime_counts_visible_tokens_at_the_bound():
    """Position p sees p + 1 tokens: bound - 1 is the last position below the QSA bound (tiny: bound 11)."""
    cfg = ReferenceBackend.open(TINY).config
    b = sizes(cfg).bound
    f = "decode batch of 1: seq a: logit error 1 of the logit scale > 1e-5 (first failing position {p}, worst {p})"
    below = root_cause(f.format(p=b - 1), "returned logits differ ...", cfg)
    past = root_cause(f.format(p=b), "returned logits differ ...", cfg)
    assert below["regime"] == "below the QSA bound" and past["regime"] == "past the QSA bound"
    # the op's start named first in a description does not decide: the first failing position does
    v = root_cause(f"verify 4 drafted tokens at position {b - 3}: seq a: logit error 1 (first failing position {b}, "
                   f"worst {b})", "returned logits differ from the backend's own logits tap ..., first at position "
                   f"{b}", cfg)
    assert v["regime"] == "past the QSA bound" and v["position"] == b


def _dense(model_path=TINY):
    """The reference with QSA selection off (tests/parity_fakes.py DenseAttention: right at and below the bound,
    wrong past it), declaring neither determinism nor batch invariance."""
    from parity_fakes import DenseAttention
    be = DenseAttention.open(model_path)
    be.capabilities = {**be.capabilities, "deterministic": False, "batch_invariant": False}
    return be


def test_below_bound_confines_to_bound_visible_tokens_and_prefill_batch_too():
    be = _dense()
    b = sizes(be.config).bound

    def prefill(L):
        def fn(run):
            ids = token_stream(run.config, L, seed=3)
            run.prefill(run.new("a"), ids)
        return Case(f"prefill_{L}", fn)

    def ragged(L):
        def fn(run):
            run.prefill_batch([run.new("a"), run.new("b")], [token_stream(run.config, L, seed=4), [1, 2]])
        return Case(f"ragged_{L}", fn)
    th = _th()
    r_at = run_case("t", prefill(b), be, _truth(), thresholds=th, below_bound=True)
    assert r_at.status == "pass", (r_at.failure, r_at.divergence)   # b visible tokens: dense == QSA
    r_past = run_case("t", prefill(b + 1), be, _truth(), thresholds=th, below_bound=True)
    assert r_past.status == "skip" and f"position {b} ({b + 1} visible tokens)" in r_past.failure, r_past.failure
    assert run_case("t", ragged(b), be, _truth(), thresholds=th, below_bound=True).status == "pass"
    assert run_case("t", ragged(b + 1), be, _truth(), thresholds=th, below_bound=True).status == "skip"
    # negative control: unconfined, the dense backend fails one token past the bound
    r = run_case("t", prefill(b + 1), be, _truth(), thresholds=th, locate_on_fail=False)
    assert r.status == "fail" and f"first failing position {b}" in r.failure, r.failure


def test_dense_attention_passes_the_budget_scenario_below_the_bound_and_fails_past_it():
    """--below-bound on a backend that attends every token: every case it runs passes, the ones reaching past the
    bound are skipped with the visible-token reason; unconfined, the bound cases fail."""
    be = _dense()
    prefixes = ("prefill_far-below", "prefill_bound-1", "prefill_bound_", "prefill_bound+1", "decode_across_bound")
    cases = [_case("budget", p, be.config) for p in prefixes]
    th = _th()
    conf = [run_case("budget", c, be, _truth(), thresholds=th, below_bound=True, locate_on_fail=False) for c in cases]
    assert all(r.status in ("pass", "skip") for r in conf), [(r.case, r.status, r.failure) for r in conf]
    assert [r.status for r in conf].count("pass") >= 1
    assert all("visible tokens" in r.failure for r in conf if r.status == "skip")
    free = [run_case("budget", c, be, _truth(), thresholds=th, locate_on_fail=False) for c in cases]
    assert any(r.status == "fail" for r in free), [(r.case, r.status) for r in free]


def test_below_bound_confines_the_kl_row_too():
    """Before: ``--below-bound`` confined the scenarios only; the kl row judged the whole prompts (32..50 tokens on
    tiny, bound 11), so a backend with right dense attention failed it (position 25). Now the prompts and the
    greedy continuation are cut so the last judged position is bound - 1, and the row says so."""
    from parity.harness.run import kl_row, run_parity
    b = sizes(ReferenceBackend.open(TINY).config).bound
    rep = run_parity(TINY, "parity_fakes:DenseAttention", ["kl"], level="ci", progress=False, below_bound=True)
    row = rep.rows[0]
    assert row.status == "pass" and row.cases == 5, (row.status, row.first_divergence)
    assert f"positions 0..{b - 1} at most ({b} visible tokens)" in row.detail, row.detail
    from parity.harness.report import skip_notes   # said under the table too, as the suites' narrowings are
    assert skip_notes(rep) == [f"kl: narrowed: {row.skips[0]['narrowed']}"] and "--below-bound" in skip_notes(rep)[0]
    # negative control: unconfined, the same backend fails the kl row past the bound
    free = kl_row(TINY, "parity_fakes:DenseAttention", None, False, 0.0)
    assert free.status == "fail" and free.failed_cases >= 1, free.detail


def test_below_bound_kl_row_still_judges_its_last_position():
    """Negative control of the confinement: a fault in the returned logits from position 10 (= bound - 1 on tiny,
    the last position below the bound) still fails the confined kl row, at that position."""
    from parity.harness.run import kl_row
    assert sizes(ReferenceBackend.open(TINY).config).bound - 1 == 10
    row = kl_row(TINY, "parity_fakes:PerturbAfter10", None, False, 0.0, below_bound=True)
    assert row.status == "fail" and "at position 10" in row.detail, row.detail
    assert "confined below the QSA bound" in row.detail, row.detail


def test_dense_attention_selection_of_another_width_is_located_where_it_differs():
    """The dense backend records its selected_blocks padded to every complete block (3 wide on tiny at 12 tokens,
    the truth block_topk = 2). Before: "shape differs", first divergence at position 0. Now the rows are compared
    as sets of valid ids: they first differ at position 11 (the bound: the first position with more complete
    blocks than block_topk), where the logits fail too."""
    be = _dense()
    b = sizes(be.config).bound

    def fn(run):
        run.prefill(run.new("a"), token_stream(run.config, b + 1, seed=3))
    r = run_case("t", Case("dense_past_bound", fn), be, _truth(), thresholds=_th())
    assert r.status == "fail" and f"first failing position {b}" in r.failure, r.failure
    assert (f"first divergence layers.2.self_attn.indexer.selected_blocks at position {b} " in r.divergence
            and "last agreeing layers.2.self_attn.indexer.block_scores" in r.divergence), r.divergence
    # the two recordings' widths really differ (what the old rule misread as a shape mismatch)
    from parity.backends import truth_model
    from taps.recorder import Recorder
    ids = token_stream(be.config, 14, seed=0)
    with be.taps(None, include=["*indexer.selected_blocks"]) as rb:
        be.logits(ids)
    with Recorder(None, include=["*indexer.selected_blocks"]) as rt:
        truth_model(TINY).forward(ids)
    A, B = rt.archive(), rb.archive()
    tap = "layers.2.self_attn.indexer.selected_blocks"
    assert np.asarray(A.get(tap)).shape[1] != np.asarray(B.get(tap)).shape[1]
    rep = diff_archives(A, B, "fp32", force=True)
    assert rep.first_divergence == tap and rep.result(tap).first_position == b, rep.result(tap).note
