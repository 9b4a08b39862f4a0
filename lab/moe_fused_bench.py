"""The MoE block's device time per layer: the grouped chain vs the three-launch decode block (GPU dev tool, not a
test).

One MoE block at the real widths (hidden 2560, 512 experts of intermediate 640, top-10, shared expert 640), random
weights built on the device: routed experts BF16, FP8 (E4M3 codes, 128x128 scales) or NVFP4 (E2M1 codes, E4M3
per-16 scales, two global scales per expert), router float32, shared expert BF16 (the engine's layouts). Variants:
``grouped`` (moe.FUSED_DECODE off: router GEMV, router_topk, route tables, shared expert, grouped GEMVs, SwiGLU,
combine) and ``decode`` (the three launches of cuda/moe_decode.cu). Each is captured alone as a CUDA graph and
replayed (median of --reps replays, device events). Bytes per block: the float32 router, the distinct selected
experts' stored bytes (codes + scales), the shared expert and its gate; GB/s = bytes / time. The two outputs are
compared (max |a - b| / max |b|, and the top-k ids; the decode block sums in another order, so not bit for bit):
exit status 1 if the ids differ or the relative difference exceeds 1e-5 (selfcheck.SELF_TOL).

Usage: python -m lab.moe_fused_bench [--formats bf16 nvfp4 fp8] [--tokens 1 16] [--reps 50]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

H, E, I, IS, K_TOP = 2560, 512, 640, 640, 10


def bf16_bits(cp, shape):
    """Random BF16 bit patterns of magnitude 2^-8 .. 2^-3, either sign."""
    b = cp.random.randint(0x3B80, 0x3E00, size=shape, dtype=cp.int32).astype(cp.uint16)
    return b | (cp.random.randint(0, 2, size=shape, dtype=cp.int32).astype(cp.uint16) << 15)


def experts(cp, fmt, N, K):
    from engine.kernels.quant import QuantWeight
    if fmt == "bf16":
        return bf16_bits(cp, (E, N, K))
    if fmt == "fp8":
        q = cp.random.randint(0, 256, size=(E, N, K), dtype=cp.int32).astype(cp.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
        s = cp.random.uniform(0.001, 0.02, size=(E, -(-N // 128), -(-K // 128))).astype(cp.float32)
        return QuantWeight("fp8", (E, N, K), q, s, rb=128, cb=128)
    q = cp.random.randint(0, 256, size=(E, N, K // 2), dtype=cp.int32).astype(cp.uint8)
    sc = cp.random.randint(0x20, 0x48, size=(E, N, K // 16), dtype=cp.int32).astype(cp.uint8)
    s2 = cp.random.uniform(0.001, 0.01, size=(E * 2,)).astype(cp.float32)
    return QuantWeight("nvfp4", (E, N, K), q, sc, s2, s2_rows=N // 2)


def graph_nodes(g):
    """Kernel / memset / other nodes of captured graph ``g`` (best effort through the CUDA runtime the process has
    loaded; None when cupy's Graph does not expose its cudaGraph_t or the runtime is not found)."""
    import ctypes
    try:
        handle = getattr(g, "graph", None)
        path = next((ln.split()[-1] for ln in open("/proc/self/maps") if "libcudart.so" in ln), None)
        if not handle or path is None:
            return None
        lib = ctypes.CDLL(path)
        n = ctypes.c_size_t(0)
        if lib.cudaGraphGetNodes(ctypes.c_void_p(int(handle)), None, ctypes.byref(n)) != 0:
            return None
        nodes = (ctypes.c_void_p * n.value)()
        lib.cudaGraphGetNodes(ctypes.c_void_p(int(handle)), nodes, ctypes.byref(n))
        kinds = {}
        for nd in nodes:
            t = ctypes.c_int(-1)
            lib.cudaGraphNodeGetType(ctypes.c_void_p(nd), ctypes.byref(t))
            kinds[t.value] = kinds.get(t.value, 0) + 1
        return {"kernel": kinds.get(0, 0), "memset": kinds.get(2, 0), "other": n.value - kinds.get(0, 0) - kinds.get(2, 0)}
    except Exception:  # a dev tool: the count is optional
        return None


def graph_us(cp, fn, reps):
    fn()
    fn()
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = fn()
        g = s.end_capture()
    for _ in range(5):
        g.launch(stream=s)
    ts = []
    for _ in range(reps):
        a0 = cp.cuda.Event()
        a0.record(s)
        g.launch(stream=s)
        a1 = cp.cuda.Event()
        a1.record(s)
        a1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a0, a1) * 1e3)
    return float(np.median(ts)), out, graph_nodes(g)


def launch_breakdown(cp, M, fn, reps):
    """Device time of each launch ``fn`` makes through ``moe.kernel`` (recorded once, then each replayed alone as a
    CUDA graph: the decode launches are idempotent and their tickets reset themselves): ``{name: us}``."""
    rec, orig = [], M.kernel

    def recording(fname, name):
        k = orig(fname, name)

        def call(grid, block, args, **kw):
            rec.append((name, k, grid, block, args, kw))
            return k(grid, block, args, **kw)
        return call
    M.kernel = recording
    try:
        fn()
    finally:
        M.kernel = orig
    return {f"{j}:{name}": round(graph_us(cp, lambda: k(grid, block, args, **kw), reps)[0], 1)
            for j, (name, k, grid, block, args, kw) in enumerate(rec)}


def expert_bytes(w) -> float:
    """Stored bytes of one expert of stack ``w`` (codes + scales)."""
    return w.nbytes / w.shape[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "nvfp4", "fp8"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import cupy as cp

    from engine.kernels import moe as M
    M.DECODE_BLOCK_MAX_TOKENS = dict.fromkeys(M.DECODE_BLOCK_MAX_TOKENS, 16)  # the block wherever its shapes fit
    cp.random.seed(0)
    router = (cp.random.standard_normal((E, H), dtype=cp.float32) * 0.02).astype(cp.float32)
    sg, su, sd = bf16_bits(cp, (IS, H)), bf16_bits(cp, (IS, H)), bf16_bits(cp, (H, IS))
    sgate, sgu = bf16_bits(cp, (1, H)), cp.concatenate([sg, su])
    rows, bad = [], []
    for fmt in args.formats:
        t0 = time.perf_counter()
        gu, dn = experts(cp, fmt, 2 * I, H), experts(cp, fmt, H, I)
        per_expert = expert_bytes(gu) + expert_bytes(dn)
        for T in args.tokens:
            x = cp.random.standard_normal((T, H), dtype=cp.float32)

            def block():
                return M.moe_block(x, router, gu, dn, top_k=K_TOP, shared_gate_proj=sg, shared_up_proj=su,
                                   shared_down_proj=sd, shared_expert_gate=sgate, shared_gate_up=sgu)
            res = {}
            for name, fused in (("grouped", False), ("decode", True)):
                M.FUSED_DECODE = fused
                us, out, nodes = graph_us(cp, block, args.reps)
                res[name] = (us, cp.asnumpy(out.out).astype(np.float64), cp.asnumpy(out.topk_ids), nodes)
            M.FUSED_DECODE = True
            distinct = len(np.unique(res["decode"][2]))
            nbytes = router.nbytes + distinct * per_expert + sgu.nbytes + sd.nbytes + sgate.nbytes
            g, d = res["grouped"], res["decode"]
            rel = float(np.abs(d[1] - g[1]).max() / max(np.abs(g[1]).max(), 1e-30))
            same_ids = bool(np.array_equal(d[2], g[2]))
            row = {"format": fmt, "tokens": T, "distinct_experts": distinct, "mbytes": round(nbytes / 1e6, 2),
                   "grouped_us": round(g[0], 1), "decode_us": round(d[0], 1),
                   "grouped_gbps": round(nbytes / g[0] / 1e3, 0), "decode_gbps": round(nbytes / d[0] / 1e3, 0),
                   "speedup": round(g[0] / d[0], 2), "rel_diff": rel, "same_ids": same_ids,
                   "graph_nodes": {n: v[3] for n, v in res.items()}}
            print(f"moe_block {fmt:5s} T={T:2d}: {distinct:3d} experts {row['mbytes']:6.1f} MB | grouped "
                  f"{g[0]:7.1f} us {row['grouped_gbps']:5.0f} GB/s | decode {d[0]:7.1f} us {row['decode_gbps']:5.0f} "
                  f"GB/s x{row['speedup']:.2f} | rel diff {rel:.1e} ids {'same' if same_ids else 'DIFFER'} | nodes "
                  + "; ".join(f"{n} " + ("n/a" if v[3] is None else f"{v[3]['kernel']}/{v[3]['memset']}/{v[3]['other']}")
                              for n, v in res.items()), flush=True)
            M.FUSED_DECODE = True
            row["decode_launch_us"] = launch_breakdown(cp, M, block, args.reps)
            print("  decode launches alone (us): " + ", ".join(f"{n} {v}" for n, v in row["decode_launch_us"].items()),
                  flush=True)
            rows.append(row)
            if not same_ids or rel > 1e-5:
                bad.append((fmt, T))
        gu = dn = None  # (freed before the next format is built)
        cp.get_default_memory_pool().free_all_blocks()
        print(f"  ({fmt}: {time.perf_counter() - t0:.1f} s incl. weights and compiles)", flush=True)
    print("JSON " + json.dumps(rows))
    if bad:
        print(f"decode block differs from the grouped chain beyond float32 summation order: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
