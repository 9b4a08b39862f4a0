"""Micro-benchmark of the quantised decode GEMVs (``engine/kernels/cuda/quant_linear.cu``) at the routed-expert
shapes of the real model: gate_up ``[10 experts x 1280 x 2560]`` and down ``[10 x 2560 x 640]``, FP8 and NVFP4,
1 / 4 / 16 activation rows per expert, grouped (the MoE launch, through its device tile table) and dense (one
matrix of the same bytes): the tensor-core GEMV (``qmma``) and the streaming
``qgemv2_*`` kernels (``v2``, the default configuration, and every other instantiated configuration:
``v2_g{G}_r{RL}_u{U}``).

Run on a GPU: ``python -m lab.bench_quant [--reps 50] [--quick] [--json OUT]``. Consecutive launches
read different groups of 10 experts out of a stack of 3x the L2 cache (so weights come from HBM, as in a decode
step); times are CUDA-event medians over ``--reps`` replays of a CUDA graph of the launches (:func:`_median_us`);
GB/s counts the bytes a launch must move (codes + scales + global scales of the 10 experts, activations, outputs).
``d2d_copy_GBps`` is a device-to-device copy in the same run (read + write bytes / time); ``*_frac`` = GB/s over it.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

SHAPES = {"gate_up": (1280, 2560), "down": (2560, 640)}  # [N, K] of one expert
TOP_K = 10


def _weights(cp, fmt, E, N, K, seed):
    """A random stored-format expert stack on the device (no NaN codes; NVFP4 scales ~2^-3 .. 2^2)."""
    from engine.kernels.quant import QuantWeight
    rs = cp.random.RandomState(seed)
    if fmt == "fp8":
        q = rs.randint(0, 256, size=(E, N, K), dtype=cp.int32).astype(cp.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F
        s = rs.uniform(0.001, 0.02, size=(E, -(-N // 128), -(-K // 128))).astype(cp.float32)
        return QuantWeight("fp8", (E, N, K), q, s, rb=128, cb=128)
    q = rs.randint(0, 256, size=(E, N, K // 2), dtype=cp.int32).astype(cp.uint8)
    sc = rs.randint(0x20, 0x48, size=(E, N, K // 16), dtype=cp.int32).astype(cp.uint8)
    s2 = rs.uniform(0.001, 0.01, size=(E * 2,)).astype(cp.float32)
    return QuantWeight("nvfp4", (E, N, K), q, sc, s2, s2_rows=N // 2)


def _expert_bytes(w) -> int:
    return w.nbytes // w.n_experts


def _median_us(cp, fns, reps):
    """Median CUDA-event time (us) of one ``fns[i]()`` call: ``fns`` (each twice) captured as one CUDA graph (the
    launches back to back, as in a decode step's graph, without Python's launch overhead between them), the
    graph replayed ``reps`` times between event pairs; the median replay time over the number of calls."""
    for f in fns:
        f()
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for _ in range(2):
            for f in fns:
                f()
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
    return ts[len(ts) // 2] * 1e3 / (2 * len(fns))


def _variants(L, fmt, rpt):
    """(label, tensor-core flag, config) for one activation-row tile: qmma (the tensor-core GEMV), v2 (the
    default qgemv2 configuration), the other qgemv2 configurations."""
    from engine.backend import CUDA_DIR
    import re
    src = (CUDA_DIR / "quant_linear.cu").read_text()
    fam = src[src.index("// qgemv2 instances begin"):src.index("// qgemv2 instances end")]
    cfgs = [(int(g), int(rl), int(u)) for nt, g, rl, u in
            re.findall(r"QGEMV2_KS\(FMT, LD, (\d+), (\d+), (\d+), (\d+)\)", fam) if int(nt) == rpt]
    default = L.QGEMV2_CONFIG[fmt, rpt]
    out = [("qmma", True, default)]
    out += [("v2", False, default)]
    out += [(f"v2_g{g}_r{rl}_u{u}", False, (g, rl, u)) for g, rl, u in cfgs if (g, rl, u) != default]
    return out


def main(argv=None) -> int:
    """Time the quantised GEMVs (needs cupy and a GPU); print one ``name value`` line per result.

    Args:
        argv: ``--reps N`` (timed graph replays per figure, default 50), ``--json FILE`` (also write the results
            there, atomically), ``--quick`` (only qmma and the default v2).
    Returns:
        0. JSON keys: ``*_us`` microseconds, ``*_GBps`` GB/s, ``*_frac`` fraction of the measured copy bandwidth,
        ``*_kernel`` the kernel a grouped launch used. Printed (compact, so a device call's output tail holds it
        all): ``G|D fmt shape M<rows> variant <us> <GB/s> <fraction of copy>`` (G grouped, D dense), ``B16 ...``
        (16 tokens routed at random over 512 experts: ~150 experts of 1-2 rows) and the per-layer summary of
        :func:`_summary`.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="only qmma and the default v2")
    args = ap.parse_args(argv)
    import cupy as cp

    from engine.kernels import linear as L
    from engine.kernels import moe as M

    res: dict = {}
    rs = cp.random.RandomState(7)
    n = 1 << 29  # 2 GiB each way: a device-to-device memcpy (DMA-free copy kernel of the driver), warmed
    src = rs.standard_normal(n, dtype=cp.float32)
    dst = cp.empty_like(src)

    def d2d():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)
    t = _median_us(cp, [d2d], 10)
    copy = 2 * src.nbytes / (t * 1e-6) / 1e9
    res["d2d_copy_GBps"] = copy
    src = dst = None  # free the 2 GiB
    print(f"d2d_copy_GBps {copy:.0f}", flush=True)
    l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 50 << 20))
    prev = (L.QMMA_ENABLED, dict(L.QGEMV2_CONFIG))
    try:
        for fmt in ("nvfp4", "fp8"):
            for shape, (N, K) in SHAPES.items():
                one = None
                # enough groups of 10 experts that consecutive launches never find their weights in L2
                probe = _weights(cp, fmt, 1, N, K, 0)
                groups = max(4, -(-3 * l2 // (TOP_K * _expert_bytes(probe))))
                del probe
                E = groups * TOP_K
                w = _weights(cp, fmt, E, N, K, 1)
                wbytes = TOP_K * _expert_bytes(w)
                for rpt in (1, 4, 16):
                    x = rs.standard_normal((rpt, K), dtype=cp.float32)
                    # grouped: rpt tokens, each routed to the same 10 experts of group g -> 10 tiles of rpt rows
                    routes = []
                    for g in range(groups):
                        ids = cp.asarray(np.tile(np.arange(g * TOP_K, (g + 1) * TOP_K, dtype=np.int32), (rpt, 1)))
                        routes.append(M.moe_route_tables(ids, E, rows_per_tile=rpt))
                    y = cp.empty((rpt * TOP_K, N), cp.float32)
                    io = x.nbytes + y.nbytes
                    for label, tc, cfg in _variants(L, fmt, rpt):
                        if args.quick and label not in ("v2", "qmma"):
                            continue
                        L.QMMA_ENABLED = tc
                        if cfg is not None:
                            L.QGEMV2_CONFIG[fmt, rpt] = cfg
                        fns = [lambda r=r: L.grouped_linear(x, w, r.offsets, row_index=r.sorted_token, tiles=r.tiles,
                                                            out=y) for r in routes]
                        us = _median_us(cp, fns, args.reps)
                        key = f"grouped_{fmt}_{shape}_M{rpt}_{label}"
                        gbs = (wbytes + io) / (us * 1e-6) / 1e9
                        res[key + "_us"], res[key + "_GBps"], res[key + "_frac"] = us, gbs, gbs / copy
                        vec = True
                        res[key + "_kernel"] = L.quant_kernel_choice(fmt, rpt, N, K, routes[0].tiles.max_tiles,
                                                                     vec=vec)[0]
                        print(f"G {fmt} {shape} M{rpt} {label} {us:.1f}us {gbs:.0f}GB/s {gbs / copy:.2f}", flush=True)
                        L.QGEMV2_CONFIG.update(prev[1])
                    # dense: the 10 experts' rows as one [10 N, K] matrix (a view of the stack), rotating groups
                    if one is None:
                        one = [w_dense(w, g, N, K) for g in range(groups)]
                    xd = rs.standard_normal((rpt, K), dtype=cp.float32)
                    yd = cp.empty((rpt, TOP_K * N), cp.float32)
                    for label, tc, cfg in _variants(L, fmt, rpt):
                        if args.quick and label not in ("v2", "qmma"):
                            continue
                        L.QMMA_ENABLED = tc
                        if cfg is not None:
                            L.QGEMV2_CONFIG[fmt, rpt] = cfg
                        fns = [lambda wd=wd: L.linear(xd, wd, out=yd) for wd in one]
                        us = _median_us(cp, fns, args.reps)
                        key = f"dense_{fmt}_{TOP_K * N}x{K}_M{rpt}_{label}"
                        gbs = (wbytes + xd.nbytes + yd.nbytes) / (us * 1e-6) / 1e9
                        res[key + "_us"], res[key + "_GBps"], res[key + "_frac"] = us, gbs, gbs / copy
                        print(f"D {fmt} {shape} M{rpt} {label} {us:.1f}us {gbs:.0f}GB/s {gbs / copy:.2f}", flush=True)
                        L.QGEMV2_CONFIG.update(prev[1])
                w = one = None
        # batch-16 decode as routed: 16 tokens x top-10 of 512 experts (~150 distinct experts of 1-2 rows), the
        # MoE's own tile size for 16 tokens (tiles.default_rows_per_tile); a fresh routing per launch in the rotation
        E, T = 512, 16
        rng = np.random.default_rng(3)
        for fmt in ("nvfp4", "fp8"):
            for shape, (N, K) in SHAPES.items():
                w = _weights(cp, fmt, E, N, K, 2)
                x = rs.standard_normal((T, K), dtype=cp.float32)
                y = cp.empty((T * TOP_K, N), cp.float32)
                ids = [np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(T)]).astype(np.int32)
                       for _ in range(8)]
                routes = [M.moe_route_tables(cp.asarray(i), E) for i in ids]
                used = float(np.mean([len(np.unique(i)) for i in ids]))
                nbytes = used * _expert_bytes(w) + x.nbytes + y.nbytes
                for label, tc, cfg in _variants(L, fmt, routes[0].rows_per_tile):
                    if args.quick and label not in ("v2", "qmma"):
                        continue
                    L.QMMA_ENABLED = tc
                    if cfg is not None:
                        L.QGEMV2_CONFIG[fmt, routes[0].rows_per_tile] = cfg
                    fns = [lambda r=r: L.grouped_linear(x, w, r.offsets, row_index=r.sorted_token, tiles=r.tiles,
                                                        out=y) for r in routes]
                    us = _median_us(cp, fns, args.reps)
                    gbs = nbytes / (us * 1e-6) / 1e9
                    key = f"b16_{fmt}_{shape}_{label}"
                    res[key + "_us"], res[key + "_GBps"], res[key + "_frac"] = us, gbs, gbs / copy
                    print(f"B16 {fmt} {shape} rpt{routes[0].rows_per_tile} {label} {us:.1f}us {gbs:.0f}GB/s "
                          f"{gbs / copy:.2f} ({used:.0f} experts)", flush=True)
                    L.QGEMV2_CONFIG.update(prev[1])
                w = None
    finally:
        L.QMMA_ENABLED = prev[0]
        L.QGEMV2_CONFIG.clear()
        L.QGEMV2_CONFIG.update(prev[1])
    _summary(res)
    if args.json:
        from reference.atomic import atomic_write_json
        atomic_write_json(args.json, res)
    return 0


def _summary(res: dict) -> None:
    """Per format and row count: the grouped gate_up + down time of one MoE layer for qgemv2's default
    configuration (v2), the tensor-core NVFP4 GEMV (qmma) and the fastest variant, the speed-up of qmma over v2,
    and 48 layers' worth of the fastest in ms."""
    for fmt in ("nvfp4", "fp8"):
        for rpt in (1, 4, 16):
            tot: dict = {}
            for key, v in res.items():
                pre = f"grouped_{fmt}_"
                if key.startswith(pre) and key.endswith("_us") and f"_M{rpt}_" in key:
                    label = key[:-3].split(f"_M{rpt}_", 1)[1]
                    tot.setdefault(label, []).append(v)
            tot = {k: sum(v) for k, v in tot.items() if len(v) == len(SHAPES)}
            if "v2" not in tot:
                continue
            best = min(tot, key=tot.get)
            name = f"moe_{fmt}_M{rpt}"
            res[name + "_v2_us"], res[name + "_best"] = tot["v2"], best
            line = f"{name}: gate_up+down v2 {tot['v2']:.1f} us"
            if "qmma" in tot:
                res[name + "_qmma_us"], res[name + "_qmma_speedup"] = tot["qmma"], tot["v2"] / tot["qmma"]
                line += f", qmma {tot['qmma']:.1f} us ({tot['v2'] / tot['qmma']:.2f}x)"
            print(f"{line}; fastest {best} {tot[best]:.1f} us; 48 layers {48 * tot[best] / 1e3:.2f} ms", flush=True)


def w_dense(w, g, N, K):
    """Experts ``[g * 10, g * 10 + 10)`` of stack ``w`` as one dense ``[10 N, K]`` QuantWeight (views)."""
    from engine.kernels.quant import QuantWeight
    a, b = g * TOP_K, (g + 1) * TOP_K
    if w.fmt == "fp8":
        return QuantWeight("fp8", (TOP_K * N, K), w.q[a:b].reshape(TOP_K * N, K),
                           w.scale[a:b].reshape(-1, w.scale.shape[-1]), rb=w.rb, cb=w.cb)
    per = N // w.s2_rows
    return QuantWeight("nvfp4", (TOP_K * N, K), w.q[a:b].reshape(TOP_K * N, K // 2),
                       w.scale[a:b].reshape(TOP_K * N, K // 16), w.scale2[a * per:b * per], s2_rows=w.s2_rows)


if __name__ == "__main__":
    sys.exit(main())
