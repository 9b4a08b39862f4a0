"""CPU checks of the MoE decode chain's host side (engine/kernels/moe.py, cuda/moe_route.cu), no GPU needed.

* The decode chain is the engine's only decode path (no environment switch selects another).
* The NumPy twin ignores the module flag.
* The route kernel's formulas are the grouped chain's (bit identity rests on it).
"""
from __future__ import annotations

import re

import numpy as np

from engine.backend import cuda_source
from engine.kernels import moe as M


def test_decode_chain_is_the_default_and_not_switchable_by_the_environment():
    assert M.FUSED_DECODE is True
    # the one switch moe.py reads moves the shared expert between streams, not the chain (the retired chain
    # switches are held absent everywhere by tests/test_environment_switches.py)
    text = (M.__file__ and open(M.__file__).read())
    assert set(re.findall(r"QWEN4EXP_[A-Z0-9_]*[A-Z0-9]", text)) == {"QWEN4EXP_MOE_SHARED_STREAM"}


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
    """The decode chain's top-k, tables and combine use the grouped chain's expressions (bit-identity rests on it;
    guards drift): the shared expert's sigmoid gate, the combine's product order, the softmax terms, the tie order."""
    _check_formulas(cuda_source("moe_route.cu"), cuda_source("dense_moe.cu"))


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
