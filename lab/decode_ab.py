"""The captured decode step under launch variants, in one process (GPU lab tool).

``python -m lab.decode_ab FMT [--modes engine,plain,one-stream,block,grouped,hc-unfused] [--layers 4] [--batches 1,16]
[--context 1024] [--steps 48] [--rounds 4]``: the real-width synthetic model in FMT (``bf16``, ``fp8``, ``nvfp4``),
one prompt of ``--context`` tokens forked into each batch; per batch, ``--rounds`` rounds of every mode (order
alternating), each mode's decode graphs captured anew, then ``--steps`` pipelined greedy steps timed between device
events (as ``qwen4exp bench``). Modes: ``engine`` (the defaults), ``plain`` (no programmatic dependent launch:
``engine.backend.pdl_capture`` launching plainly), ``one-stream`` (the MoE's shared expert on the current stream,
``moe.SHARED_SIDE_STREAM`` off), ``block`` (the three-launch MoE decode block for every format at one token),
``grouped`` (the grouped MoE chain for every format and batch), ``hc-unfused`` (the hyper-connection input sides as
the unfused chain of GEMVs and element-wise launches, ``norms.HC_FUSED_ENABLED`` off).
Prints each mode's per-round medians (us per step), the median of those, each mode's ratio to ``engine``, and the
graphs' counters (a failed verification would show).
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fmt", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", default="engine,plain,one-stream")
    args = ap.parse_args(argv)

    import engine as E
    from engine import backend
    from engine.kernels import moe as MOE
    from engine.kernels import norms as NORMS
    from parity.bench import synthetic as S

    ck = S.SyntheticWeights(S.real_width_config(args.layers), args.fmt)
    batches = [int(b) for b in args.batches.split(",")]
    steps_total = args.rounds * len(args.modes.split(",")) * (args.steps + 8)
    eng = E.Engine(ck, precision="bf16", device="cuda", max_seqs=max(batches) + 1,
                   kv_tokens=(max(batches) + 1) * (args.context + steps_total + 64))
    g = eng.graphs
    V = ck.config.vocab_size
    rng = np.random.default_rng(0)
    pdl = backend._pdl_launcher
    print(f"decode_ab: {args.fmt}, {args.layers} layers, PDL launcher {'present' if pdl() is not None else 'absent'}",
          flush=True)
    base = eng.add_sequence()
    eng.prefill(base, rng.integers(0, V - 10, args.context), last_only=True)
    result = {}
    for B in batches:
        seqs = [eng.fork(base) for _ in range(B)]
        toks = rng.integers(0, V - 10, B).astype(np.int64)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        times = {m: [] for m in modes}
        keep, keep_side = dict(MOE.DECODE_BLOCK_MAX_TOKENS), MOE.SHARED_SIDE_STREAM
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                backend._pdl_launcher = (lambda: None) if mode == "plain" else pdl
                MOE.DECODE_BLOCK_MAX_TOKENS.update(dict.fromkeys(keep, 1) if mode == "block"
                                                   else dict.fromkeys(keep, 0) if mode == "grouped" else keep)
                MOE.SHARED_SIDE_STREAM = keep_side and mode != "one-stream"
                NORMS.HC_FUSED_ENABLED = mode != "hc-unfused"
                g.entries.clear(), g.seen.clear(), g.failed.clear()
                n0 = backend.pdl_launches
                toks = eng.decode_greedy_steps(seqs, toks, 2 + g.verify_replays + 2)[-1]
                st = []
                toks = eng.decode_greedy_steps(seqs, toks, args.steps, step_times=st)[-1]
                times[mode].append(float(np.median(st)) * 1e6)
                if mode != "plain" and pdl() is not None and backend.pdl_launches == n0:
                    print(f"decode_ab: no launch used the attribute in mode {mode}", flush=True)
        backend._pdl_launcher = pdl
        MOE.DECODE_BLOCK_MAX_TOKENS.update(keep)
        MOE.SHARED_SIDE_STREAM = keep_side
        NORMS.HC_FUSED_ENABLED = True
        for q in seqs:
            eng.free(q)
        med = {m: float(np.median(v)) for m, v in times.items()}
        ref = med.get("engine", med[modes[0]])
        result[B] = {"us_per_step": times, "median": med}
        print(f"decode_ab B={B}: " + ", ".join(f"{m} {med[m]:.1f} us/step ({med[m] / ref:.3f})" for m in modes)
              + "; rounds " + "; ".join(f"{m} {[round(t, 1) for t in times[m]]}" for m in modes), flush=True)
    print("decode_ab graphs", json.dumps(g.stats), "pdl launches", backend.pdl_launches, flush=True)
    return 0 if g.stats["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
