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
        eng.prefill(s, rng.integers(0, V - 10, n), last_only=True)
        eng.free(s)

    if not lens:
        prefill(args.tokens)
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStart()
        prefill(args.tokens)
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStop()
        return 0
    modes = ([("grouped", 0.0)] if args.ab else []) + [("tc", None)]  # (grouped first: its pool peak shows apart)
    pool = cp.get_default_memory_pool()
    for name, pad in modes:
        saved = TC.MOE_MAX_PAD_FP8, TC.MOE_MAX_PAD_NVFP4
        if pad is not None:
            TC.MOE_MAX_PAD_FP8 = TC.MOE_MAX_PAD_NVFP4 = pad
        try:
            for n in lens:
                prefill(n)  # warm-up (kernels compiled, pool grown)
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
            TC.MOE_MAX_PAD_FP8, TC.MOE_MAX_PAD_NVFP4 = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
