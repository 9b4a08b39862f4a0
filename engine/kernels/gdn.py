"""Gated DeltaNet sequence kernels: causal depthwise conv (prefill + decode on state slabs), the gated delta rule
(chunked for prefill, recurrent for batched decode / verify) and the gate nonlinearities.

Every op takes numpy or cupy arrays and dispatches on :func:`engine.backend.xp_of`: cupy -> CUDA kernels from
``engine/kernels/cuda/gdn.cu``; numpy -> the NumPy twin (the CPU path CI runs), which calls the shared reference
functions (``reference.blocks.gdn`` / ``ple`` / ``norms``) for the math.

Prefill on the GPU: :func:`gated_delta_prefill` runs the one-launch recurrent kernel by default (measured faster at
the real widths on the H200); ``algorithm="chunked"`` runs the chunked form as cupy array code (batched matmuls,
one CUDA launch for the unit-lower forward substitution of every chunk at once when ``chunk_size <= 64``).
Decode and verify: :func:`gated_delta_recurrent` (one launch for a whole batch of sequences, optional per-position
state checkpoints for rollback); :func:`causal_conv_decode` (one launch per step).

State layouts (owned by the engine's pools, addressed here by slot index):
  * conv state slab ``conv_state [S, K-1, C]`` (row ``K-2`` is the newest input), C = ``2*key_dim + value_dim``;
  * recurrent state slab ``state [S, Hv, Dk, Dv]`` float32 (the official ``[Hv, k_head_dim, v_head_dim]`` layout).

Sources (modeling_qwen4_exp.py): ``causal_conv1d_fn`` / ``causal_conv1d_update`` (conv + silu, state = last K-1
inputs), ``l2norm`` (eps 1e-6 inside the rsqrt), ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
(q scaled by ``Dk ** -0.5`` after the l2norm; each key head serves ``Hv/Hk`` consecutive value heads),
``Qwen4ExpTextGatedDeltaNet.forward`` (``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``).
"""
from __future__ import annotations


import numpy as np

from engine.backend import load_module, xp_of
from reference.blocks.gdn import delta_rule_chunked, delta_rule_recurrent, l2norm
from reference.blocks.norms import sigmoid, silu, softplus
from reference.blocks.ple import dilated_causal_conv
from reference.errors import InputError

L2NORM_EPS = 1e-6  # official l2norm default, used with use_qk_l2norm_in_kernel=True
_BLOCK = 128
#: which CUDA recurrent kernel runs: in float32 (decode, verify and prefill), 8 warps per (sequence, value head, 32
#: columns), each holding 1/8 of the key rows (``gdn_recurrent_split_f32_f32``); in float64, one warp per 32 columns
#: holding every key row (``gdn_recurrent_<dtypes>``). Same math; the split kernel sums the two key-row reductions
#: per warp then over the warps (a different float32 summation order, deterministic). The split kernel measured
#: faster at a 4096-token prefill too (H100, 4 real-width layers: 359 vs 371 ms per prefill). ``None`` = no limit; a
#: number caps the average tokens per sequence of a split launch (the tests set 0 to run the one-warp kernel).
GDN_SPLIT_MAX_TPS: int | None = None
_GDN_WARPS = 8  # GDN_W in gdn.cu


# --------------------------------------------------------------------------------------------- validation helpers
def _shape(name, a, expected):
    if tuple(a.shape) != tuple(expected):
        raise InputError(f"{name}: expected shape {list(expected)}, found {list(a.shape)}")


def _ndim(name, a, n, what):
    if a.ndim != n:
        raise InputError(f"{name}: expected shape {what}, found {list(a.shape)}")


def _float(name, a):
    if a.dtype.kind != "f":
        raise InputError(f"{name}: expected a float32/float64 array, found dtype {a.dtype}")


# --------------------------------------------------------------------------------------------- gates
def gdn_gates(a, b, A_log, dt_bias):
    """Decay and write strength of the gated delta rule.

    Args:
        a: ``[T, Hv]`` float (in_proj_a output). b: ``[T, Hv]`` float (in_proj_b output).
        A_log: ``[Hv]`` float. dt_bias: ``[Hv]`` float.
    Returns:
        ``(g, beta)`` each ``[T, Hv]`` float32: ``g = -exp(A_log) * softplus(a + dt_bias)`` (log-space decay, <= 0;
        softplus with torch's threshold 20) and ``beta = sigmoid(b)``. float64 inputs give float64.
    Raises:
        InputError: shapes disagree.
    Source: modeling_qwen4_exp.py ``Qwen4ExpTextGatedDeltaNet.forward``.
    """
    xp = xp_of(a)
    _ndim("gdn_gates: a", a, 2, "[T, Hv]")
    _shape("gdn_gates: b", b, a.shape)
    _shape("gdn_gates: A_log", A_log, (a.shape[1],))
    _shape("gdn_gates: dt_bias", dt_bias, (a.shape[1],))
    dt = np.float64 if a.dtype == np.float64 else np.float32
    if xp is not np and dt == np.float32:  # one fused elementwise kernel (decode: ~13 separate cupy kernels)
        return _gates_kernel(xp)(a.astype(dt, copy=False), b.astype(dt, copy=False), A_log.astype(dt, copy=False),
                                 dt_bias.astype(dt, copy=False))
    x = a.astype(dt) + dt_bias.astype(dt)[None, :]
    if xp is np:  # NumPy twin: the reference's own nonlinearities
        return (-np.exp(A_log.astype(dt))[None, :] * softplus(x)).astype(dt), sigmoid(b.astype(dt))
    sp = xp.where(x > 20, x, xp.log1p(xp.exp(xp.minimum(x, 20))))
    g = (-xp.exp(A_log.astype(dt))[None, :] * sp).astype(dt)
    beta = (1 / (1 + xp.exp(-b.astype(dt)))).astype(dt)
    return g, beta


_GATES = {}


def _gates_kernel(cp):
    """The float32 ``gdn_gates`` as one cupy ElementwiseKernel (same operations, same order, float32)."""
    if "k" not in _GATES:
        _GATES["k"] = cp.ElementwiseKernel(
            "float32 a, float32 b, float32 A_log, float32 dt_bias", "float32 g, float32 beta",
            """
            const float x = a + dt_bias;
            const float sp = x > 20.0f ? x : log1pf(expf(fminf(x, 20.0f)));
            g = -expf(A_log) * sp;
            beta = 1.0f / (1.0f + expf(-b));
            """, "qwen4exp_gdn_gates")
    return _GATES["k"]


# --------------------------------------------------------------------------------------------- causal conv
def _check_conv(x, weight, conv_state):
    _ndim("gdn conv: x", x, 2, "[T, C]")
    _ndim("gdn conv: weight", weight, 2, "[C, K]")
    C, K = weight.shape
    if x.shape[1] != C:
        raise InputError(f"gdn conv: x: expected {C} channels (conv weight [C, K]), found {x.shape[1]}")
    _ndim("gdn conv: conv_state", conv_state, 3, "[S, K-1, C]")
    if conv_state.shape[1:] != (K - 1, C):
        raise InputError(f"gdn conv: conv_state: expected shape [S, {K - 1}, {C}], found {list(conv_state.shape)}")
    for n, a in (("x", x), ("weight", weight), ("conv_state", conv_state)):
        _float("gdn conv: " + n, a)


def causal_conv_prefill(x, weight, conv_state, slot: int, checkpoints=None):
    """Causal depthwise conv + silu over ``T`` new inputs of one sequence, continuing from its carried state.

    Args:
        x: ``[T, C]`` float32/float64 inputs (in_proj_qkv output).
        weight: ``[C, K]`` float (conv1d weight squeezed), same array module.
        conv_state: ``[S, K-1, C]`` slab; row ``slot`` holds the last K-1 inputs before ``x`` (zeros for a new
            sequence). Updated IN PLACE to the last K-1 inputs of ``concat(state, x)``.
        slot: int, the sequence's slab row.
        checkpoints: optional ``[T, K-1, C]`` (state dtype): row ``t`` receives the conv state after input ``t``
            (for verify/rollback).
    Returns:
        ``[T, C]`` of x's dtype: ``silu(sum_j weight[:, j] * window[j])`` with window ``concat(state, x)``.
    Raises:
        InputError: shapes/dtypes/slot inconsistent.
    Source: modeling_qwen4_exp.py ``causal_conv1d_fn`` / ``causal_conv1d_update``.
    """
    xp = xp_of(x)
    _check_conv(x, weight, conv_state)
    slot = int(slot)
    if not 0 <= slot < conv_state.shape[0]:
        raise InputError(f"gdn conv: slot: expected in [0, {conv_state.shape[0]}), found {slot}")
    T, C = x.shape
    K = weight.shape[1]
    if checkpoints is not None:
        _shape("gdn conv: checkpoints", checkpoints, (T, K - 1, C))
    if xp is np:  # NumPy twin: the reference conv (dilation 1) + silu
        old = conv_state[slot].astype(x.dtype)
        y, new_state = dilated_causal_conv(x, old, weight.astype(x.dtype), 1)
        if checkpoints is not None:
            full = np.concatenate([old, x], axis=0)
            for t in range(T):
                checkpoints[t] = full[t + 1:t + K]
        conv_state[slot] = new_state
        return silu(y)
    import cupy as cp
    if K - 1 > 16:
        raise InputError(f"gdn conv: kernel size: the CUDA conv carries at most 16 state rows, found K={K}")
    x = cp.ascontiguousarray(x)
    w = cp.ascontiguousarray(weight, dtype=x.dtype)
    out = cp.empty_like(x)
    if T == 0:
        return out
    sfx = _sfx(x.dtype, conv_state.dtype)
    _inplace_ok("conv_state", conv_state)
    if checkpoints is not None:
        _inplace_ok("checkpoints", checkpoints)
    mod = load_module("gdn.cu")
    ck = checkpoints if checkpoints is not None else x  # dummy pointer when unused
    n = T * C
    mod.get_function("gdn_conv_prefill_" + sfx)(
        ((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,),
        (x, w, conv_state, ck, out, np.int64(T), np.int32(C), np.int32(K), np.int64(slot),
         np.int32(checkpoints is not None)))
    mod.get_function("gdn_conv_state_update_" + sfx)(
        ((C + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (x, conv_state, np.int64(T), np.int32(C), np.int32(K), np.int64(slot)))
    return out


def causal_conv_decode(x, weight, conv_state, slots):
    """One conv step for a batch of sequences (one input each), one launch, state rows updated IN PLACE.

    Args:
        x: ``[B, C]`` float inputs (one per sequence). weight: ``[C, K]``.
        conv_state: ``[S, K-1, C]`` slab. slots: ``[B]`` int32/int64 slab rows (distinct).
    Returns:
        ``[B, C]``: silu of the conv over ``concat(conv_state[slot], x[b])``; each state row shifted by one.
    Raises:
        InputError: shapes inconsistent.
    Source: modeling_qwen4_exp.py ``causal_conv1d_update``.
    """
    xp = xp_of(x)
    _check_conv(x, weight, conv_state)
    B, C = x.shape
    K = weight.shape[1]
    _shape("gdn conv decode: slots", slots, (B,))
    if xp is np:  # NumPy twin: the reference conv per sequence (one input each)
        out = np.empty_like(x)
        for b in range(B):
            sb = int(slots[b])
            y, conv_state[sb] = dilated_causal_conv(x[b:b + 1], conv_state[sb].astype(x.dtype),
                                                    weight.astype(x.dtype), 1)
            out[b] = silu(y)[0]
        return out
    import cupy as cp
    x = cp.ascontiguousarray(x)
    w = cp.ascontiguousarray(weight, dtype=x.dtype)
    sl = cp.ascontiguousarray(slots, dtype=cp.int64)
    _inplace_ok("conv_state", conv_state)
    out = cp.empty_like(x)
    n = B * C
    if n:
        load_module("gdn.cu").get_function("gdn_conv_decode_" + _sfx(x.dtype, conv_state.dtype))(
            ((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (x, w, conv_state, sl, out, np.int64(B), np.int32(C), np.int32(K)))
    return out


def _inplace_ok(name, a):
    if not a.flags.c_contiguous:
        raise InputError(f"gdn: {name}: expected a C-contiguous slab (updated in place), found strides {a.strides}")


def _sfx(xdt, sdt):
    xs = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
    if np.dtype(xdt) not in xs or np.dtype(sdt) not in xs:
        raise InputError(f"gdn: expected float32/float64 activations and state, found {xdt} and {sdt}")
    return xs[np.dtype(xdt)] + "_" + xs[np.dtype(sdt)]


# --------------------------------------------------------------------------------------------- delta rule
def _check_delta(q, k, v, g, beta, state):
    _ndim("gated delta: q", q, 3, "[T, Hk, Dk]")
    T, Hk, Dk = q.shape
    _shape("gated delta: k", k, q.shape)
    _ndim("gated delta: v", v, 3, "[T, Hv, Dv]")
    if v.shape[0] != T:
        raise InputError(f"gated delta: v: expected {T} positions (q), found {v.shape[0]}")
    Hv, Dv = v.shape[1:]
    if Hv % Hk:
        raise InputError(f"gated delta: v heads: expected a multiple of the {Hk} key heads, found {Hv}")
    _shape("gated delta: g", g, (T, Hv))
    _shape("gated delta: beta", beta, (T, Hv))
    _ndim("gated delta: state", state, 4, "[S, Hv, Dk, Dv]")
    if state.shape[1:] != (Hv, Dk, Dv):
        raise InputError(f"gated delta: state: expected shape [S, {Hv}, {Dk}, {Dv}], found {list(state.shape)}")
    for n, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        _float("gated delta: " + n, a)
    return T, Hk, Dk, Hv, Dv


def _prep_qk(xp, q, k, Hv, dt):
    """l2-normalise q, k per head (eps inside the rsqrt), scale q by Dk**-0.5, expand to the Hv value heads."""
    q = q.astype(dt)
    k = k.astype(dt)
    q = q / xp.sqrt((q * q).sum(-1, keepdims=True) + L2NORM_EPS)
    k = k / xp.sqrt((k * k).sum(-1, keepdims=True) + L2NORM_EPS)
    q = q * dt(q.shape[-1] ** -0.5)
    rep = Hv // q.shape[1]
    if rep > 1:
        q = xp.repeat(q, rep, axis=1)
        k = xp.repeat(k, rep, axis=1)
    return q, k


def _unit_lower_solve(xp, L, rhs):
    """Solve ``(I + L) X = rhs`` for strictly lower-triangular ``L [..., C, C]`` by forward substitution
    (vectorised over all leading dims). On the GPU, float32 with C <= 64: one CUDA launch
    (``gdn_unit_lower_solve_f32``, a thread per right-hand-side column); otherwise array code row by row."""
    C = L.shape[-1]
    if xp is not np and rhs.dtype == np.float32 and C <= 64:
        W = rhs.shape[-1]
        Lc = xp.ascontiguousarray(L, dtype=np.float32).reshape(-1, C, C)
        X = xp.ascontiguousarray(rhs).copy().reshape(-1, C, W)
        if X.shape[0]:
            load_module("gdn.cu").get_function("gdn_unit_lower_solve_f32")(
                (X.shape[0], (W + 63) // 64), (64,), (Lc, X, np.int32(C), np.int32(W)))
        return X.reshape(rhs.shape)
    X = rhs.copy()
    for i in range(1, C):
        X[..., i, :] -= (L[..., i:i + 1, :i] @ X[..., :i, :])[..., 0, :]
    return X


def gated_delta_prefill(q, k, v, g, beta, state, slot: int, chunk_size: int = 64, algorithm: str = "auto"):
    """Gated delta rule over ``T`` positions of one sequence (prefill), continuing from ``state[slot]``.

    ``algorithm``: ``"chunked"`` (the chunked form below), ``"recurrent"`` (the token-by-token CUDA kernel of
    :func:`gated_delta_recurrent`, one launch) or ``"auto"``: NumPy -> the reference's chunked form; GPU -> the
    recurrent kernel, measured faster on the H200 (T=2048 at the real widths: 4.5 ms vs 18.7 ms for the chunked
    array code; see tests/engine/test_qsa.py::test_seq_kernels_timing_summary).

    Args:
        q, k: ``[T, Hk, Dk]`` float (post-conv, NOT yet normalised: the l2norm + ``Dk**-0.5`` happen here).
        v: ``[T, Hv, Dv]`` float. g: ``[T, Hv]`` log decay (<= 0). beta: ``[T, Hv]`` in (0, 1).
        state: ``[S, Hv, Dk, Dv]`` recurrent slab; row ``slot`` updated IN PLACE to the state after position T-1.
        slot: int slab row. chunk_size: positions per chunk (any positive int; 64 like the official default).
    Returns:
        ``[T, Hv, Dv]`` float32 (float64 when q is float64): the delta-rule read-out per position.
    Raises:
        InputError: shapes/dtypes inconsistent, slot out of range, chunk_size < 1.
    Math: within a chunk, with cumulative log decay ``G`` and ``D_ij = exp(G_i - G_j)`` (i >= j), solve the unit
    lower system ``(I + tril(beta k k^T * D, -1)) [U | W] = [beta v | beta k exp(G)]``, then per chunk
    ``V' = U - W S``, ``o = (q exp(G)) S + tril(q k^T * D) V'``, ``S <- exp(G_last) S + (k exp(G_last - G))^T V'``.
    Source: modeling_qwen4_exp.py ``torch_chunk_gated_delta_rule``.
    """
    xp = xp_of(q)
    T, Hk, Dk, Hv, Dv = _check_delta(q, k, v, g, beta, state)
    slot = int(slot)
    if not 0 <= slot < state.shape[0]:
        raise InputError(f"gated delta: slot: expected in [0, {state.shape[0]}), found {slot}")
    if int(chunk_size) < 1:
        raise InputError(f"gated delta: chunk_size: expected >= 1, found {chunk_size}")
    if algorithm not in ("auto", "chunked", "recurrent"):
        raise InputError(f"gated delta: algorithm: expected 'auto', 'chunked' or 'recurrent', found {algorithm!r}")
    dt = np.float64 if q.dtype == np.float64 else np.float32
    if T == 0:
        return xp.zeros((0, Hv, Dv), dtype=dt)
    if algorithm == "recurrent" or (algorithm == "auto" and xp is not np):
        sl = xp.asarray(np.array([slot], dtype=np.int64))
        cu = xp.asarray(np.array([0, T], dtype=np.int64))
        return gated_delta_recurrent(q, k, v, g, beta, state, sl, cu)
    if xp is np:  # NumPy twin: the reference's chunked delta rule on the normalised q, k
        qn = l2norm(q.astype(dt), L2NORM_EPS) * dt(Dk ** -0.5)
        kn = l2norm(k.astype(dt), L2NORM_EPS)
        out, S = delta_rule_chunked(qn, kn, v.astype(dt), g.astype(dt), beta.astype(dt), state[slot].astype(dt),
                                    int(chunk_size))
        state[slot] = S
        return out
    return _chunked_xp(xp, q, k, v, g, beta, state, slot, int(chunk_size))


def _chunked_xp(xp, q, k, v, g, beta, state, slot, C):
    """The GPU prefill algorithm as array code (cupy on the GPU; also runs on numpy so CI exercises it).

    Same contract as :func:`gated_delta_prefill`. All chunks are prepared at once (batched matmuls over
    ``[Hv, n_chunks]``, one forward substitution over the chunk rows for every chunk together); only the state
    hand-over between chunks is sequential.
    """
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    dt = np.float64 if q.dtype == np.float64 else np.float32
    qn, kn = _prep_qk(xp, q, k, Hv, dt)
    pad = (-T) % C
    N = (T + pad) // C

    def heads_first(a, fill_shape):  # [T, Hv, ...] -> [Hv, N, C, ...] zero padded
        a = a.astype(dt)
        if pad:
            a = xp.concatenate([a, xp.zeros((pad,) + fill_shape, dtype=dt)], axis=0)
        a = xp.moveaxis(a, 1, 0)
        return a.reshape((Hv, N, C) + a.shape[2:])

    Q = heads_first(qn, (Hv, Dk))
    Kc = heads_first(kn, (Hv, Dk))
    V = heads_first(v, (Hv, Dv))
    Gl = heads_first(g, (Hv,))
    Bt = heads_first(beta, (Hv,))
    G = xp.cumsum(Gl, axis=-1)  # [Hv, N, C]
    diff = G[..., :, None] - G[..., None, :]
    lower = xp.tril(xp.ones((C, C), dtype=bool))
    Dm = xp.where(lower, xp.exp(xp.where(lower, diff, 0)), 0).astype(dt)  # [Hv, N, C, C]
    kb = Kc * Bt[..., None]
    L = xp.tril(kb @ xp.swapaxes(Kc, -1, -2) * Dm, -1)
    eG = xp.exp(G)
    rhs = xp.concatenate([V * Bt[..., None], kb * eG[..., None]], axis=-1)
    X = _unit_lower_solve(xp, L, rhs)
    U, W = X[..., :Dv], X[..., Dv:]
    intra = (Q @ xp.swapaxes(Kc, -1, -2)) * Dm
    Qd = Q * eG[..., None]
    glast = G[..., -1:]
    Kd = Kc * xp.exp(glast - G)[..., None]
    cdec = xp.exp(glast)[..., None]  # [Hv, N, 1, 1]
    S = state[slot].astype(dt)
    out = xp.empty((Hv, N, C, Dv), dtype=dt)
    for n in range(N):
        vn = U[:, n] - W[:, n] @ S
        out[:, n] = Qd[:, n] @ S + intra[:, n] @ vn
        S = S * cdec[:, n] + xp.swapaxes(Kd[:, n], -1, -2) @ vn
    state[slot] = S.astype(state.dtype)
    out = out.reshape(Hv, N * C, Dv)[:, :T]
    return xp.ascontiguousarray(xp.moveaxis(out, 0, 1))


def gated_delta_recurrent(q, k, v, g, beta, state, slots, cu_seqlens=None, checkpoints=None):
    """Token-by-token gated delta rule for a batch of sequences in ONE launch (decode: one token each; verify:
    k tokens of one sequence with per-position checkpoints). State rows are updated IN PLACE.

    Args:
        q, k: ``[N, Hk, Dk]`` float (normalised and scaled here, like :func:`gated_delta_prefill`).
        v: ``[N, Hv, Dv]``. g, beta: ``[N, Hv]``.
        state: ``[S, Hv, Dk, Dv]`` slab. slots: ``[B]`` int slab rows (distinct).
        cu_seqlens: ``[B+1]`` int, tokens ``cu[b]:cu[b+1]`` belong to ``slots[b]``; None means one token per slot
            (``N == B``). On the GPU it stays on the device (no host sync).
        checkpoints: optional ``[N, Hv, Dk, Dv]`` (state dtype) receiving the state after each token.
    Returns:
        ``[N, Hv, Dv]`` float32 (float64 for float64 q).
    Raises:
        InputError: shapes inconsistent.
    Source: modeling_qwen4_exp.py ``torch_recurrent_gated_delta_rule``.
    """
    xp = xp_of(q)
    N, Hk, Dk, Hv, Dv = _check_delta(q, k, v, g, beta, state)
    _ndim("gated delta: slots", slots, 1, "[B]")
    B = slots.shape[0]
    if cu_seqlens is None:
        if B != N:
            raise InputError(f"gated delta: slots: expected {N} entries (one per token when cu_seqlens is None), "
                             f"found {B}")
    else:
        _shape("gated delta: cu_seqlens", cu_seqlens, (B + 1,))
    if checkpoints is not None:
        _shape("gated delta: checkpoints", checkpoints, (N, Hv, Dk, Dv))
    dt = np.float64 if q.dtype == np.float64 else np.float32
    if xp is np:
        cu = np.arange(B + 1) if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
        if cu[0] != 0 or cu[-1] != N or np.any(np.diff(cu) < 0):
            raise InputError(f"gated delta: cu_seqlens: expected non-decreasing offsets from 0 to {N}, found {cu}")
        qn = l2norm(q.astype(dt), L2NORM_EPS) * dt(Dk ** -0.5)  # NumPy twin: the reference recurrence
        kn = l2norm(k.astype(dt), L2NORM_EPS)
        vv, gg, bb = v.astype(dt), g.astype(dt), beta.astype(dt)
        out = np.empty((N, Hv, Dv), dtype=dt)
        for b in range(B):
            s = int(slots[b])
            lo, hi = int(cu[b]), int(cu[b + 1])
            if checkpoints is None:
                out[lo:hi], S = delta_rule_recurrent(qn[lo:hi], kn[lo:hi], vv[lo:hi], gg[lo:hi], bb[lo:hi],
                                                     state[s].astype(dt))
            else:
                S = state[s].astype(dt)
                for t in range(lo, hi):
                    out[t:t + 1], S = delta_rule_recurrent(qn[t:t + 1], kn[t:t + 1], vv[t:t + 1], gg[t:t + 1],
                                                           bb[t:t + 1], S)
                    checkpoints[t] = S
            state[s] = S
        return out
    return _recurrent_cuda(q, k, v, g, beta, state, slots, cu_seqlens, checkpoints, None)


def _token_rows(cp, a, dt):
    """``a [N, H, D]`` as float32 with contiguous ``[H, D]`` token rows and a whole-float row stride: a column
    slice of the conv output as is (no copy), anything else made contiguous."""
    a = a if a.dtype == dt else a.astype(dt)
    if a.shape[0] > 1 and (a.strides[2] != 4 or a.strides[1] != 4 * a.shape[2] or a.strides[0] % 4
                           or a.strides[0] < 4 * a.shape[1] * a.shape[2]):
        a = cp.ascontiguousarray(a)
    if a.shape[0] <= 1 and not a.flags.c_contiguous:
        a = cp.ascontiguousarray(a)
    return a


def _recurrent_cuda(q, k, v, g, beta, state, slots, cu_seqlens, checkpoints, gates):
    """The CUDA recurrence (shapes checked by the caller). ``gates``: None, or ``(a, b, A_log, dt_bias)`` float32
    to fuse :func:`gdn_gates` into the split kernel (``g``/``beta`` unused then)."""
    import cupy as cp
    N, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    B = slots.shape[0]
    dt = np.float64 if q.dtype == np.float64 else np.float32
    out = cp.empty((N, Hv, Dv), dtype=dt)
    if N == 0:
        return out
    split = (dt == np.float32 and state.dtype == np.float32 and Dk >= _GDN_WARPS
             and (GDN_SPLIT_MAX_TPS is None or N <= GDN_SPLIT_MAX_TPS * B))
    if gates is not None and not split:  # the unfused path: the gates kernel, then the recurrence
        g, beta = gdn_gates(*gates)
        gates = None
    if split:
        sl = cp.ascontiguousarray(slots, dtype=cp.int64)
        cu = np.uint64(0) if cu_seqlens is None else cp.ascontiguousarray(cu_seqlens, dtype=cp.int64)  # null: 1/seq
        qkv = [_token_rows(cp, a, dt) for a in (q, k, v)]
        lds = [np.int64(a.strides[0] // 4) for a in qkv]
        if gates is not None:
            gb = [cp.ascontiguousarray(a, dtype=dt) for a in gates]
            gbeta = [np.uint64(0), np.uint64(0)]
        else:
            gb = [np.uint64(0)] * 4
            gbeta = [cp.ascontiguousarray(a, dtype=dt) for a in (g, beta)]
        _inplace_ok("state", state)
        if checkpoints is not None:
            _inplace_ok("checkpoints", checkpoints)
        ck = checkpoints if checkpoints is not None else state
        load_module("gdn.cu", (f"-DGDN_DK={Dk}",)).get_function("gdn_recurrent_split_f32_f32")(
            (B, Hv, (Dv + 31) // 32), (32 * _GDN_WARPS,),
            (*qkv, *gbeta, state, sl, cu, ck, out, np.int32(Hk), np.int32(Hv), np.int32(Dv),
             np.int32(checkpoints is not None), np.float32(L2NORM_EPS), *gb, *lds))
        return out
    cu = cp.arange(B + 1, dtype=cp.int64) if cu_seqlens is None else cp.ascontiguousarray(cu_seqlens, dtype=cp.int64)
    sl = cp.ascontiguousarray(slots, dtype=cp.int64)
    args = [cp.ascontiguousarray(a, dtype=dt) for a in (q, k, v, g, beta)]
    _inplace_ok("state", state)
    if checkpoints is not None:
        _inplace_ok("checkpoints", checkpoints)
    ck = checkpoints if checkpoints is not None else state
    sfx = _sfx(dt, state.dtype)
    mod = load_module("gdn.cu", (f"-DGDN_DK={Dk}",))
    warps = (Dv + 31) // 32
    mod.get_function("gdn_recurrent_" + sfx)(
        (B, Hv, warps), (32,),
        (*args, state, sl, cu, ck, out, np.int32(Hk), np.int32(Hv), np.int32(Dv),
         np.int32(checkpoints is not None), np.float32(L2NORM_EPS)))
    return out


def gated_delta_decode(q, k, v, g, beta, state, slots):
    """One decode step for ``B`` sequences: :func:`gated_delta_recurrent` with one token per slot.

    Shapes: q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``; state ``[S, Hv, Dk, Dv]`` (rows
    ``slots`` updated in place); returns ``[B, Hv, Dv]``.
    """
    return gated_delta_recurrent(q, k, v, g, beta, state, slots)


def gated_delta_decode_gates(q, k, v, a, b, A_log, dt_bias, state, slots):
    """:func:`gdn_gates` + :func:`gated_delta_decode` in one call: on the GPU (float32, the split kernel)
    the gates are computed inside the recurrent kernel (one launch instead of two; the same float32 formula, but not
    bitwise the two-launch result: the in-kernel exp / log1p may differ from the gates kernel's by an ulp, measured
    on the H200 as last-ulp differences of the read-out).

    Shapes: q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; a, b ``[B, Hv]`` (in_proj_a / in_proj_b outputs); A_log,
    dt_bias ``[Hv]``; state ``[S, Hv, Dk, Dv]`` (rows ``slots`` updated in place); returns ``[B, Hv, Dv]``.
    Raises: InputError (shapes inconsistent). Source: ``Qwen4ExpTextGatedDeltaNet.forward``.
    """
    xp = xp_of(q)
    if xp is np or q.dtype != np.float32 or a.dtype != np.float32:
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        return gated_delta_recurrent(q, k, v, g, beta, state, slots)
    _ndim("gdn_gates: a", a, 2, "[T, Hv]")
    _shape("gdn_gates: b", b, a.shape)
    _shape("gdn_gates: A_log", A_log, (a.shape[1],))
    _shape("gdn_gates: dt_bias", dt_bias, (a.shape[1],))
    N, Hk, Dk, Hv, Dv = _check_delta(q, k, v, a, b, state)
    _ndim("gated delta: slots", slots, 1, "[B]")
    if slots.shape[0] != N:
        raise InputError(f"gated delta: slots: expected {N} entries (one per token), found {slots.shape[0]}")
    f32 = [A.astype(np.float32, copy=False) for A in (a, b, A_log, dt_bias)]
    return _recurrent_cuda(q, k, v, None, None, state, slots, None, None, tuple(f32))
