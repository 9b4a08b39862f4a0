"""Where a decode step's time goes (GPU dev tool, not a test): host half, graph replay, logits copy,
and an eager per-component split. Usage: python ci/tools/profile_decode.py [--layers 4] [--batches 1 16]
[--weights bf16|fp8|nvfp4] (--weights: in-memory synthetic weights in that stored format, no files, the PLE
table scaled down; without it the cached BF16 synthetic checkpoint)."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1025)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--weights", choices=["bf16", "fp8", "nvfp4"], default=None)
    args = ap.parse_args()
    import cupy as cp

    import engine as E
    from engine.backend import to_numpy
    from engine.model import Segment
    from parity.bench import synthetic as S
    from reference.checkpoint import Checkpoint

    t0 = time.perf_counter()
    if args.weights:
        ck = S.SyntheticWeights(S.real_width_config(args.layers), args.weights)
    else:
        ck = Checkpoint.open(S.cached_synthetic(args.layers, progress=False))
    print(f"synthetic ready {time.perf_counter() - t0:.1f}s", flush=True)
    t0 = time.perf_counter()
    eng = E.Engine(ck, precision="bf16", device="cuda", max_seqs=max(args.batches) + 2,
                   kv_tokens=2 * args.context + 64 * (max(args.batches) + 2) * 4)
    print(f"engine loaded {time.perf_counter() - t0:.1f}s; {eng.describe_limits()}", flush=True)
    m, g, pool = eng.model, eng.graphs, eng.pool
    V = ck.config.vocab_size
    rng = np.random.default_rng(0)
    res = {}

    def ev():
        e = cp.cuda.Event()
        e.record()
        return e

    for B in args.batches:
        base = eng.add_sequence()
        eng.prefill(base, rng.integers(0, V - 10, args.context), last_only=True)
        seqs = [eng.fork(base) for _ in range(B)]
        eng.free(base)
        toks = rng.integers(0, V - 10, B).astype(np.int64)
        for _ in range(5):  # eager, capture, 2 verified, 1 replay
            lg = eng.decode(seqs, toks)
            toks = np.argmax(lg, -1).astype(np.int64)
        prep_t = []
        orig_ph = m.prepare_host

        def ph(*a, **k):
            t1 = time.perf_counter()
            r = orig_ph(*a, **k)
            prep_t.append(time.perf_counter() - t1)
            return r
        m.prepare_host = ph
        for _ in range(3):
            toks = eng.decode_greedy(seqs, toks)
        prep_t.clear()
        ts = []
        for _ in range(args.steps):
            t1 = time.perf_counter()
            toks = eng.decode_greedy(seqs, toks)
            ts.append(time.perf_counter() - t1)
        m.prepare_host = orig_ph
        med = {"decode_greedy_wall": float(np.median(ts)) * 1e6, "prepare_host": float(np.median(prep_t)) * 1e6}
        pt = []
        toks = eng.decode_greedy_steps(seqs, toks, args.steps, step_times=pt)[-1]
        med["pipelined_step_events"] = float(np.median(pt[1:])) * 1e6
        t1 = time.perf_counter()
        toks = eng.decode_greedy_steps(seqs, toks, args.steps)[-1]
        med["pipelined_wall_per_step"] = (time.perf_counter() - t1) / args.steps * 1e6
        e = next(x for x in g.entries.values() if len(x["host_i64"]) == 2 * B)
        tl = []
        for _ in range(args.steps):
            e0 = cp.cuda.Event(); e0.record(g.stream)
            e["head"].launch(stream=g.stream)
            e["tail"].launch(stream=g.stream)
            e1 = cp.cuda.Event(); e1.record(g.stream)
            e1.synchronize()
            tl.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        med["graph_device"] = float(np.median(tl))
        tab = next(iter(m.ple.values()))
        rr = rng.integers(0, tab.rows_total, (B, 16))
        for nm, fn in (("gather_ngram_rows", lambda: ck.ngram_rows(tab.layer, rr)), ("gather_host", lambda: tab.gather_host(rr))):
            fn()
            tq = []
            for _ in range(20):
                rr = rng.integers(0, tab.rows_total, (B, 16))
                t1 = time.perf_counter(); fn(); tq.append(time.perf_counter() - t1)
            med[nm] = float(np.median(tq)) * 1e6
        ts = []
        for _ in range(args.steps):
            cp.cuda.Device().synchronize()
            t1 = time.perf_counter()
            lg = eng.decode(seqs, toks)
            toks = np.argmax(lg, -1).astype(np.int64)
            ts.append(time.perf_counter() - t1)
        med["eng.decode+host_argmax"] = float(np.median(ts)) * 1e6
        # per-component device time: each component captured alone as a CUDA graph and replayed
        try:
            med["component_graph_us"] = component_graph_times(cp, eng, seqs, toks)
        except Exception as ex:  # a dev tool: report and go on
            med["component_graph_us"] = f"failed: {type(ex).__name__}: {ex}"
        # eager per-component split (device events around each; launch-bound parts show launch time)
        comp = {}
        orig = {}
        for name in ("_gdn", "_qsa", "_moe", "_ple", "_hc_pre", "_embed"):
            fn = getattr(m, name)
            orig[name] = fn

            def wrap(*a, _fn=fn, _n=name, **k):
                cp.cuda.Device().synchronize()
                s0 = ev()
                out = _fn(*a, **k)
                s1 = ev()
                s1.synchronize()
                comp.setdefault(_n, []).append(cp.cuda.get_elapsed_time(s0, s1))
                return out
            setattr(m, name, wrap)
        from engine.kernels import linear as K_lin
        lin = K_lin.linear
        lm = m.w["lm_head.weight"]

        def lin_wrap(x, w, *a, **k):
            if w is lm:
                cp.cuda.Device().synchronize()
                s0 = ev()
                out = lin(x, w, *a, **k)
                s1 = ev()
                s1.synchronize()
                comp.setdefault("lm_head", []).append(cp.cuda.get_elapsed_time(s0, s1))
                return out
            return lin(x, w, *a, **k)
        K_lin.linear = lin_wrap
        import engine.model as EM
        EM.K_lin.linear = lin_wrap
        for _ in range(3):
            for s in seqs:
                pool.reserve(s, 1)
            lg = m.forward(pool, [Segment(s, [t]) for s, t in zip(seqs, toks)], "decode")
            for s in seqs:
                s.length += 1
            toks = np.argmax(to_numpy(lg), -1).astype(np.int64)
        K_lin.linear = lin
        for name, fn in orig.items():
            setattr(m, name, fn)
        med["eager_components_us_per_step"] = {k: float(np.sum(v) / 3 * 1e3) for k, v in comp.items()}
        # isolated lm_head (graph-captured) device time
        x = cp.random.standard_normal((B, ck.config.hidden_size), dtype=cp.float32)
        s = cp.cuda.Stream()
        with s:
            s.begin_capture()
            y = lin(x, lm)
            gr = s.end_capture()
        for _ in range(3):
            gr.launch(stream=s)
        tl = []
        for _ in range(20):
            a0 = cp.cuda.Event(); a0.record(s)
            gr.launch(stream=s)
            a1 = cp.cuda.Event(); a1.record(s)
            a1.synchronize()
            tl.append(cp.cuda.get_elapsed_time(a0, a1) * 1e3)
        med["lm_head_graph_us"] = float(np.median(tl))
        # H2D cost of a tiny pageable array
        th = []
        for _ in range(50):
            t1 = time.perf_counter()
            cp.asarray(np.arange(B, dtype=np.int64))
            th.append(time.perf_counter() - t1)
        med["tiny_h2d_pageable_us"] = float(np.median(th)) * 1e6
        for q in seqs:
            eng.free(q)
        res[B] = med
        print(f"B={B}: " + json.dumps(med), flush=True)
    print("stats", g.stats)


def component_graph_times(cp, eng, seqs, toks, reps=20):
    """Device microseconds of each decode component at this batch, each captured alone as a graph."""
    from engine.kernels import linear as K_lin
    from engine.kernels import norms as K_norms
    from engine.model import Segment
    m, pool, c = eng.model, eng.pool, eng.config
    segs = [Segment(s, [int(t)]) for s, t in zip(seqs, toks)]
    for s in segs:
        pool.reserve(s.seq, 1)
    st = m.prepare_step(pool, segs, "decode", None)
    m._pool = pool
    B, H = len(segs), c.hidden_size
    h = cp.random.standard_normal((B, c.hc_count * H), dtype=cp.float32) * 0.1
    x = cp.random.standard_normal((B, H), dtype=cp.float32) * 0.1
    inj = cp.random.standard_normal((B, c.hc_count), dtype=cp.float32)
    comps = {"embed": lambda: m._embed(st.ids_dev),
             "lm_head": lambda: K_lin.linear(x, m.w["lm_head.weight"]),
             "hc_combine": lambda: K_norms.hc_combine(h, x, inj)}
    for i, lt in enumerate(c.layer_types):
        p = f"layers.{i}."
        comps[f"{i}.hc_pre"] = (lambda p=p: m._hc_pre(p + "attn_hyper_connection.", h, None, st.positions))
        if lt == "linear_attention":
            comps[f"{i}.gdn"] = (lambda i=i: m._gdn(i, x, segs, st))
        else:
            comps[f"{i}.qsa"] = (lambda i=i: m._qsa(i, x, st, pool))
        comps[f"{i}.moe"] = (lambda i=i: m._moe(i, x, None, st.positions))
        if i in m.ple:
            comps[f"{i}.ple"] = (lambda i=i: m._ple(i, h, segs, st))
    out = {}
    s = cp.cuda.Stream()
    for name, f in comps.items():
        f()  # compile / warm
        cp.cuda.Device().synchronize()
        with s:
            s.begin_capture()
            try:
                f()
            finally:
                g = s.end_capture()
        g.launch(stream=s)
        ts = []
        for _ in range(reps):
            a0 = cp.cuda.Event(); a0.record(s)
            g.launch(stream=s)
            a1 = cp.cuda.Event(); a1.record(s)
            a1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a0, a1) * 1e3)
        out[name] = round(float(np.median(ts)), 1)
    out["sum"] = round(sum(v for v in out.values()), 1)
    from engine.kernels import moe as K_moe
    from engine.kernels import tiles as K_tiles
    keep = K_tiles.DECODE_ROWS_PER_TILE
    i0 = 0
    for rpt in (1, 4, 16):
        K_tiles.DECODE_ROWS_PER_TILE = rpt
        f = (lambda: m._moe(i0, x, None, st.positions))
        f()
        cp.cuda.Device().synchronize()
        with s:
            s.begin_capture()
            try:
                f()
            finally:
                g = s.end_capture()
        g.launch(stream=s)
        ts = []
        for _ in range(reps):
            a0 = cp.cuda.Event(); a0.record(s)
            g.launch(stream=s)
            a1 = cp.cuda.Event(); a1.record(s)
            a1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a0, a1) * 1e3)
        out[f"moe_rpt{rpt}"] = round(float(np.median(ts)), 1)
    K_tiles.DECODE_ROWS_PER_TILE = keep
    keep, keep_max = K_moe.FUSED_DECODE, K_moe.DECODE_BLOCK_MAX_TOKENS
    # the MoE block's grouped chain vs the three-launch decode block (moe_decode.cu) wherever its shapes fit
    K_moe.DECODE_BLOCK_MAX_TOKENS = dict.fromkeys(keep_max, 16)
    for fused in (False, True):
        K_moe.FUSED_DECODE = fused
        f = (lambda: m._moe(i0, x, None, st.positions))
        f()
        cp.cuda.Device().synchronize()
        with s:
            s.begin_capture()
            try:
                f()
            finally:
                g = s.end_capture()
        g.launch(stream=s)
        ts = []
        for _ in range(reps):
            a0 = cp.cuda.Event(); a0.record(s)
            g.launch(stream=s)
            a1 = cp.cuda.Event(); a1.record(s)
            a1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a0, a1) * 1e3)
        out["moe_fused" if fused else "moe_unfused"] = round(float(np.median(ts)), 1)
    K_moe.FUSED_DECODE, K_moe.DECODE_BLOCK_MAX_TOKENS = keep, keep_max
    return out


if __name__ == "__main__":
    main()
