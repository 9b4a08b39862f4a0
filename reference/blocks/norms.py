"""RMS normalisations.

Sources (transformers ``models/qwen4_exp/modeling_qwen4_exp.py``): ``Qwen4ExpTextRMSNorm`` (zero-centred
weight ``(1 + w)``, optional grouped form) and ``Qwen4ExpTextRMSNormGated`` (plain weight ``w`` -- NOT
zero-centred -- times an activation of the gate).
"""
from __future__ import annotations

import numpy as np
from scipy.special import expit

from reference.threads import map_rows

__all__ = ["rms_norm", "gated_rms_norm", "silu", "sigmoid", "softplus"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function (``scipy.special.expit``: overflow-free); same shape and dtype as ``x``. Large arrays
    run in row blocks on the host's threads (:func:`reference.threads.map_rows`: bitwise one pass)."""
    return map_rows(expit, x)


def _silu(x: np.ndarray) -> np.ndarray:
    return x * expit(x)


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` (the model's only activation); same shape and dtype as ``x`` (row blocks on threads,
    as :func:`sigmoid`)."""
    return map_rows(_silu, x)


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))``; torch's ``F.softplus`` (beta=1) switches to the identity above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(x.dtype, copy=False)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, group_size: int | None = None) -> np.ndarray:
    """Zero-centred RMSNorm: ``x / sqrt(mean(x**2) + eps) * (1 + weight)``.

    Args:
        x: ``[..., D]`` float32/float64.
        weight: ``[D]`` (the stored, zero-centred weight).
        eps: ``rms_norm_eps``.
        group_size: when set, the mean is taken per consecutive group of ``group_size`` channels
            (the per-stream norm over ``hc_count`` streams: ``D = hc_count * hidden_size``).
    Returns:
        ``[..., D]`` in ``x.dtype``.
    Source: ``Qwen4ExpTextRMSNorm._norm`` / ``forward``.
    """
    if x.ndim >= 2:   # rows are independent: row blocks on the host's threads, bitwise one pass
        return map_rows(lambda xs: _rms_norm(xs, weight, eps, group_size), x)
    return _rms_norm(x, weight, eps, group_size)


def _rms_norm(x, weight, eps, group_size):
    shape = x.shape
    if group_size is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))
    out = (x * inv).reshape(shape)
    return out * (x.dtype.type(1.0) + weight.astype(x.dtype, copy=False))


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float, activation: str) -> np.ndarray:
    """Gated RMSNorm of the GDN output: ``weight * x / sqrt(mean(x**2) + eps) * act(gate)``.

    The weight is used as stored (initialised to ones), not as ``1 + w``.

    Args:
        x: ``[..., D]``; gate: ``[..., D]``; weight: ``[D]``.
        activation: ``'sigmoid'`` or ``'silu'`` (``output_gate_type or hidden_act``).
    Returns:
        ``[..., D]`` in ``x.dtype``.
    Raises:
        ValueError: unknown activation (the config validation rules it out earlier).
    Source: ``Qwen4ExpTextRMSNormGated.forward``.
    """
    if activation not in ("sigmoid", "silu"):
        raise ValueError(f"gated_rms_norm: activation: expected 'sigmoid' or 'silu', found {activation!r}")
    act = expit if activation == "sigmoid" else _silu

    def rows(xs, gs):
        inv = 1.0 / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + xs.dtype.type(eps))
        return weight.astype(xs.dtype, copy=False) * (xs * inv) * act(gs)
    if x.ndim >= 2 and gate.shape[:1] == x.shape[:1]:   # rows are independent: row blocks on threads
        return map_rows(rows, x, gate)
    return rows(x, gate)
