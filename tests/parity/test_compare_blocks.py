"""compare_logits over row blocks on threads: bitwise the one-pass comparison, every field, every row kind."""
import dataclasses

import numpy as np
import pytest

from parity.harness import metrics as M


def _one_pass(a, b):
    """The comparison as one pass over the whole arrays (the formula compare_logits blocks), written out here as
    the oracle: exp recomputed inside the KL, top-1 from its own top-k call."""
    la, lb = M.log_softmax(a), M.log_softmax(b)
    pa, pb = np.exp(la), np.exp(lb)
    kl_ab, kl_ba = M._kl_rows(la, lb), M._kl_rows(lb, la)
    kl_ab = np.where(np.isnan(kl_ab), np.nan, np.maximum(kl_ab, 0.0))
    kl_ba = np.where(np.isnan(kl_ba), np.nan, np.maximum(kl_ba, 0.0))
    ta, tb = M.topk_sets(a, 1)[:, 0], M.topk_sets(b, 1)[:, 0]
    t5a, t5b = M.topk_sets(a, 5), M.topk_sets(b, 5)
    overlap = np.array([len(set(x.tolist()) & set(y.tolist())) / t5a.shape[1] for x, y in zip(t5a, t5b)])
    rows = np.arange(a.shape[0])
    a64 = a.astype(np.float64)
    err, off = M.offset_free_error(a64, b)
    with np.errstate(invalid="ignore"):
        gap = a64[rows, ta] - a64[rows, tb]
    return M.LogitComparison(kl_ab, kl_ba, ta == tb, overlap, pb[rows, ta] - pa[rows, ta], err, M.logit_scale(a),
                             gap, off, np.full(a.shape[0], M.kl_rounding_floor(a.shape[1])))


def _logits(T=70, V=1000, seed=0):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    b = a + (rng.standard_normal((T, V)) * 1e-3).astype(np.float32)
    a[3, [10, 20]] = a[3].max() + 1.0          # a tie at the top-1 (the lower id wins)
    b[3, [10, 20]] = a[3, 10]
    a[5, [7, 8, 9, 11, 12, 13]] = 50.0         # a tie across the top-5 cut
    b[8, 4] = np.nan                           # a nan row on one side
    a[9, :5] = -np.inf                         # tokens one side excludes
    b[10, :] = b[10, 0]                        # a uniform row (scale 0 on b)
    return a, b


def _fields_equal(x, y):
    return {f.name: np.array_equal(getattr(x, f.name), getattr(y, f.name), equal_nan=True)
            for f in dataclasses.fields(M.LogitComparison)}


@pytest.mark.parametrize("rows_per_block,threads", [(1, "1"), (3, "2"), (16, "4"), (1000, "2")])
def test_blocked_compare_is_bitwise_the_one_pass_comparison(monkeypatch, rows_per_block, threads):
    a, b = _logits()
    monkeypatch.setattr(M, "COMPARE_BLOCK_ELEMENTS", rows_per_block * a.shape[1])
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    got, want = M.compare_logits(a, b), _one_pass(a, b)
    assert got.n == a.shape[0]
    assert all(_fields_equal(got, want).values()), _fields_equal(got, want)


def test_blocked_compare_places_each_row_negative_control(monkeypatch):
    # a fault in one row shows in that row only, at its own position (a block concatenated out of order, or a
    # block compared against another block's rows, would move or spread it)
    a, b = _logits(seed=1)
    monkeypatch.setattr(M, "COMPARE_BLOCK_ELEMENTS", 4 * a.shape[1])
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    clean = M.compare_logits(a, b)
    bad = b.copy()
    bad[41, 17] += 5.0
    hit = M.compare_logits(a, bad)
    moved = np.nonzero(~np.isclose(hit.max_abs_err, clean.max_abs_err, equal_nan=True))[0]
    assert moved.tolist() == [41]
    swapped = M.LogitComparison.concat([M.compare_logits(a[4:8], b[4:8]), M.compare_logits(a[:4], b[:4])])
    assert not all(_fields_equal(swapped, _one_pass(a[:8], b[:8])).values())   # the oracle sees an order fault


def test_host_threads_keeps_to_omp_num_threads(monkeypatch):
    from reference.threads import host_threads
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert host_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert host_threads() >= 1


def test_tap_error_stats_in_blocks_are_the_whole_array_figures(monkeypatch):
    # the per-tap floor's sums over row blocks on threads: the whole-array float64 figures to float64 rounding,
    # and bitwise the same for any thread count (the blocks are fixed, summed in their order)
    from parity.harness import floor as F
    rng = np.random.default_rng(4)
    a = rng.standard_normal((37, 3, 50))
    b = a + rng.standard_normal(a.shape) * 1e-6
    a[2, 1, 7], b[5, 0, 3], a[9, 2, 9] = np.nan, np.inf, -np.inf
    fin = np.isfinite(a) & np.isfinite(b)
    d, aa = np.where(fin, b - a, 0.0), np.where(fin, a, 0.0)
    want = (np.sum(aa * aa), np.sum(d * d), np.max(np.abs(d)))
    monkeypatch.setattr(F, "_TAP_BLOCK_ELEMENTS", 150)      # 1 row of 150 values per block: 37 blocks
    got = {}
    for thr in ("1", "3"):
        monkeypatch.setenv("OMP_NUM_THREADS", thr)
        got[thr] = F._tap_err_stats(a, b)
    assert got["1"] == got["3"]
    sa, sd, md, anyf = got["1"]
    assert anyf and md == want[2]
    assert abs(sa - want[0]) <= 1e-12 * want[0] and abs(sd - want[1]) <= 1e-12 * want[1]
    bad = b.copy()
    bad[30, 2, 40] += 1e-3                                  # negative control: a fault in the last blocks counts
    assert F._tap_err_stats(a, bad)[2] >= 0.9e-3
    assert F._tap_err_stats(np.zeros((0, 4)), np.zeros((0, 4))) == (0.0, 0.0, 0.0, False)
    assert F._tap_err_stats(np.full(3, np.nan), np.ones(3))[3] is False


def test_a_large_tap_is_copied_to_float64_on_threads_exactly(monkeypatch):
    from parity.harness.floor import _float64_copy
    rng = np.random.default_rng(8)
    a = rng.standard_normal((1100, 4000)).astype(np.float32)   # 4.4M values: the threaded path
    a[7, 3], a[900, 1] = np.nan, -np.inf
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    b = _float64_copy(a)
    assert b.dtype == np.float64 and np.array_equal(b, a.astype(np.float64), equal_nan=True)
    b[0, 0] = 123.0                                              # a copy: the tap is never aliased
    assert a[0, 0] != 123.0
    small = np.arange(5.0)
    c = _float64_copy(small)
    c[0] = 9.0
    assert small[0] == 0.0
