"""Negative controls on the real reference (bundled tiny fixture): two runs that differ by ONE injected
fault; tap-diff must name the right first divergence (layer + module, and the position where the
fault first shows) and --replay must give the right verdict. Identical runs must agree.

Faults are injected from outside the reference's hot paths: a patched weights view
(``with_override``), an instance attribute, or a monkeypatched block function in
``reference.model``'s namespace, active only while B records.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from reference.paths import bundled_model

if not (bundled_model("tiny") / "config.json").exists():  # pragma: no cover - fixture is committed
    pytest.skip("fixtures/tiny not built", allow_module_level=True)

import reference.model as rm
from reference.blocks.qsa import canonical_topk
from reference.checkpoint import Checkpoint
from reference.model import ReferenceModel
from taps import registry
from taps.diff import diff_archives
from taps.replay import replay_check
from taps.recorder import Recorder

CK = Checkpoint.open(bundled_model("tiny"))
CFG = CK.config
IDS = [int(x) for x in np.random.default_rng(0).integers(0, 440, 40)]
CHUNK = 16   # B prefills in chunks of 16: state-carrying faults show at position 16


def record(weights=CK, chunk=None, patch=None, monkeypatch=None):
    m = ReferenceModel(weights)
    if patch is not None:
        patch(m, monkeypatch)
    with Recorder(meta={"token_ids": IDS, "backend": "reference", "dtype": "float32",
                        "model": {"config_hash": CFG.config_hash()}}) as rec:
        m.new_session().prefill(IDS, chunk_size=chunk)
    if monkeypatch is not None:
        monkeypatch.undo()
    return rec.archive()


@pytest.fixture(scope="module")
def A():
    return record()


@pytest.fixture(scope="module")
def clean():
    return ReferenceModel(CK)


# ---------------------------------------------------------------- faults
def perturbed_weight():
    name = "layers.3.linear_attn.in_proj_qkv.weight"
    w = CK.get(name).copy()
    w[5] *= 1.05                      # one row of the q projection, +5%
    return dict(weights=CK.with_override(name, w))


def swapped_heads():
    name = "layers.2.self_attn.q_proj.weight"
    nh, hd = CFG.num_attention_heads, CFG.head_dim
    q = CK.get(name)
    return dict(weights=CK.with_override(name, q.reshape(nh, 2 * hd, -1)[[2, 1, 0, 3]].reshape(q.shape)))


def rope_off_by_one():
    def patch(m, mp):   # positions of every chunk after the first start one too late
        orig = m.cos_sin
        mp.setattr(m, "cos_sin", lambda pos: orig(np.asarray(pos) + (1 if np.asarray(pos)[0] > 0 else 0)))
    return dict(chunk=CHUNK, patch=patch)


def dropped_ple_context():
    def patch(m, mp):   # the carried n-gram context loses its most recent token at a chunk boundary
        orig = rm.ngram_hash_rows
        mp.setattr(rm, "ngram_hash_rows", lambda ctx, ids, eos, *a: orig(
            np.concatenate([[eos], ctx[:-1]]).astype(np.int64), ids, eos, *a))
    return dict(chunk=CHUNK, patch=patch)


def stale_gdn_conv():
    def patch(m, mp):   # the GDN conv state is never updated: later chunks convolve with a stale state
        orig = rm.gdn_block

        def f(x, w, conv, rec, cfg, mode="auto"):
            out, taps, _new_conv, new_rec = orig(x, w, conv, rec, cfg, mode)
            return out, taps, conv, new_rec
        mp.setattr(rm, "gdn_block", f)
    return dict(chunk=CHUNK, patch=patch)


def _tied_select(high: bool):
    """indexer_select with scores rounded to integers (many exact ties) and a chosen tie-break."""
    orig = rm.indexer_select

    def f(q, block_keys, positions, cfg):
        scores, sel, n_complete = orig(q, block_keys, positions, cfg)
        scores = np.where(np.isfinite(scores), np.round(scores), scores).astype(scores.dtype)
        k = sel.shape[1]
        if high:   # ties broken towards the HIGHER block index (the bug)
            rev = canonical_topk(scores[:, ::-1], min(k, scores.shape[1]))
            top = np.where(rev >= 0, scores.shape[1] - 1 - rev, -1)
        else:
            top = canonical_topk(scores, min(k, scores.shape[1]))
        top = np.concatenate([top, np.full((len(top), k - top.shape[1]), -1, np.int64)], axis=1)
        keep = np.arange(k)[None, :] < np.minimum(cfg.block_topk, n_complete)[:, None]
        return scores, np.where(keep, top, -1), n_complete
    return f


def wrong_tie_break():
    return dict(patch=lambda m, mp: mp.setattr(rm, "indexer_select", _tied_select(True)))


CONTROLS = {
    # fault: (how, expected first-divergence tap, expected first position)
    # in_proj_qkv rows enter the conv history first (position 0 reads only the carried zero state)
    "perturbed weight (layer 3 GDN in_proj_qkv)": (perturbed_weight, "layers.3.linear_attn.conv_state", 1),
    "swapped attention heads (layer 2 q_proj)": (swapped_heads, "layers.2.self_attn.q_norm.out", 0),
    "off-by-one RoPE position (chunks after the first)": (rope_off_by_one,
                                                         # the first block pooled in a later chunk completes
                                                         # ratio - 1 tokens after the chunk's start
                                                         "layers.2.self_attn.indexer.block_keys",
                                                         CHUNK + CFG.indexer_compress_ratio - 1),
    "dropped PLE context token": (dropped_ple_context, "layers.1.ple.ple_embedding.ngram_ids", CHUNK),
    "stale GDN conv state": (stale_gdn_conv, "layers.0.linear_attn.conv_state", CHUNK),
}


@pytest.mark.parametrize("fault", list(CONTROLS))
def test_fault_is_caught_located_and_blamed_on_the_block(fault, A, clean, monkeypatch):
    make, tap, pos = CONTROLS[fault]
    B = record(monkeypatch=monkeypatch, **make())
    rep = diff_archives(A, B, "fp32")
    assert rep.exit_code == 1
    assert rep.first_divergence == tap, rep.first_divergence
    assert rep.result(tap).first_position == pos
    names = registry.tap_names(CFG)
    prev_ok = [n for n in names[:names.index(tap)] if rep.result(n).ok]
    assert rep.last_agreeing == prev_ok[-1]
    v = replay_check(clean, B, tap, "fp32")
    assert v["verdict"] == "block", v["message"]


def test_wrong_qsa_tie_break_is_an_error_with_block_verdict(clean, monkeypatch):
    # both runs score with exact ties (rounded scores); only B breaks them towards the higher index
    A_t = record(patch=lambda m, mp: mp.setattr(rm, "indexer_select", _tied_select(False)), monkeypatch=monkeypatch)
    B_t = record(monkeypatch=monkeypatch, **wrong_tie_break())
    rep = diff_archives(A_t, B_t, "fp32")
    tap = "layers.2.self_attn.indexer.selected_blocks"
    assert rep.first_divergence == tap
    assert rep.last_agreeing == "layers.2.self_attn.indexer.block_scores"
    r = rep.result(tap)
    assert r.metrics["errors"] > 0 and r.metrics["flips"] == 0 and r.errors[0]["tie_break"]
    assert replay_check(clean, B_t, tap, "fp32")["verdict"] == "block"


def test_replay_downstream_of_the_fault_says_look_upstream(A, clean):
    B = record(**perturbed_weight())
    # layer 4's GDN conv gets B's (already wrong) input; the block itself is fine
    rep = diff_archives(A, B)
    assert rep.result("layers.4.linear_attn.conv_out").status == "diverged"
    v = replay_check(clean, B, "layers.4.linear_attn.conv_out", "fp32")
    assert v["verdict"] == "upstream", v["message"]
    # and the same call on the faulty block itself blames the block (the verdict can differ)
    assert replay_check(clean, B, "layers.3.linear_attn.conv_out", "fp32")["verdict"] == "block"


def test_identical_runs_agree_across_chunking_and_precision(A):
    rep = diff_archives(A, record(chunk=7), "fp32")
    assert rep.agree and rep.exit_code == 0
    m64 = ReferenceModel(CK, dtype=np.float64)
    with Recorder(meta={"token_ids": IDS, "model": {"config_hash": CFG.config_hash()}}) as rec:
        m64.forward(IDS)
    # float64 truth vs float32 run: float32 reduction noise only (~1e-6 rel), inside the fp32 profile
    assert diff_archives(rec.archive(), A, "fp32").agree


def test_cli_record_diff_replay(tmp_path, capsys):
    from parity.cli import main
    from parity.harness.record import record as record_cli
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(" ".join(map(str, IDS)))
    assert main(["taps", "record", "tiny", "--ids", str(ids_file), "--out", str(tmp_path / "A")]) == 0
    assert main(["taps", "record", "tiny", "--ids", str(ids_file), "--out", str(tmp_path / "A2"),
                 "--chunk-size", "9"]) == 0
    capsys.readouterr()
    assert main(["tap-diff", str(tmp_path / "A"), str(tmp_path / "A2")]) == 0
    assert "AGREE" in capsys.readouterr().out
    # B: same model, one weight perturbed (a different weights fingerprint -> needs --force)
    record_cli(perturbed_weight()["weights"], IDS, tmp_path / "B")
    assert main(["tap-diff", str(tmp_path / "A"), str(tmp_path / "B")]) == 2
    assert "weights_fingerprint differs" in capsys.readouterr().err
    assert main(["tap-diff", str(tmp_path / "A"), str(tmp_path / "B"), "--force", "--replay", "tiny", "--replay-other-weights",
                 "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["first_divergence"] == "layers.3.linear_attn.conv_state"
    assert d["first_divergence_detail"]["layer"] == 3
    assert d["first_divergence_detail"]["module"] == "layers.3.linear_attn"
    assert d["replay"]["verdict"] == "block"
    assert main(["tap-diff", str(tmp_path / "A"), str(tmp_path / "B"), "--force"]) == 1
    out = capsys.readouterr().out
    assert "FIRST DIVERGENCE: layers.3.linear_attn.conv_state" in out and "\x1b[" not in out  # plain off a tty
    # a recording cap that the up-front estimate exceeds: clean error, nothing written
    assert main(["taps", "record", "tiny", "--ids", str(ids_file), "--out", str(tmp_path / "C"),
                 "--cap", "1000"]) == 2
    assert "exceeds the cap" in capsys.readouterr().err and not (tmp_path / "C").exists()
    assert main(["taps", "record", "tiny", "--ids", str(ids_file), "--out", str(tmp_path / "D"),
                 "--taps", "layers.*.mlp.otu"]) == 2
    assert "expected a glob matching" in capsys.readouterr().err


def test_cli_taps_list(capsys):
    from parity.cli import main
    assert main(["taps", "list", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    for s in registry.specs():
        assert s.pattern in out
    assert "layers.2.self_attn.indexer.selected_blocks" in out
    assert main(["taps", "list", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["registry_version"] == registry.REGISTRY_VERSION and len(d["taps"]) == len(registry.specs())


def test_decode_steps_and_rollback_concatenate_by_position(A, monkeypatch):
    # prefill 30 + 7 decode steps + verify 3 (rolled back, re-decoded) == one 40-token forward
    m = ReferenceModel(CK)
    with Recorder(meta={"token_ids": IDS, "model": {"config_hash": CFG.config_hash()}}) as rec:
        s = m.new_session()
        s.prefill(IDS[:30])
        for t in IDS[30:37]:
            s.decode(t)
        s.forward_tokens(IDS[37:40])   # verify 3 tokens, then roll them back and decode them again
        s.rollback(3)
        for t in IDS[37:40]:
            s.decode(t)
    arc = rec.archive()
    assert len(arc.positions("logits")) == 30 + 10 + 3     # every emit kept, re-recorded positions included
    assert diff_archives(A, arc, "fp32").agree
    # negative control: the same run whose re-decode after the rollback feeds a wrong token diverges
    # exactly at the first re-decoded position (the LAST recording of a position counts)
    with Recorder(meta={"token_ids": IDS, "model": {"config_hash": CFG.config_hash()}}) as rec2:
        s = m.new_session()
        s.prefill(IDS[:37])
        s.forward_tokens(IDS[37:38])
        s.rollback(1)
        s.decode((IDS[37] + 1) % 440)
        for t in IDS[38:40]:
            s.decode(t)
    rep = diff_archives(A, rec2.archive(), "fp32")
    assert rep.first_divergence == "embed_tokens.out" and rep.result("embed_tokens.out").first_position == 37


def test_cli_replay_without_recorded_input_is_reported_not_fatal(tmp_path, capsys):
    from parity.cli import main
    from parity.harness.record import record as record_cli
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(" ".join(map(str, IDS)))
    assert main(["taps", "record", "tiny", "--ids", str(ids_file), "--out", str(tmp_path / "A"),
                 "--taps", "layers.3.linear_attn.*"]) == 0
    record_cli(perturbed_weight()["weights"], IDS, tmp_path / "B", include=["layers.3.linear_attn.*"])
    capsys.readouterr()
    assert main(["tap-diff", str(tmp_path / "A"), str(tmp_path / "B"), "--force", "--replay", "tiny",
                 "--replay-other-weights"]) == 1
    out = capsys.readouterr().out
    assert "FIRST DIVERGENCE: layers.3.linear_attn.conv_state" in out
    assert "replay unavailable" in out and "layers.3.attn_hyper_connection.out" in out
