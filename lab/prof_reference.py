"""Where the reference's time goes on this host: one float32 forward of the real-width period (cProfile, top
functions by own time), with the host's BLAS / Numba thread settings and a BLAS GEMM rate beside it.

    python -m lab.prof_reference [--tokens 2060] [--model DIR] [--top 20]

The model defaults to the real-width period ``ci/gpu_realwidth.sh`` judges (written into the synthetic cache the
first time, ~1 min); the prompt is the floor's stream past the QSA bound, cut to ``--tokens``."""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2060)
    ap.add_argument("--model", default=None)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    try:
        from threadpoolctl import threadpool_info
        pools = [(p.get("internal_api"), p.get("num_threads"), p.get("filepath", "").split("/")[-1])
                 for p in threadpool_info()]
    except ImportError:
        pools = "threadpoolctl not installed"
    import numba
    print(f"host: {os.cpu_count()} cpus, affinity {len(os.sched_getaffinity(0))}; numba threads "
          f"{numba.config.NUMBA_NUM_THREADS}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; pools {pools}")
    a = np.random.default_rng(0).standard_normal((2048, 2560), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((16384, 2560), dtype=np.float32)
    a @ b.T
    t = time.perf_counter()
    for _ in range(3):
        a @ b.T
    dt = (time.perf_counter() - t) / 3
    print(f"BLAS sgemm 2048x2560x16384: {dt * 1e3:.0f} ms = {2 * 2048 * 2560 * 16384 / dt / 1e9:.0f} GFLOP/s")

    from parity.backends import load_weights
    from parity.bench.synthetic import cached_synthetic
    from parity.harness.floor import floor_prompts, logged_logits
    from reference.model import ReferenceModel
    model = args.model or cached_synthetic(4, overrides={"num_experts": 32, "num_experts_per_tok": 10},
                                           progress=False)
    w = load_weights(model)
    ids = floor_prompts(w.config, None)[-1][:args.tokens]
    m = ReferenceModel(w, dtype=np.float32, progress=False)
    logged_logits(m, ids[:16])   # Numba's compilation out of the figure
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    logged_logits(m, ids)
    pr.disable()
    print(f"float32 forward, {len(ids)} tokens: {time.perf_counter() - t:.1f} s wall")
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
