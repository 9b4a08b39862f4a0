"""Gated DeltaNet (the linear-attention layers).

Sources (modeling_qwen4_exp.py): ``Qwen4ExpTextGatedDeltaNet.forward`` (projections, conv, gates),
``causal_conv1d_fn`` / ``causal_conv1d_update`` (depthwise causal conv + silu), ``l2norm``,
``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule`` (the two forms of the
delta rule, both applying ``q * dk**-0.5`` after the l2 norm), ``Qwen4ExpTextRMSNormGated``.

The chunked form here is derived independently (closed form of the recurrence inside a chunk, solved
with a unit lower-triangular system); tests hold it equal to the recurrent form.
"""
from __future__ import annotations

import numpy as np

from reference.blocks.linear import linear
from reference.blocks.norms import gated_rms_norm, sigmoid, silu, softplus
from reference.blocks.ple import dilated_causal_conv
from reference.numba_kernels import delta_rule_recurrent, unit_lower_solve
from reference.order import current as current_order

__all__ = ["conv_history", "l2norm", "delta_rule_chunked", "delta_rule_recurrent", "delta_rule_recurrent_numpy", "gdn_block",
           "CHUNK_SIZE"]

CHUNK_SIZE = 64  # the official torch_chunk_gated_delta_rule default


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis (eps inside the root, as the official ``l2norm``)."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + x.dtype.type(eps))


def delta_rule_recurrent_numpy(q, k, v, g, beta, state):
    """Readable NumPy twin of :func:`reference.numba_kernels.delta_rule_recurrent` (same contract)."""
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    rep = Hv // Hk
    qh, kh = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    S = np.array(state, dtype=q.dtype, copy=True)
    out = np.empty((T, Hv, v.shape[2]), dtype=q.dtype)
    for t in range(T):
        S *= np.exp(g[t])[:, None, None]
        mem = np.einsum("hij,hi->hj", S, kh[t])
        delta = (v[t] - mem) * beta[t][:, None]
        S += kh[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, qh[t])
    return out, S


def delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """Gated delta rule over chunks of ``chunk_size`` tokens (prefill form).

    Inside a chunk with start state ``S0`` and cumulative log decay ``c_i = g_0 + ... + g_i``:
    the written values ``u`` solve ``(I + A) u = beta*v - beta*exp(c) * (k S0)`` with the strictly lower
    ``A_ij = beta_i exp(c_i - c_j) k_i.k_j``; then ``o_i = exp(c_i) q_i S0 + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j``
    and ``S_end = exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T``. A last partial chunk is handled
    directly (the official zero padding leaves outputs and state unchanged).

    Args / returns: as :func:`reference.numba_kernels.delta_rule_recurrent`.
    Source: ``torch_chunk_gated_delta_rule`` (same chunking, independent derivation).
    """
    dt = q.dtype
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    rep = Hv // Hk
    qh = np.repeat(q, rep, axis=1).transpose(1, 0, 2)  # [Hv, T, dk]
    kh = np.repeat(k, rep, axis=1).transpose(1, 0, 2)
    vh = v.transpose(1, 0, 2)  # [Hv, T, dv]
    gh, bh = g.T, beta.T  # [Hv, T]
    S = np.array(state, dtype=dt, copy=True)
    out = np.empty((Hv, T, dv), dtype=dt)
    for s0 in range(0, T, chunk_size):
        sl = slice(s0, min(T, s0 + chunk_size))
        C = sl.stop - sl.start
        qc, kc, vc, b = qh[:, sl], kh[:, sl], vh[:, sl], bh[:, sl]
        c = np.cumsum(gh[:, sl], axis=1)  # [Hv, C]
        diff = c[:, :, None] - c[:, None, :]
        lower = np.tril(np.ones((C, C), dtype=bool))
        decay = np.exp(np.where(lower, diff, -np.inf)).astype(dt)  # [Hv, C, C] incl. diagonal (=1)
        kk = kc @ kc.transpose(0, 2, 1)
        A = b[:, :, None] * kk * decay
        A = A * np.tril(np.ones((C, C), dtype=dt), -1)
        ec = np.exp(c).astype(dt)
        rhs = b[:, :, None] * vc - (b * ec)[:, :, None] * (kc @ S)  # [Hv, C, dv]
        u = unit_lower_solve(A, rhs)
        qk = (qc @ kc.transpose(0, 2, 1)) * decay
        out[:, sl] = ec[:, :, None] * (qc @ S) + qk @ u
        tail = np.exp(c[:, -1:] - c).astype(dt)  # [Hv, C]
        S = np.exp(c[:, -1]).astype(dt)[:, None, None] * S + (kc * tail[:, :, None]).transpose(0, 2, 1) @ u
    return out.transpose(1, 0, 2), S


def gdn_block(x: np.ndarray, w: dict, conv_state: np.ndarray, rec_state: np.ndarray, cfg, mode: str = "auto"):
    """One Gated DeltaNet block.

    Args:
        x: ``[T, hidden_size]`` (the attention hyper-connection's output).
        w: ``in_proj_qkv [2*key_dim+value_dim, H]``, ``in_proj_z [value_dim, H]``, ``in_proj_b``/``in_proj_a``
           ``[Hv, H]``, ``conv1d [conv_dim, K]``, ``A_log``/``dt_bias`` ``[Hv]``, ``norm [dv]``,
           ``out_proj [H, value_dim]``.
        conv_state: ``[K-1, conv_dim]``; rec_state: ``[Hv, dk, dv]``.
        cfg: the :class:`~reference.config.ModelConfig`.
        mode: ``'recurrent'``, ``'chunked'`` or ``'auto'`` (recurrent for one token, chunked otherwise:
            the official choice).
    Returns:
        ``(out [T, H], taps dict(conv_in [T, conv_dim]: the conv input (``in_proj_qkv`` output; with the
        carried state it gives the ``conv_state`` tap, see :func:`conv_history`), conv_out [T, conv_dim],
        core_out [T, Hv, dv], norm [T, Hv, dv]: the gated RMSNorm output), new_conv_state, new_rec_state)``.
    Source: ``Qwen4ExpTextGatedDeltaNet.forward``.
    """
    T = x.shape[0]
    dt = x.dtype.type
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd = Hk * dk
    mixed = linear(x, w["in_proj_qkv"])
    z = linear(x, w["in_proj_z"])
    b = linear(x, w["in_proj_b"])
    a = linear(x, w["in_proj_a"])
    conv, new_conv = dilated_causal_conv(mixed, conv_state, w["conv1d"], 1)
    conv = silu(conv)
    q = conv[:, :kd].reshape(T, Hk, dk)
    k = conv[:, kd:2 * kd].reshape(T, Hk, dk)
    v = conv[:, 2 * kd:].reshape(T, Hv, dv)
    beta = sigmoid(b)
    g = -np.exp(w["A_log"]) * softplus(a + w["dt_bias"])
    q = l2norm(q) * dt(dk ** -0.5)
    k = l2norm(k)
    if mode == "auto" and current_order().gdn != "auto":   # another legitimate form (the floor's envelope)
        mode = current_order().gdn
    if mode == "recurrent" or (mode == "auto" and T == 1):
        core, new_rec = delta_rule_recurrent(q, k, v, g, beta, rec_state)
    else:
        core, new_rec = delta_rule_chunked(q, k, v, g, beta, rec_state)
    normed = gated_rms_norm(core, z.reshape(T, Hv, dv), w["norm"], cfg.rms_norm_eps, cfg.output_gate)
    out = linear(normed.reshape(T, Hv * dv), w["out_proj"])
    return out, {"conv_in": mixed, "conv_out": conv, "core_out": core, "norm": normed}, new_conv, new_rec


def conv_history(state: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The ``K-1`` rows a causal conv reads before each position: ``[T, K-1, C]`` from the carried
    ``state [K-1, C]`` and the new inputs ``x [T, C]`` (row ``t`` = ``concat(state, x)[t : t+K-1]``).
    The tap ``layers.{i}.linear_attn.conv_state``: a stale or unrolled-back conv state differs here first."""
    S = state.shape[0]
    z = np.concatenate([state.astype(x.dtype, copy=False), x], axis=0)
    idx = np.arange(x.shape[0])[:, None] + np.arange(S)[None, :]
    return z[idx]
