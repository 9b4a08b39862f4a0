"""reference.threads.map_rows: row blocks on threads give bitwise one pass for row-independent functions (the
norms and activations that use it), and the comparison has teeth (a row-mixing function differs)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

import reference.threads as T
from reference.blocks import norms


@pytest.fixture
def threaded(monkeypatch):
    monkeypatch.setattr(T, "host_threads", lambda: 4)   # several blocks even on a one-core runner
    monkeypatch.setattr(T, "MAP_MIN_ELEMENTS", 1 << 10)


def _one_pass(monkeypatch, fn, *a):
    monkeypatch.setattr(T, "MAP_MIN_ELEMENTS", 1 << 62)
    try:
        return fn(*a)
    finally:
        monkeypatch.setattr(T, "MAP_MIN_ELEMENTS", 1 << 10)


@pytest.mark.parametrize("shape", [(37, 2560), (5, 3, 640), (2, 4096)])
def test_norms_and_activations_are_bitwise_one_pass(threaded, monkeypatch, shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1:]).astype(np.float32)
    np.testing.assert_array_equal(norms.sigmoid(x), expit(x))
    np.testing.assert_array_equal(norms.silu(x), x * expit(x))
    for fn, args in [(norms.rms_norm, (x, w, 1e-6)), (norms.rms_norm, (x, w, 1e-6, 128)),
                     (norms.gated_rms_norm, (x, g, w, 1e-6, "silu")), (norms.gated_rms_norm, (x, g, w, 1e-6, "sigmoid"))]:
        got = fn(*args)
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(got, _one_pass(monkeypatch, fn, *args))


def test_a_row_mixing_function_is_not_one_pass_negative_control(threaded):
    # map_rows' contract is row independence; a function that mixes rows shows the blocks are really cut
    x = np.arange(64 * 32, dtype=np.float64).reshape(64, 32)
    assert not np.array_equal(T.map_rows(lambda a: a - a.mean(), x), x - x.mean())


def test_small_arrays_and_one_thread_run_in_one_pass(monkeypatch):
    calls = []
    monkeypatch.setattr(T, "host_threads", lambda: 1)
    T.map_rows(lambda a: calls.append(a.shape) or a, np.zeros((64, 1 << 15), np.float32))
    assert calls == [(64, 1 << 15)]
