"""Sampling: ``row_argmax`` (engine/kernels/sampling.py), the greedy pick of every row, on the CPU and on CUDA.

It matches ``np.argmax``: the first maximum, NaN ranks first (the first NaN wins), an all -inf row gives 0; on CUDA
also for vocabularies that are not a multiple of the block (up to the real 248320). Bad input is refused. All exact
comparisons (integer ids). The engine's greedy decoding: tests/engine/test_engine_greedy.py (CPU) and
test_engine_greedy_gpu.py (CUDA graphs).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels.dense_common import KernelInputError
from engine.kernels.sampling import row_argmax
from op_devices import cp, on_cuda

# the gpu marker and a skip without cupy / a GPU on every CUDA test
cuda = on_cuda()


def test_row_argmax_matches_numpy_ties_nan_inf():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 37)).astype(np.float32)
    x[1, [3, 20]] = 9.0  # a tie: first index wins
    x[2, [7, 30]] = np.nan  # NaN ranks first, first NaN wins
    x[3] = -np.inf
    got = row_argmax(x)
    assert got.dtype == np.int64
    assert got.tolist() == np.argmax(x, axis=-1).tolist()
    assert got[1] == 3 and got[2] == 7 and got[3] == 0
    out = np.full(5, -1, np.int64)
    assert row_argmax(x, out=out) is out and out.tolist() == got.tolist()



def test_row_argmax_bad_input():
    with pytest.raises(KernelInputError, match="float32"):
        row_argmax(np.zeros((2, 3), np.float64))
    with pytest.raises(KernelInputError, match="V = 0"):
        row_argmax(np.zeros((2, 0), np.float32))
    with pytest.raises(KernelInputError, match="out"):
        row_argmax(np.zeros((2, 3), np.float32), out=np.zeros(3, np.int64))



@cuda
@pytest.mark.parametrize("V", [1, 37, 1024, 5000, 248320])
def test_row_argmax_cuda_matches_numpy(V):
    from engine.kernels.sampling import row_argmax
    rng = np.random.default_rng(V)
    x = rng.standard_normal((6, V)).astype(np.float32)
    x[1, [V // 3, V - 1]] = 50.0  # tie: first wins
    x[2, [V - 1, V // 2]] = np.nan  # first NaN wins
    x[3] = -np.inf
    x[4, :] = 1.0  # all equal: index 0
    got = cp.asnumpy(row_argmax(cp.asarray(x)))
    assert got.tolist() == np.argmax(x, axis=-1).tolist()

