"""In-memory synthetic weights for full-depth benches (parity/bench/synthetic.py:SyntheticWeights, the
``--weights`` option, the not-fitting projection of parity/bench/measure.py). CPU side, small widths."""
import argparse

import numpy as np
import pytest

from engine import Engine
from engine.kernels.quant import QuantWeight
from parity.bench import measure as Ms
from parity.bench import synthetic as S
from reference.config import ModelConfig
from reference.errors import InputError

SMALL = dict(hidden_size=64, num_attention_heads=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
             linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, hc_lowrank=16, ple_embed_dim=32,
             heads_per_ngram=2, indexer_head_dim=16, indexer_budget=8, vocab_size=512, eos_token_id=500,
             bos_token_id=500, make_ngram_vocab_size_divisible_by=64, split_ngram_parts=4)


def small_cfg(layers=4):
    return S.real_width_config(layers, ngram_vocab_size_base=1000, overrides=SMALL)


@pytest.mark.parametrize("fmt", S.WEIGHT_FORMATS)
def test_in_memory_weights_run_in_their_format(fmt):
    ck = S.SyntheticWeights(small_cfg(), fmt)
    eng = Engine(ck, device="cpu")
    w = eng.model.w
    gu = w["layers.0.mlp.experts.gate_up"]
    assert isinstance(gu, QuantWeight) == (fmt != "bf16")
    assert isinstance(w["layers.3.self_attn.o_proj.weight"], QuantWeight) == (fmt == "fp8")  # FP8 release list
    assert ck.dtype("layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight") == (
        "BF16" if fmt == "bf16" else "F8_E4M3")
    s = eng.add_sequence()
    logits = eng.prefill(s, np.arange(1, 25), last_only=True)
    assert np.all(np.isfinite(logits)) and float(np.abs(logits).max()) > 0
    # deterministic: a second build gives the same logits
    eng2 = Engine(S.SyntheticWeights(small_cfg(), fmt), device="cpu")
    assert np.array_equal(eng2.prefill(eng2.add_sequence(), np.arange(1, 25), last_only=True), logits)
    wb = Ms.engine_weight_bytes(eng.model)
    per = {"bf16": 2, "fp8": 1, "nvfp4": 0.5}[fmt]  # bytes per expert weight (+ scales: within 20%)
    assert abs(wb["per_expert"] - per * 3 * 32 * 64) / (per * 3 * 32 * 64) < 0.2


def test_hash_twin_is_what_the_fill_uses():
    a = S._fill_u8(np, (3, 5), 7, 0xBF, 0)
    h = S._hash32(np.arange(15, dtype=np.uint64), 7)
    assert np.array_equal(a.reshape(-1), (h & 0xBF).astype(np.uint8))
    assert not np.array_equal(a, S._fill_u8(np, (3, 5), 8, 0xBF, 0))  # the seed matters
    assert not np.any((a & 0x7F) == 0x7F)  # never an E4M3 NaN code


def test_real_depth_estimates():
    cfg = ModelConfig.from_dict(S.real_width_config(48))
    est = {f: S.weights_bytes_estimate(cfg, f)["total"] / 1e9 for f in S.WEIGHT_FORMATS}
    # model-facts: BF16 ~250 GB, FP8 ~131 GB, NVFP4 experts ~68 GB + BF16 rest
    assert 240 < est["bf16"] < 260 and 120 < est["fp8"] < 135 and 70 < est["nvfp4"] < 85
    f = Ms.flops_per_token(cfg, 1024)
    routed = 48 * 10 * 3 * 640 * 2560  # the 10 routed experts of every layer
    lm_head = 248320 * 2560
    # everything else (GDN/QSA projections, shared expert, hyper-connections, router): ~3.7B parameters, which
    # with NVFP4 experts and BF16 rest gives the ~9.9 GB/token the issue quotes for SGLang's NVFP4 decode
    rest = f["matmul"] / 2 - routed - lm_head
    assert 3.0e9 < rest < 4.5e9
    assert 9.0e9 < routed * (0.5 + 1 / 16) + (rest + lm_head) * 2 < 11e9


def test_projection_from_one_and_two_periods():
    cfg = ModelConfig.from_dict(S.real_width_config(48))

    def res(L):  # a step of 1 ms + 0.5 ms per period, 1 GB + 0.8 GB per period
        per = L // 4
        return {"hbm": {"bytes_per_s": 4e12}, "matmul": {"flop_per_s": 7e14}, "gpu": "x", "precision": "bf16",
                "decode": [{"batch": 1, "context": 100, "step_s": {"median": 1e-3 + 0.5e-3 * (per - 1)},
                            "bytes_per_step": 1e9 + 0.8e9 * (per - 1), "host_syncs_per_step": 1.0}],
                "prefill": [{"prompt_len": 4096, "tokens_per_s": {"median": 4096 / (0.1 + 0.05 * (per - 1))}}]}
    out = Ms.project_periods({4: res(4), 8: res(8)}, cfg)
    d = out["decode"][0]
    assert d["projected"] and d["step_s"]["median"] == pytest.approx(1e-3 + 11 * 0.5e-3)
    assert d["bytes_per_step"] == pytest.approx(1e9 + 11 * 0.8e9)
    assert d["period_marginal_hbm_fraction"] == pytest.approx(0.8e9 / 0.5e-3 / 4e12)
    p = out["prefill"][0]
    assert p["tokens_per_s"]["median"] == pytest.approx(4096 / (0.1 + 11 * 0.05))
    # negative control: a wrong depth (24 layers) gives a different projection
    cfg24 = ModelConfig.from_dict(S.real_width_config(24))
    assert Ms.project_periods({4: res(4), 8: res(8)}, cfg24)["decode"][0]["step_s"]["median"] != d["step_s"]["median"]


def test_projection_carries_the_range_its_measurements_allow():
    """A projection multiplies the measurements' spread by up to L/4 - 1: the projected rate carries the range
    of its extremes, wide for noisy inputs, and no upper bound where the extremes allow a step of zero."""
    cfg = ModelConfig.from_dict(S.real_width_config(48))

    def res(L, spread):
        per = L // 4
        return {"hbm": {"bytes_per_s": 4e12}, "gpu": "x", "precision": "bf16", "prefill": [],
                "decode": [{"batch": 1, "context": 100, "bytes_per_step": 1e9 * per, "host_syncs_per_step": 1.0,
                            "step_s": {"median": 1e-3 + 0.5e-3 * (per - 1), "spread": spread}}]}
    exact = Ms.project_periods({4: res(4, 0.0), 8: res(8, 0.0)}, cfg)["decode"][0]["tokens_per_s"]
    assert exact["range"] == [pytest.approx(exact["median"])] * 2 and exact["spread"] == pytest.approx(0.0)
    r = Ms.project_periods({4: res(4, 0.1), 8: res(8, 0.1)}, cfg)["decode"][0]["tokens_per_s"]
    # extremes by hand: t = -10 m4 + 11 m8, m4 = 1 ms, m8 = 1.5 ms, each +- 5 %
    lo_t, hi_t = -10 * 1.05e-3 + 11 * 1.5e-3 * 0.95, -10 * 0.95e-3 + 11 * 1.5e-3 * 1.05
    assert r["median"] == pytest.approx(1 / 6.5e-3)
    assert r["range"] == [pytest.approx(1 / hi_t), pytest.approx(1 / lo_t)]
    assert r["spread"] > 4 * 0.1      # the inputs' relative range 0.1 becomes > 0.4 at 48 layers
    wild = Ms.project_periods({4: res(4, 0.9), 8: res(8, 0.9)}, cfg)["decode"][0]["tokens_per_s"]
    assert wild["range"][1] is None and wild["spread"] is None
    from parity.bench.runner import _fmt_rate
    assert "unbounded" in _fmt_rate(wild) and "(" in _fmt_rate(r) and "±" not in _fmt_rate(r)


def _args(**kw):
    base = dict(model_pos=None, model=None, synthetic="real-widths", backend="engine", layers=48, vocab=None,
                device="cpu", precision=None, prompt_lens=None, batches=None, contexts=None, decode_tokens=None,
                repeats=1, warmup=1, no_peer=False, no_extras=True, budget_s=None, timeout_s=None, json=False,
                out=None, weights="fp8")
    base.update(kw)
    return argparse.Namespace(**base)


def test_cli_plan_in_memory_writes_no_file_and_has_no_peer(tmp_path, monkeypatch):
    from parity.bench.plan import plan
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path))
    jobs, _, cks = plan(_args())
    assert [k for k, _ in jobs] == ["engine"]
    assert "real size in host memory" in cks["engine"]["ple_table"]
    spec = jobs[0][1]
    assert spec["model"] is None and spec["synthetic"]["weights"] == "fp8"
    assert spec["synthetic"]["config"]["num_hidden_layers"] == 48
    assert spec["synthetic"]["config"]["ngram_vocab_size_base"] == 20_000_000  # the real table size
    assert cks["engine"]["in_memory"] == "fp8" and not list(tmp_path.rglob("*.safetensors"))
    with pytest.raises(InputError, match="--weights fp8: only applies to --synthetic"):
        plan(_args(synthetic=None, layers=None))
    with pytest.raises(InputError, match="expected --backend engine"):
        plan(_args(backend="both"))


def _worker_spec(layers, **syn):
    return {"kind": "engine", "device": "cpu", "prompt_lens": [12], "decode": [[1, 10], [2, 10]], "decode_tokens": 2,
            "repeats": 1, "warmup": 1, "synthetic": dict({"config": small_cfg(layers), "weights": "fp8"}, **syn)}


def test_worker_in_memory_end_to_end_and_the_table():
    from parity.bench import runner
    r = Ms.run_engine(_worker_spec(4))
    assert r["fits"] and r["weights_format"] == "fp8"
    d = {(x["batch"], x["context"]): x for x in r["decode"]}
    assert set(d) == {(1, 10), (2, 10)} and all(x["tokens_per_s"]["median"] > 0 for x in d.values())
    wb = r["weight_bytes_read"]
    # bytes per step: dense once + expected distinct experts (2 of 8 per token) + state; batch 2 reads more
    assert d[(2, 10)]["bytes_per_step"] > d[(1, 10)]["bytes_per_step"] > wb["dense"]
    assert r["prefill"][0]["flop_per_token"] > 0
    rows = runner.table_rows(runner.assemble({"engine": r}, {}, {}))
    assert any("weights fp8 in memory" in row[1] for row in rows)


def test_worker_projects_a_depth_that_does_not_fit():
    r = Ms.run_engine(_worker_spec(12, free_bytes=1, working_bytes=0))  # pretend nothing fits
    assert r["fits"] is False and "12 layers projected" in r["not_fitting"]
    assert set(r["periods"]) == {4, 8} and r["periods"][8]["limits"] != r["periods"][4]["limits"]
    row = r["decode"][0]
    p4 = next(x for x in r["periods"][4]["decode"] if x["batch"] == row["batch"])
    p8 = next(x for x in r["periods"][8]["decode"] if x["batch"] == row["batch"])
    assert row["projected"] and row["step_s"]["median"] == pytest.approx(
        p4["step_s"]["median"] + 2 * (p8["step_s"]["median"] - p4["step_s"]["median"]))
