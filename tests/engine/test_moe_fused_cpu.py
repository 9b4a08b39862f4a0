"""CPU checks of the MoE decode block's host side (engine/kernels/moe.py, cuda/moe_decode.cu), no GPU needed.

* The decode block is the engine's decode path (no environment switch selects another).
* The NumPy twin ignores the module flag.
* The decode kernels' top-k, SwiGLU and combine are the grouped chain's expressions; no float atomics.
* Every kernel name the host builds exists in the source, in the NVRTC module the options select.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from engine.backend import CUDA_DIR, cuda_source
from engine.kernels import moe as M
from engine.kernels.dense_common import _MOE_FORMATS, kernel_module_options


def test_decode_block_is_the_default_and_not_switchable_by_the_environment():
    assert M.FUSED_DECODE is True
    text = open(M.__file__).read()
    assert not re.findall(r"QWEN4EXP_[A-Z0-9_]*[A-Z0-9]", text)


def test_decode_block_default_only_where_measured_faster():
    """The default runs the decode block for one token of BF16 / FP8 experts only (docs/performance.md: faster than
    the grouped chain there, slower for NVFP4 and at 16 tokens); no format of the kernels is left out of the table."""
    assert M.DECODE_BLOCK_MAX_TOKENS == {"bf16": 1, "fp8": 1, "nvfp4": 0}
    assert set(M.DECODE_BLOCK_MAX_TOKENS) == set(_MOE_FORMATS)


def test_numpy_twin_ignores_the_flag(rng, monkeypatch):
    E, H, I, Is, k, T = 8, 16, 8, 8, 2, 3
    W = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in
         ((E, H), (E, 2 * I, H), (E, H, I), (Is, H), (Is, H), (H, Is), (1, H))]
    x = rng.standard_normal((T, H))

    def run():
        return M.moe_block(x, W[0], W[1], W[2], top_k=k, shared_gate_proj=W[3], shared_up_proj=W[4],
                           shared_down_proj=W[5], shared_expert_gate=W[6]).out
    monkeypatch.setattr(M, "FUSED_DECODE", False)
    a = run()
    monkeypatch.setattr(M, "FUSED_DECODE", True)
    np.testing.assert_array_equal(run(), a)


def test_decode_formulas_are_the_grouped_ones():
    """The decode block's SwiGLU and combine use the grouped chain's expressions (guards drift): the shared expert's
    sigmoid gate, the combine's product order; the top-k is one function (moe_route.cuh's moe_topk_block) that
    both modules include and call, not two copies."""
    dec = cuda_source("moe_decode.cu")
    unf = cuda_source("dense_moe.cu")
    pairs = [("acc += (1.f / (1.f + expf(-g))) * shared[", "acc += (1.f / (1.f + expf(-g))) * __ldcg(ys +"),
             ("acc += Y[(long long)p * H + h] * w[t * k + j];",
              "acc += __ldcg(y + (long long)(t * k + j) * H + n) * wts[t * k + j];"),
             ("h[i] = (g / (1.f + expf(-g))) * u;", "= (g / (1.f + expf(-g))) * u;")]
    for u, f in pairs:
        assert u in unf, u
        assert f in dec, f
    topk = (Path(CUDA_DIR) / "moe_route.cuh").read_text()
    head = "__device__ __forceinline__ void moe_topk_block("
    assert topk.count(head) == 1
    for src in (dec, unf):   # the header's text inlined once, and called; no second softmax / arg-max of its own
        assert src.count(head) == 1 and src.count("moe_topk_block(") == 2, src.count("moe_topk_block(")
        assert src.count("expf(__ldcg(l + e) - m)") == 1 and src.count("moe_better(") == topk.count("moe_better(")
    # integer tickets and counts only: every atomicAdd's target is an int / unsigned counter
    targets = re.findall(r"atomicAdd\(([^,]+),", dec)
    assert targets and set(targets) == {"counter", "&cnt[e]"}, targets


def test_every_host_kernel_name_is_in_its_module():
    src = cuda_source("moe_decode.cu")
    routers = {int(m) for m in re.findall(r"^MOE_ROUTER_ENTRY\((\d+)\)$", src, re.M)}
    pairs = set(re.findall(r"^MOE_PAIR\((\w+), (\w+)\)$", src, re.M))
    assert routers == {M._token_bound(t) for t in range(1, 17)} == {1, 4, 16}
    assert pairs == {(a, b) for a in _MOE_FORMATS for b in _MOE_FORMATS}
    for a, b in pairs:  # each pair's entries compiled in the module of its defines, the routers in the base one
        opts = kernel_module_options("moe_decode.cu", f"moe_down_{a}_{b}_t16")
        assert opts == (f"-DMOE_FR={_MOE_FORMATS.index(a)}", f"-DMOE_FS={_MOE_FORMATS.index(b)}")
        sel = f"#if MOE_SEL({_MOE_FORMATS.index(a)}, {_MOE_FORMATS.index(b)})\nMOE_PAIR({a}, {b})\n#endif"
        assert sel in src, sel
    assert kernel_module_options("moe_decode.cu", "moe_router_f32_t4") == ()
    assert kernel_module_options("moe_decode.cu", "moe_down_f32_bf16_t4") == ()  # not a pair: no such entry


def test_nvrtc_text_has_every_header_inlined():
    """NVRTC resolves no local include: cuda_source must inline every header of moe_decode.cu (an include line with
    a trailing comment is not matched by its pattern and would reach NVRTC as is)."""
    assert not [ln for ln in cuda_source("moe_decode.cu").splitlines() if ln.lstrip().startswith("#include")]
