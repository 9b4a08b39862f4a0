"""llama.cpp (llama-cpp-python 0.3.36) and an OpenAI server (llama_cpp.server) judged on every bundled fixture.

What llama.cpp 0.3.36 gets wrong is ASSERTED here, located (docs/outside-engines.md has each finding's
reproduction and counterfactual). Skipped cleanly without llama-cpp-python or its converter's sdist.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from reference.paths import bundled_model  # noqa: E402

SDIST_CANDIDATES = [os.environ.get("QWEN4EXP_LLAMACPP_SDIST"), "/work/llama/llama_cpp_python-0.3.36.tar.gz",
                    str(Path.home() / ".cache/qwen4exp/sdist/llama_cpp_python-0.3.36.tar.gz")]


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """One conversion cache for the module (the converter runs once per fixture and re-parameterisation)."""
    sd = next((p for p in SDIST_CANDIDATES if p and Path(p).is_file()), None)
    if sd is None and not (Path.home() / ".cache/qwen4exp/llama.cpp-0.3.36").is_dir():
        pytest.skip("llama-cpp-python 0.3.36 source distribution (the converter) not found")
    old = {k: os.environ.get(k) for k in ("QWEN4EXP_CACHE", "QWEN4EXP_LLAMACPP_SDIST")}
    os.environ["QWEN4EXP_CACHE"] = str(tmp_path_factory.mktemp("qwen4exp-cache"))
    if sd:
        os.environ["QWEN4EXP_LLAMACPP_SDIST"] = sd
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _parity(fixture, spec, scenarios=None):
    from parity.harness.run import run_parity
    m = fixture if isinstance(fixture, Path) else bundled_model(fixture)   # a fixture's name or a checkpoint
    return run_parity(m, spec, scenarios or ["kl", "budget"], level="ci", progress=False)


# --- as shipped: every fixture is refused, with llama.cpp's own message ---------------------------------

@pytest.mark.parametrize("fixture,stage,message", [
    ("tiny", "converter", "NotImplementedError: BPE pre-tokenizer was not recognized"),
    ("tiny-hc2", "converter", "NotImplementedError: BPE pre-tokenizer was not recognized"),
    ("tiny-hc3", "converter", "ValueError: Duplicated tensor name 'per_layer_token_embd.weight'"),
    ("tiny-fp8", "converter", "ValueError: Can not map tensor 'model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale'"),
    ("tiny-mtp", "converter", "NotImplementedError: BPE pre-tokenizer was not recognized"),
    ("tiny-hc3-mtp", "converter", "ValueError: Duplicated tensor name 'per_layer_token_embd.weight'"),
    # ggml's NVFP4 super-block is 64 wide: an expert projection of in-features 32 cannot be packed
    ("tiny-nvfp4", "converter", "ValueError: cannot reshape array of size 128 into shape (64,0,4)"),
])
def test_as_shipped_is_refused(fixture, stage, message):
    rep = _parity(fixture, "llama.cpp")
    assert rep.verdict == "refused" and rep.exit_code == 1
    assert rep.meta["refused"]["stage"] == stage
    assert rep.meta["refused"]["message"].startswith(message), rep.meta["refused"]
    # the table compares nothing ('-', never nan) and names the offered re-parameterisation where there is one
    from parity.harness.report import render_table
    text = render_table(rep, columns=2000)
    assert " nan " not in text, text
    offer = rep.meta["refused"].get("offer")
    assert not offer or offer in text, (offer, text)


# --- with the function-preserving re-parameterisations ------------------------------------------------

@pytest.mark.slow  # a conversion (+ the official-model check) and a parity run: ~20-40 s on one core
@pytest.mark.parametrize("fixture,stage,message", [
    ("tiny-hc2", "loader", "check_tensor_dims: tensor 'blk.0.attn_qkv.weight' has wrong shape"),
    ("tiny-hc3", "converter", "ValueError: Duplicated tensor name 'per_layer_token_embd.weight'"),
    ("tiny-hc3-mtp", "converter", "ValueError: Duplicated tensor name 'per_layer_token_embd.weight'"),
    ("tiny-nvfp4", "converter", "ValueError: cannot reshape array of size 128 into shape (64,0,4)"),
])
def test_refused_even_reparameterised(fixture, stage, message):
    rep = _parity(fixture, "llama.cpp:reparam=auto")
    assert rep.verdict == "refused"
    assert rep.meta["refused"]["stage"] == stage and rep.meta["refused"]["message"].startswith(message)


@pytest.mark.slow  # a conversion (+ the official-model check) and a parity run: ~20-40 s on one core
@pytest.mark.parametrize("fixture", ["tiny", "tiny-fp8", "tiny-mtp"])
def test_reparameterised_fails_at_the_first_qsa_layer_position_11(fixture):
    """The converter reads the config through transformers, which renames 'full_attention' to
    'indexed_attention'; the converter then writes compress ratio 0 for every layer, so llama.cpp attends
    densely. Dense equals QSA while every visible token is selected: budget 8, ratio 4 -> first wrong at
    position 11 (12 visible = 3 complete blocks > 2), in layers.2 (the first QSA layer) core_out."""
    rep = _parity(fixture, "llama.cpp:reparam=auto")
    assert rep.verdict == "fail"
    kl, budget = rep.rows
    want = "first divergence layers.2.self_attn.core_out at position 11 "
    assert kl.status == "fail" and want in kl.first_divergence, kl.first_divergence
    assert budget.status == "fail" and want in budget.first_divergence, budget.first_divergence
    conv = rep.meta["conversion"]
    assert "ple-pad" in conv["reparams"] and conv["checks"][0]["ok"]


def test_reparameterisation_preserves_the_function_and_is_checked():
    """Negative control of the check: a padded table with a nonzero pad is caught."""
    from parity.backends import gguf_convert as gc
    import json
    import shutil
    import tempfile
    tmp = Path(tempfile.mkdtemp())
    try:
        dst = gc.reparameterise(bundled_model("tiny"), tmp / "rp", ["ple-pad"])
        assert json.loads((dst / "config.json").read_text())["ple_embed_dim"] == 64
        assert gc.check_same_function(bundled_model("tiny"), dst)["ok"]
        from safetensors.torch import load_file, save_file
        ts = load_file(str(dst / "model.safetensors"))
        k = next(n for n in ts if n.endswith("ple.key_proj.weight"))
        ts[k][:, 9] = 0.5  # a pad column (head 0, row slot 9 >= the original width 8) made nonzero ...
        for n in [n for n in ts if ".ngram_embedding.shard_" in n]:
            ts[n][:, 9] = 0.5  # ... and the table's pad with it (either alone still multiplies a zero)
        ts = {n: v.contiguous() for n, v in ts.items()}
        save_file(ts, str(dst / "model.safetensors"), metadata={"format": "pt"})
        assert not gc.check_same_function(bundled_model("tiny"), dst)["ok"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_sequence_ops_agree_below_the_budget():
    """Chunked prefill, batched decode and snapshot/restore agree with a one-shot prefill, and all of them
    with the reference below the budget; rollback across an earlier llama_decode call is wrong (finding)."""
    from parity.backends import open_backend, truth_model
    from parity.harness.kl import compare_logits, thresholds_for, verdict
    be = open_backend("llama.cpp:reparam=auto", bundled_model("tiny"))
    ids = [5, 17, 99, 3, 250, 7, 8, 9, 10, 11]
    one = be.logits(ids)
    ok, why = verdict(compare_logits(truth_model(bundled_model("tiny")).forward(ids), one), thresholds_for("float32"))
    assert ok, why
    h = be.new_sequence()
    ch = np.concatenate([be.prefill(h, ids[:4], chunk_size=3), be.prefill(h, ids[4:])])
    # chunking changes ggml's matmul shapes, so the summation order: float32 rounding only (seen: 3e-7)
    assert np.abs(ch - one).max() < 1e-5
    s = be.snapshot(h)
    d1 = be.decode([h], [7])
    be.restore(h, s)
    assert np.array_equal(be.decode([h], [7]), d1)
    # rollback within the last batch is exact ...
    h2 = be.new_sequence()
    f = be.forward_tokens(h2, ids[:6] + [7, 8])
    be.rollback(h2, 1)
    assert np.abs(be.decode([h2], [8]) - f[-1]).max() < 1e-5
    # ... across llama_decode calls it is not: the recurrent state is not the one before the token
    be.rollback(h, 1)
    assert np.abs(be.decode([h], [7]) - d1).max() > 0.1
    be.close()


# --- openai: llama_cpp.server serving the converted tiny ---------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    from parity.backends import gguf_convert as gc
    m = bundled_model("tiny")
    gguf = gc.convert(m, gc.installed_version(), reparams=gc.parse_reparams("auto", m))["gguf"]
    with _serve(gguf) as url:
        yield url


@contextlib.contextmanager
def _serve(gguf):
    """llama_cpp.server on ``gguf`` at a free loopback port (bounded start-up wait), stopped on exit. The KV
    cache is float32 (``--type_k/--type_v 0``, GGML_TYPE_F32): the server is judged as a float32 engine, and its
    default f16 cache moves tiny's logprobs by ~2e-4 of the logit scale, ~10x the float32 tolerance."""
    for mod in ("uvicorn", "fastapi", "sse_starlette", "starlette_context"):  # llama_cpp.server's own imports
        pytest.importorskip(mod)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                             "--host", "127.0.0.1", "--n_ctx", "512", "--logits_all", "true", "--n_threads", "1",
                             "--type_k", "0", "--type_v", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # bounded wait for the server to come up
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server did not start within 60 s (exit {proc.poll()})")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow  # a conversion (+ the official-model check) and a parity run: ~20-40 s on one core
def test_openai_against_llama_cpp_server_fails_at_the_same_position(server):
    rep = _parity("tiny", f"openai:url={server}", ["kl"])
    row = rep.rows[0]
    assert row.scenario == "kl-topk" and row.status == "fail"
    assert "first divergent position 11 " in row.first_divergence, row.first_divergence
    assert rep.meta["openai"]["convention"] == "after-token"  # llama-cpp-python's echo rows (finding)
    assert all(r.status == "skip" for r in rep.rows[1:])
    # the GGUF's pre-tokenizer label matches the checkpoint's (gpt-2): the server tokenizes every text prompt
    # as the checkpoint does (labelled qwen35 it retokenized 4 of 5)
    assert row.failures[0]["retokenized_by_server"] == 0, row.failures[0]


def test_openai_passes_where_llama_cpp_agrees(server):
    """Short prompts (below the QSA budget) agree: the top-k comparison passes."""
    from parity.backends import open_backend, truth_model
    from parity.harness.topk import run_topk
    be = open_backend(f"openai:url={server}", bundled_model("tiny"))
    ids = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    res = run_topk(be, truth_model(bundled_model("tiny")), [ids], n_new=2)
    assert res["prompts"] == 1 and res["passed"] and res["positions"] >= 9, res  # prompt + greedy rows
    # the prefix-cache request pattern ran too (first half, then the whole reusing it) and agreed
    assert res["patterns"] == {"fresh": 1, "prefix-reuse: first half": 1,
                               "prefix-reuse: whole after its first half": 1}, res
    # negative control: the same answers judged against another model's truth fail, at the first row
    bad = run_topk(be, truth_model(bundled_model("tiny-hc2")), [ids], n_new=3)
    assert not bad["passed"] and bad["first"]["position"] == 1, bad


def _near_uniform(dst, factor):
    """tiny with ``lm_head`` scaled by ``factor``: every next-token row near uniform (logit scale ~0.9 x factor;
    the top-20 of the 512 ids hold ~4% of the probability), the rest of the function unchanged -- including
    llama.cpp's defect A (QSA converted as dense: wrong from position 11)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(bundled_model("tiny"), dst, ignore=shutil.ignore_patterns("golden*"))
    ts = load_file(str(dst / "model.safetensors"))
    ts["lm_head.weight"] = (ts["lm_head.weight"].float() * factor).to(ts["lm_head.weight"].dtype)
    save_file({k: v.contiguous() for k, v in ts.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


#: three plain prompts (no ',': llama-cpp-python drops echoed tokens equal to its default BOS id 11, finding G)
PLAIN = ["The quick brown fox jumps over the lazy dog near the river bank.",
         "Once upon a time there was a small village in the mountains.",
         "Water boils at one hundred degrees at sea level they say."]


@pytest.mark.slow  # a conversion, a server and two parity runs: ~1 min on one core
def test_openai_on_a_near_uniform_model_is_never_pass(tmp_path):
    """A known-wrong server (llama.cpp's dense QSA, wrong from position 11) on a near-uniform model (logit scale
    ~1e-4, top-20 holding ~1.5-4% of each row): its lower-bound KL is ~1e-11, far under the former fixed limit
    (tol^2 at unit scale, ~4e-9), which passed it blind (measured: PASS, 3 prompts). Judged by the limit that
    follows the model's scale it is not PASS; where llama.cpp is right (below the QSA budget) the row cannot
    resolve a useful fault and is INCONCLUSIVE, never FAIL; --backend llama.cpp on the same GGUF FAILs."""
    import json
    from parity.backends import gguf_convert as gc
    from parity.backends import open_backend, truth_model
    from parity.harness.topk import run_topk
    m = _near_uniform(tmp_path / "near-uniform", 1e-4)
    prompts = tmp_path / "plain.json"
    prompts.write_text(json.dumps(PLAIN))
    conv = gc.convert(m, gc.installed_version(), reparams=gc.parse_reparams("auto", m))
    with _serve(conv["gguf"]) as url:
        from parity.harness.run import run_parity
        rep = run_parity(m, f"openai:url={url}", ["kl"], prompts=prompts, level="ci", progress=False)
        below = run_topk(open_backend(f"openai:url={url}", m), truth_model(m),
                         [[60, 61, 62, 63, 64, 65, 66, 67, 68, 69]], n_new=1, prefix_reuse=False)
    row = rep.rows[0]
    assert row.scenario == "kl-topk" and row.status in ("fail", "inconclusive") and rep.exit_code in (1, 3), \
        (row.status, row.first_divergence, row.detail)
    res = row.failures[0]
    assert res["prompts"] == 3 and not res["echo_misaligned"], res
    # the trap is real: the worst lower-bound KL is below the limit at unit logit scale (what the row compared
    # against before), and the top-k sees only a few percent of each row
    assert res["worst_kl"] < rep.meta["thresholds"]["max_kl_at_unit_scale"], res
    assert res["min_mass_truth"] < 0.1 and res["resolution_rel"] > 1e-2, res
    # llama.cpp right (10 tokens + 1, below the budget): INCONCLUSIVE with its reason, far from any FAIL
    # (measured worst KL / limit 2e-4)
    assert below["status"] == "inconclusive" and "too little" in below["inconclusive"], below
    assert below["worst_kl_over_bound"] < 0.1, below
    lc = _parity(m, f"llama.cpp:gguf={conv['gguf']}", ["kl"])
    assert lc.rows[0].status == "fail"


@pytest.mark.slow  # a conversion and a kl run: ~20-40 s on one core
def test_checkpoint_without_tokenizer_files_is_converted_and_judged(tmp_path):
    """A checkpoint with no tokenizer files (synthetic weights) is converted with the converter's 'none'
    vocabulary (token ids -> logits need none) and judged, never REFUSED for its tokenizer: the
    re-parameterisations it gets are the function-preserving ones only (no tokenizer-label: there is no
    pre-tokenizer to label), it agrees with the truth below the QSA budget and FAILs at llama.cpp's known
    divergence (dense QSA, position 11)."""
    import shutil
    from parity.backends import gguf_convert as gc
    from parity.backends import open_backend, truth_model
    from parity.harness.kl import compare_logits, thresholds_for, verdict
    src = bundled_model("tiny")
    m = tmp_path / "tiny-no-tokenizer"
    m.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(src / f, m / f)
    assert gc.has_tokenizer(src) and not gc.has_tokenizer(m)
    be = open_backend("llama.cpp:reparam=auto", m)
    assert be.conversion["vocab"].startswith("none: no tokenizer files"), be.conversion
    assert be.conversion["reparams"] == ["ple-pad"] and "tokenizer_label" not in be.conversion, be.conversion
    ids = [5, 17, 99, 3, 250, 7, 8, 9, 10, 11]   # below the QSA budget: llama.cpp agrees there
    ok, why = verdict(compare_logits(truth_model(m).forward(ids), be.logits(ids)), thresholds_for("float32"))
    be.close()
    assert ok, why
    rep = _parity(m, "llama.cpp:reparam=auto", ["kl"])
    assert rep.verdict == "fail" and rep.rows[0].status == "fail", (rep.verdict, rep.meta.get("refused"))
    assert "layers.2.self_attn.core_out at position 11 " in rep.rows[0].first_divergence, rep.rows[0].first_divergence


def test_openai_refuses_non_http_url():
    from reference.errors import InputError
    from parity.backends import open_backend
    with pytest.raises(InputError, match="expected url=http"):
        open_backend("openai:url=ftp://x", bundled_model("tiny"))


# --- counterfactuals: the reference made to behave like llama.cpp matches it to float32 precision -----------

def _dense_hook(i, pos, scores, sel):
    """Every complete block visible to each query: QSA turned into dense attention (compress ratio 0)."""
    nb = scores.shape[1]
    out = np.full((len(pos), max(nb, 1)), -1, np.int64)
    for t in range(len(pos)):
        vis = np.nonzero(np.isfinite(scores[t]))[0]
        out[t, :len(vis)] = vis
    return out


@pytest.mark.slow  # a conversion (+ the official-model check) and a parity run: ~20-40 s on one core
@pytest.mark.parametrize("fixture", ["tiny", "tiny-fp8"])
def test_counterfactual_dense_attention_matches_llama_cpp(fixture):
    from parity.backends import open_backend, truth_model
    from parity.prompts import load_prompts
    m = bundled_model(fixture)
    ids = load_prompts(None, m, 512)[4]  # the KL harness's worst prompt (50 tokens)
    be = open_backend("llama.cpp:reparam=auto", m)
    got = be.logits(ids)
    ref = truth_model(m)
    d_truth = np.abs(ref.forward(ids) - got).max()
    ref.selection_hook = _dense_hook
    d_dense = np.abs(ref.forward(ids) - got).max()
    # float32 agreement: summation-order differences only (measured 2e-6 on logits of scale ~5)
    assert d_dense < 2e-5 < 0.05 < d_truth, (d_dense, d_truth)
    be.close()


def test_counterfactual_rollback_across_calls_restores_the_recurrent_state_one_token_too_early():
    """docs/outside-engines.md, finding 8: after prefill(6) + decode(1) + rollback(1), llama.cpp's GDN conv
    state is the right one (after 6 tokens) but its recurrent state is the one after 5 tokens. The reference given
    exactly that state matches llama.cpp's first diverging tap (layers.0.linear_attn.out) to float32."""
    from parity.backends import open_backend, truth_model
    from taps.recorder import Recorder
    m = bundled_model("tiny")
    be = open_backend("llama.cpp:reparam=auto", m)
    ids, tap = [5, 17, 99, 3, 250, 7], "layers.0.linear_attn.out"
    h = be.new_sequence()
    be.prefill(h, ids)
    be.decode([h], [7])
    be.rollback(h, 1)
    with be.taps(None, include=[tap]) as rec:
        be.decode([h], [7])
    got = rec.archive().read_rows(tap, np.arange(1))[0]
    ref = truth_model(m)

    def state_after(seq):
        s = ref.new_session()
        s.prefill(seq)
        return s.state.copy()

    def out_with(conv_from, recurrent_from):
        s = ref.new_session()
        s.state = state_after(ids)
        c, r = state_after(conv_from), state_after(recurrent_from)
        for i, g in s.state.gdn.items():
            g.conv, g.recurrent = c.gdn[i].conv.copy(), r.gdn[i].recurrent.copy()
        with Recorder(None, include=[tap]) as rr:
            s.prefill([7])
        return rr.archive().read_rows(tap, np.arange(1))[0]
    rel = lambda x: float(np.abs(x - got).max() / np.abs(got).max())  # noqa: E731
    assert rel(out_with(ids, ids)) > 0.1            # the right state: llama.cpp is wrong
    assert rel(out_with(ids, ids[:5])) < 1e-5       # recurrent state one token too early: llama.cpp exactly
    be.close()


@pytest.mark.slow  # a conversion (+ the official-model check) and a parity run: ~20-40 s on one core
def test_cli_end_to_end_refused_and_own_gguf():
    """`python -m parity.cli parity tiny --backend llama.cpp` runs (conversion included): REFUSED, exit 1,
    llama.cpp's message in the table; `llama.cpp:gguf=PATH` on the re-parameterised GGUF gives the FAIL."""
    from parity.backends import gguf_convert as gc
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "parity.cli", "parity", "tiny", "--backend", "llama.cpp",
                        "--scenario", "kl", "--no-progress"], capture_output=True, text=True, cwd=root, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "BPE pre-tokenizer was not recognized" in " ".join(r.stdout.split())
    m = bundled_model("tiny")
    gguf = gc.convert(m, gc.installed_version(), reparams=gc.parse_reparams("auto", m))["gguf"]
    rep = _parity("tiny", f"llama.cpp:gguf={gguf}", ["kl"])
    assert rep.verdict == "fail" and "layers.2.self_attn.core_out at position 11 " in rep.rows[0].first_divergence


@pytest.mark.parametrize("spec,match", [
    ("llama.cpp:bogus=1", "expected options of the llama.cpp backend"),
    ("llama.cpp:gguf=/nonexistent.gguf", "expected a GGUF file, found nothing there"),
    ("llama.cpp:reparam=frobnicate", "expected 'none', 'auto' or a '\\+'-joined list"),
    ("llama.cpp:kv=q4", "expected one of f32, f16"),
    ("llama.cpp:novalue", "key=value"),
    ("openai:url=ftp://x", "expected url=http"),
])
def test_bad_options_are_one_clear_error(spec, match):
    from reference.errors import UserError
    from parity.backends import open_backend
    with pytest.raises(UserError, match=match):
        open_backend(spec, bundled_model("tiny"))


# --- outside-engine checker: cells -> positions, rollback judged, GDN attn_output, MTP head reported -------

@pytest.fixture(scope="module")
def qsa_gguf(tmp_path_factory):
    """The re-parameterised tiny's GGUF with the QSA compress ratios the converter should have written
    ([0, 0, 4, 0, 0, 4]: defect A drops them), patched in place with the vendored gguf-py: llama.cpp then
    builds its QSA graph (indexer_* nodes), which the selected_tokens tap reads."""
    import shutil

    from parity.backends import gguf_convert as gc
    m = bundled_model("tiny")
    doc = gc.convert(m, gc.installed_version(), reparams=gc.parse_reparams("auto", m))
    sys.path.insert(0, str(gc.converter_dir(gc.installed_version()) / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    dst = tmp_path_factory.mktemp("qsa") / "tiny-qsa.gguf"
    shutil.copy(doc["gguf"], dst)
    r = gguf.GGUFReader(str(dst), "r+")
    f = r.fields["qwen4exp.attention.compress_ratios"]
    from reference.config import load_config
    cfg = load_config(m)
    want = [cfg.indexer_compress_ratio if t == "indexed_attention" else 0 for t in cfg.layer_types]
    for i, part in enumerate(f.data):
        f.parts[part][0] = want[i]
    del r
    return dst


SEL = "layers.2.self_attn.indexer.selected_tokens"


def _selection(be, h, tok):
    with be.taps(None, include=[SEL]) as rec:
        be.decode([h], [tok])
    a = rec.archive()
    return (a.get(SEL).tolist(), a.positions(SEL).tolist()) if a.has(SEL) else None


def test_selected_tokens_are_positions_when_sequences_share_the_cache(qsa_gguf):
    """Checker's tool defect 5: indexer_top_k names KV cache CELLS; with another sequence in the unified
    cache (and a batched decode interleaving their cells) a sequence's cells are not its positions. The tap
    must give the same positions as the sequence run alone in a fresh context."""
    from parity.backends import open_backend
    m = bundled_model("tiny")
    ids = [5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # decode at position 14: past the budget
    be = open_backend(f"llama.cpp:gguf={qsa_gguf}", m)
    h = be.new_sequence()
    be.prefill(h, ids)
    alone = _selection(be, h, 40)
    be.close()
    be = open_backend(f"llama.cpp:gguf={qsa_gguf}", m)
    a = be.new_sequence()
    be.prefill(a, [1, 2, 3, 4, 6])
    b = be.new_sequence()
    be.prefill(b, ids[:10])
    be.decode([a, b], [7, ids[10]])  # one call, two sequences: their new cells interleave
    be.prefill(b, ids[11:])
    shared = _selection(be, b, 40)
    cells = be.cells.positions(b)
    # the case really shares: b's cells are not its positions (the old tap reported the cells, 5..20)
    assert any(c != p for c, p in cells.items()) and sorted(cells.values()) == list(range(len(ids) + 1))
    assert alone is not None and shared == alone, (shared, alone)
    # past the budget the selection is a proper subset of the 15 visible positions, all in 0..14
    sel = [p for p in alone[0][0] if p >= 0]
    assert len(sel) < len(ids) + 1 and all(0 <= p <= len(ids) for p in sel)
    # after a restore llama.cpp chooses the cells itself: a selection of some of those cells is left out
    # (never guessed); one of all of them still maps (as a set)
    snap = be.snapshot(b)
    c = be.new_sequence()
    be.restore(c, snap)
    assert _selection(be, c, 40) is None
    d = be.new_sequence()
    be.restore(d, be.snapshot(a))
    got = _selection(be, d, 9)
    assert got is not None and [p for p in got[0][0] if p >= 0] == list(range(7)), got  # a: 6 tokens + this one
    be.close()


def test_rollback_is_declared_limited_and_judged(qsa_gguf):
    """Checker's tool defect 8: rollback is declared limited (n_rs_seq tokens), a limit the suites read, so
    the speculative cases RUN against llama.cpp and its defect D (rolling back a whole llama_decode call
    restores the recurrent state one token too early) FAILs, located at the decode after the rollback;
    a rollback inside the last verify batch (exact in llama.cpp) passes: the negative control."""
    from parity.backends import open_backend, truth_model
    from parity.backends.base import capability
    from parity.harness.scenarios.common import Case, TruthCache
    from parity.harness.scenarios.runner import run_case
    m = bundled_model("tiny")
    be = open_backend("llama.cpp:reparam=auto,rs=3", m)
    cap = capability(be, "rollback")
    assert (cap.status, cap.max_tokens) == ("limited", 3) and "rollback_limit" not in be.capabilities
    truth = TruthCache(truth_model(m))

    def spec(n_back):
        def fn(run):
            a = run.new("a")
            run.prefill(a, [5, 17, 99, 3, 250])
            run.verify(a, [7, 8, 9], desc="verify 3 drafts")
            if run.rollback_refusal(a, n_back):
                run.narrow(run.rollback_refusal(a, n_back))
                return
            run.rollback(a, n_back, desc=f"roll back {n_back}")
            run.decode([a], [10], desc=f"decode after rolling back {n_back}")
        return Case(f"rollback_{n_back}", fn)
    whole = run_case("speculative_rollback", spec(3), be, truth)   # the whole verify call: llama.cpp wrong
    assert whole.status == "fail" and "decode after rolling back 3" in whole.failure, whole
    part = run_case("speculative_rollback", spec(2), be, truth)    # inside the verify batch: exact
    assert part.status == "pass", part
    # the suite's own case (every draft rejected, below the QSA bound) catches it, at that rollback
    from parity.harness.scenarios import cases_for
    case = next(c for c in cases_for("speculative_rollback", be.config, "ci") if c.name == "reject_all_drafts_below_bound")
    assert run_case("speculative_rollback", case, be, truth).status == "skip"  # 4 drafts > rs=3: beyond the limit
    be8 = open_backend("llama.cpp:reparam=auto", m)  # the default rs=8 admits it
    suite = run_case("speculative_rollback", case, be8, truth)
    assert suite.status == "fail" and "after rolling back a whole verify call" in suite.failure, suite
    be8.close()
    # beyond the declared limit the case is narrowed, never run and never counted as a pass
    be4 = open_backend("llama.cpp:reparam=auto,rs=2", m)
    over = run_case("speculative_rollback", spec(3), be4, TruthCache(truth_model(m)))
    assert over.narrowed and "at most 2 tokens" in over.narrowed[0], over
    be.close()
    be4.close()


def test_gdn_attn_output_is_not_recorded_as_self_attn_and_mtp_head_is_reported():
    """Checker's tool defects 10 and F: llama.cpp's attn_output-i in a GDN layer (the delta-net core output)
    is not recorded as layers.i.self_attn.out; the dropped MTP head is a located finding, not a silent skip."""
    from parity.backends import open_backend
    from parity.backends.base import capability
    m = bundled_model("tiny-mtp")
    be = open_backend("llama.cpp:reparam=auto", m)
    with be.taps(None) as rec:
        be.logits([5, 17, 99, 3])
    a = rec.archive()
    gdn = [i for i, t in enumerate(be.config.layer_types) if t == "linear_attention"]
    attn = [i for i, t in enumerate(be.config.layer_types) if t != "linear_attention"]
    assert not any(a.has(f"layers.{i}.self_attn.out") for i in gdn)
    assert all(a.has(f"layers.{i}.self_attn.out") for i in attn)    # control: attention layers still are
    assert a.has(f"layers.{gdn[0]}.linear_attn.out")
    c = capability(be, "mtp")
    assert c.status == "unsupported" and "MTP head" in c.limit and "no_mtp" in c.limit
    assert [f["id"] for f in be.findings] == ["llama.cpp:mtp-head-dropped"]
    be.close()
    plain = open_backend("llama.cpp:reparam=auto", bundled_model("tiny"))
    assert plain.findings == [] and capability(plain, "mtp").status == "unsupported"  # no head: nothing to say
    plain.close()


def test_tokenizer_label_tokenizes_as_the_checkpoint_and_keeps_the_function(tmp_path):
    """Checker's tool defect 9: reparam tokenizer-label gives the GGUF the label of the checkpoint's own
    pre-tokenizer (a plain GPT-2-regex ByteLevel -> 'gpt-2'), so llama.cpp's tokenizer gives the checkpoint
    tokenizer's ids on every bundled text prompt; the label leaves ids -> logits bit-identical (a copy of
    the GGUF relabelled in place, 'qwen2', computes exactly the same logits)."""
    import json as _json
    import shutil

    from tokenizers import Tokenizer

    from parity.backends import gguf_convert as gc
    from parity.backends import open_backend
    m = bundled_model("tiny")
    doc = gc.convert(m, gc.installed_version(), reparams=gc.parse_reparams("auto", m))
    assert doc["tokenizer_label"] == "gpt-2"
    be = open_backend(f"llama.cpp:gguf={doc['gguf']}", m)
    ll, vocab = be.ll, be.ll.llama_model_get_vocab(be._model)
    hf = Tokenizer.from_file(str(m / "tokenizer.json"))
    texts = [t for t in _json.loads((Path(__file__).parents[2] / "parity/prompts/default.json").read_text())
             if isinstance(t, str)]

    def llama_ids(text):
        b = text.encode()
        buf = (ll.llama_token * (len(b) + 8))()
        n = ll.llama_tokenize(vocab, b, len(b), buf, len(buf), False, True)
        return list(buf[:n])
    differ = [t for t in texts if llama_ids(t) != hf.encode(t, add_special_tokens=False).ids]
    assert texts and not differ, differ
    ids = [5, 17, 99, 3, 250, 7, 8, 9]
    want = be.logits(ids)
    be.close()
    sys.path.insert(0, str(gc.converter_dir(gc.installed_version()) / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    other = tmp_path / "relabelled.gguf"
    shutil.copy(doc["gguf"], other)
    r = gguf.GGUFReader(str(other), "r+")
    f = r.fields["tokenizer.ggml.pre"]
    f.parts[f.data[0]][:] = np.frombuffer(b"qwen2", np.uint8)  # same length as 'gpt-2': rewritten in place
    del r
    be2 = open_backend(f"llama.cpp:gguf={other}", m)
    assert np.array_equal(be2.logits(ids), want)
    be2.close()


SMALL_CTX = """
import sys
from parity.backends import open_backend
from parity.backends.base import BackendError
be = open_backend("llama.cpp:reparam=auto,ctx=16", sys.argv[1])
h = be.new_sequence()
try:
    be.prefill(h, list(range(1, 34)), chunk_size=33)
except BackendError as e:
    print("RAISED", e)
"""


def test_a_batch_over_a_small_ctx_is_an_error_not_an_abort():
    """ctx= below 512 caps llama.cpp's n_batch; a llama_decode of more tokens than that is a BackendError naming
    ctx=, not llama.cpp's GGML_ASSERT killing the process (SIGABRT, no report). In a child process: the abort
    would take pytest down."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", SMALL_CTX, str(bundled_model("tiny"))], capture_output=True,
                       text=True, cwd=root, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-1500:])
    assert "RAISED" in r.stdout and "a llama_decode of 33 tokens: expected at most n_batch=16" in r.stdout
    assert "raise ctx=" in r.stdout
