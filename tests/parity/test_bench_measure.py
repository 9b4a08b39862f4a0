"""Benchmarks: the synthetic checkpoint writer, statistics, the bytes model, peer comparison and goals,
and `qwen4exp bench` end to end on tiny sizes. Structure and positivity only - never speed."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from parity.bench import measure, runner, stats
from parity.bench import synthetic as S

# small widths with every structural feature of the real model (GDN x3 + QSA, PLE on layer 1,
# fused experts, sharded n-gram table)
SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             hc_lowrank=8, ple_embed_dim=64, indexer_n_heads=2, indexer_head_dim=16, indexer_budget=16,
             indexer_compress_ratio=4, eos_token_id=0, bos_token_id=0, split_ngram_parts=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn") / "small"
    return S.write_synthetic(d, S.real_width_config(4, ngram_vocab_size_base=100, overrides=SMALL), progress=False)


# --------------------------------------------------------------------------------------------- synthetic
def test_real_width_config_is_model_facts():
    from reference.config import ModelConfig
    cfg = ModelConfig.from_dict(S.real_width_config(4))
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (2560, 512, 10, 640)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 48, 128)
    assert (cfg.hc_count, cfg.hc_lowrank, cfg.vocab_size) == (4, 320, 248320)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",) and cfg.ple_layers == (1,)
    one = ModelConfig.from_dict(S.real_width_config(1, vocab_size=32768))
    assert one.layer_types == ("indexed_attention",) and one.ple_layers == () and one.vocab_size == 32768
    # the n-gram table is scaled down ~1000x: rows per head ~ base
    assert cfg.ple_layout(1).padded_rows < 20 * S.DEFAULT_NGRAM_BASE
    from reference.errors import InputError
    with pytest.raises(InputError, match="layers"):
        S.real_width_config(0)


def test_synthetic_checkpoint_reads_back(small_ckpt):
    from reference.checkpoint import Checkpoint
    ck = Checkpoint.open(small_ckpt)
    assert ck.validate() == []
    cfg = ck.config
    lay = cfg.ple_layout(1)
    assert tuple(ck.get_raw("layers.1.ple.ple_embedding.layer_multipliers")) == tuple(lay.multipliers)
    assert ck.dtype("layers.0.mlp.experts.gate_up_proj") == "BF16"
    assert ck.shape("layers.0.mlp.experts.gate_up_proj") == (8, 64, 64)
    w = ck.get("layers.2.mlp.experts.down_proj")
    assert 0.01 < float(w.std()) < 0.03 and np.isfinite(w).all()  # N(0, 0.02) as the official init
    assert np.all(ck.get("layers.0.linear_attn.norm.weight") == 1.0)  # the GDN gated norm is not zero-centred
    a = ck.get("layers.0.linear_attn.A_log")
    assert np.all((a > 0) & (a < math.log(16) + 0.05))
    rows = ck.ngram_rows(1, np.array([0, lay.padded_rows - 1]))
    assert rows.shape == (2, lay.head_dim)
    # atomic write: nothing but the finished directory is left
    assert not [p for p in small_ckpt.parent.iterdir() if p.name.startswith(".")]


def test_synthetic_negative_control_truncated_shard(small_ckpt, tmp_path):
    import shutil

    from reference.checkpoint import Checkpoint
    from reference.errors import CheckpointError
    d = tmp_path / "broken"
    shutil.copytree(small_ckpt, d)
    shard = sorted(d.glob("model-*.safetensors"))[2]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError):
        ck = Checkpoint.open(d)
        for n in ck.names():
            ck.get_raw(n)


def test_cached_synthetic_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path))
    kw = dict(ngram_vocab_size_base=100, overrides=SMALL, progress=False)
    a = S.cached_synthetic(2, **kw)
    t = (a / "config.json").stat().st_mtime_ns
    b = S.cached_synthetic(2, **kw)
    assert a == b and (b / "config.json").stat().st_mtime_ns == t
    c = S.cached_synthetic(2, seed=1, **kw)  # other settings: another entry
    assert c != a
    assert S.checkpoint_bytes(S.real_width_config(2, ngram_vocab_size_base=100, overrides=SMALL)) == \
        json.loads((a / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


@pytest.mark.oracle
def test_synthetic_loads_in_official_implementation_and_matches_reference(small_ckpt):
    torch = pytest.importorskip("torch", reason="torch absent: the official implementation cannot run")
    tr = pytest.importorskip("transformers", reason="transformers absent")
    if not hasattr(tr, "Qwen4ExpForCausalLM"):
        pytest.skip(f"transformers {tr.__version__} has no qwen4_exp")
    from reference.checkpoint import Checkpoint
    from reference.model import ReferenceModel
    m, info = tr.Qwen4ExpForCausalLM.from_pretrained(small_ckpt, dtype=torch.float64, output_loading_info=True,
                                                       experts_implementation="eager")  # grouped_mm has no float64
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = np.array([3, 17, 99, 5, 250, 3, 17, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 21, 22], dtype=np.int64)
    with torch.no_grad():
        want = m(torch.as_tensor(ids)[None]).logits[0].numpy()
    got = ReferenceModel(Checkpoint.open(small_ckpt), dtype=np.float64).forward(ids)
    # float64 on both sides, but the official model keeps a few parts in float32 (GDN state dtype
    # mamba_ssm_dtype, rotary inv_freq): observed ~2e-8; 1e-6 still catches any wrongly written tensor
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------- stats / bytes
def test_summarize_and_rate():
    s = stats.summarize([2.0, 1.0, 4.0])
    assert s == {"median": 2.0, "min": 1.0, "max": 4.0, "spread": 1.5, "n": 3}
    r = stats.rate(10, s)
    assert r["median"] == 5.0 and r["min"] == 2.5 and r["max"] == 10.0
    with pytest.raises(ValueError):
        stats.summarize([])


def test_decode_bytes_model():
    from reference.checkpoint import expected_shapes
    from reference.config import ModelConfig
    cfg = ModelConfig.from_dict(S.real_width_config(4))
    shapes = {n: s for n, s in expected_shapes(cfg).items()
              if not (".mlp.experts." in n and not n.endswith(("gate_up_proj", "down_proj")))}
    b1 = measure.decode_bytes(cfg, 2, 4, 1, 1024, shapes)
    b16 = measure.decode_bytes(cfg, 2, 4, 16, 1024, shapes)
    per_expert = 3 * 640 * 2560 * 2
    # batch 1 reads exactly top-k experts per layer; batch 16 more experts but fewer bytes per token
    assert b1["weights"] > 4 * 10 * per_expert
    assert b16["weights"] - b1["weights"] > 0 and b16["per_token"] < b1["per_token"] / 4
    # above the QSA bound the K/V read saturates: only the compressed block keys keep growing
    bound = cfg.qsa_bound
    lo, hi, far = (measure.decode_bytes(cfg, 2, 4, 1, c, shapes)["state_read"] for c in (bound, 2 * bound, 4 * bound))
    assert 0 < hi - lo == pytest.approx((far - hi) / 2, rel=0.01)
    assert hi - lo < (bound * 2 * 2 * 256 * 4)  # far less than reading every token's K/V


# --------------------------------------------------------------------------------------------- compare / goals
def _rate(x):
    return {"median": x, "min": x, "max": x, "spread": 0.0, "n": 1}


def test_compare_ratios_and_goals():
    runs = {"reference": {"kind": "reference", "prefill_tokens_per_s": _rate(100), "decode_tokens_per_s": _rate(10),
                          "peak_rss_bytes": 100},
            "peer_cpu": {"kind": "peer", "prefill": [{"prompt_len": 8, "tokens_per_s": _rate(50)}],
                         "decode": [{"batch": 1, "context": 8, "tokens_per_s": _rate(20)}], "peak_rss_bytes": 200},
            "engine": {"kind": "engine", "device": "cuda", "prefill": [{"prompt_len": 512, "tokens_per_s": _rate(1e4)}],
                       "decode": [{"batch": 1, "context": 1024, "tokens_per_s": _rate(100), "hbm_fraction": 0.5,
                                   "host_syncs_per_step": 1.0},
                                  {"batch": 16, "context": 1024, "tokens_per_s": _rate(500), "hbm_fraction": 0.6,
                                   "host_syncs_per_step": 3.0}]},
            "peer_gpu": {"kind": "peer", "prefill": [{"prompt_len": 512, "tokens_per_s": _rate(2e3)}],
                         "decode": [{"batch": 1, "context": 1024, "tokens_per_s": _rate(17)}]}}
    ratios, goals = runner.compare(runs)
    assert ratios["reference_decode_vs_peer_cpu"] == 0.5 and ratios["reference_prefill_vs_peer_cpu"] == 2.0
    assert ratios["engine_decode_vs_peer_gpu_b1_ctx1024"] == pytest.approx(100 / 17)
    assert ratios["engine_prefill_vs_peer_gpu_512"] == 5.0
    met = {g["goal"].split(" (")[0]: g["met"] for g in goals}
    assert met["reference decode at least as fast as the official CPU forward"] is False
    assert met["engine decode batch 1 >= 40% of the measured HBM roofline"] is True
    assert met["engine batch 16 >= 6x batch 1"] is False  # 5x
    assert met["engine decode batch 1 >= 5x the official eager GPU forward"] is True
    assert met["zero host synchronisations inside a decode step"] is False  # 3 copies per step, one is the logits
    # negative controls: a failed or unavailable peer gives no ratio, and the table says why
    runs["peer_gpu"] = {"kind": "peer", "unavailable": "transformers 5.17 has no qwen4_exp"}
    runs["peer_cpu"] = {"kind": "peer", "error": "boom"}
    ratios, goals = runner.compare(runs)
    assert not any(k.startswith(("engine_decode_vs_peer", "reference_")) for k in ratios)
    rows = runner.table_rows(runner.assemble(runs, {}, {}))
    assert ("official GPU (eager)", "", "peer unavailable", "transformers 5.17 has no qwen4_exp") in rows


def test_peer_unavailable_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    r = measure.run_peer({"model": "tiny", "repeats": 1})
    assert "unavailable" in r and "transformers" in r["unavailable"]


def test_worker_timeout_keeps_partial_results():
    done = runner.run_worker({"kind": "selftest", "sleep": 0}, timeout_s=60, quiet=True)
    assert done.get("finished") and "error" not in done
    cut = runner.run_worker({"kind": "selftest", "sleep": 60}, timeout_s=2, quiet=True)
    assert "timed out" in cut["error"] and not cut.get("finished")
    # the exit codes of such runs: a timed-out job gives no figure (3), a crashed one is an environment failure (4)
    from parity.cli.bench import exit_of_runs
    assert cut.get("timed_out") and exit_of_runs({"a": done}) == 0 and exit_of_runs({"a": done, "b": cut}) == 3
    assert exit_of_runs({"b": cut, "c": {"error": "worker exited 1"}}) == 4
    assert cut["decode"][0]["tokens_per_s"]["median"] == 2.0  # what was measured before the limit survives


def test_write_json_atomic(tmp_path):
    p = runner.write_json_atomic(tmp_path / "sub" / "r.json", {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1} and [x.name for x in p.parent.iterdir()] == ["r.json"]


# --------------------------------------------------------------------------------------------- end to end
TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"


def _need_tiny():
    if not (TINY / "config.json").is_file():
        pytest.skip("fixtures/tiny not built yet")
    try:
        import engine
        getattr(engine, "Engine")
        import reference.model  # noqa: F401
    except (ImportError, AttributeError) as e:
        pytest.skip(f"reference/engine not importable yet: {e}")


def _positive_rate(r):
    return r["median"] > 0 and r["min"] > 0 and r["max"] >= r["median"] >= r["min"] and r["n"] >= 1


@pytest.mark.oracle
def test_peer_cpu_worker_tiny():
    _need_tiny()
    pytest.importorskip("torch", reason="torch absent: the official implementation cannot run")
    tr = pytest.importorskip("transformers", reason="transformers absent")
    if not hasattr(tr, "Qwen4ExpForCausalLM"):
        pytest.skip(f"transformers {tr.__version__} has no qwen4_exp")
    r = measure.run_peer({"kind": "peer", "model": str(TINY), "device": "cpu", "prompt_lens": [8],
                          "decode": [[2, 8]], "decode_tokens": 1, "repeats": 1, "warmup": 0})
    assert "error" not in r and "unavailable" not in r, r
    assert _positive_rate(r["prefill"][0]["tokens_per_s"])
    assert [d["batch"] for d in r["decode"]] == [2] and all(_positive_rate(d["tokens_per_s"]) for d in r["decode"])
    assert r["attn_implementation"] == "eager" and r["peak_rss_bytes"] > 0


def test_extras_small():
    r = measure.run_extras({"table_bytes": 4 << 20, "gathers": 3, "rows_per_gather": 256, "diff_positions": 32})
    assert r["ngram_gather"]["rows_per_s"] > 0 and r["ngram_gather"]["rows"] == 3 * 256
    assert (r["tap_diff_mb_per_s"] or 0) > 0, r.get("tap_diff_unavailable")


