"""Hyper-connections (the gated multi-stream residual) and the final mixer.

Source: modeling_qwen4_exp.py ``Qwen4ExpTextGatedResidual.forward`` and its use in
``Qwen4ExpTextDecoderLayer.forward`` (the combine) and ``Qwen4ExpTextModel`` (``hyper_connection_mixer``,
built with ``use_combine=False``).
"""
from __future__ import annotations

import numpy as np

from reference.blocks.linear import linear
from reference.blocks.norms import rms_norm, sigmoid, silu

__all__ = ["hyper_connection", "hc_combine"]


def hyper_connection(x: np.ndarray, norm_w: np.ndarray, down_w: np.ndarray, up_w: np.ndarray,
                     inject_w: np.ndarray | None, hc_count: int, hidden_size: int, eps: float, taps: dict | None = None):
    """Mix the ``hc_count`` residual streams into one block input (and the injection weights).

    ``n = RMSNorm_grouped(x)``; ``m = sigmoid(up(silu(down(n) / hc)))``;
    ``out = mean_over_streams(m * n)``; ``inject = 2 * sigmoid(W_inject n / hc)``.

    Args:
        x: ``[T, hc_count * hidden_size]`` the multi-stream residual.
        norm_w: ``[hc*H]`` zero-centred grouped-norm weight (group = ``hidden_size``).
        down_w: ``[hc_lowrank, hc*H]``; up_w: ``[hc*H, hc_lowrank]`` (arrays or ``BF16Matrix``).
        inject_w: ``[hc, hc*H]`` or None (the final mixer has no combine).
        taps: when a dict, receives ``hc_norm`` (the normed streams ``n`` ``[T, hc*H]``).
    Returns:
        ``(mixed [T, H], injection_weights [T, hc] or None)`` in ``x.dtype``.
    Source: ``Qwen4ExpTextGatedResidual.forward``.
    """
    T = x.shape[0]
    hc = x.dtype.type(hc_count)
    n = rms_norm(x, norm_w, eps, group_size=hidden_size)
    if taps is not None:
        taps["hc_norm"] = n
    m = sigmoid(linear(silu(linear(n, down_w) / hc), up_w))
    mixed = (m * n).reshape(T, hc_count, hidden_size).mean(axis=1)
    if inject_w is None:
        return mixed, None
    inj = x.dtype.type(2.0) * sigmoid(linear(n, inject_w) / hc)
    return mixed, inj


def hc_combine(residual: np.ndarray, block_out: np.ndarray, injection_weights: np.ndarray) -> np.ndarray:
    """Inject a block output into every stream: ``residual + block_out[:, None, :] * inj[:, :, None]``.

    Args:
        residual: ``[T, hc*H]`` (the hyper-connection's un-normalised input);
        block_out: ``[T, H]``; injection_weights: ``[T, hc]``.
    Returns:
        ``[T, hc*H]``.
    Source: ``Qwen4ExpTextDecoderLayer.forward`` (``injection = hidden.unsqueeze(-2) * weights.unsqueeze(-1)``).
    """
    T, H = block_out.shape
    inj = block_out[:, None, :] * injection_weights[:, :, None]
    return residual + inj.reshape(T, -1)
