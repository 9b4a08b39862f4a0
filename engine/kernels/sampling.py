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
    if B:
        kernel("sampling.cu", "row_argmax")((B,), (1024,), (x, np.int64(V), y))
    return y
