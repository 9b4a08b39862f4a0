"""Micro-benchmark of the QSA and GDN decode kernels at the real model widths
(QSA: 24 query heads, 2 KV heads x 256, indexer 4 x 128, ratio 4, block_topk 512; GDN: 16 key / 48 value heads
x 128), context 1025 and 8192, batch 1 and 16.

Run on a GPU: ``python -m lab.bench_qsa_gdn [--reps N] [--json OUT]``. Each op is captured
``--inner`` times back to back in one CUDA graph (so Python launch overhead is not timed and the capture itself
checks that the op is graph-capturable), the graph is replayed ``--reps`` times between CUDA events, and the
median per call is printed in microseconds: ``<op> <shape> new_us`` (and ``legacy_us``, speedup where an op has an
older composition to compare, e.g. the token write as cupy scatters). The engine has one kernel per op now; the
"legacy" rows of older JSONs measured kernels that are gone.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

HQ, HKV, D, HI, DI, RATIO, TOPK, ROT = 24, 2, 256, 4, 128, 4, 512, 64
HK, HV, DK, DV = 16, 48, 128, 128
PAGE = 16
BUCKET = 512  # DecodeGraphs' score-width bucket


def graph_time_us(cp, fn, reps=200, inner=10):
    """Median device time of one ``fn()`` call in microseconds: ``inner`` calls captured in one CUDA graph
    (private memory pool), the graph replayed ``reps`` times between events, each replay's time / inner."""
    fn()
    cp.cuda.Device().synchronize()
    mem = cp.cuda.MemoryPool()
    s = cp.cuda.Stream(non_blocking=True)
    keep = []
    with s, cp.cuda.using_allocator(mem.malloc):
        s.begin_capture()
        try:
            for _ in range(inner):
                keep.append(fn())
        finally:
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
    del keep
    return ts[len(ts) // 2] * 1e3 / inner


def _qsa_setup(cp, rng, B, ctx):
    """Device pools for B sequences of ctx tokens (distinct pages), the decode query of each, its selection."""
    from engine.kernels import qsa as K
    pages = -(-(ctx + 1) // PAGE) + 1
    S = B * pages * PAGE
    bt = cp.asarray(np.arange(B * pages, dtype=np.int32).reshape(B, pages)[:, rng.permutation(pages)])
    crs = cp.random.RandomState(int(rng.integers(1 << 31)))  # the pools on the device (fast at B=16, ctx 8192)
    kv_k = crs.standard_normal((S, HKV, D), dtype=cp.float32)
    kv_v = crs.standard_normal((S, HKV, D), dtype=cp.float32)
    idx_k = crs.standard_normal((S, DI), dtype=cp.float32)
    blk_k = crs.standard_normal((S, DI), dtype=cp.float32)
    rows = cp.arange(B, dtype=cp.int64)
    pos = cp.full((B,), ctx - 1, dtype=cp.int64)
    nv = pos + 1
    nb = -(-max(1, ctx // RATIO) // BUCKET) * BUCKET
    scores = cp.asarray(rng.standard_normal((B, nb), dtype=np.float32))
    scores[:, ctx // RATIO:] = -np.inf
    sel = K.qsa_topk(scores, nv, RATIO, TOPK)
    q = cp.asarray(rng.standard_normal((B, HQ, D), dtype=np.float32))
    return dict(bt=bt, kv_k=kv_k, kv_v=kv_v, idx_k=idx_k, blk_k=blk_k, rows=rows, pos=pos, nv=nv, nb=nb,
                scores=scores, sel=sel, q=q)


def main(argv=None) -> int:
    """Time legacy vs split QSA / GDN decode kernels; print one line per op and shape.

    Args:
        argv: ``--reps N`` (graph replays per op, default 200), ``--inner N`` (calls per graph, default 10),
            ``--json FILE`` (also write the results there, atomically).
    Returns:
        0.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import cupy as cp

    from engine.kernels import gdn as G
    from engine.kernels import qsa as K

    rng = np.random.default_rng(7)
    res = []

    def ab(name, fn_legacy, fn_new):
        new = graph_time_us(cp, fn_new, args.reps, args.inner)
        if fn_legacy is fn_new:
            res.append({"op": name, "new_us": new})
            print(f"{name:<44s} new {new:8.2f} us", flush=True)
            return
        old = graph_time_us(cp, fn_legacy, args.reps, args.inner)
        res.append({"op": name, "legacy_us": old, "new_us": new})
        print(f"{name:<44s} legacy {old:8.2f} us   new {new:8.2f} us   x{old / new:.2f}", flush=True)

    invf = cp.asarray((1.0 / 1e7 ** (np.arange(0, ROT, 2) / ROT)).astype(np.float32))
    wk = cp.asarray((rng.standard_normal(DI) * 0.3).astype(np.float32))
    for ctx in (1025, 8192):
        for B in (1, 16):
            d = _qsa_setup(cp, rng, B, ctx)
            tag = f"ctx={ctx} B={B}"

            def attn(d=d):
                return K.qsa_sparse_attention(d["q"], d["kv_k"], d["kv_v"], d["bt"], d["rows"], d["nv"], d["sel"],
                                              RATIO, PAGE, D ** -0.5, n_blocks=d["nb"])
            ab(f"qsa_attention (partial+combine) {tag}", attn, attn)

            def topk(d=d):
                return K.qsa_topk(d["scores"], d["nv"], RATIO, TOPK)
            ab(f"qsa_topk nb={d['nb']} {tag}", topk, topk)
            # the token write of a decode step at a block-completing position (pos+1 % ratio == 0)
            pos_c = d["pos"] - ((d["pos"] + 1) % RATIO)
            src_i = cp.asarray(rng.standard_normal((B, 640), dtype=np.float32))[:, 512:]  # a strided column slice
            src_k = cp.asarray(rng.standard_normal((B, HKV, D), dtype=np.float32))
            src_v = cp.asarray(rng.standard_normal((B, HKV, D), dtype=np.float32))

            def write_old(d=d, pc=pos_c, si=src_i, sk=src_k, sv=src_v):
                slots = K.token_slots(d["bt"], d["rows"], pc, PAGE)
                d["idx_k"][slots] = si
                K.qsa_block_keys(d["idx_k"], d["blk_k"], d["bt"], d["rows"], pc, wk, invf, ROT, RATIO, PAGE, 1e-6)
                d["kv_k"][slots] = sk
                d["kv_v"][slots] = sv
                return pc + 1

            def write_new(d=d, pc=pos_c, si=src_i, sk=src_k, sv=src_v):
                return K.qsa_write_tokens(d["idx_k"], d["kv_k"], d["kv_v"], d["bt"], d["rows"], pc, si, sk, sv, PAGE,
                                          block_keys=(d["blk_k"], wk, invf, ROT, RATIO, 1e-6))
            ab(f"qsa token write + block keys {tag}", write_old, write_new)

            def bk(d=d, pc=pos_c):
                return K.qsa_block_keys(d["idx_k"], d["blk_k"], d["bt"], d["rows"], pc, wk, invf, ROT, RATIO, PAGE,
                                        1e-6)
            ab(f"qsa_block_keys alone {tag}", bk, bk)
            del d
    from engine.kernels.norms import rms_norm
    from engine.kernels.rope import apply_rope
    for B in (1, 16):  # a QSA layer's head norms + RoPEs (old: 3 rms_norm + 3 rope + the strided-q copy)
        fz = cp.asarray(rng.standard_normal((B, 640 + HQ * 2 * D + 2 * HKV * D), dtype=np.float32))
        o1, o2, o3 = 640, 640 + HQ * 2 * D, 640 + HQ * 2 * D + HKV * D
        wq = [cp.asarray((rng.standard_normal(n) * 0.3).astype(np.float32)) for n in (DI, D, D)]
        pz = cp.full((B,), 1024, dtype=cp.int64)

        def prep_old(fz=fz, o1=o1, o2=o2, o3=o3, wq=wq, pz=pz):
            qi = rms_norm(fz[:, :HI * DI].reshape(B, HI, DI), wq[0], eps=1e-6)
            qq = rms_norm(cp.ascontiguousarray(fz[:, o1:o2].reshape(B, HQ, 2 * D)[:, :, :D]), wq[1], eps=1e-6)
            kk = rms_norm(fz[:, o2:o3].reshape(B, HKV, D), wq[2], eps=1e-6)
            return [apply_rope(a, pz, invf, ROT) for a in (qi, qq, kk)]

        def prep_new(fz=fz, o1=o1, o2=o2, o3=o3, wq=wq, pz=pz):
            return K.qsa_prep_heads(fz[:, :o1], fz[:, o1:o2], fz[:, o2:o3], *wq, pz, invf, ROT, 1e-6, HI, DI, HQ, HKV,
                                    D)
        ab(f"qsa head prep (norms + ropes) B={B}", prep_old, prep_new)
    for B in (1, 16):
        q = cp.asarray(rng.standard_normal((B, HK, DK), dtype=np.float32))
        k = cp.asarray(rng.standard_normal((B, HK, DK), dtype=np.float32))
        v = cp.asarray(rng.standard_normal((B, HV, DV), dtype=np.float32))
        a = cp.asarray(rng.standard_normal((B, HV), dtype=np.float32))
        b = cp.asarray(rng.standard_normal((B, HV), dtype=np.float32))
        A_log = cp.asarray((rng.standard_normal(HV) * 0.5).astype(np.float32))
        dtb = cp.asarray(rng.standard_normal(HV).astype(np.float32))
        state = cp.asarray((rng.standard_normal((B, HV, DK, DV)) * 0.1).astype(np.float32))
        slots = cp.arange(B, dtype=cp.int64)
        gg, bb = G.gdn_gates(a, b, A_log, dtb)

        def rec(q=q, k=k, v=v, gg=gg, bb=bb, state=state, slots=slots):
            return G.gated_delta_decode(q, k, v, gg, bb, state, slots)
        ab(f"gdn_recurrent decode B={B}", rec, rec)

        def old(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dtb=dtb, state=state, slots=slots):
            g_, b_ = G.gdn_gates(a, b, A_log, dtb)
            return G.gated_delta_decode(q, k, v, g_, b_, state, slots)

        def new(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dtb=dtb, state=state, slots=slots):
            return G.gated_delta_decode_gates(q, k, v, a, b, A_log, dtb, state, slots)
        ab(f"gdn gates + recurrent decode B={B}", old, new)
    # verify-sized (k = 4 tokens of one sequence, checkpoints) and, for information, a forced-split prefill
    T = 4
    q = cp.asarray(rng.standard_normal((T, HK, DK), dtype=np.float32))
    k = cp.asarray(rng.standard_normal((T, HK, DK), dtype=np.float32))
    v = cp.asarray(rng.standard_normal((T, HV, DV), dtype=np.float32))
    gg = -cp.abs(cp.asarray(rng.standard_normal((T, HV), dtype=np.float32)))
    bb = cp.full((T, HV), 0.5, dtype=cp.float32)
    state = cp.asarray((rng.standard_normal((1, HV, DK, DV)) * 0.1).astype(np.float32))
    ck = cp.empty((T, HV, DK, DV), dtype=cp.float32)
    sl, cu = cp.zeros((1,), dtype=cp.int64), cp.asarray(np.array([0, T], dtype=np.int64))

    def ver():
        return G.gated_delta_recurrent(q, k, v, gg, bb, state, sl, cu, checkpoints=ck)
    ab(f"gdn_recurrent verify T={T} (checkpoints)", ver, ver)
    T = 2048
    q = cp.asarray(rng.standard_normal((T, HK, DK), dtype=np.float32))
    k = cp.asarray(rng.standard_normal((T, HK, DK), dtype=np.float32))
    v = cp.asarray(rng.standard_normal((T, HV, DV), dtype=np.float32))
    gg = -cp.abs(cp.asarray(rng.standard_normal((T, HV), dtype=np.float32)))
    bb = cp.full((T, HV), 0.5, dtype=cp.float32)
    cu = cp.asarray(np.array([0, T], dtype=np.int64))
    saved = G.GDN_SPLIT_MAX_TPS

    def pre():
        return G.gated_delta_recurrent(q, k, v, gg, bb, state, sl, cu)

    def pre_one_warp():  # the float64 kernel's float32 twin (the prefill default before the split kernel took it)
        G.GDN_SPLIT_MAX_TPS = 0
        try:
            return G.gated_delta_recurrent(q, k, v, gg, bb, state, sl, cu)
        finally:
            G.GDN_SPLIT_MAX_TPS = saved
    old_reps, old_inner = args.reps, args.inner
    args.reps, args.inner = 5, 1
    ab(f"gdn_recurrent prefill T={T} (one-warp vs split)", pre_one_warp, pre)
    args.reps, args.inner = old_reps, old_inner
    if args.json:
        from reference.atomic import atomic_write_json
        atomic_write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
