"""Micro-benchmark of the tensor-core prefill GEMM (engine/kernels/gemm_tc.py) at the real model widths, new path
against the float32-FMA kernels it replaces, each figure from one process.

Run on a GPU: ``python -m lab.bench_tc [--json OUT] [--quick]``. Rows:

* ``dense_<fmt>_M<M>_N<N>_K<K>_<path>_TFLOPs``: model FLOP (``2 M N K``) per second; ``path`` is ``tc`` (the
  3-part split with the default ``K_CHUNK``), ``tc_kc0`` / ``tc_kc1024`` (the hi part unchunked / in chunks of
  at most 1024 columns), ``tc_1part`` (``SPLITS = 1``: one BF16 GEMM, the speed ceiling of this design: not
  float32-accurate), ``old`` (``TC_ENABLED`` off). ``..._relerr``: relative Frobenius error against float64 on 64
  rows.
* ``bf16_gemm_8192_1part_TFLOPs``: one BF16 cuBLAS GEMM 8192^3 through ``linear`` with ``SPLITS = 1`` (the split
  pass included): the matmul rate the 35% goal refers to, same process.
* ``moe_<fmt>_T<T>_<path>``: the routed experts of one MoE block (512 experts top-10 of width 640, hidden 2560),
  ``_ms`` and ``_TFLOPs`` (model FLOP ``2 S (2 I H + H I)``, ``S = T * 10``) of BF16 / NVFP4 / FP8 experts on the
  tensor-core path (``tc_R<R>``, padding bound lifted; BF16 sweeps the tile rows R) and on the grouped kernels
  (``old``); ``_reldiff_vs_old``: relative difference of the outputs of both paths.

Times are CUDA-event medians after warm-up; random data of fixed seeds.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def _timer(cp, fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    return sorted(cp.cuda.get_elapsed_time(a, b) for a, b in ev)[reps // 2] * 1e-3


def main(argv=None) -> int:
    """Print one ``name value`` line per figure (see the module docstring); ``--json FILE`` also writes them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here (atomically)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (no R sweep, no K-chunk row)")
    args = ap.parse_args(argv)
    import cupy as cp

    from engine.kernels import gemm_tc as TC
    from engine.kernels import linear as L
    from engine.kernels import moe as MO
    from engine.kernels.dense_common import bf16_bits_to_float32
    from engine.kernels.quant import QuantWeight, dequantize

    rs = cp.random.RandomState(3)
    res: dict = {}
    print(f"cuBLAS caller: {TC.blas_backend(verbose=True)} (grouped GEMM available: {TC.available(grouped=True)})")

    def bf16(*shape, scale=0.05):
        a = rs.standard_normal(shape, dtype=cp.float32) * scale
        return (a.view(cp.uint32) >> 16).astype(cp.uint16)

    def nvfp4(*shape):
        *lead, N, K = shape
        lead = tuple(lead)
        E = lead[0] if lead else 1
        q = rs.randint(0, 256, size=lead + (N, K // 2), dtype=cp.int32).astype(cp.uint8)
        sc = rs.randint(0x28, 0x40, size=lead + (N, K // 16), dtype=cp.int32).astype(cp.uint8)
        s2 = (rs.uniform(0.001, 0.01, size=(E * 2,))).astype(cp.float32)
        return QuantWeight("nvfp4", shape, q, sc, s2, s2_rows=N // 2)

    def fp8(*shape):
        *lead, N, K = shape
        lead = tuple(lead)
        q = rs.randint(0, 256, size=lead + (N, K), dtype=cp.int32).astype(cp.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
        sc = rs.uniform(0.001, 0.02, size=lead + (-(-N // 128), -(-K // 128))).astype(cp.float32)
        return QuantWeight("fp8", shape, q, sc, rb=128, cb=128)

    def setflags(enabled=True, splits=3, kc=TC.K_CHUNK, R=64):
        TC.TC_ENABLED, TC.SPLITS, TC.K_CHUNK, TC.MOE_TILE_ROWS = enabled, splits, kc, R
        TC.MOE_MAX_PAD = 1e9 if enabled else TC.MOE_MAX_PAD
        TC.MOE_MAX_PAD_FP8 = 1e9 if enabled else TC.MOE_MAX_PAD_FP8

    def relerr(y, x, w):
        xs = cp.asnumpy(x[:64]).astype(np.float64)
        w64 = dequantize(w, np.float64) if isinstance(w, QuantWeight) else (
            bf16_bits_to_float32(cp.asnumpy(w)).astype(np.float64) if w.dtype == np.uint16
            else cp.asnumpy(w).astype(np.float64))
        ref = xs @ w64.T
        return float(np.linalg.norm(cp.asnumpy(y[:64]) - ref) / np.linalg.norm(ref))

    # the BF16 matmul rate of this GPU through the same cuBLAS call (one part)
    n = 8192
    a, b = bf16(n, n), rs.standard_normal((n, n), dtype=cp.float32)
    setflags(splits=1)
    TC.TC_MIN_ROWS = 64
    t = _timer(cp, lambda: L.linear(b, a))
    res["bf16_gemm_8192_1part_TFLOPs"] = 2 * n ** 3 / t / 1e12
    a = b = None  # (free)
    M = 4096
    shapes = [("bf16", 10240, 2560), ("bf16", 2560, 2560), ("bf16", 2560, 6144), ("nvfp4", 10240, 2560),
              ("fp8", 10240, 2560), ("f32", 512, 2560)]
    kdef = TC.K_CHUNK
    paths = [("tc", dict(kc=kdef)), ("tc_1part", dict(splits=1, kc=kdef)), ("old", dict(enabled=False))]
    if not args.quick:
        paths[1:1] = [("tc_kc0", dict(kc=0)), ("tc_kc1024", dict(kc=1024))]
    for fmt, N, K in shapes:
        make = {"bf16": bf16, "nvfp4": nvfp4, "fp8": fp8,
                "f32": lambda *sh: rs.standard_normal(sh, dtype=cp.float32) * 0.05}[fmt]
        w = make(N, K)
        x = rs.standard_normal((M, K), dtype=cp.float32)
        for name, fl in paths:
            if fmt == "f32" and name not in ("tc", "old"):
                continue
            setflags(**fl)
            t = _timer(cp, lambda: L.linear(x, w))
            key = f"dense_{fmt}_M{M}_N{N}_K{K}_{name}"
            res[key + "_TFLOPs"] = 2 * M * N * K / t / 1e12
            res[key + "_relerr"] = relerr(L.linear(x, w), x, w)
        w = x = None
    # MoE routed experts at real width
    E, I, H, k = 512, 640, 2560, 10
    flop = lambda T: 2 * T * k * (2 * I * H + H * I)  # noqa: E731
    router = rs.standard_normal((E, H), dtype=cp.float32) * 0.05
    for fmt in ("bf16", "nvfp4", "fp8"):
        make = {"bf16": bf16, "nvfp4": nvfp4, "fp8": fp8}[fmt]
        gu, dn = make(E, 2 * I, H), make(E, H, I)
        for T in (4096,) if args.quick else (512, 4096):
            x = rs.standard_normal((T, H), dtype=cp.float32)
            setflags(enabled=False)
            ids, wts = MO.router_topk(L.linear(x, router), k, True)
            ref = MO.moe_experts(x, ids, wts, gu, dn)
            t = _timer(cp, lambda: MO.moe_experts(x, ids, wts, gu, dn), reps=3, warm=1)
            res[f"moe_{fmt}_T{T}_old_ms"] = t * 1e3
            res[f"moe_{fmt}_T{T}_old_TFLOPs"] = flop(T) / t / 1e12
            for R in (64,) if args.quick or fmt != "bf16" else (32, 64, 128):
                setflags(R=R)
                t = _timer(cp, lambda: MO.moe_experts(x, ids, wts, gu, dn), reps=3, warm=1)
                key = f"moe_{fmt}_T{T}_tc_R{R}"
                res[key + "_ms"] = t * 1e3
                res[key + "_TFLOPs"] = flop(T) / t / 1e12
                y = MO.moe_experts(x, ids, wts, gu, dn)
                res[key + "_reldiff_vs_old"] = float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref))
            x = ref = None
        gu = dn = None
    setflags()
    width = max(len(k_) for k_ in res)
    for k_, v in res.items():
        print(f"{k_:<{width}}  {v:12.4g}")
    if args.json:
        from reference.atomic import atomic_write_json
        atomic_write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
