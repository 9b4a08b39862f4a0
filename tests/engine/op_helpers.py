"""Helpers shared by the op tests (tests/engine/test_<op>.py): not a test module.

One copy of what several op modules compare with: float64 references (``rel``, ``bf16_to_f64``, ``to_f64``,
``sig64``, ``rms_ref64``), the wide-exponent float32 inputs (``wide_floats``), and the CUDA side's plumbing: ``g``
(a host array to the device), ``rel_dev`` / ``three_way`` (errors of a device or host result against float64),
``no_poison`` (no element left as the bytes of tests/engine/conftest.py's ``poisoned_allocations``) and
``replayed`` (a step captured in a CUDA graph and replayed). The poisoning fixtures are in conftest.py, where pytest
finds them by name. The markers of the CUDA tests are in op_devices.py.

Whatever touches cupy reads ``cp`` when called, so this module imports without cupy or a GPU.
"""
from __future__ import annotations

import numpy as np

from op_devices import cp

POISON_I32 = 0x7F7F7F7F  # an int32 element of a poisoned allocation (bytes 0x7F); a float32 one is 3.4e38


# ----------------------------------------------------------------------------------------------- float64 references
def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64 of host arrays; a must be finite."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def bf16_to_f64(bits):
    # independent decode: bit pattern -> float64 through Python's struct-free integer view
    u32 = bits.astype(np.uint32) << np.uint32(16)
    return u32.view(np.float32).astype(np.float64)


def to_f64(w):
    """A weight as float64: BF16 bits (uint16) decoded, float arrays widened."""
    return bf16_to_f64(w) if w.dtype == np.uint16 else w.astype(np.float64)


def sig64(x):
    return 1.0 / (1.0 + np.exp(-x))


def rms_ref64(x, w, gs, eps):
    """Zero-centred RMSNorm (weight 1 + w) over groups of ``gs`` columns, in float64 loops."""
    x = x.astype(np.float64)
    y = np.empty_like(x)
    D = x.shape[-1]
    for g in range(D // gs):
        sl = slice(g * gs, (g + 1) * gs)
        ms = (x[:, sl] ** 2).sum(axis=1, keepdims=True) / gs
        y[:, sl] = x[:, sl] / np.sqrt(ms + eps) * (1.0 + w[sl].astype(np.float64))
    return y


def wide_floats(rng, n):
    # all 24 significand bits random, exponents over most of the normal range
    return (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-100, 100, n) * rng.choice([-1, 1], n)).astype(np.float32)


# ----------------------------------------------------------------------------------------------- CUDA
def g(a):
    return cp.asarray(a)


def rel_dev(a, b):
    """``rel`` of device or host arrays (either side copied to the host); a non-finite element of a is an output a
    kernel did not write (the outputs are poisoned with NaN)."""
    a = cp.asnumpy(a).astype(np.float64) if isinstance(a, cp.ndarray) else np.asarray(a, np.float64)
    b = cp.asnumpy(b).astype(np.float64) if isinstance(b, cp.ndarray) else np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), f"{np.count_nonzero(~np.isfinite(a))} non-finite (unwritten?) elements"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def three_way(gpu_out, twin32, twin64):
    """CUDA vs twin (float32) and vs float64; returns the two relative errors."""
    cp.cuda.Device().synchronize()
    return rel_dev(gpu_out, twin64), rel_dev(twin32, twin64)


def no_poison(a):
    """No element of the device array ``a`` still holds the poison bytes of ``poisoned_allocations``."""
    a = cp.asnumpy(a)
    if a.dtype.kind == "f":
        return not np.any(a.astype(np.float64) >= 3e38)
    return not np.any(a == POISON_I32)


def replayed(step, launches: int = 1):
    """``step()`` captured in a CUDA graph on a non-blocking stream, the graph launched ``launches`` times and the
    stream synchronised; returns what the captured call returned (holding the last replay's results)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = step()
        graph = s.end_capture()
    for _ in range(launches):
        graph.launch(stream=s)
    s.synchronize()
    return out
