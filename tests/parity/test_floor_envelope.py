"""The float32 floor is an envelope over legitimate float32 evaluation orders (reference.order), the tap
tolerances follow the same rule, and every entry point (CLI parity, kl, the pytest plugin) derives one limit."""
from __future__ import annotations

import numpy as np
import pytest

from fixture_helpers import fixture_dir

FIX = fixture_dir("tiny")


@pytest.fixture(scope="module")
def weights():
    from parity.backends import load_weights
    return load_weights(FIX)


def _stream(cfg, n=24):
    from parity.harness.scenarios.common import token_stream
    return token_stream(cfg, n, seed=3)


def test_blocked_matmul_is_the_same_product_in_another_rounding_order():
    from reference.order import blocked_matmul_t
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 70)).astype(np.float32)
    w = rng.standard_normal((9, 70)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    for block in (1, 4, 16, 64, 100):   # a last partial block and a block wider than K included
        got = blocked_matmul_t(x, w, block)
        assert got.dtype == np.float32 and got.shape == (5, 9)
        # float32 rounding only: K = 70 terms of |x w| ~ 1 each, so |error| <= 70 u sum|x w| (gamma_K bound)
        bound = 70 * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w.T.astype(np.float64)))
        assert np.all(np.abs(got - exact) <= bound)


def test_an_evaluation_order_changes_the_float32_rounding_only_and_is_restored(weights):
    from reference.errors import InputError
    from reference.model import ReferenceModel
    from reference.order import ALTERNATIVES, EvalOrder, NATIVE, current, evaluation_order
    ids = _stream(weights.config)
    m32, m64 = ReferenceModel(weights, dtype=np.float32), ReferenceModel(weights, dtype=np.float64)
    l64 = m64.forward(ids)
    native = m32.forward(ids)
    scale = l64.std(axis=-1, keepdims=True)
    for o in ALTERNATIVES:
        with evaluation_order(o):
            assert current() is o
            alt = m32.forward(ids)
        assert current() is NATIVE
        assert not np.array_equal(alt, native), o.name                 # the mechanism is active ...
        # ... and changes nothing but float32 rounding: far below a useful fault (1e-2 of the scale)
        assert np.max(np.abs(alt - l64) / scale) < 1e-4, o.name
    with pytest.raises(RuntimeError):
        with evaluation_order(ALTERNATIVES[0]):
            raise RuntimeError("inside")
    assert current() is NATIVE                                          # restored on an exception too
    with pytest.raises(InputError, match="gdn"):
        EvalOrder("bad", gdn="sideways")
    with pytest.raises(InputError, match="EvalOrder"):
        with evaluation_order("split-k4"):
            pass


def test_the_float32_floor_is_the_envelope_over_the_orders(weights):
    from parity.harness.floor import FLOOR_ORDERS, floor_prompts, measure_floor
    from parity.prompts import load_prompts
    cfg = weights.config
    fl = measure_floor(weights, floor_prompts(cfg, load_prompts(None, FIX, cfg.vocab_size)))
    assert set(fl.by_order) == {o.name for o in FLOOR_ORDERS} and len(FLOOR_ORDERS) >= 3
    assert fl.logit_rel == max(fl.by_order.values()) == fl.f32_logit_rel
    # on tiny another order's noise exceeds the native one's (one order alone would be a tighter, wrong floor)
    assert fl.logit_rel > fl.by_order["native"]
    assert fl.to_json()["by_order"] == fl.by_order


def test_tap_tolerances_use_the_same_envelope(weights, monkeypatch):
    import parity.harness.floor as F
    from reference.order import NATIVE
    ids = _stream(weights.config, 20)
    env = F.tap_floor_profile(weights, ids).floors
    monkeypatch.setattr(F, "FLOOR_ORDERS", (NATIVE,))
    one = F.tap_floor_profile(weights, ids).floors
    assert env.keys() == one.keys() and env
    assert all(env[k][0] >= one[k][0] and env[k][1] >= one[k][1] for k in env)
    assert any(env[k][0] > one[k][0] for k in env)      # some tap's floor is raised by another order


def test_cli_kl_and_plugin_derive_one_limit(weights, monkeypatch):
    """`parity` (run_parity), `kl` (run_kl's own floor) and the pytest plugin (parity.suites.plugin) judge one
    model + backend with the same limit (the plugin used the nominal one before). Scenario suites are stubbed:
    only the thresholds each entry point derives are compared."""
    import parity.harness.run as R
    import parity.harness.scenarios as S
    from parity.backends import open_backend
    from parity.harness.floor import floor_prompts, measure_floor, stores_of
    from parity.harness.kl import thresholds_for
    from parity.harness.report import ScenarioRow
    from parity.prompts import load_prompts
    from parity.suites.plugin import thresholds_of
    monkeypatch.setattr(S, "run_scenario", lambda name, *a, **k: [])
    monkeypatch.setattr(S, "summarize_results", lambda name, *a, **k: ScenarioRow(name, 0, 0, 0.0, 0.0, None, 0.0,
                                                                                   "skip"))
    meta = R.run_parity(FIX, "reference", ["budget"], level="ci", progress=False).meta
    be = open_backend("reference", FIX)
    try:
        plugin = thresholds_of(FIX, weights, be).tol_rel
        ps = load_prompts(None, FIX, weights.config.vocab_size)
        kl = thresholds_for("float32", measure_floor(weights, floor_prompts(weights.config, ps), stores_of(be))).tol_rel
    finally:
        be.close() if hasattr(be, "close") else None
    assert meta["thresholds"]["tol_rel"] == plugin == kl
    assert meta["smallest_fault_rel"] == plugin          # the report states the run's resolution


def test_the_report_states_the_smallest_fault_it_can_catch():
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    rep = ParityReport("reference", "tiny")
    rep.rows.append(ScenarioRow("budget", 1, 0, 0.0, 0.0, None, 0.1, "pass"))
    rep.meta.update(smallest_fault_rel=8.4e-5, useful_fault_rel=1e-2)
    text = render_table(rep)
    assert "smallest fault this run can catch moves a logit by 8.4e-05 of the logit scale" in text
    assert rep.to_json()["meta"]["smallest_fault_rel"] == 8.4e-5


def _one_output_split_k(descending: bool = True):
    """The split-K order written as the plainest loop, one output at a time (the oracle of the kernel's
    four-output tasks); ``descending=False``: the partials from the first block to the last (another order)."""
    from numba import njit

    @njit(fastmath={'contract'})
    def k(xt, w, block, out):
        K, N = xt.shape
        nb = (K + block - 1) // block
        for o in range(w.shape[0]):
            acc = np.zeros(N, dtype=xt.dtype)
            part = np.empty(N, dtype=xt.dtype)
            for s in range(nb):
                bi = nb - 1 - s if descending else s
                part[:] = 0
                for j in range(bi * block, min(K, (bi + 1) * block)):
                    for t in range(N):
                        part[t] += xt[j, t] * w[o, j]
                for t in range(N):
                    acc[t] += part[t]
            for t in range(N):
                out[t, o] = acc[t]
    return k


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_k_kernel_is_bitwise_the_one_output_loop_and_tells_orders_apart(dtype):
    from reference.numba_kernels import split_k_matmul_t
    rng = np.random.default_rng(3)
    oracle, forward = _one_output_split_k(True), _one_output_split_k(False)
    differs = False
    for N, O, K in ((1, 1, 7), (5, 2, 70), (37, 3, 33), (19, 53, 130), (64, 9, 257)):  # O % 4 = 1, 2, 3, 0 ...
        x = rng.standard_normal((N, K)).astype(dtype)
        w = rng.standard_normal((O, K)).astype(dtype)
        xt = np.ascontiguousarray(x.T)
        for block in (1, 4, 16, 300):
            got = split_k_matmul_t(x, w, block)
            want = np.empty((N, O), dtype)
            oracle(xt, w, block, want)
            assert got.dtype == dtype and np.array_equal(got, want), (N, O, K, block)
            other = np.empty((N, O), dtype)
            forward(xt, w, block, other)
            differs |= not np.array_equal(got, other)
    assert differs   # negative control: the bitwise check sees an accumulation in the other block order


def test_a_prompt_equal_to_the_floor_stream_is_measured_once(weights):
    from parity.harness.floor import floor_prompts, measure_floor
    cfg = weights.config
    stream = floor_prompts(cfg, None)[-1]
    assert floor_prompts(cfg, [stream]) == [stream]
    other = list(stream)
    other[-1] = (other[-1] + 1) % cfg.vocab_size   # one token apart: a prompt of its own (negative control)
    assert floor_prompts(cfg, [other]) == [other, stream]
    # the repeat measured nothing new: the same floor with and without it
    once, twice = measure_floor(weights, [stream]), measure_floor(weights, [stream, stream])
    assert (once.logit_rel, once.positions * 2) == (twice.logit_rel, twice.positions)


def test_a_float32_forward_gives_the_same_bits_whatever_order_ran_before_it(weights):
    # an alternative order caches the lm_head's upcast; the native order must not take another path because of it
    # (it did: the floor's native figure then depended on the prompt's place in the list)
    from parity.harness.floor import ALTERNATIVES, SelectionLog, floor_prompts, forced_logits, logged_logits
    from reference.model import ReferenceModel
    from reference.order import evaluation_order
    ids = floor_prompts(weights.config, None)[-1]
    _, log = logged_logits(ReferenceModel(weights, dtype=np.float64), ids)
    fresh = forced_logits(ReferenceModel(weights, dtype=np.float32), ids, log, SelectionLog())
    used = ReferenceModel(weights, dtype=np.float32)
    with evaluation_order(ALTERNATIVES[0]):
        alt = forced_logits(used, ids, log, SelectionLog())
    assert not np.array_equal(alt, fresh)   # the alternative is another rounding sequence (else this proves nothing)
    np.testing.assert_array_equal(forced_logits(used, ids, log, SelectionLog()), fresh)


def test_tap_floor_of_the_judged_rows_covers_a_correct_decode_step():
    """A decode step is judged at its one row. The tap floor of the whole history (a relative error over all rows)
    can sit below that row's own float32 error, where error has accumulated; the floor of the judged rows is the same
    rule applied to what is compared. The reference's own decode of the last row (a correct float32 evaluation)
    must then sit within the multiple x floor at every activation tap; and the rows' floors never fall below the
    whole history's (the join only widens where a subset is judged). Negative control: a 1e-4 relative fault in
    one tap of that row is named."""
    from parity.harness.floor import tap_floor_profile
    from parity.prompts import load_prompts
    from reference.checkpoint import Checkpoint
    from reference.config import load_config
    from reference.model import ReferenceModel
    from reference.paths import resolve_model
    from reference.session import Session
    from taps.archive import MemoryArchive
    from taps.diff import diff_archives
    from taps.recorder import Recorder

    path = resolve_model("tiny")
    cfg = load_config(path)
    ids = [int(t) for t in load_prompts(None, path, cfg.vocab_size, cfg.max_position_embeddings)[1]]
    w = Checkpoint.open(str(path))
    last = len(ids) - 1
    whole = tap_floor_profile(w, ids, None, 8.0)
    rows = tap_floor_profile(w, ids, None, 8.0, rows=[last])
    for name, (rel, at) in whole.floors.items():
        assert rows.floors[name][0] >= rel and rows.floors[name][1] >= at, name
    m = ReferenceModel(w, dtype=np.float32)
    with Recorder(None, positions=[last]) as rec:
        m.forward(ids)
    truth = rec.archive()
    sess = Session(m)
    sess.prefill(ids[:-1])
    with Recorder(None, positions=[last]) as rec:
        sess.decode(ids[-1])
    dec = rec.archive()
    assert diff_archives(truth, dec, profile=rows, force=True).first_divergence is None
    name = next(n for n in dec.names() if n.endswith("linear_attn.norm.out"))
    data = {n: [(dec.positions(n), dec.get(n) * (1 + 1e-4) if n == name else dec.get(n))] for n in dec.names()}
    bad = MemoryArchive(dec.manifest, data)
    assert diff_archives(truth, bad, profile=rows, force=True).first_divergence == name
