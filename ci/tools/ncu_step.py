"""One steady-state decode step at real widths under Nsight Compute (dev tool): run as
ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python ci/tools/ncu_step.py [B] [bf16|fp8|nvfp4]
(a weights format: in-memory synthetic weights in that stored format, no files; else the cached BF16 checkpoint)"""
import sys

import numpy as np


def main():
    import cupy as cp

    import engine as E
    from parity.bench import synthetic as S
    from reference.checkpoint import Checkpoint
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    fmt = sys.argv[2] if len(sys.argv) > 2 else None
    ck = (S.SyntheticWeights(S.real_width_config(4), fmt) if fmt
          else Checkpoint.open(S.cached_synthetic(4, progress=False)))
    eng = E.Engine(ck, precision="bf16", device="cuda", max_seqs=B + 2, kv_tokens=4096 + 64 * (B + 2) * 4)
    V = ck.config.vocab_size
    rng = np.random.default_rng(0)
    base = eng.add_sequence()
    eng.prefill(base, rng.integers(0, V - 10, 1025), last_only=True)
    seqs = [eng.fork(base) for _ in range(B)]
    eng.free(base)
    toks = rng.integers(0, V - 10, B)
    for _ in range(6):
        toks = eng.decode_greedy(seqs, toks)
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStart()
    toks = eng.decode_greedy(seqs, toks)
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
