"""Norms and hyper-connection ops of the engine (float32 activations; norm weights float32).

Ops (each takes numpy or cupy arrays and dispatches on their module; cupy -> CUDA kernels in
``engine/kernels/cuda/dense_norms.cu``, numpy -> the NumPy twin):

* :func:`rms_norm` - zero-centred RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, optionally per
  group of ``group_size`` channels. Source: modeling_qwen4_exp.py ``Qwen4ExpTextRMSNorm.forward``/``_norm``.
* :func:`gated_rms_norm` - ``w * rmsnorm(x) * act(gate)``. Source: ``Qwen4ExpTextRMSNormGated.forward``.
* :func:`hc_pre` - a hyper-connection's input side: grouped norm, low-rank sigmoid mix, mean over
  streams, injection weights. Source: ``Qwen4ExpTextGatedResidual.forward``.
* :func:`hc_combine` - ``residual + block_out * injection_weights`` per stream. Source:
  ``Qwen4ExpTextDecoderLayer.forward`` (the two ``injection`` lines).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, check_dim, compute_dtype, f32_contig, is_cupy, kernel,
                                         same_device, weight_as_float, xp_of)
from engine.kernels.linear import linear
from reference.blocks import hyper_connection as _ref_hc
from reference.blocks import norms as _ref_norms

__all__ = ["rms_norm", "gated_rms_norm", "hc_pre", "hc_combine", "hc_combine_norm", "HCOut", "act_div"]

_ACTS = {"silu": 0, "swish": 0, "sigmoid": 1}


def _weight_f(w, xp, dt=np.float32):
    """Small weights (norm gains, conv kernels) as float arrays; BF16 bits are upcast exactly."""
    return weight_as_float(w, dt) if w.dtype != dt else w


def _norm_threads(gs: int) -> int:
    """Block size of the row-norm kernels for groups of ``gs`` channels: a thread per 1..2 elements, up to 1024
    (2560-wide groups with 256 threads were latency-bound, ~10 us). ``hc_combine_norm`` must use the same, so
    that its norm is bit-identical to ``rms_norm``'s."""
    return min(1024, max(32, 1 << (gs - 1).bit_length()))


def rms_norm(x, weight, *, eps: float, group_size: int | None = None, out=None):
    """Zero-centred (optionally grouped) RMSNorm over the last axis.

    ``y = x * rsqrt(mean(x_g^2) + eps) * (1 + w)`` where the mean runs over each group of
    ``group_size`` channels (the whole axis when None). NumPy twin: ``reference.blocks.norms.rms_norm``.

    Args:
        x: ``[..., D]`` float32 (float64 on NumPy).
        weight: ``[D]`` float32 (or BF16 bits / bfloat16, upcast exactly).
        eps: the config's ``rms_norm_eps``.
        group_size: channels per group; must divide ``D``.
        out: optional ``[..., D]`` float32 output (may alias ``x``).
    Returns:
        ``[..., D]`` float32 (float64 for float64 NumPy input).
    Raises:
        KernelInputError: ``weight`` not ``[D]``, ``group_size`` not dividing ``D``, bad ``out``.
    """
    xp = same_device(x, weight, out)
    D = int(x.shape[-1])
    gs = D if group_size is None else int(group_size)
    if gs <= 0 or D % gs:
        raise KernelInputError(f"group_size: expected a positive divisor of D={D}, found {group_size}")
    check_dim("weight", int(weight.size), D, "D (last axis of x)")
    if out is not None and tuple(out.shape) != tuple(x.shape):
        raise KernelInputError(f"out: expected shape {tuple(x.shape)}, found {tuple(out.shape)}")
    if not is_cupy(xp):
        dt = compute_dtype(x)
        y = _ref_norms.rms_norm(x.astype(dt, copy=False), _weight_f(weight, np, dt).reshape(-1), eps,
                                group_size=group_size)
        if out is not None:
            out[...] = y
            return out
        return y
    xc = f32_contig(x, "x")
    w = f32_contig(_weight_f(weight, xp).reshape(-1), "weight")
    y = out if out is not None else _empty(xp, x.shape, dtype=xp.float32)
    rows = xc.size // D if D else 0
    if rows == 0:
        return y
    yk = y if (y.flags.c_contiguous and y.dtype == np.float32) else _empty(xp, x.shape, dtype=xp.float32)
    kernel("dense_norms.cu", "rms_norm_rows")(
        (rows * (D // gs),), (_norm_threads(gs),),
        (xc, w, yk, np.int64(rows), np.int32(D), np.int32(gs), np.float32(eps), np.int32(1)))
    if yk is not y:
        y[...] = yk
    return y


def gated_rms_norm(x, gate, weight, *, eps: float, activation: str = "silu", out=None):
    """Gated RMSNorm over the last axis: ``w * (x * rsqrt(mean(x^2) + eps)) * act(gate)``.

    Args:
        x, gate: ``[..., D]`` float32 (float64 on NumPy).
        weight: ``[D]`` (plain gain, not zero-centred).
        activation: ``'silu'`` (= ``'swish'``) or ``'sigmoid'`` (the config's ``output_gate``).
        out: optional ``[..., D]`` output.
    Returns:
        ``[..., D]`` float32.
    Raises:
        KernelInputError: shape mismatch or an unsupported activation.
    """
    xp = same_device(x, gate, weight, out)
    if activation not in _ACTS:
        raise KernelInputError(f"activation: expected one of {sorted(_ACTS)}, found {activation!r}")
    if tuple(gate.shape) != tuple(x.shape):
        raise KernelInputError(f"gate: expected shape {tuple(x.shape)} (as x), found {tuple(gate.shape)}")
    D = int(x.shape[-1])
    check_dim("weight", int(weight.size), D, "D (last axis of x)")
    if not is_cupy(xp):
        dt = compute_dtype(x)
        y = _ref_norms.gated_rms_norm(x.astype(dt, copy=False), gate.astype(dt, copy=False),
                                      _weight_f(weight, np, dt).reshape(-1), eps,
                                      "silu" if _ACTS[activation] == 0 else "sigmoid")
        if out is not None:
            out[...] = y
            return out
        return y
    xc, gc = f32_contig(x, "x"), f32_contig(gate, "gate")
    w = f32_contig(_weight_f(weight, xp).reshape(-1), "weight")
    y = out if out is not None else _empty(xp, x.shape, dtype=xp.float32)
    rows = xc.size // D if D else 0
    if rows:
        kernel("dense_norms.cu", "gated_rms_norm_rows")(
            (rows,), (256,), (xc, gc, w, y, np.int64(rows), np.int32(D), np.float32(eps), np.int32(_ACTS[activation])))
    return y


def act_div(x, divisor: float, mode: str, *, out=None):
    """Elementwise ``silu(x / d)`` (mode ``'silu'``) or ``2 * sigmoid(x / d)`` (mode ``'inject'``).

    Args: x: any shape, float32. Returns: same shape float32.
    Raises: KernelInputError: unknown mode.
    """
    xp = same_device(x, out)
    if mode not in ("silu", "inject"):
        raise KernelInputError(f"mode: expected 'silu' or 'inject', found {mode!r}")
    if not is_cupy(xp):
        dt = compute_dtype(x)
        v = x.astype(dt, copy=False) / dt(divisor)
        y = _ref_norms.silu(v) if mode == "silu" else dt(2) * _ref_norms.sigmoid(v)
        if out is not None:
            out[...] = y
            return out
        return y
    xc = f32_contig(x, "x")
    y = out if out is not None else _empty(xp, x.shape, dtype=xp.float32)
    n = xc.size
    if n:
        kernel("dense_norms.cu", "act_div")(
            (-(-n // 256),), (256,), (xc, y, np.int64(n), np.float32(divisor), np.int32(0 if mode == "silu" else 1)))
    return y


@dataclass
class HCOut:
    """Result of :func:`hc_pre`.

    Attributes:
        mixed: ``[T, hidden_size]`` the block input (mean over streams of sigmoid mix * normed streams).
        injection_weights: ``[T, hc_count]`` ``2*sigmoid(W_inject normed / hc_count)``, or None
            (the final ``hyper_connection_mixer`` has no injection).
    """

    mixed: object
    injection_weights: object


def hc_pre(x, norm_weight, down_weight, up_weight, inject_weight=None, *, hc_count: int, eps: float,
           down_inject=None, normed=None) -> HCOut:
    """Hyper-connection input side (``Qwen4ExpTextGatedResidual.forward``).

    ``n = rmsnorm_grouped(x, group=H)``; ``a = silu(n @ down.T / hc)``; ``m = sigmoid(a @ up.T)``;
    ``mixed = mean_s(m_s * n_s)``; ``inj = 2 * sigmoid(n @ inject.T / hc)``.

    Args:
        x: ``[T, hc_count * H]`` float32 multi-stream residual.
        norm_weight: ``[hc_count * H]`` (``hc_norm.weight``, zero-centred).
        down_weight: ``[hc_lowrank, hc_count * H]`` (``input_mix_weight_down.weight``), BF16 bits or float32.
        up_weight: ``[hc_count * H, hc_lowrank]`` (``input_mix_weight_up.weight``).
        inject_weight: ``[hc_count, hc_count * H]`` (``block_inject_weight.weight``) or None.
        hc_count: streams; eps: ``rms_norm_eps``.
        down_inject: optional (cupy) ``[hc_lowrank + hc_count, hc_count * H]``: ``down_weight`` and
            ``inject_weight`` stacked in one matrix (the engine's fused layout; both read the same normed
            input, so one GEMV launch serves both). The per-row products are those of the separate weights.
        normed: optional (cupy) ``[T, hc_count * H]``: ``rms_norm(x, norm_weight, group_size=H)`` already
            computed (by :func:`hc_combine_norm`); it is used instead of normalising ``x`` again.
    Returns:
        :class:`HCOut` (arrays on the device of ``x``).
    Raises:
        KernelInputError: ``x``'s width not divisible by ``hc_count`` or weights mis-shaped.
    """
    xp = same_device(x, down_weight, up_weight, inject_weight)
    if x.ndim != 2 or x.shape[1] % hc_count:
        raise KernelInputError(f"x: expected [T, hc_count*H] with hc_count={hc_count}, found {tuple(x.shape)}")
    T, W = x.shape
    H = W // hc_count
    if tuple(up_weight.shape) != (W, down_weight.shape[0]):
        raise KernelInputError(f"up_weight: expected {(W, down_weight.shape[0])}, found {tuple(up_weight.shape)}")
    if not is_cupy(xp):  # NumPy twin: the shared reference function
        dt = compute_dtype(x)
        mixed, inj = _ref_hc.hyper_connection(
            x.astype(dt, copy=False), _weight_f(norm_weight, np, dt).reshape(-1), weight_as_float(down_weight, dt),
            weight_as_float(up_weight, dt), None if inject_weight is None else weight_as_float(inject_weight, dt),
            hc_count, H, eps)
        return HCOut(mixed=mixed, injection_weights=inj)
    if normed is None:
        normed = rms_norm(x, norm_weight, eps=eps, group_size=H)
    elif tuple(normed.shape) != (T, W):
        raise KernelInputError(f"normed: expected shape {(T, W)}, found {tuple(normed.shape)}")
    r = down_weight.shape[0]
    if inject_weight is not None and down_inject is not None and hc_pre_fused_ok(T, hc_count, H, r, down_inject, up_weight):
        return _hc_pre_fused(normed, down_inject, up_weight, T, H, r, hc_count)
    di = None
    if down_inject is not None and inject_weight is not None:
        di = linear(normed, down_inject)  # [T, r + hc]
        a = act_div(di[:, :r], float(hc_count), "silu")
    else:
        a = act_div(linear(normed, down_weight), float(hc_count), "silu")
    mpre = linear(a, up_weight)
    mixed = _empty(xp, (T, H), dtype=xp.float32)
    n = T * H
    if n:
        kernel("dense_norms.cu", "hc_mix")(
            (-(-n // 256),), (256,), (mpre, normed, mixed, np.int64(T), np.int32(hc_count), np.int32(H)))
    inj = None
    if inject_weight is not None:
        inj = act_div(di[:, r:] if di is not None else linear(normed, inject_weight), float(hc_count), "inject")
    return HCOut(mixed=mixed, injection_weights=inj)


#: Decode-sized steps (T <= :data:`HC_FUSED_MAX_TOKENS`) run the hyper-connection input side as three launches
#: (norm, down+inject GEMV with its activations, up GEMV with the stream mix: ``cuda/hc_fused.cu``) instead of six.
#: False restores the unfused chain (A/B in benchmarks and tests).
HC_FUSED_ENABLED = True
HC_FUSED_MAX_TOKENS = 1  # measured at real widths: T=1 fused 21.5 vs 23.8 us; T=16 fused 124.9 vs 58.9 us


def _weight_dtype_name(w) -> str | None:
    if w.dtype == np.uint16:
        return "bf16"
    if w.dtype == np.float32:
        return "f32"
    return None


def hc_pre_fused_ok(T: int, hc: int, H: int, r: int, down_inject, up_weight) -> bool:
    """Whether :func:`hc_pre` takes the fused path (pure host logic): the flag is on, ``1 <= T <= 16``,
    ``hc_count <= 8``, ``W = hc*H`` and ``r = hc_lowrank`` multiples of 8 (16-byte weight pieces) with
    ``r <= 512`` (the kernel's register tile), both weights BF16 bits or float32, C-contiguous, 16-byte aligned."""
    W = hc * H
    if not HC_FUSED_ENABLED or not 1 <= T <= HC_FUSED_MAX_TOKENS or not 1 <= hc <= 8 or W % 8 or r % 8 or r > 512:
        return False
    for w in (down_inject, up_weight):
        if _weight_dtype_name(w) is None or not w.flags.c_contiguous or w.data.ptr % 16:
            return False
    return True


def _hc_pre_fused(normed, down_inject, up_weight, T: int, H: int, r: int, hc: int) -> "HCOut":
    """The fused launches of ``cuda/hc_fused.cu`` on the grouped-normed residual ``normed [T, hc*H]``."""
    xp = xp_of(normed)
    W = hc * H
    a = _empty(xp, (T, r), dtype=xp.float32)
    inj = _empty(xp, (T, hc), dtype=xp.float32)
    mixed = _empty(xp, (T, H), dtype=xp.float32)
    tg = "t1" if T == 1 else "t4"
    pu = next((p for p in (2, 4, 5) if W <= 2048 * p), 8)  # pieces per thread: one round of loads, few registers
    hcm = 4 if hc <= 4 else 8
    kernel("hc_fused.cu", f"hc_down_act_{_weight_dtype_name(down_inject)}_{tg}_pu{pu}")(
        (r + hc,), (256,), (normed, down_inject, a, inj, np.int32(T), np.int32(W), np.int32(r), np.int32(hc)))
    # 4 warps (outputs) per block: at ~85 registers a thread, 256-thread blocks fit 2 to an SM, so H = 2560's 320
    # blocks took two waves on 132 SMs; 128-thread blocks fit 5, one wave (the same per-warp arithmetic: same bits)
    kernel("hc_fused.cu", f"hc_up_mix_{_weight_dtype_name(up_weight)}_{tg}_hc{hcm}")(
        (-(-H // 4),), (128,), (a, up_weight, normed, mixed, np.int32(T), np.int32(H), np.int32(r), np.int32(hc)),
        shared_mem=T * r * 4)
    return HCOut(mixed=mixed, injection_weights=inj)


def hc_combine(residual, block_out, injection_weights, *, out=None):
    """``out[t, s*H + h] = residual[t, s*H + h] + block_out[t, h] * injection_weights[t, s]``.

    Args:
        residual: ``[T, hc_count * H]``; block_out: ``[T, H]``; injection_weights: ``[T, hc_count]``.
        out: optional ``[T, hc_count * H]`` output; may be ``residual`` itself (in place).
    Returns:
        ``[T, hc_count * H]`` float32.
    Raises:
        KernelInputError: inconsistent shapes.
    """
    xp = same_device(residual, block_out, injection_weights, out)
    if residual.ndim != 2 or block_out.ndim != 2 or injection_weights.ndim != 2:
        raise KernelInputError("residual/block_out/injection_weights: expected 2-D [T, hc*H] / [T, H] / [T, hc], "
                               f"found {tuple(residual.shape)} / {tuple(block_out.shape)} / "
                               f"{tuple(injection_weights.shape)}")
    T, W = residual.shape
    hc = int(injection_weights.shape[1])
    H = int(block_out.shape[1])
    if hc * H != W or block_out.shape[0] != T or injection_weights.shape[0] != T:
        raise KernelInputError(f"block_out/injection_weights: expected [T={T}, H] and [T, hc] with hc*H={W}, found "
                               f"{tuple(block_out.shape)} and {tuple(injection_weights.shape)}")
    if not is_cupy(xp):
        dt = compute_dtype(residual)
        y = _ref_hc.hc_combine(residual.astype(dt, copy=False), block_out.astype(dt, copy=False),
                               injection_weights.astype(dt, copy=False))
        if out is not None:
            out[...] = y
            return out
        return y
    r, b, i = f32_contig(residual, "residual"), f32_contig(block_out, "block_out"), f32_contig(injection_weights, "inj")
    y = out if out is not None else _empty(xp, (T, W), dtype=xp.float32)
    n = T * W
    if n:
        kernel("dense_norms.cu", "hc_combine")(
            (-(-n // 256),), (256,), (r, b, i, y, np.int64(T), np.int32(hc), np.int32(H)))
    return y


def hc_combine_norm(residual, block_out, injection_weights, norm_weight, *, eps: float):
    """:func:`hc_combine` followed by the next hyper-connection's grouped norm of its result, in one launch.

    ``out = hc_combine(residual, block_out, injection_weights)``;
    ``normed = rms_norm(out, norm_weight, eps=eps, group_size=H)`` (zero-centred, per stream), both bit-identical
    to the two separate ops on the GPU (same loop, block size and reduction order; ``cuda/dense_norms.cu``).

    Args:
        residual: ``[T, hc * H]``; block_out: ``[T, H]``; injection_weights: ``[T, hc]`` (float32).
        norm_weight: ``[hc * H]`` the next hyper-connection's ``hc_norm.weight``.
        eps: ``rms_norm_eps``.
    Returns:
        ``(out, normed)``, both ``[T, hc * H]`` float32.
    Raises:
        KernelInputError: inconsistent shapes.
    """
    xp = same_device(residual, block_out, injection_weights, norm_weight)
    if not is_cupy(xp) or residual.ndim != 2 or block_out.ndim != 2 or injection_weights.ndim != 2:
        out = hc_combine(residual, block_out, injection_weights)  # the NumPy twin (and its shape errors)
        return out, rms_norm(out, norm_weight, eps=eps, group_size=int(block_out.shape[-1]))
    T, W = residual.shape
    H = int(block_out.shape[1])
    hc = int(injection_weights.shape[1])
    if hc * H != W or block_out.shape[0] != T or injection_weights.shape[0] != T:
        raise KernelInputError(f"block_out/injection_weights: expected [T={T}, H] and [T, hc] with hc*H={W}, found "
                               f"{tuple(block_out.shape)} and {tuple(injection_weights.shape)}")
    check_dim("norm_weight", int(norm_weight.size), W, "hc * H (the residual's width)")
    r, b, i = f32_contig(residual, "residual"), f32_contig(block_out, "block_out"), f32_contig(injection_weights, "inj")
    wn = f32_contig(_weight_f(norm_weight, xp).reshape(-1), "norm_weight")
    out = _empty(xp, (T, W), dtype=xp.float32)
    normed = _empty(xp, (T, W), dtype=xp.float32)
    if T:
        kernel("dense_norms.cu", "hc_combine_norm")(
            (T * hc,), (_norm_threads(H),), (r, b, i, wn, out, normed, np.int64(T), np.int32(hc), np.int32(H),
                                             np.float32(eps)))
    return out, normed
