"""Rotary position embedding for the engine (text positions).

Source: modeling_qwen4_exp.py ``Qwen4ExpTextRotaryEmbedding.compute_default_rope_parameters`` (inverse
frequencies), ``Qwen4ExpTextRotaryEmbedding.forward`` / ``recomposition_frequencies`` (interleaved mrope) and
``apply_rotary_pos_emb`` / ``rotate_half`` (the rotation of the first ``rotary_dim`` channels).

Text-only positions: the three mrope components (T, H, W) are all the token position, so the interleaved
recomposition gives back the plain per-position frequencies ``pos * inv_freq``; the engine therefore rotates with
one position per token. Angles are computed on the fly in float32 exactly as the official forward does
(``float32(pos) * inv_freq`` then cos/sin), so there is no table and no cap below ``max_position_embeddings``.

The rotation is the "half" layout: channels ``[0, rotary_dim/2)`` pair with ``[rotary_dim/2, rotary_dim)``;
channels at and above ``rotary_dim`` pass through unchanged.
"""
from __future__ import annotations

import numpy as np

from engine.backend import load_module, xp_of
from reference.blocks import rope as _ref_rope
from reference.errors import InputError

_BLOCK = 128


def rope_inv_freq(config, dtype=np.float32) -> np.ndarray:
    """Inverse frequencies ``[rotary_dim // 2]`` (host numpy, ``dtype``): the shared reference's
    :func:`reference.blocks.rope.inv_freq`, so engine and reference rotate with bit-identical frequencies.

    Source: modeling_qwen4_exp.py ``Qwen4ExpTextRotaryEmbedding.compute_default_rope_parameters``.
    """
    return _ref_rope.inv_freq(config.rope_theta, config.rotary_dim, np.dtype(dtype).type)


def _check(x, positions, inv_freq, rotary_dim):
    if x.ndim != 3:
        raise InputError(f"rope: x: expected shape [T, heads, head_dim], found {tuple(x.shape)}")
    T, _, D = x.shape
    if positions.shape != (T,):
        raise InputError(f"rope: positions: expected shape [{T}], found {tuple(positions.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= D:
        raise InputError(f"rope: rotary_dim: expected an even number in (0, head_dim={D}], found {rotary_dim}")
    if inv_freq.shape != (rotary_dim // 2,):
        raise InputError(f"rope: inv_freq: expected shape [{rotary_dim // 2}], found {tuple(inv_freq.shape)}")


def apply_rope(x, positions, inv_freq, rotary_dim: int, out=None):
    """Rotate the first ``rotary_dim`` channels of every head of ``x`` by its token's position.

    Args:
        x: ``[T, H, D]`` float32 or float64 (numpy or cupy, C-contiguous).
        positions: ``[T]`` integer absolute positions (any int dtype; int64 recommended).
        inv_freq: ``[rotary_dim // 2]`` float32 (see :func:`rope_inv_freq`); on the array module of ``x``.
        rotary_dim: rotated channels per head (even, <= D).
        out: optional ``[T, H, D]`` output of x's dtype; may be ``x`` itself (in place).

    Returns:
        ``out`` (a new array when not given): ``x`` with channels ``[0, r)`` rotated,
        ``o[:h] = x[:h]*cos - x[h:r]*sin``, ``o[h:r] = x[h:r]*cos + x[:h]*sin`` with ``h = r/2`` and
        ``angle = float32(pos) * inv_freq`` (computed in float32 like the official forward); channels ``>= r``
        copied.

    Raises:
        InputError: shapes or rotary_dim inconsistent.

    Source: modeling_qwen4_exp.py ``apply_rotary_pos_emb`` + ``rotate_half``.
    """
    xp = xp_of(x)
    _check(x, positions, inv_freq, rotary_dim)
    if out is None:
        out = xp.empty_like(x)
    if xp is np:
        return _rope_numpy(x, positions, inv_freq, rotary_dim, out)
    return _rope_cuda(x, positions, inv_freq, rotary_dim, out)


def _rope_numpy(x, positions, inv_freq, rotary_dim, out):
    """NumPy twin: the reference's cos/sin tables (float32 angles, text positions) and rotation."""
    invf = np.asarray(inv_freq, dtype=np.float32)
    cos, sin = _ref_rope.rope_cos_sin(np.asarray(positions, dtype=np.int64), invf, [rotary_dim // 2, 0, 0])
    out[...] = _ref_rope.apply_rope(x, cos.astype(x.dtype), sin.astype(x.dtype))
    return out


def _rope_cuda(x, positions, inv_freq, rotary_dim, out):
    import cupy as cp
    if x.dtype not in (cp.float32, cp.float64):
        raise InputError(f"rope: x: expected float32 or float64, found {x.dtype}")
    x = cp.ascontiguousarray(x)
    pos = cp.ascontiguousarray(positions, dtype=cp.int64)
    invf = cp.ascontiguousarray(inv_freq, dtype=cp.float32)
    T, H, D = x.shape
    # the kernel writes a C-contiguous buffer; a strided `out` (or an in-place call on a strided view) gets a copy
    res = out if (out.flags.c_contiguous and out.dtype == x.dtype) else cp.empty_like(x, order="C")
    name = "rope_f32" if x.dtype == cp.float32 else "rope_f64"
    k = load_module("rope.cu").get_function(name)
    n = T * H * (D - rotary_dim // 2)  # one thread per rotated pair or copied channel
    if n:
        k(((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,),
          (x, res, pos, invf, np.int64(T), np.int32(H), np.int32(D), np.int32(rotary_dim)))
    if res is not out:
        out[...] = res
    return out
