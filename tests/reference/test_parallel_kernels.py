"""The reference kernels that run their independent problems on all Numba threads (the delta rule's value heads, the
chunked rule's triangular systems) are bitwise their one-thread loops: the same arithmetic in the same order."""
import numpy as np
import pytest
from numba import njit


@njit(fastmath=False)
def _delta_serial(q, k, v, g, beta, state, out):
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    dv = v.shape[2]
    rep = Hv // Hk
    for h in range(Hv):
        kh = h // rep
        S = state[h]
        for t in range(T):
            decay = np.exp(g[t, h])
            for i in range(dk):
                for j in range(dv):
                    S[i, j] *= decay
            b = beta[t, h]
            for j in range(dv):
                acc = 0.0
                for i in range(dk):
                    acc += S[i, j] * k[t, kh, i]
                delta = (v[t, h, j] - acc) * b
                for i in range(dk):
                    S[i, j] += k[t, kh, i] * delta
            for j in range(dv):
                acc = 0.0
                for i in range(dk):
                    acc += S[i, j] * q[t, kh, i]
                out[t, h, j] = acc


@njit
def _solve_serial(A, B, X):
    n_batch, C, _ = A.shape
    m = B.shape[2]
    for h in range(n_batch):
        for i in range(C):
            for j in range(m):
                acc = B[h, i, j]
                for t in range(i):
                    acc -= A[h, i, t] * X[h, t, j]
                X[h, i, j] = acc


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_delta_rule_over_heads_on_threads_is_the_serial_loop(dtype):
    from reference.numba_kernels import delta_rule_recurrent
    rng = np.random.default_rng(5)
    T, Hk, Hv, dk, dv = 9, 2, 6, 8, 5
    q = rng.standard_normal((T, Hk, dk)).astype(dtype)
    k = (rng.standard_normal((T, Hk, dk)) / 3).astype(dtype)
    v = rng.standard_normal((T, Hv, dv)).astype(dtype)
    g = -np.abs(rng.standard_normal((T, Hv))).astype(dtype)
    beta = rng.uniform(0, 1, (T, Hv)).astype(dtype)
    s0 = rng.standard_normal((Hv, dk, dv)).astype(dtype)
    out, st = delta_rule_recurrent(q, k, v, g, beta, s0)
    S, want = s0.copy(), np.empty((T, Hv, dv), dtype)
    _delta_serial(q, k, v, g, beta, S, want)
    assert np.array_equal(out, want) and np.array_equal(st, S)
    # negative control: the heads' key-head mapping matters (a head reading another's key head differs)
    k2 = k.copy()
    k2[:, 1] = k[:, 0]
    assert not np.array_equal(delta_rule_recurrent(q, k2, v, g, beta, s0)[0][:, Hv // 2:], out[:, Hv // 2:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unit_lower_solve_on_threads_is_the_serial_loop(dtype):
    from reference.numba_kernels import unit_lower_solve
    rng = np.random.default_rng(6)
    A = (rng.standard_normal((11, 16, 16)) / 4).astype(dtype)
    B = rng.standard_normal((11, 16, 7)).astype(dtype)
    got = unit_lower_solve(A, B)
    want = np.empty_like(B)
    _solve_serial(A, B, want)
    assert np.array_equal(got, want)
    L = np.tril(A.astype(np.float64), -1) + np.eye(16)
    assert np.allclose(L @ got, B, atol=1e-4)   # it solves (I + L) X = B
