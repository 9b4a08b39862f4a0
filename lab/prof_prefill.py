"""One prefill at real widths (synthetic weights in memory, 4 layers by default), for a kernel profile or a timing.

Run on a GPU from the repository root:

* ``python -m lab.prof_prefill FMT [--tokens N]``: one warm-up prefill of N tokens (default 4096), then one more
  between ``cudaProfilerStart`` / ``cudaProfilerStop``, for a profiler that records only that region, e.g.
  ``ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv python3 -m
  lab.prof_prefill fp8 > p.csv`` then ``python3 ci/tools/ncu_sum.py p.csv`` (kernel totals, ns).
* ``python -m lab.prof_prefill FMT --time 512,4096 [--ab]``: per prompt length, the median of 3 prefills (CUDA
  events, after one warm-up) in ms and tokens/s; ``--ab`` also times them with the FP8 / NVFP4 experts on their
  grouped float32-FMA kernels (``gemm_tc.MOE_MAX_PAD_FP8`` / ``MOE_MAX_PAD_NVFP4`` = 0: the MoE's tensor-core path
  off, the dense projections unchanged), the "before" of the tensor-core MoE in the same process, timed first
  (cupy's pool never shrinks: the GiB it holds after each mode are that mode's peak, then the larger of both).
  ``--seq-ab`` also times the GDN recurrence and the QSA attention of the prefill on their fallback kernels (the
  one-warp GDN recurrence, the per-query-head QSA attention: ``gdn.GDN_SPLIT_MAX_TPS`` / ``qsa.QSA_SPLIT_MAX_T`` =
  0), each and both. Each mode's last logits are
  compared with the first mode's (max |diff|, same prompt).

* ``--sweep-scratch-mb 512,8192`` / ``--sweep-tile-rows 32,128`` (with ``--time``): the tensor-core MoE again at
  each FP8 scratch budget (``gemm_tc.MOE_FP8_SCRATCH_BYTES``) / tile height (``gemm_tc.MOE_TILE_ROWS``), at the
  longest ``--time`` length.

``FMT``: ``bf16``, ``fp8`` or ``nvfp4`` (``parity.bench.synthetic``'s real-width weights). The engine runs at
``precision="bf16"`` (float32 activations and accumulation on the stored weights), one sequence, the whole prompt
in one chunk, last logits only. Peak device memory (cupy's pool) is printed with ``--time``.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    """Parse the arguments, build the engine, run the profiled prefill or the timings (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fmt", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length of the profiled prefill")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--time", default="", help="comma-separated prompt lengths to time (no profiler region)")
    ap.add_argument("--ab", action="store_true", help="with --time: also the grouped-kernel MoE (before)")
    ap.add_argument("--sweep-scratch-mb", default="", help="with --time: FP8 scratch budgets to time (MiB)")
    ap.add_argument("--sweep-tile-rows", default="", help="with --time: MoE tile heights to time")
    ap.add_argument("--seq-ab", action="store_true",
                    help="with --time: also the GDN / QSA prefill on their fallback kernels")
    args = ap.parse_args(argv)
    import cupy as cp

    import engine as E
    from engine.kernels import gemm_tc as TC
    from parity.bench import synthetic as S

    lens = [int(v) for v in args.time.split(",") if v.strip()]
    n_max = max(lens + [args.tokens])
    ck = S.SyntheticWeights(S.real_width_config(args.layers), args.fmt)
    eng = E.Engine(ck, precision="bf16", device="cuda", max_seqs=4, kv_tokens=2 * n_max + 512)
    V = ck.config.vocab_size
    rng = np.random.default_rng(0)

    def prefill(n):
        s = eng.add_sequence()
        out = eng.prefill(s, np.random.default_rng(n).integers(0, V - 10, n), last_only=True)
        eng.free(s)
        return out

    if not lens:
        prefill(args.tokens)
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStart()
        prefill(args.tokens)
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStop()
        return 0
    from engine.kernels import gdn as GDN
    from engine.kernels import qsa as QSA
    # (name, [(module, attribute, value)], lengths); the grouped mode first: its pool peak shows apart
    modes = ([("grouped", [(TC, "MOE_MAX_PAD_FP8", 0.0), (TC, "MOE_MAX_PAD_NVFP4", 0.0)], lens)] if args.ab else [])
    modes.append(("tc", [], lens))
    if args.seq_ab:
        modes += [("gdn_one_warp", [(GDN, "GDN_SPLIT_MAX_TPS", 0)], lens),
                  ("qsa_per_head", [(QSA, "QSA_SPLIT_MAX_T", 0)], lens),
                  ("both_fallback", [(GDN, "GDN_SPLIT_MAX_TPS", 0), (QSA, "QSA_SPLIT_MAX_T", 0)], lens)]
    modes += [(f"tc_scratch{v}MiB", [(TC, "MOE_FP8_SCRATCH_BYTES", int(v) << 20)], lens[-1:])
              for v in args.sweep_scratch_mb.split(",") if v.strip()]
    modes += [(f"tc_R{v}", [(TC, "MOE_TILE_ROWS", int(v))], lens[-1:]) for v in args.sweep_tile_rows.split(",")
              if v.strip()]
    pool = cp.get_default_memory_pool()
    first = {}  # the first mode's logits per length: every other mode's agreement is printed against them
    for name, sets, mlens in modes:
        saved = [(m, a, getattr(m, a)) for m, a, _ in sets]
        for m, a, v in sets:
            setattr(m, a, v)
        try:
            for n in mlens:
                lg = np.asarray(prefill(n), dtype=np.float64)  # warm-up (kernels compiled, pool grown)
                if n in first:
                    ref = first[n]
                    print(f"  {name} T={n}: last logits max |diff| vs {ref[0]} "
                          f"{np.max(np.abs(lg - ref[1])):.3e} (logit scale {np.std(ref[1]):.3e})")
                else:
                    first[n] = (name, lg)
                times = []
                for _ in range(3):
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record()
                    prefill(n)
                    b.record()
                    b.synchronize()
                    times.append(cp.cuda.get_elapsed_time(a, b))
                ms = sorted(times)[1]
                print(f"prefill {args.fmt} layers={args.layers} T={n} moe={name}: {ms:.1f} ms median of 3 "
                      f"({n / ms * 1e3:.0f} tok/s; all {', '.join(f'{t:.1f}' for t in times)}); pool "
                      f"{pool.total_bytes() / 2**30:.2f} GiB held")
        finally:
            for m, a, v in saved:
                setattr(m, a, v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
