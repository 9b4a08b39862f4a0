"""Benchmark of the dense CUDA kernels at the real model widths (hidden 2560, 512 experts top-10 of
width 640, hc_count 4, hc_lowrank 320, PLE 16 heads x 160).

Run on a GPU: ``python -m lab.bench_dense [--json OUT]``. The ``gemv_bf16_mma_*`` /
``gemv_bf16_fma_*`` rows time the BF16 GEMV at 4 and 16 rows with the tensor-core kernel
(``dense_linear_mma.cu``) and with the float32-FMA kernel (``linear.MMA_GEMV_ENABLED`` off). Times are CUDA-event medians
over repeated launches on fresh random (never zero) data; bandwidth figures count the bytes each
kernel must move at least (weights + activations) and are compared with a device-to-device copy
measured in the same run (read + write bytes / time).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def _timer(cp, fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    ts = sorted(cp.cuda.get_elapsed_time(a, b) for a, b in ev)
    return ts[len(ts) // 2] * 1e-3  # seconds


def _graph_timer(cp, fn, reps=20):
    """Median time of ``fn`` captured as one CUDA graph (kernel time without Python launch overhead)."""
    fn()
    fn()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        fn()
        graph = s.end_capture()
        for _ in range(3):
            graph.launch(stream=s)
        ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
        for a, b in ev:
            a.record(s)
            graph.launch(stream=s)
            b.record(s)
        ev[-1][1].synchronize()
    ts = sorted(cp.cuda.get_elapsed_time(a, b) for a, b in ev)
    return ts[len(ts) // 2] * 1e-3


def main(argv=None) -> int:
    """Time the dense engine kernels on the GPU (needs cupy) and print one ``name value`` line per result.

    Args:
        argv: command-line arguments (``--json FILE`` also writes the results there as JSON, atomically).

    Returns:
        0. Times are in microseconds (``*_us``), bandwidths in GB/s (``*_GBps``).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import cupy as cp

    from engine.kernels import linear as L
    from engine.kernels import moe as M
    from engine.kernels import norms as N
    from engine.kernels import ple as P

    rs = cp.random.RandomState(1)
    res = {}

    def bf16(*shape, scale=0.05):
        a = (rs.standard_normal(shape, dtype=cp.float32) * scale)
        return (a.view(cp.uint32) >> 16).astype(cp.uint16)  # truncation is fine for timing data

    # device-to-device copy ceiling
    n = 1 << 28  # 1 GiB of float32
    src = rs.standard_normal(n, dtype=cp.float32)
    dst = cp.empty_like(src)
    t = _timer(cp, lambda: dst.__setitem__(Ellipsis, src), reps=10)
    copy_gbs = 2 * src.nbytes / t / 1e9
    res["d2d_copy_GBps"] = copy_gbs
    del src, dst

    H = 2560
    # decode GEMV: a large BF16 matrix (lm_head-like rows) at K = hidden
    for (Nn, K, label) in ((131072, H, "gemv_131072x2560"), (2560, 10240, "gemv_2560x10240_hc"),
                           (320, 10240, "gemv_320x10240_hcdown")):
        w = bf16(Nn, K)
        for m in (1, 4, 16):
            x = rs.standard_normal((m, K), dtype=cp.float32)
            y = cp.empty((m, Nn), cp.float32)
            t = _timer(cp, lambda: L.linear(x, w, out=y))
            gbs = (w.nbytes + x.nbytes + y.nbytes) / t / 1e9
            res[f"{label}_M{m}_us"] = t * 1e6
            res[f"{label}_M{m}_GBps"] = gbs
            res[f"{label}_M{m}_frac_of_copy"] = gbs / copy_gbs
        res[f"{label}_tokrate_M16_over_M1"] = 16 * res[f"{label}_M1_us"] / res[f"{label}_M16_us"]
        # GEMV BF16 MMA (tensor-core kernel, dense_linear_mma.cu) vs the float32-FMA GEMV at 4/16 rows
        for m in (4, 16):
            x = rs.standard_normal((m, K), dtype=cp.float32)
            y = cp.empty((m, Nn), cp.float32)
            prev = L.MMA_GEMV_ENABLED
            try:
                for on, tag in ((True, "mma"), (False, "fma")):
                    L.MMA_GEMV_ENABLED = on
                    t = _timer(cp, lambda: L.linear(x, w, out=y))
                    res[f"gemv_bf16_{tag}_{label[5:]}_M{m}_us"] = t * 1e6
                    res[f"gemv_bf16_{tag}_{label[5:]}_M{m}_GBps"] = (w.nbytes + x.nbytes + y.nbytes) / t / 1e9
            finally:
                L.MMA_GEMV_ENABLED = prev
            res[f"gemv_bf16_mma_{label[5:]}_M{m}_speedup"] = (res[f"gemv_bf16_fma_{label[5:]}_M{m}_us"]
                                                               / res[f"gemv_bf16_mma_{label[5:]}_M{m}_us"])
        del w
    # fp32 weights GEMV
    w = rs.standard_normal((32768, H), dtype=cp.float32)
    x = rs.standard_normal((1, H), dtype=cp.float32)
    t = _timer(cp, lambda: L.linear(x, w))
    res["gemv_f32_32768x2560_M1_GBps"] = w.nbytes / t / 1e9
    del w
    # prefill GEMM
    w = bf16(H * 4, H)
    for m in (64, 512):
        x = rs.standard_normal((m, H), dtype=cp.float32)
        t = _timer(cp, lambda: L.linear(x, w), reps=5)
        res[f"gemm_bf16_{m}x2560x10240_TFLOPs"] = 2 * m * H * H * 4 / t / 1e12
    del w
    # MoE at real width
    E, I, k, Is = 512, 640, 10, 640
    gu, dn = bf16(E, 2 * I, H), bf16(E, H, I)
    router = bf16(E, H)
    sg, su, sd, sgt = bf16(Is, H), bf16(Is, H), bf16(H, Is), bf16(1, H)
    for T in (1, 16, 512):
        x = rs.standard_normal((T, H), dtype=cp.float32)
        ids, wts = M.router_topk(L.linear(x, router), k, True)
        route = M.moe_route_tables(ids, E)
        t = _timer(cp, lambda: M.moe_experts(x, ids, wts, gu, dn, route=route), reps=10 if T > 16 else 20)
        n_exp = int(cp.unique(ids).size)
        bytes_min = n_exp * 3 * I * H * 2
        res[f"moe_experts_T{T}_us"] = t * 1e6
        res[f"moe_experts_T{T}_GBps_unique_experts"] = bytes_min / t / 1e9
        blk = (lambda: M.moe_block(x, router, gu, dn, top_k=k, shared_gate_proj=sg, shared_up_proj=su,
                                   shared_down_proj=sd, shared_expert_gate=sgt))
        t = _timer(cp, blk, reps=10 if T > 16 else 20)
        res[f"moe_block_T{T}_eager_us"] = t * 1e6
        tg = _graph_timer(cp, blk, reps=10 if T > 16 else 20)
        res[f"moe_block_T{T}_us"] = tg * 1e6
        if T == 1:  # bytes the decode step must read: 10 experts, router, shared expert
            res["moe_block_T1_GBps"] = (n_exp * 3 * I * H * 2 + E * H * 2 + 3 * Is * H * 2) / tg / 1e9
    res["moe_tokrate_T16_over_T1"] = 16 * res["moe_block_T1_us"] / res["moe_block_T16_us"]
    del gu, dn
    # hyper-connection at real width
    hc, r = 4, 320
    nw = rs.standard_normal(hc * H, dtype=cp.float32) * 0.1
    down, up, inj = bf16(r, hc * H), bf16(hc * H, r), bf16(hc, hc * H)
    for T in (1, 16):
        x = rs.standard_normal((T, hc * H), dtype=cp.float32)
        f = (lambda: N.hc_pre(x, nw, down, up, inj, hc_count=hc, eps=1e-6))
        res[f"hc_pre_T{T}_eager_us"] = _timer(cp, f) * 1e6
        res[f"hc_pre_T{T}_us"] = _graph_timer(cp, f) * 1e6
    # PLE at real width: 16 heads x 160 = 2560
    D, K, dil = 2560, 4, 3
    kp, vp = bf16(hc * H, D), bf16(H, D)
    cw = rs.standard_normal((hc * H, K), dtype=cp.float32)
    slab = cp.zeros((64, (K - 1) * dil, hc * H), cp.float32)
    for B in (1, 16):
        hid = rs.standard_normal((B, 1, hc * H), dtype=cp.float32)
        emb = rs.standard_normal((B, 1, D), dtype=cp.float32)
        slots = cp.arange(B, dtype=cp.int64)

        def f():  # the layer as engine.model.Engine._ple composes it: projections, gate, conv
            e2, h2 = emb.reshape(B, D), hid.reshape(B, hc * H)
            pg = P.ple_gate(L.linear(e2, kp), L.linear(e2, vp), h2, nw, nw, nw, hc_count=hc, eps=1e-6)
            return pg.gated + P.ple_conv(pg.gated_normed.reshape(B, 1, hc * H), slab, slots, cw,
                                         dilation=dil).reshape(B, hc * H)
        res[f"ple_layer_B{B}_eager_us"] = _timer(cp, f) * 1e6
        res[f"ple_layer_B{B}_us"] = _graph_timer(cp, f) * 1e6
    width = max(len(k_) for k_ in res)
    for k_, v in res.items():
        print(f"{k_:<{width}}  {v:12.3f}")
    if args.json:
        from reference.atomic import atomic_write_json
        atomic_write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
