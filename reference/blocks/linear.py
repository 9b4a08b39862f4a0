"""Linear maps ``x @ W.T`` over float arrays or BF16 weights kept in their stored bits.

The reference keeps every number in its compute dtype; a BF16 weight is upcast exactly (each BF16 value
is a float32 value). :class:`BF16Matrix` wraps the stored BF16 bits (usually a memory-mapped checkpoint
slice) so that a product with a few rows reads the 2-byte weight once instead of upcasting it to a
4-byte copy first: :func:`linear` multiplies with the fused Numba kernel
(:func:`reference.numba_kernels.bf16_matmul_t`) for float32 inputs of at most :data:`FUSED_MAX_ROWS`
rows, and with BLAS on the upcast weight otherwise (float64, or many rows). The two differ only in
float32 summation order.

Source: every ``nn.Linear(bias=False)`` of modeling_qwen4_exp.py (``F.linear(x, W) = x W^T``).
"""
from __future__ import annotations

import numpy as np

from reference.numba_kernels import bf16_matmul_t, bf16_upcast
from reference.order import blocked_matmul_t, current as current_order

__all__ = ["BF16Matrix", "linear", "FUSED_MAX_ROWS"]

#: float32 products with at most this many rows use the fused BF16 kernel; more rows use BLAS on the
#: upcast weight (the fused kernel is bandwidth-bound, BLAS wins once the product is compute-bound).
FUSED_MAX_ROWS = 64


class BF16Matrix:
    """A ``[O, K]`` BF16 weight held as its stored bits.

    Args:
        raw: ``[O, K]`` array of dtype ``ml_dtypes.bfloat16`` (or its ``uint16`` bits), e.g. a memmap view.
        upcast: optional callable ``dtype -> [O, K] array``: the weight in that dtype (e.g. through the
            model's weight cache); default ``raw.astype(dtype)`` on every use.
    Raises:
        TypeError: ``raw`` is not a 2-D 16-bit array.
    """

    __slots__ = ("raw", "shape", "_upcast")

    def __init__(self, raw: np.ndarray, upcast=None):
        a = np.asarray(raw)
        if a.ndim != 2 or (a.dtype != np.dtype(np.uint16) and a.dtype.name != "bfloat16"):
            raise TypeError(f"BF16Matrix: expected a 2-D bfloat16 array, found {a.ndim}-D {a.dtype}")
        self.raw = a
        self.shape = a.shape
        self._upcast = upcast

    def upcast(self, dtype) -> np.ndarray:
        """The weight in ``dtype`` (exact for float32/float64)."""
        if self._upcast is not None:
            return self._upcast(dtype)
        return bf16_upcast(self.raw, dtype)

    def __repr__(self) -> str:
        return f"BF16Matrix(shape={self.shape})"


def linear(x: np.ndarray, w) -> np.ndarray:
    """``x @ W.T``: x ``[N, K]``, W ``[O, K]`` (array or :class:`BF16Matrix`) -> ``[N, O]`` in ``x.dtype``.

    For a plain array this is exactly ``x @ w.T``. Inside :func:`reference.order.evaluation_order` with a
    ``linear_block`` (float32 only) the sum runs in that split-K order instead (the floor's envelope).
    """
    blk = current_order().linear_block
    if blk and x.dtype == np.float32:
        return blocked_matmul_t(x, w.upcast(x.dtype) if isinstance(w, BF16Matrix) else w, blk)
    if not isinstance(w, BF16Matrix):
        return x @ w.T
    if x.dtype == np.float32 and x.ndim == 2 and x.shape[0] <= FUSED_MAX_ROWS:
        return bf16_matmul_t(x, w.raw)
    return x @ w.upcast(x.dtype).T
