"""CPU checks of the fused MoE decode chain's host logic (engine/kernels/moe.py, cuda/moe_fused.cu), no GPU needed.

* Every GEMV the decode dispatch can pick has a fused twin, and the twin's column blocks (the combine epilogue's
  unit) tile the output columns exactly as the body's grid does; the GEMMs have none (they run unfused).
* The name expressions moe.py hands NVRTC are valid instantiations of the text NVRTC compiles (moe_fused.cu with
  its headers inlined; nvcc, sm_90), with a negative control (a misspelt template is reported).
* The NumPy twin ignores the flag.
"""
from __future__ import annotations

import itertools
import subprocess

import numpy as np
import pytest

from engine.backend import cuda_source
from engine.kernels import linear as L
from engine.kernels import moe as M



def _decode_choices():
    """(kind, name, N, grid_x) of every decode GEMV the dispatch picks over a grid of shapes (H200: 132 SMs); the
    quantised ones of the qgemv family (the handshake epilogues have twins of those, not of qgemv2)."""
    out = set()
    Ns, Ks, Gy = (1, 8, 160, 192, 256, 512, 1280, 2560, 131072), (64, 96, 256, 640, 2560), (1, 4, 12, 88, 170)
    for kind, rpt, N, K, gy, al, mma in itertools.product(("bf16", "f32"), (1, 4, 16), Ns, Ks, Gy, (True, False),
                                                          (True, False)):
        f, name, gx = L.dense_kernel_choice(kind, rpt, N, K, gy, aligned=al, sms=132, mma=mma)
        out.add((kind, name, N, gx))
    for fmt, rpt, N, K, gy, vec in itertools.product(("fp8", "nvfp4"), (1, 4, 16), Ns, Ks, Gy, (True, False)):
        name, gx = L.quant_kernel_choice(fmt, rpt, N, K, gy, vec=vec, sms=132, v2=False)
        out.add((fmt, name, N, gx))
    return out


def test_every_decode_gemv_has_a_fused_twin_with_the_same_column_blocks():
    choices = _decode_choices()
    names = {c[1] for c in choices}
    assert len(names) >= 30  # all families reached (dense, tensor-core, fp8, nvfp4)
    for kind, name, N, gx in choices:
        for epi in (1, 2):
            got = M.fused_kernel_name(name, epi)
            assert got is not None, name
            expr, cols = got
            assert expr.startswith(("moe_gemv_dense<", "moe_gemv_mma<", "moe_qgemv_fp8<", "moe_qgemv_nvfp4<")), expr
            # the combine's column blocks are the body's: grid_x blocks of `cols` columns cover N, none is empty
            assert (gx - 1) * cols < N <= gx * cols, (name, N, gx, cols)
        route = M.fused_kernel_name(name, 0)
        assert (route is not None) == (name.startswith("gemv_") and "_mma_" not in name), name
    # no twin: tiled GEMMs and the debug split-2 variants
    for name in ("gemm_bf16", "qgemm_fp8", "gemv_bf16_mma_nt16_ks8_mt1_split2", "gemv_bf16_mma_nt16_ks1_mt1_sx_split2"):
        assert M.fused_kernel_name(name, 1) is None and M.fused_kernel_name(name, 2) is None


def test_epilogue_plan_geometry_and_the_batch_1_chain_fully_fused():
    """SwiGLU per column pair only where the pair geometry holds (I a multiple of the block's columns, grid x = 2
    pairs); at the real widths and one token every epilogue of every format is fused."""
    for kind, name, N, gx in _decode_choices():
        if N % 2:
            continue
        got = M.epilogue_plan(name, 1, (gx, 4, 1), M=4, N=N, rows=1)
        if got is not None and got[2]:
            assert (N // 2) % got[1] == 0 and gx == 2 * got[2], (name, N, gx, got)
    # real widths, T = 1: shared gate/up (dense, 1 row), routed gate/up (20 tiles of 1 row), routed down (combine)
    mt = 10 // 1 + 10
    for fmt in ("bf16", "fp8", "nvfp4", "f32"):
        for N, K, gy, epi in ((1280, 2560, 1, 1), (1280, 2560, mt, 1), (2560, 640, mt, 2)):
            if fmt in ("bf16", "f32"):
                name, gx = L.dense_kernel_choice(fmt, 1, N, K, gy, sms=132)[1:]
            else:
                name, gx = L.quant_kernel_choice(fmt, 1, N, K, gy, vec=True, sms=132, v2=False)
            assert M.epilogue_plan(name, epi, (gx, gy, 1), M=gy, N=N, rows=1, T=1) is not None, (fmt, N, epi, name)
    # a tail above the limit is refused (runs unfused): 16 tokens x 128 columns of a tensor-core down launch
    assert M.epilogue_plan("gemv_bf16_mma_nt8_ks1_mt1_sx", 2, (20, 200, 1), M=160, N=2560, rows=4, T=16) is None


def _real_width_exprs():
    """The expressions a real-width block (H 2560, E 512, I 640, top-10, shared 640) and the GPU tests' shapes use."""
    exprs = set()
    for T in range(1, 17):
        rpt_r = L.gemv_tile_rows(T)
        for kind in ("bf16", "f32"):
            exprs.add(M.fused_kernel_name(L.dense_kernel_choice("f32", rpt_r, 512, 2560, 1, sms=132)[1], 0)[0])
            exprs.add(M.fused_kernel_name(L.dense_kernel_choice(kind, rpt_r, 1280, 2560, 1, sms=132)[1], 1)[0])
        rpt = M._rows_per_tile(T, 10, 512)
        mt = T * 10 // rpt + min(512, T * 10)
        for kind in ("bf16", "f32"):
            exprs.add(M.fused_kernel_name(L.dense_kernel_choice(kind, rpt, 1280, 2560, mt, sms=132)[1], 1)[0])
            exprs.add(M.fused_kernel_name(L.dense_kernel_choice(kind, rpt, 2560, 640, mt, sms=132)[1], 2)[0])
        for fmt in ("fp8", "nvfp4"):
            exprs.add(M.fused_kernel_name(L.quant_kernel_choice(fmt, rpt, 1280, 2560, mt, vec=True, sms=132, v2=False)[0], 1)[0])
            exprs.add(M.fused_kernel_name(L.quant_kernel_choice(fmt, rpt, 2560, 640, mt, vec=True, sms=132, v2=False)[0], 2)[0])
    return sorted(exprs)


def _compile(nvcc, exprs, tmp_path):
    """nvcc over the text NVRTC gets (headers inlined, the nvcc-only instantiations left out) plus ``exprs``."""
    text = cuda_source("moe_fused.cu")
    assert "#ifndef __CUDACC_RTC__" in text
    text = text.replace("#ifndef __CUDACC_RTC__", "#if 0  // (nvcc-only instantiations)")
    body = "\n".join(f"    (void)&{e};" for e in exprs)
    src = tmp_path / "inst.cu"
    src.write_text(f"{text}\nvoid instantiate_all() {{\n{body}\n}}\n")
    return subprocess.run([nvcc, "-c", "-std=c++17", "--gpu-architecture=sm_90", "-o", str(tmp_path / "inst.o"),
                           str(src)], capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.nvcc
def test_real_width_fused_instantiations_compile(nvcc, tmp_path):
    exprs = _real_width_exprs()
    assert any("moe_route<float" in e for e in exprs) and any("moe_gemv_mma<" in e for e in exprs)
    r = _compile(nvcc, exprs, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # negative control: a template the file does not define is reported
    r = _compile(nvcc, ["moe_gemv_densex<1, float, 1, 1, 1, true>"], tmp_path)
    assert r.returncode != 0 and "moe_gemv_densex" in r.stderr


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


def test_fused_formulas_are_the_unfused_ones():
    """The fused epilogues and top-k use the unfused kernels' expressions (bit-identity rests on it; guards drift):
    SwiGLU, the shared expert's sigmoid gate, the combine's product order, the softmax terms, the tie order."""
    unfused = cuda_source("dense_moe.cu")
    for fused in (cuda_source("moe_fused.cu"), cuda_source("moe_route.cu")):
        _check_formulas(fused, unfused)


def _check_formulas(fused, unfused):
    pairs = [("acc += (1.f / (1.f + expf(-g))) * shared[", "acc += (1.f / (1.f + expf(-g))) * shared["),
             ("acc += Y[(long long)p * H + h] * w[t * k + j];", "acc += yv[q] * wv[q];"),
             ("float v = expf(l[e] - m);", "float x = expf(__ldcg(l + e) - m);"),
             ("probs[e] = probs[e] / total;", "probs[e] = probs[e] / total;"),
             ("return pa > pb || (pa == pb && ia < ib);", "return pa > pb || (pa == pb && ia < ib);"),
             ("out_w[(long long)t * k + j] = renorm ? top_p[j] / sum : top_p[j];",
              "out_w[j] = renorm ? out_w[j] / sum : out_w[j];")]
    if "moe_swiglu_rows" in fused:
        pairs.append(("(g / (1.f + expf(-g))) * u", "(g[q] / (1.f + expf(-g[q]))) * u[q]"))
    for u, f in pairs:
        assert u in unfused, u
        assert f in fused, f
    assert "atomicAdd(&" not in fused.split("moe_tables_block")[0]  # no float atomics before the tables' int counts
