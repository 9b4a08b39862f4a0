"""RoPE (engine/kernels/rope.py) on the CPU and on CUDA. How the sequence kernels are judged:
tests/kernels_seq_common.py.
"""
from __future__ import annotations

import numpy as np

from engine.kernels import rope
from tests.kernels_seq_common import TOL, dense_rope, seeded_rng, rel_err
from op_devices import on_cuda
from op_helpers import g, no_poison

# the gpu marker, a skip without cupy / a GPU, and poisoned_allocations (conftest.py) before every CUDA test
cuda = on_cuda("poisoned_allocations")


# ------------------------------------------------------------------------------------------------ RoPE
def test_rope_matches_dense_at_large_positions_and_in_place():
    seed, rng = seeded_rng()
    x = rng.standard_normal((6, 3, 32)).astype(np.float32)
    pos = np.array([0, 1, 17, 4095, 131072, 262143])
    invf = (1.0 / 1e7 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    out = rope.apply_rope(x, pos, invf, 16)
    ref = dense_rope(x, pos, invf, 16)
    # cos/sin of float32 angles up to 2.6e5 rad: both sides use the same float32 angle, the float32 cos/sin then
    # differ from float64 by < 1e-7 absolute
    assert rel_err(out, ref) < TOL, seed
    assert np.array_equal(out[..., 16:], x[..., 16:])
    y = x.copy()
    rope.apply_rope(y, pos, invf, 16, out=y)
    assert np.array_equal(y, out)
    assert rel_err(rope.apply_rope(x, pos + 1, invf, 16), ref) > 1e-2, "off-by-one position not caught"


@cuda
def test_rope_cuda_matches_twin_and_dense():
    seed, rng = seeded_rng()
    x = rng.standard_normal((7, 24, 256)).astype(np.float32)
    pos = np.array([0, 1, 5, 999, 65536, 200001, 262143])
    invf = (1.0 / 1e7 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    got = rope.apply_rope(g(x), g(pos), g(invf), 64)
    assert no_poison(got), seed
    twin = rope.apply_rope(x, pos, invf, 64)
    assert rel_err(got.get(), twin) < TOL and rel_err(got.get(), dense_rope(x, pos, invf, 64)) < TOL, seed
    y = g(x)
    rope.apply_rope(y, g(pos), g(invf), 64, out=y)
    assert rel_err(y.get(), twin) < TOL, seed
    wide = g(np.concatenate([x, x], axis=2))  # a strided view, rotated in place
    view = wide[:, :, :256]
    rope.apply_rope(view, g(pos), g(invf), 64, out=view)
    assert rel_err(view.get(), twin) < TOL and np.array_equal(wide[:, :, 256:].get(), x), seed
    assert rel_err(rope.apply_rope(g(x), g(pos + 1), g(invf), 64).get(), twin) > 1e-2, "off-by-one not caught"
