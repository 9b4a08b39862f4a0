"""The llama.cpp speed peer (parity.bench.llamacpp_peer): parsing llama.cpp's own output formats, the pairing,
the same-model check (with its negative control), the goal marking, a failed llama.cpp run reported with its
own error, and bad input -> one clear error. CPU only, seconds.

The sample outputs are written the way llama.cpp 0.3.36 (commit 0c1e570) prints them: llama-bench's
``json_printer`` (tools/llama-bench/llama-bench.cpp: ``test::get_fields()`` then ``samples_ns`` / ``samples_ts``),
llama-batched-bench's jsonl and markdown lines (tools/batched-bench/batched-bench.cpp), and llama-quantize log
lines copied from a real run of llama.cpp's quantizer (src/llama-quant.cpp, via llama-cpp-python 0.3.36).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.bench import llamacpp_peer as L
from parity.bench import synthetic as S
from reference.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
CFG4 = S.real_width_config(4)  # the shapes prepare converts (BENCH_LAYERS 4)


def _lb_row(p, n, d, ts, *, n_params, size=23_000_000_000):
    """One llama-bench json_printer object (field order of test::get_fields(); three samples)."""
    ns = [int(1e9 * (p + n) / t) for t in ts]
    return {"build_commit": "0c1e570", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "NVIDIA H200",
            "backends": "CUDA", "model_filename": "/tmp/m.gguf", "model_type": "qwen4exp ?B BF16",
            "model_size": size, "model_n_params": n_params, "n_batch": 2048, "n_ubatch": 512, "n_threads": 16,
            "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99,
            "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": 1,
            "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "mmap",
            "lazy_mode": "none", "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
            "fit_target": 1024, "fit_min_ctx": 4096, "n_prompt": p, "n_gen": n, "n_depth": d,
            "test_time": "2026-12-02T04:00:00Z", "avg_ns": sum(ns) // 3, "stddev_ns": 0, "avg_ts": sum(ts) / 3,
            "stddev_ts": 0.0, "samples_ns": ns, "samples_ts": ts}


def _lb_text(rows):
    """The text json_printer writes: '[', objects joined by ',\\n' with 4-space fields, ']'."""
    objs = []
    for r in rows:
        body = ",\n".join(f'    "{k}": {json.dumps(v)}' for k, v in r.items())
        objs.append("  {\n" + body + "\n  }")
    return "[\n" + ",\n".join(objs) + "\n]\n"


def _bb_jsonl(pl, speed_tg, pp=1024, tg=64):
    t_tg = pl * tg / speed_tg
    return ('{"n_kv_max": 17408, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, '
            '"n_gpu_layers": 99, "n_threads": 16, "n_threads_batch": 16, '
            f'"pp": {pp}, "tg": {tg}, "pl": {pl}, "n_kv": {pl * (pp + tg)}, "t_pp": 0.500000, '
            f'"speed_pp": {pl * pp / 0.5:f}, "t_tg": {t_tg:f}, "speed_tg": {speed_tg:f}, "t": {0.5 + t_tg:f}, '
            f'"speed": 1.000000}}')


def _llama_result(n_params, *, pp=(20000.0, 15000.0), tg=400.0, b16=3000.0, table=0, fail=None):
    """A run_llama result for one GGUF (llama-bench: pp512 / pp4096 at depth 0 and tg128 at depth 1024)."""
    if fail:
        lb = {"rows": [], "error": fail}
    else:
        rows = [_lb_row(512, 0, 0, [pp[0]] * 3, n_params=n_params), _lb_row(4096, 0, 0, [pp[1]] * 3, n_params=n_params),
                _lb_row(0, 128, 1024, [tg * 0.98, tg, tg * 1.1], n_params=n_params)]
        lb = {"rows": L.parse_llama_bench(_lb_text(rows))}
    bb = {"rows": L.parse_batched_bench("\n".join(_bb_jsonl(16, b16 * f) for f in (0.99, 1.0, 1.01)))}
    return {"llama_bench": lb, "batched_bench": bb,
            "gguf": {"n_params": n_params, "bytes": 2 * n_params, "table_params": table, "table_bytes": 2 * table}}


def _engine_doc(cfg, fmt, *, pre=(40000.0, 30000.0), b1=800.0, b16=6000.0, bytes_on_device=None):
    return {"schema": 1, "runs": {"engine": {
        "kind": "engine", "weights_format": fmt,
        "weight_bytes_on_device": bytes_on_device or 2 * L.engine_params(cfg)["compared"],
        "prefill": [{"prompt_len": 512, "tokens_per_s": {"median": pre[0]}},
                    {"prompt_len": 4096, "tokens_per_s": {"median": pre[1]}}],
        "decode": [{"batch": 1, "context": 1024, "tokens_per_s": {"median": b1}},
                   {"batch": 16, "context": 1024, "tokens_per_s": {"median": b16}},
                   {"batch": 1, "context": 4096, "tokens_per_s": {"median": 1.0}}],
        "spec": {"synthetic": {"config": cfg, "weights": fmt}}}}}


def _gguf_n_params(cfg):
    """What llama.cpp's model_n_params is for a GGUF of ``cfg``: every float tensor (the converter turns the int64
    PLE hash constants into metadata; measured on a converted synthetic checkpoint: 3,553,592 = shapes - 11)."""
    return L.engine_params(cfg)["total"]


# ------------------------------------------------------------------------------------------------ parsing

def test_llama_bench_json_is_parsed_with_the_median_of_its_samples():
    rows = L.parse_llama_bench(_lb_text([_lb_row(512, 0, 0, [100.0, 300.0, 200.0], n_params=7)]))
    assert len(rows) == 1 and rows[0]["median_ts"] == 200.0 and rows[0]["n_prompt"] == 512


def test_an_interrupted_llama_bench_keeps_its_complete_tests():
    text = _lb_text([_lb_row(512, 0, 0, [1.0] * 3, n_params=7), _lb_row(4096, 0, 0, [2.0] * 3, n_params=7)])
    cut = text[: text.rindex('"n_prompt"')]  # killed in the middle of the second object
    rows = L.parse_llama_bench(cut)
    assert [r["n_prompt"] for r in rows] == [512]


@pytest.mark.parametrize("text, what", [("", "JSON array"), ("main: error: failed to load model", "JSON array"),
                                        ('[\n  {"n_prompt": 512}\n]', "missing")])
def test_llama_bench_bad_output_is_one_clear_error(text, what):
    with pytest.raises(L.PeerInputError, match=what):
        L.parse_llama_bench(text, "llama-bench BF16")


def test_batched_bench_jsonl_and_markdown_give_the_same_rows():
    log = "llama_model_loader: loaded meta data\nmain: n_kv_max = 17408\n"
    jl = L.parse_batched_bench(log + _bb_jsonl(16, 2500.0) + "\n")
    # the markdown row as batched-bench.cpp's LOG("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | ...") prints it
    t_tg = 16 * 64 / 2500.0
    md = f"|{1024:6d} | {64:6d} | {16:4d} | {17408:6d} | {0.5:8.3f} | {32768.0:8.2f} | {t_tg:8.3f} | {2500.0:8.2f} | " \
         f"{0.5 + t_tg:8.3f} | {1.0:8.2f} |"
    mk = L.parse_batched_bench(log + "|    PP |     TG |    B |   N_KV |\n" + md)
    assert jl[0]["pl"] == mk[0]["pl"] == 16 and jl[0]["speed_tg"] == pytest.approx(mk[0]["speed_tg"])


def test_batched_bench_without_results_is_one_clear_error():
    with pytest.raises(L.PeerInputError, match="found none"):
        L.parse_batched_bench("main: error: unable to load model\n")


# real llama-quantize lines (Q4_K_M of a small synthetic qwen4exp GGUF; the 640-column line is the real-width
# expert down projection, in the same format)
QLOG = """\
warning: output_hc_up.weight                  - ncols     16 not divisible by 256 (required for type    q4_K) (WARNING: must use F16 due to unusual shape) -> falling back to     f16
warning: blk.0.ffn_down_exps.weight           - ncols    640 not divisible by 256 (required for type    q4_K) -> falling back to    q5_0
warning: blk.2.ffn_down_exps.weight           - ncols    640 not divisible by 256 (required for type    q6_K) -> falling back to    q8_0
[   1/ 113] output.weight                        - [   256,    512,      1,      1], type =   bf16, converting to q6_K .. size =     0.25 MiB ->     0.10 MiB
[   3/ 113] output_hc_norm.weight                - [  1024,      1,      1,      1], type =    f32, size =    0.004 MiB
[   9/ 113] blk.0.ffn_down_exps.weight           - [   640,   2560,    512,      1], type =   bf16, converting to q5_0 .. size =  1600.00 MiB ->   550.00 MiB
llama_model_quantize_impl: WARNING: 3 of 113 tensor(s) required fallback quantization
"""


def test_quantize_log_records_what_could_not_be_quantised_to_the_asked_type():
    q = L.parse_quantize_log(QLOG)
    assert q["n_fallback"] == 3 and len(q["fallbacks"]) == 3
    down = q["fallbacks"][1]
    assert (down["name"], down["ncols"], down["block"], down["asked"], down["used"]) == \
        ("blk.0.ffn_down_exps.weight", 640, 256, "q4_K", "q5_0")
    assert q["fallbacks"][0]["f16_forced"] and q["fallbacks"][2]["used"] == "q8_0"
    t = {x["name"]: x for x in q["tensors"]}
    assert t["output.weight"]["to"] == "q6_K" and t["output_hc_norm.weight"]["to"] == "f32"  # kept as it was
    assert t["blk.0.ffn_down_exps.weight"]["shape"] == [640, 2560, 512, 1]


def test_llama_error_quotes_llama_cpps_own_lines():
    err = "load_tensors: loading\nllama_model_load: error loading model: missing tensor 'blk.0.ssm_a'\n" \
          "main: error: failed to load model 'm.gguf'\n"
    msg = L.llama_error(err, 1)
    assert "missing tensor 'blk.0.ssm_a'" in msg and "failed to load model" in msg and "exit status 1" in msg


# --------------------------------------------------------------------------------------------- the models

def test_engine_and_llama_side_see_the_same_shapes_in_every_format():
    """prepare converts real_width_config(4) (scaled n-gram table); the engine's in-memory fp8 / nvfp4 weights
    hold the real-size table: with the table excluded the counts are equal, with it they are not."""
    real_table = S.real_width_config(4, ngram_vocab_size_base=S.REAL_NGRAM_BASE)
    a, b = L.engine_params(CFG4), L.engine_params(real_table)
    assert a["compared"] == b["compared"] and a["total"] != b["total"]
    assert b["table"] > 100 * a["table"]


# ------------------------------------------------------------------------------------------ the comparison

def _pairs(doc):
    return {p["engine_format"]: {r["key"]: r for r in p["rows"]} | {"_p": p} for p in doc["pairs"]}


def test_pairing_ratios_and_goal_marking():
    n = _gguf_n_params(CFG4)
    eng = {"bf16": _engine_doc(CFG4, "bf16", pre=(40000.0, 29999.0), b1=600.0, b16=4500.0),
           "fp8": _engine_doc(CFG4, "fp8", b1=599.0)}
    lla = {"BF16": _llama_result(n, pp=(20000.0, 15000.0), tg=400.0, b16=3000.0), "Q8_0": _llama_result(n, tg=400.0)}
    doc = L.compare(eng, lla)
    by = _pairs(doc)
    assert set(by) == {"bf16", "fp8"} and by["bf16"]["_p"]["llama_type"] == "BF16" and by["fp8"]["_p"]["llama_type"] == "Q8_0"
    r = by["bf16"]
    assert r["decode_b1"]["ratio"] == pytest.approx(1.5) and r["decode_b1"]["met"] is True   # exactly at the goal
    assert r["decode_b16"]["ratio"] == pytest.approx(1.5) and r["decode_b16"]["met"] is True
    assert r["prefill_512"]["ratio"] == pytest.approx(2.0) and r["prefill_512"]["met"] is True
    assert r["prefill_4096"]["ratio"] < 2.0 and r["prefill_4096"]["met"] is False
    assert by["fp8"]["decode_b1"]["met"] is False                                       # 599 / 400 < 1.5
    assert r["_p"]["same_model"]["ok"] is True
    assert r["_p"]["bytes_per_weight"]["engine"] == pytest.approx(2.0)
    md = L.markdown(doc)
    assert "| bf16 (2.00 B/w) | BF16 (2.00 B/w) | decode batch 1, context 1024 | 600.0 | 400.0 | 1.50x | >= 1.5x | met |" in md
    assert "not met" in md


def test_same_model_check_refuses_a_different_model():
    """Negative control: the GGUF of an 8-layer checkpoint against the engine's 4 layers is refused, located."""
    n8 = _gguf_n_params(S.real_width_config(8))
    doc = L.compare({"bf16": _engine_doc(CFG4, "bf16")}, {"BF16": _llama_result(n8)})
    p = doc["pairs"][0]
    assert p["same_model"]["ok"] is False
    assert all(r["ratio"] is None and r["met"] is None for r in p["rows"])
    assert all("ratio refused" in r["note"] and "not the engine's shapes" in r["note"] for r in p["rows"])
    # ... and 1% is the line: 0.5% off passes, 2% off is refused
    n = _gguf_n_params(CFG4)
    e = L.engine_params(CFG4)
    assert L.same_model(e, {"model_n_params": n + e["compared"] // 200})["ok"] is True
    assert L.same_model(e, {"model_n_params": n + e["compared"] // 50})["ok"] is False


def test_the_table_is_left_out_of_the_same_model_check_on_the_llama_side():
    n = _gguf_n_params(CFG4)
    tab = L.engine_params(CFG4)["table"]
    ok = L.same_model(L.engine_params(CFG4), {"model_n_params": n, "gguf": {"table_params": tab}})
    assert ok["ok"] is True and ok["rel"] == 0.0
    # without the subtraction the same GGUF is off by exactly the table's share
    off = L.same_model(L.engine_params(CFG4), {"model_n_params": n, "gguf": {}})
    assert off["rel"] == pytest.approx(tab / L.engine_params(CFG4)["compared"])


def test_a_failed_llama_cpp_run_is_reported_with_its_own_error_not_dropped():
    n = _gguf_n_params(CFG4)
    err = "llama_model_load: error loading model: unknown model architecture: 'qwen4exp' | main: error: failed to " \
          "load model (exit status 1)"
    doc = L.compare({"nvfp4": _engine_doc(CFG4, "nvfp4")}, {"Q4_K_M": _llama_result(n, fail=err)})
    r = _pairs(doc)["nvfp4"]
    for k in ("decode_b1", "prefill_512", "prefill_4096"):
        assert r[k]["ratio"] is None and r[k]["llama"] is None and "unknown model architecture" in r[k]["note"]
    assert r["decode_b16"]["ratio"] is not None  # batched-bench ran: its row stays
    assert r["_p"]["same_model"]["ok"] is True   # from the GGUF's tensor table
    md = L.markdown(doc)
    assert "unknown model architecture" in md and "| nvfp4" in md


def test_a_format_only_one_side_ran_is_still_a_row():
    n = _gguf_n_params(CFG4)
    doc = L.compare({}, {"Q8_0": _llama_result(n)})
    r = _pairs(doc)["fp8"]
    assert r["decode_b1"]["ratio"] is None and "engine" in r["decode_b1"]["note"]


# ------------------------------------------------------------------------------------------------ bad input

def test_table_bad_input_is_one_clear_error(tmp_path):
    good = tmp_path / "llamacpp.json"
    good.write_text(json.dumps({"results": {}}))
    with pytest.raises(L.PeerInputError, match="expected a file") as e:
        L.table({"bf16": tmp_path / "nope.json"}, good)
    assert isinstance(e.value, UserError)
    bad = tmp_path / "engine-bf16.json"
    bad.write_text('{"runs": ')
    with pytest.raises(L.PeerInputError, match="malformed"):
        L.table({"bf16": bad}, good)
    bad.write_text("[]")
    with pytest.raises(L.PeerInputError, match="qwen4exp bench --out"):
        L.table({"bf16": bad}, good)
    eng = tmp_path / "engine-ok.json"
    eng.write_text(json.dumps(_engine_doc(CFG4, "bf16")))
    good.write_text("[1, 2]")
    with pytest.raises(L.PeerInputError, match="'results'"):
        L.table({"bf16": eng}, good)


def test_cli_help_and_bad_input_exit_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "parity.bench.llamacpp_peer", "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and "prepare" in r.stdout and "table" in r.stdout
    r = subprocess.run([sys.executable, "-m", "parity.bench.llamacpp_peer", "table", "--engine",
                        f"bf16={tmp_path / 'missing.json'}", "--llama", str(tmp_path / "l.json")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "parity.bench.llamacpp_peer", "table", "--engine", "fp16=x.json",
                        "--llama", "l.json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "FORMAT=FILE" in r.stderr


def test_table_writes_the_comparison_atomically(tmp_path):
    n = _gguf_n_params(CFG4)
    e = tmp_path / "engine-bf16.json"
    e.write_text(json.dumps(_engine_doc(CFG4, "bf16")))
    lj = tmp_path / "llamacpp.json"
    lj.write_text(json.dumps({"results": {"BF16": _llama_result(n)}, "commit": "0c1e570"}))
    out = tmp_path / "peer.json"
    lines = []
    doc = L.table({"bf16": e}, lj, out, log=lines.append)
    assert json.loads(out.read_text())["pairs"][0]["rows"][0]["ratio"] == doc["pairs"][0]["rows"][0]["ratio"]
    assert doc["llama_cpp"]["commit"] == "0c1e570" and lines and lines[0].startswith("| engine |")
    assert not list(tmp_path.glob("*.tmp*"))


# ----------------------------------------------------------------------------------------------- GGUF reading

def _gguf_py():
    for d in (Path("/tmp/llama-src/gguf-py"), Path.home() / ".cache/qwen4exp/llama.cpp-0.3.36/gguf-py"):
        if (d / "gguf" / "__init__.py").is_file():
            return d
    return None


def test_gguf_summary_counts_parameters_bytes_and_the_table(tmp_path):
    gp = _gguf_py()
    if gp is None:
        pytest.skip("llama.cpp's gguf-py not extracted here (tests/parity/test_llamacpp.py extracts it)")
    sys.path.insert(0, str(gp))
    import numpy as np
    from gguf import GGUFWriter
    f = tmp_path / "m.gguf"
    w = GGUFWriter(str(f), "qwen4exp")
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float16))
    w.add_tensor(L.GGUF_TABLE, np.zeros((4, 16), np.float32))
    w.add_array(L.GGUF_COMPRESS_RATIOS, [0, 0, 0, 4])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = L.gguf_summary(f, gp)
    assert (s["n_params"], s["bytes"], s["table_params"], s["table_bytes"]) == (192, 8 * 16 * 2 + 4 * 16 * 4, 64, 256)
    assert s["by_type"]["F16"]["tensors"] == 1 and s["by_type"]["F32"]["params"] == 64
    assert s["compress_ratios"] == [0, 0, 0, 4]
    assert L.patch_compress_ratios(f, [0, 0, 0, 8], gp) == [0, 0, 0, 4]   # in place, what it replaced
    assert L.gguf_summary(f, gp)["compress_ratios"] == [0, 0, 0, 8]
    with pytest.raises(L.PeerInputError, match="with 6 entries, found 4"):
        L.patch_compress_ratios(f, [0] * 6, gp)
    assert L.gguf_summary(f, gp)["compress_ratios"] == [0, 0, 0, 8]     # nothing written
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(L.PeerInputError, match="expected a GGUF file"):
        L.gguf_summary(bad, gp)


# ------------------------------------------------------------------------------------------------ ci scripts

@pytest.mark.parametrize("script", ["ci/llamacpp_src.sh", "ci/gpu_llamacpp.sh"])
def test_ci_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0


def test_llamacpp_src_refuses_a_missing_sdist(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "ci/llamacpp_src.sh"), str(tmp_path / "none.tar.gz")], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "expected llama-cpp-python's source distribution" in r.stderr


def test_gpu_llamacpp_bench_refuses_without_a_build(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "LLAMA_BUILD": str(tmp_path / "b"),
           "LLAMA_WORK": str(tmp_path / "w"), "LLAMA_MODELS": str(tmp_path / "m")}
    r = subprocess.run(["bash", str(ROOT / "ci/gpu_llamacpp.sh"), "bench"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "expected a finished build" in r.stdout
    r = subprocess.run(["bash", str(ROOT / "ci/gpu_llamacpp.sh"), "wait", "prepare"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "nothing under way" in r.stdout


def test_a_gguf_whose_qsa_layers_llama_cpp_would_run_dense_is_flagged():
    """docs/outside-engines.md finding 6: a converter run under a transformers that renames the attention layers
    writes compress ratio 0 for them (seen here: [0, 0, 0, 0] from transformers 5.24's config, [0, 0, 0, 4] from
    config.json), and llama.cpp then builds dense attention: the comparison says so instead of hiding it."""
    ok = L.qsa_check(CFG4, [0, 0, 0, 4])
    assert ok["ok"] and ok["expected"] == [0, 0, 0, 4]
    bad = L.qsa_check(CFG4, [0, 0, 0, 0])
    assert not bad["ok"] and "DENSE" in bad["message"]
    assert not L.qsa_check(CFG4, None)["ok"]  # no key at all: not QSA either
    n = _gguf_n_params(CFG4)
    res = _llama_result(n)
    res["gguf"]["qsa"] = bad
    md = L.markdown(L.compare({"bf16": _engine_doc(CFG4, "bf16")}, {"BF16": res}))
    assert "runs the QSA layers as DENSE attention" in md


# ----------------------------------------------------------------------- prepare, end to end on small widths

SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, hc_lowrank=16,
             ple_embed_dim=256, heads_per_ngram=2, indexer_head_dim=32, indexer_budget=8, split_ngram_parts=4,
             make_ngram_vocab_size_divisible_by=64, vocab_size=512, eos_token_id=511, bos_token_id=511,
             ngram_vocab_size_base=500,
             rope_parameters=dict(S.REAL_TEXT_CONFIG["rope_parameters"], mrope_section=[3, 3, 2]))

# llama-quantize stand-in: llama.cpp's own quantizer (src/llama-quant.cpp) through llama-cpp-python, same log
FAKE_QUANTIZE = """#!{py}
import sys, llama_cpp
src, dst, ty = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = {{"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}}[ty]
p.nthread = 1
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p))
"""


@pytest.mark.llamacpp
def test_prepare_converts_quantises_and_llama_cpp_counts_the_engines_parameters(tmp_path, monkeypatch):
    """The real converter and quantizer of llama.cpp 0.3.36 on a small synthetic checkpoint of the bench's layout:
    the GGUFs' parameter counts (what llama-bench's model_n_params sums) equal the engine's shapes' count, the
    quantizer's fallbacks are recorded, the QSA ratios end as the config's, the safetensors are removed."""
    pytest.importorskip("llama_cpp")
    from parity.backends import gguf_convert as gc
    try:
        conv = gc.converter_dir(gc.installed_version())
    except Exception as e:  # noqa: BLE001 - no sdist here: nothing to convert with
        pytest.skip(f"llama.cpp converter not available: {e}")
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path / "cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    q = bin_dir / "llama-quantize"
    q.write_text(FAKE_QUANTIZE.format(py=sys.executable))
    q.chmod(0o755)
    man = L.prepare(conv, bin_dir, tmp_path / "models", 4, overrides=SMALL, log=lambda *_: None)
    cfg = man["config"]
    e = L.engine_params(cfg)
    for qt in ("BF16", "Q8_0", "Q4_K_M"):
        g = man["gguf"][qt]
        assert g["n_params"] == e["total"] and g["table_params"] == e["table"], qt
        assert g["qsa"]["ok"] and g["compress_ratios"] == [0, 0, 0, cfg["indexer_compress_ratio"]], qt
        assert L.same_model(e, {"model_n_params": g["n_params"], "gguf": g})["ok"] is True
    fb = {f["name"]: f for f in man["quantize"]["Q4_K_M"]["fallbacks"]}
    assert fb["blk.0.ffn_down_exps.weight"]["ncols"] == 64 and fb["blk.0.ffn_down_exps.weight"]["used"] == "q5_0"
    assert man["quantize"]["Q4_K_M"]["n_fallback"] == len(fb)
    assert not list((tmp_path / "cache" / "synthetic").glob("realwidth-*"))  # the safetensors copy is gone
    # a second call keeps what is there
    again = L.prepare(conv, bin_dir, tmp_path / "models", 4, overrides=SMALL, log=lambda *_: None)
    assert again["steps"] == man["steps"]
