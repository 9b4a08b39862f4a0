"""The dense decode GEMVs' split-K rule, measured (GPU lab tool).

``python -m lab.gemv_splitk FMT [--layers 4] [--batches 1,16] [--rules 1,2,4] [--rounds 3] [--steps 40]``:

1. records the dense (BF16 / float32 weight) GEMV launches of one decode step of the real-width synthetic model
   (``linear.launch_plan``), and times each distinct shape alone as a CUDA graph with its K unsplit (``ks1``) and
   split over the block's 8 warps (``ks8``);
2. times whole decode steps (captured, pipelined, as ``qwen4exp bench``) under split-K rules: ``linear.
   dense_kernel_choice`` told the GPU has ``m`` times its SMs, so a matrix splits K while its row blocks number
   fewer than ``2 m`` SMs (``m = 1`` is the engine's rule); rounds alternate the order.
"""
from __future__ import annotations

import argparse

import numpy as np


def _graph_us(cp, fn, reps=30):
    """Median microseconds of ``fn`` captured as one CUDA graph (lab.bench_dense's timer)."""
    from lab.bench_dense import _graph_timer
    return _graph_timer(cp, fn, reps=reps) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fmt", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rules", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args(argv)
    import cupy as cp

    import engine as E
    from engine.kernels import linear as L
    from engine.kernels.dense_common import sm_count
    from engine.model import Segment
    from parity.bench import synthetic as S

    ck = S.SyntheticWeights(S.real_width_config(args.layers), args.fmt)
    batches = [int(b) for b in args.batches.split(",")]
    rules = [int(r) for r in args.rules.split(",")]
    eng = E.Engine(ck, precision="bf16", device="cuda", max_seqs=max(batches) + 1,
                   kv_tokens=(max(batches) + 1) * (args.context + args.rounds * len(rules) * (args.steps + 8) + 64))
    V, sms = ck.config.vocab_size, sm_count()
    rng = np.random.default_rng(0)
    base = eng.add_sequence()
    eng.prefill(base, rng.integers(0, V - 10, args.context), last_only=True)
    orig_plan, orig_choice = L.launch_plan, L.dense_kernel_choice

    def with_rule(m):
        L.dense_kernel_choice = (lambda *a, **kw: orig_choice(*a, **{**kw, "sms": m * sms}))

    for B in batches:
        # 1. the step's dense GEMV shapes, each alone with K unsplit and split
        seen = {}

        def rec(xp, x, row_index, w, stride, y, tiles, M, N, K):
            plan = orig_plan(xp, x, row_index, w, stride, y, tiles, M, N, K)
            if plan is not None and plan[1].startswith("gemv_") and tiles is None and row_index is None:
                seen.setdefault((plan[1].split("_ks")[0], int(M), int(N), int(K)), (w, plan[1]))
            return plan
        seqs = [eng.fork(base) for _ in range(B)]
        L.launch_plan = rec
        try:
            for q in seqs:
                eng.pool.reserve(q, 1)
            eng.model.forward(eng.pool, [Segment(q, [1]) for q in seqs], "decode")
            for q in seqs:
                q.length += 1
        finally:
            L.launch_plan = orig_plan
        print(f"gemv_splitk B={B}: {len(seen)} dense GEMV shapes in one step", flush=True)
        for (kn, M, N, K), (w, used) in sorted(seen.items(), key=lambda t: -t[0][2] * t[0][3]):
            x = cp.asarray(rng.standard_normal((M, K)), dtype=cp.float32)
            y = cp.empty((M, N), cp.float32)
            t = {}
            for m, tag in ((1e-6, "ks1"), (1e6, "ks8")):
                L.dense_kernel_choice = (lambda *a, m=m, **kw: orig_choice(*a, **{**kw, "sms": max(1, int(m))}))
                t[tag] = _graph_us(cp, lambda: L.linear(x, w, out=y))
            L.dense_kernel_choice = orig_choice
            gb = w.nbytes / 1e3
            print(f"  {kn} M={M} N={N} K={K}: engine uses {used}; ks1 {t['ks1']:.1f} us ({gb / t['ks1']:.0f} GB/s), "
                  f"ks8 {t['ks8']:.1f} us ({gb / t['ks8']:.0f} GB/s)", flush=True)
        # 2. whole steps under each rule
        g = eng.graphs
        toks = rng.integers(0, V - 10, B).astype(np.int64)
        times = {m: [] for m in rules}
        for r in range(args.rounds):
            for m in (rules if r % 2 == 0 else rules[::-1]):
                with_rule(m)
                g.entries.clear(), g.seen.clear(), g.failed.clear()
                toks = eng.decode_greedy_steps(seqs, toks, 2 + g.verify_replays + 2)[-1]
                st = []
                toks = eng.decode_greedy_steps(seqs, toks, args.steps, step_times=st)[-1]
                times[m].append(float(np.median(st)) * 1e6)
        L.dense_kernel_choice = orig_choice
        for q in seqs:
            eng.free(q)
        med = {m: float(np.median(v)) for m, v in times.items()}
        print(f"gemv_splitk B={B} steps: " + ", ".join(f"rule x{m} {med[m]:.1f} us/step {[round(v, 1) for v in times[m]]}"
                                                     for m in rules) + f"; graphs {g.stats}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
