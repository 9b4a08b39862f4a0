"""Token selection on the engine's device (greedy decoding without copying the logits to the host).

* cupy: ``row_argmax`` (engine/kernels/cuda/sampling.cu), one block per row, no host synchronisation
  (capturable in a CUDA graph).
* numpy: ``np.argmax`` (the definition the kernel matches: first maximum, NaN first).
"""
from __future__ import annotations

import numpy as np

from engine.kernels.dense_common import KernelInputError, check_ndim, is_cupy, kernel, xp_of

__all__ = ["row_argmax"]


def row_argmax(logits, out=None):
    """Index of each row's maximum, as ``np.argmax(logits, axis=-1)``: the first maximum; a row holding NaN
    gives its first NaN.

    Args:
        logits: float32 ``[B, V]`` (device or host).
        out: optional int64 ``[B]`` on the same device, written and returned.
    Returns:
        int64 ``[B]`` token ids.
    Raises:
        KernelInputError: not a 2-D float32 array, an empty vocabulary, or a bad ``out``.
    """
    xp = xp_of(logits)
    check_ndim("logits", logits, 2, "[B, V]")
    B, V = logits.shape
    if logits.dtype != np.float32:
        raise KernelInputError(f"logits: expected float32 [B, V], found {logits.dtype}")
    if V == 0:
        raise KernelInputError("logits: expected a non-empty vocabulary axis, found V = 0")
    if out is not None and (tuple(out.shape) != (B,) or out.dtype != np.int64):
        raise KernelInputError(f"out: expected int64 [{B}], found {out.dtype} {tuple(out.shape)}")
    if not is_cupy(xp):
        r = np.argmax(logits, axis=-1).astype(np.int64)
        if out is not None:
            out[...] = r
            return out
        return r
    x = logits if logits.flags.c_contiguous else xp.ascontiguousarray(logits)
    y = out if out is not None else xp.empty((B,), dtype=xp.int64)
    if not B:
        return y
    P = min(_MAX_PARTS, max(1, -(-V // _PART_MIN)))
    if P == 1:
        kernel("sampling.cu", "row_argmax")((B,), (1024,), (x, np.int64(V), y))
        return y
    chunk = -(-V // P)
    pv = xp.empty((B, P), dtype=xp.float32)
    pi = xp.empty((B, P), dtype=xp.int64)
    kernel("sampling.cu", "row_argmax_partial")((P, B), (256,), (x, np.int64(V), np.int64(chunk), pv, pi))
    threads = 1 << max(5, (P - 1).bit_length())
    kernel("sampling.cu", "row_argmax_final")((B,), (threads,), (pv, pi, np.int32(P), np.int64(V), y))
    return y


_PART_MIN = 4096  # entries per partial block at least (below that one block per row is as fast)
_MAX_PARTS = 128  # partial blocks per row at most (<= 1024, the final kernel's block)
