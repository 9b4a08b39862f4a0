"""The hyper-connection input side at real widths (hc_count 4, hidden 2560, hc_lowrank 320, BF16 weights), one
token: ``hc_down_act`` and ``hc_up_mix`` (``engine/kernels/cuda/hc_fused.cu``) timed alone as CUDA graphs, at
several launch shapes, with the achieved weight bandwidth and the agreement of every variant with the product's.

Run on a GPU: ``python -m lab.bench_hc [--json OUT]``. Variants are launch shapes of the product's kernels and,
for comparison, patched copies of the source compiled here (never part of the package): ``lb3`` caps the
registers with ``__launch_bounds__(256, 3)``. Times are CUDA-event medians of graph replays of 20 launches each,
on fresh random (never zero) data; GB/s counts the weight bytes once.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _graph_us(cp, fn, reps=30, inner=20):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(inner):
            fn()
        g = s.end_capture()
        for _ in range(3):
            g.launch(stream=s)
        ts = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(stream=s)
            b.record(s)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / inner)
    return float(np.median(ts))


def main(argv=None) -> int:
    """Print one line per variant (us, GB/s, max |diff| against the product's launch) and return 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import cupy as cp

    from engine.kernels.dense_common import kernel

    hc, H, r, T = 4, 2560, 320, 1
    W = hc * H
    rs = cp.random.RandomState(7)

    def bf16(*shape, scale=0.05):
        a = rs.standard_normal(shape, dtype=cp.float32) * scale
        return (a.view(cp.uint32) >> 16).astype(cp.uint16)

    di = bf16(r + hc, W)
    up = bf16(W, r)
    normed = rs.standard_normal((T, W), dtype=cp.float32)
    a = cp.empty((T, r), cp.float32)
    inj = cp.empty((T, hc), cp.float32)
    mixed = cp.empty((T, H), cp.float32)
    from engine.backend import cuda_source
    lb3 = cp.RawModule(code=cuda_source("hc_fused.cu").replace("__launch_bounds__(256)", "__launch_bounds__(256, 3)"),
                       options=("-std=c++17",))
    args_dn = (normed, di, a, inj, np.int32(T), np.int32(W), np.int32(r), np.int32(hc))
    kd = kernel("hc_fused.cu", "hc_down_act_bf16_t1_pu5")
    kd((r + hc,), (256,), args_dn)
    args_up = (a, up, normed, mixed, np.int32(T), np.int32(H), np.int32(r), np.int32(hc))
    ku = kernel("hc_fused.cu", "hc_up_mix_bf16_t1_hc4")
    ku((-(-H // 8),), (256,), args_up, shared_mem=T * r * 4)
    ref = mixed.copy()
    res = {}
    dn_bytes, up_bytes = di.nbytes, up.nbytes
    res["down_pu5_b256_us"] = _graph_us(cp, lambda: kd((r + hc,), (256,), args_dn))
    for name, fn, per in (("b256", ku, 8), ("b128", ku, 4), ("b64", ku, 2),
                          ("lb3_b256", lb3.get_function("hc_up_mix_bf16_t1_hc4"), 8)):
        mixed.fill(cp.nan)
        fn((-(-H // per),), (32 * per,), args_up, shared_mem=T * r * 4)
        diff = float(cp.max(cp.abs(mixed - ref)))
        us = _graph_us(cp, lambda: fn((-(-H // per),), (32 * per,), args_up, shared_mem=T * r * 4))
        res[f"up_{name}_us"] = us
        res[f"up_{name}_GBps"] = up_bytes / us * 1e-3
        res[f"up_{name}_maxdiff"] = diff
    res["down_pu5_b256_GBps"] = dn_bytes / res["down_pu5_b256_us"] * 1e-3
    for k, v in res.items():
        print(f"hc {k} {v:.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
