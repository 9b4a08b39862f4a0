"""Weights kept in their stored quantised format (FP8 block-scaled, NVFP4), dequantised inside the
linear / MoE kernels (``engine/kernels/cuda/quant_linear.cu``) with float32 accumulation.

Formats (model-facts section 4; the reference reader ``reference/checkpoint.py`` dequantises the same way):

* ``fp8`` (official FP8 release, ``Qwen/Qwen3.8-Flash-Next-FP8``): ``q`` uint8 ``[E?, N, K]`` E4M3 codes,
  ``scale`` float32 ``[E?, N / rb, ceil(K / cb)]`` (``weight_scale_inv``; blocks of ``rb x cb``, 128 x 128 in
  the release). ``deq[n, k] = float32(code) * scale[n // rb, k // cb]``. ``rb`` is smaller than the
  checkpoint's block height only where two matrices are stacked (gate + up of an expert whose width is not a
  multiple of 128): each stored scale is then repeated over the ``rb``-row blocks it covers.
* ``nvfp4`` (ModelOpt NVFP4, ``RadixArk/...-NVFP4`` / ``nvidia/...-NVFP4`` experts): ``q`` uint8
  ``[E?, N, K / 2]`` E2M1 codes, element ``2j`` in the low nibble of byte ``j``; ``scale`` uint8
  ``[E?, N, K / 16]`` E4M3 per-16 scales (``weight_scale``, row-major, not swizzled); ``scale2`` float32
  ``[E? * (N / s2_rows)]`` global scales (``weight_scale_2``, one per stacked source matrix of ``s2_rows``
  rows). ``deq = (float32(code) * float32(scale)) * scale2`` (the first product is exact in float32, so
  only the last multiplication rounds). ``input_scale`` (the activation scale of W4A4 serving) is not used:
  activations stay float32, which is what the official model computes on the dequantised weights.

The NumPy twin (:func:`dequantize`) decodes the codes with ml_dtypes (E4M3) and the reader's 16-entry table
(E2M1, :func:`reference.checkpoint.nvfp4_dequantize`) and is the reference for the CUDA decode (which works
by bit manipulation).
"""
from __future__ import annotations

import math

import numpy as np

from engine.backend import xp_of
from engine.kernels.dense_common import KernelInputError
from reference.checkpoint import E2M1_VALUES, nvfp4_dequantize  # the reader's decode: one implementation

__all__ = ["QuantWeight", "E2M1_VALUES", "e4m3_to_float32", "dequantize", "fp8_from_stored", "nvfp4_from_stored",
           "stack_rows", "stack_experts", "FORMATS"]

FORMATS = ("fp8", "nvfp4")


def e4m3_to_float32(codes) -> np.ndarray:
    """E4M3 (``float8_e4m3fn``) codes as uint8 (any shape, numpy) -> float32, exact."""
    import ml_dtypes
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


class QuantWeight:
    """A weight matrix (``[N, K]``) or a stack of expert matrices (``[E, N, K]``) in a stored format.

    Attributes:
        fmt: 'fp8' or 'nvfp4'.
        shape: logical shape (``[N, K]`` or ``[E, N, K]``); ``ndim`` its length.
        q, scale, scale2: the stored arrays (numpy or cupy, all on one device; ``scale2`` None for fp8).
        rb, cb: fp8 scale block (rows, columns). s2_rows: nvfp4 rows per global scale.

    Indexing with an int (``w[e]``) gives expert ``e`` as a 2-D QuantWeight (views, no copy); ``nbytes``
    counts every stored array.
    """

    dtype = np.dtype(np.uint8)  # storage dtype of the codes (the weight is not a plain array)

    def __init__(self, fmt: str, shape, q, scale, scale2=None, *, rb: int = 128, cb: int = 128,
                 s2_rows: int | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {FORMATS}, found {fmt!r}")
        self.fmt, self.shape = fmt, tuple(int(s) for s in shape)
        self.q, self.scale, self.scale2 = q, scale, scale2
        self.rb, self.cb = int(rb), int(cb)
        self.s2_rows = int(s2_rows if s2_rows is not None else self.shape[-2])
        self._check()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def n_experts(self) -> int:
        return self.shape[0] if self.ndim == 3 else 1

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.q, self.scale, self.scale2) if a is not None))

    @property
    def storage_array(self):
        """The code array (what :func:`engine.backend.xp_of` looks at to find the device)."""
        return self.q

    def _check(self) -> None:
        if self.ndim not in (2, 3):
            raise KernelInputError(f"quantised weight: expected [N, K] or [E, N, K], found shape {self.shape}")
        *lead, N, K = self.shape
        if self.fmt == "fp8":
            want_q = tuple(lead) + (N, K)
            want_s = tuple(lead) + (math.ceil(N / self.rb), math.ceil(K / self.cb))
            if tuple(self.q.shape) != want_q or tuple(self.scale.shape) != want_s:
                raise KernelInputError(f"fp8 weight {self.shape}: expected codes {list(want_q)} and scales "
                                       f"{list(want_s)} ({self.rb}x{self.cb} blocks), found {list(self.q.shape)} "
                                       f"and {list(self.scale.shape)}")
            if self.q.dtype != np.uint8 or self.scale.dtype != np.float32:
                raise KernelInputError(f"fp8 weight: expected uint8 codes and float32 scales, found "
                                       f"{self.q.dtype} / {self.scale.dtype}")
        else:
            if K % 16 or N % self.s2_rows:
                raise KernelInputError(f"nvfp4 weight {self.shape}: expected K % 16 == 0 and N % s2_rows "
                                       f"({self.s2_rows}) == 0")
            want_q, want_s = tuple(lead) + (N, K // 2), tuple(lead) + (N, K // 16)
            want_s2 = (self.n_experts * (N // self.s2_rows),)
            if (tuple(self.q.shape) != want_q or tuple(self.scale.shape) != want_s
                    or tuple(self.scale2.shape) != want_s2):
                raise KernelInputError(f"nvfp4 weight {self.shape}: expected codes {list(want_q)}, scales "
                                       f"{list(want_s)}, global scales {list(want_s2)}, found "
                                       f"{list(self.q.shape)}, {list(self.scale.shape)}, {list(self.scale2.shape)}")
            if self.q.dtype != np.uint8 or self.scale.dtype != np.uint8 or self.scale2.dtype != np.float32:
                raise KernelInputError("nvfp4 weight: expected uint8 codes, uint8 (E4M3) scales, float32 global "
                                       f"scales, found {self.q.dtype} / {self.scale.dtype} / {self.scale2.dtype}")

    def __getitem__(self, e):
        if self.ndim != 3 or not isinstance(e, (int, np.integer)):
            raise TypeError("QuantWeight supports w[e] (one expert of a stack) only")
        e = int(e)
        if self.fmt == "fp8":
            return QuantWeight("fp8", self.shape[1:], self.q[e], self.scale[e], rb=self.rb, cb=self.cb)
        per = self.shape[1] // self.s2_rows
        return QuantWeight("nvfp4", self.shape[1:], self.q[e], self.scale[e], self.scale2[e * per:(e + 1) * per],
                           s2_rows=self.s2_rows)

    def rows(self, a: int, b: int) -> "QuantWeight":
        """Rows ``[a, b)`` of a 2-D weight as a view (a stacked projection's member). ``a`` must start a scale
        block (fp8: ``a % rb == 0``; nvfp4: ``a`` and ``b`` multiples of ``s2_rows``).

        Raises:
            ValueError: the rows cut a scale block.
        """
        if self.ndim != 2:
            raise ValueError("QuantWeight.rows: expected a 2-D weight")
        if self.fmt == "fp8":
            if a % self.rb or (b % self.rb and b != self.shape[0]):
                raise ValueError(f"QuantWeight.rows: rows [{a}, {b}) cut {self.rb}-row scale blocks")
            return QuantWeight("fp8", (b - a, self.shape[1]), self.q[a:b], self.scale[a // self.rb:-(-b // self.rb)],
                               rb=self.rb, cb=self.cb)
        if a % self.s2_rows or b % self.s2_rows:
            raise ValueError(f"QuantWeight.rows: rows [{a}, {b}) cut {self.s2_rows}-row global-scale blocks")
        return QuantWeight("nvfp4", (b - a, self.shape[1]), self.q[a:b], self.scale[a:b],
                           self.scale2[a // self.s2_rows:b // self.s2_rows], s2_rows=self.s2_rows)

    def expert_block(self, start: int, end: int, sink: bool = False) -> "QuantWeight":
        """Experts ``[start, end)`` of a stack as a host QuantWeight (a copy), with one all-zero expert appended
        when ``sink`` (codes, scales and global scales 0: it contributes exactly 0; expert parallelism routes
        other ranks' experts there)."""
        w = self.to(np)
        if w.ndim != 3:
            raise ValueError("QuantWeight.expert_block: expected an expert stack [E, N, K]")

        def part(a, per=1):
            a = np.asarray(a[start * per:end * per])
            return np.concatenate([a, np.zeros_like(a[:per])], axis=0) if sink else a.copy()
        per = w.shape[1] // w.s2_rows
        E = end - start + (1 if sink else 0)
        return QuantWeight(w.fmt, (E,) + w.shape[1:], part(w.q), part(w.scale),
                           None if w.scale2 is None else part(w.scale2, per), rb=w.rb, cb=w.cb, s2_rows=w.s2_rows)

    def map(self, fn) -> "QuantWeight":
        """The same weight with ``fn`` applied to each stored array (e.g. a copy to another device)."""
        return QuantWeight(self.fmt, self.shape, fn(self.q), fn(self.scale),
                           None if self.scale2 is None else fn(self.scale2), rb=self.rb, cb=self.cb,
                           s2_rows=self.s2_rows)

    def to(self, xp) -> "QuantWeight":
        """The same weight with its arrays on ``xp``'s device (numpy or cupy)."""
        conv = (lambda a: a) if xp_of(self.q) is xp else (
            (lambda a: xp.asarray(a)) if xp is not np else (lambda a: a.get()))
        return QuantWeight(self.fmt, self.shape, conv(self.q), conv(self.scale),
                           None if self.scale2 is None else conv(self.scale2), rb=self.rb, cb=self.cb,
                           s2_rows=self.s2_rows)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """Host float weights (:func:`dequantize`, the NumPy twin)."""
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return f"QuantWeight({self.fmt}, shape={self.shape})"


def dequantize(w: QuantWeight, dtype=np.float32) -> np.ndarray:
    """NumPy twin of the kernels' decode: the float32 weights ``[.., N, K]`` (then cast to ``dtype``).

    Bit-identical to ``reference.checkpoint`` for the same stored tensors (same products, same order)."""
    w = w.to(np) if xp_of(w.q) is not np else w
    *lead, N, K = w.shape
    if w.fmt == "fp8":
        codes = e4m3_to_float32(w.q)
        s = np.repeat(np.repeat(w.scale, w.rb, axis=-2), w.cb, axis=-1)[..., :N, :K]
        out = codes * s
    else:
        g = np.repeat(w.scale2.astype(np.float32), w.s2_rows).reshape(tuple(lead) + (N, 1))
        out = nvfp4_dequantize(w.q, e4m3_to_float32(w.scale), g)
    return out.astype(dtype, copy=False)


# ------------------------------------------------------------------------------ building from stored tensors
def _u8(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a).view(np.uint8))


def fp8_from_stored(codes, scale_inv, block=(128, 128)) -> QuantWeight:
    """A 2-D (or stacked 3-D) FP8 weight from a checkpoint's ``F8_E4M3`` tensor and its float32
    ``weight_scale_inv`` (``block = quantization_config.weight_block_size``). A per-tensor scale (one
    value) becomes a single block covering the matrix."""
    q = _u8(codes)
    s = np.ascontiguousarray(np.asarray(scale_inv, dtype=np.float32))
    *lead, N, K = q.shape
    if s.size == 1 and (N > block[0] or K > block[1]):
        s = np.full(tuple(lead) + (1, 1), float(s.reshape(-1)[0]), np.float32)
        return QuantWeight("fp8", q.shape, q, s, rb=max(N, 1), cb=max(K, 1))
    s = s.reshape(tuple(lead) + (math.ceil(N / block[0]), math.ceil(K / block[1])))
    return QuantWeight("fp8", q.shape, q, s, rb=block[0], cb=block[1])


def nvfp4_from_stored(packed, scale, scale2) -> QuantWeight:
    """A 2-D NVFP4 weight from a ModelOpt projection: ``weight`` U8 ``[N, K/2]``, ``weight_scale``
    F8_E4M3 ``[N, K/16]``, ``weight_scale_2`` F32 (one value)."""
    q = _u8(packed)
    N, K2 = q.shape
    return QuantWeight("nvfp4", (N, 2 * K2), q, _u8(scale), np.asarray(scale2, np.float32).reshape(1), s2_rows=N)


def stack_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack 2-D weights of one format and width along N (gate over up; stacked projections), on the parts'
    device. fp8: the scale block height of the stack is the largest power of two dividing the checkpoint
    block and every part's height but the last's (each stored scale repeated over the blocks it covers);
    nvfp4: every part's global scale is kept (``s2_rows`` = the parts' common height).

    Raises:
        ValueError: parts of different formats, widths or fp8 column blocks; nvfp4 parts of unequal heights.
    """
    xp = xp_of(parts[0].q)
    fmt, K = parts[0].fmt, parts[0].shape[-1]
    if any(p.fmt != fmt or p.ndim != 2 or p.shape[-1] != K for p in parts):
        raise ValueError("stack_rows: expected 2-D weights of one format and width")
    N = sum(p.shape[0] for p in parts)
    if fmt == "fp8":
        cb = parts[0].cb
        if any(p.cb != cb for p in parts):
            raise ValueError("stack_rows: fp8 parts with different column blocks")
        rb = min(p.rb for p in parts)
        while any(p.shape[0] % rb or p.rb % rb for p in parts[:-1]) and rb > 1:
            rb //= 2
        if any(p.rb % rb for p in parts):
            raise ValueError("stack_rows: fp8 parts whose scale blocks do not nest")
        scales = [xp.repeat(p.scale, p.rb // rb, axis=0)[:math.ceil(p.shape[0] / rb)] for p in parts]
        return QuantWeight("fp8", (N, K), xp.concatenate([p.q for p in parts], 0), xp.concatenate(scales, 0),
                           rb=rb, cb=cb)
    rows = {p.s2_rows for p in parts} | {p.shape[0] for p in parts}
    if len(rows) != 1:
        raise ValueError("stack_rows: nvfp4 parts must have equal heights")
    return QuantWeight("nvfp4", (N, K), xp.concatenate([p.q for p in parts], 0),
                       xp.concatenate([p.scale for p in parts], 0), xp.concatenate([p.scale2 for p in parts]),
                       s2_rows=parts[0].shape[0])


def stack_experts(ws: list[QuantWeight]) -> QuantWeight:
    """``[E, N, K]`` from E 2-D weights of identical layout (host arrays)."""
    w0 = ws[0]
    if any(w.fmt != w0.fmt or w.shape != w0.shape or w.rb != w0.rb or w.cb != w0.cb or w.s2_rows != w0.s2_rows
           for w in ws):
        raise ValueError("stack_experts: experts of different layouts")
    return QuantWeight(w0.fmt, (len(ws),) + w0.shape, np.stack([w.q for w in ws]), np.stack([w.scale for w in ws]),
                       None if w0.scale2 is None else np.concatenate([w.scale2 for w in ws]), rb=w0.rb, cb=w0.cb,
                       s2_rows=w0.s2_rows)
