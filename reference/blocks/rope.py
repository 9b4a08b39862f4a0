"""Partial rotary position embedding with the interleaved mrope layout.

Source: modeling_qwen4_exp.py ``Qwen4ExpTextRotaryEmbedding`` (``compute_default_rope_parameters``,
``forward``, ``recomposition_frequencies``), ``rotate_half`` and ``apply_rotary_pos_emb``.

For text tokens the three mrope position rows (T, H, W) are equal, so the interleaved recomposition
leaves the frequencies unchanged; it is implemented anyway for explicit ``[3, T]`` positions.
"""
from __future__ import annotations

import numpy as np

__all__ = ["inv_freq", "rope_cos_sin", "apply_rope"]


def inv_freq(rope_theta: float, rotary_dim: int, dtype=np.float32) -> np.ndarray:
    """``1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim)``: ``[rotary_dim // 2]`` in ``dtype``.

    Source: ``Qwen4ExpTextRotaryEmbedding.compute_default_rope_parameters`` (computed in float32 there;
    in ``dtype`` here so float64 mode is float64 throughout).
    """
    exps = np.arange(0, rotary_dim, 2, dtype=dtype) / dtype(rotary_dim)
    return (dtype(1.0) / (dtype(rope_theta) ** exps)).astype(dtype)


def rope_cos_sin(positions: np.ndarray, inv_f: np.ndarray, mrope_section) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables ``[T, rotary_dim]`` for int positions ``[T]`` (text) or ``[3, T]`` (T/H/W rows).

    Interleaved mrope: frequency slot ``j`` takes the H row when ``j % 3 == 1`` and ``j < 3*sec[1]``,
    the W row when ``j % 3 == 2`` and ``j < 3*sec[2]``, the T row otherwise; the half-table is then
    repeated twice (``cat(f, f)``), matching ``rotate_half``.
    Source: ``Qwen4ExpTextRotaryEmbedding.forward`` / ``recomposition_frequencies``.
    """
    dtype = inv_f.dtype.type
    pos = np.asarray(positions)
    if pos.ndim == 1:
        pos = np.broadcast_to(pos, (3, pos.shape[0]))
    freqs = pos[..., None].astype(dtype) * inv_f  # [3, T, rd/2]
    out = freqs[0].copy()
    for row, offset in ((1, 1), (2, 2)):
        length = int(mrope_section[row]) * 3
        out[..., offset:length:3] = freqs[row, ..., offset:length:3]
    emb = np.concatenate([out, out], axis=-1)
    return np.cos(emb), np.sin(emb)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first ``rotary_dim`` channels of ``x`` (rotate-half convention); the rest pass through.

    Args:
        x: ``[T, heads, D]`` (or ``[T, D]``); cos/sin: ``[T, rotary_dim]`` with ``rotary_dim <= D``.
    Returns:
        same shape and dtype as ``x``.
    Source: ``apply_rotary_pos_emb`` / ``rotate_half``.
    """
    rd = cos.shape[-1]
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return np.concatenate([xr * cos + rot * sin, xp], axis=-1)
