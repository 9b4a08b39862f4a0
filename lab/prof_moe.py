"""One MoE block at the real widths under Nsight Compute (GPU dev tool, not a test): the grouped chain and the
three-launch decode block, each run ``--runs`` times inside a profiler region (weights as lab/moe_fused_bench.py).

Usage: ncu --clock-control none --profile-from-start off [--section ...] python -m lab.prof_moe [--formats nvfp4]
           [--tokens 1] [--runs 2]
"""
from __future__ import annotations

import argparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["nvfp4"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    import cupy as cp

    from engine.kernels import moe as M
    from lab.moe_fused_bench import E, H, I, IS, K_TOP, bf16_bits, experts
    M.DECODE_BLOCK_MAX_TOKENS = dict.fromkeys(M.DECODE_BLOCK_MAX_TOKENS, 16)
    cp.random.seed(0)
    router = (cp.random.standard_normal((E, H), dtype=cp.float32) * 0.02).astype(cp.float32)
    sg, su, sd = bf16_bits(cp, (IS, H)), bf16_bits(cp, (IS, H)), bf16_bits(cp, (H, IS))
    sgate, sgu = bf16_bits(cp, (1, H)), cp.concatenate([sg, su])
    for fmt in args.formats:
        gu, dn = experts(cp, fmt, 2 * I, H), experts(cp, fmt, H, I)
        for T in args.tokens:
            x = cp.random.standard_normal((T, H), dtype=cp.float32)
            for fused in (False, True):
                M.FUSED_DECODE = fused
                for _ in range(3):  # compiles and warm-up, outside the region
                    M.moe_block(x, router, gu, dn, top_k=K_TOP, shared_gate_proj=sg, shared_up_proj=su,
                                shared_down_proj=sd, shared_expert_gate=sgate, shared_gate_up=sgu)
                cp.cuda.Device().synchronize()
                print(f"region: {fmt} T={T} {'decode block' if fused else 'grouped chain'}", flush=True)
                cp.cuda.runtime.profilerStart()
                for _ in range(args.runs):
                    M.moe_block(x, router, gu, dn, top_k=K_TOP, shared_gate_proj=sg, shared_up_proj=su,
                                shared_down_proj=sd, shared_expert_gate=sgate, shared_gate_up=sgu)
                cp.cuda.Device().synchronize()
                cp.cuda.runtime.profilerStop()
        gu = dn = None
        cp.get_default_memory_pool().free_all_blocks()
    M.FUSED_DECODE = True


if __name__ == "__main__":
    main()
