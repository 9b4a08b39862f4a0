"""Integrity of `qwen4exp taps record` / `tap-diff`: corrupt chunks are refused (sha256
per chunk), taps that cannot be compared fail the diff, selections that record nothing are errors,
messages name the right flag, and the parity harness's archives carry what `--replay` needs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from taps.archive import Archive, ArchiveError, MemoryArchive
from taps.diff import diff_archives
from taps.recorder import Recorder
from taps.synthetic import fake_forward, tiny_config

REPO = Path(__file__).resolve().parents[2]
CFG = tiny_config()
IDS = list(range(2, 14))


def _record(out, chunk_size=None, **kw):
    meta = {"backend": "synthetic", "token_ids": IDS, "model": {"config_hash": CFG.config_hash()}}
    with Recorder(out, meta=meta, **kw) as rec:
        fake_forward(CFG, IDS, chunk_size=chunk_size)
    return rec.archive()


def _main(argv):
    from parity.cli import main
    return main([str(a) for a in argv])


def _clobber(path: Path, start: int, stop: int) -> None:
    b = bytearray(path.read_bytes())
    b[start:stop] = b"\xff" * (stop - start)
    path.write_bytes(bytes(b))


# ------------------------------------------------------------------ corrupt archives
@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_corrupt_chunk_is_one_line_error_naming_the_file(tmp_path, capsys, damage):
    _record(tmp_path / "A", include=["logits", "embed_tokens.out"])
    _record(tmp_path / "T", include=["logits", "embed_tokens.out"])
    chunk = tmp_path / "T" / "chunk-00000.safetensors"
    size = chunk.stat().st_size
    if damage == "overwrite":   # past the header: hits tensor data (rows / position indices), not the JSON
        _clobber(chunk, size - 400, size - 100)
    else:
        chunk.write_bytes(chunk.read_bytes()[:size // 2])
    capsys.readouterr()
    assert _main(["tap-diff", tmp_path / "A", tmp_path / "T", "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "chunk-00000.safetensors" in err[0] and "corrupt" in err[0], cap.err
    # the undamaged recording still diffs clean (the check does not refuse good archives)
    _record(tmp_path / "B", include=["logits", "embed_tokens.out"])
    assert _main(["tap-diff", tmp_path / "A", tmp_path / "B"]) == 0


def test_manifest_records_chunk_checksums_and_old_archives_still_read(tmp_path):
    arc = _record(tmp_path / "A", include=["logits"], flush_bytes=500, chunk_size=4)
    m = json.loads((tmp_path / "A" / "manifest.json").read_text())
    files = sorted(p.name for p in (tmp_path / "A").glob("chunk-*.safetensors"))
    assert len(files) > 1 and sorted(m["chunks"]) == files
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in m["chunks"].values())
    want = arc.get("logits")
    # an archive from before per-chunk checksums: no "chunks" key -> still read, same data
    del m["chunks"]
    (tmp_path / "A" / "manifest.json").write_text(json.dumps(m))
    np.testing.assert_array_equal(Archive.open(tmp_path / "A").get("logits"), want)
    # ... and a truncated chunk of such an archive is still an ArchiveError naming the file, not a raw
    # safetensors exception
    f = tmp_path / "A" / files[0]
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(ArchiveError, match=files[0]):
        Archive.open(tmp_path / "A").get("logits")


# ------------------------------------------------------------------ uncomparable taps
def _mem(taps: dict) -> MemoryArchive:
    manifest = {"order": [], "taps": {}, "token_ids": IDS}
    data = {}
    for n, (v, p) in taps.items():
        manifest["order"].append(n)
        manifest["taps"][n] = {"dtype": str(v.dtype), "tail": list(v.shape[1:]), "rows": len(v), "kind": "activation"}
        data[n] = [(np.asarray(p, dtype=np.int64), v)]
    return MemoryArchive(manifest, data)


def test_no_overlap_is_a_divergence_not_agreement(capsys):
    rng = np.random.default_rng(0)
    emb, lg = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 3)).astype(np.float32)
    A = _mem({"embed_tokens.out": (emb, range(6)), "logits": (lg, range(6))})
    same = _mem({"embed_tokens.out": (emb, range(6)), "logits": (lg, range(6))})
    assert diff_archives(A, same).exit_code == 0            # control: comparable and equal -> agree
    # logits recorded at positions that share nothing with A's (e.g. garbage position indices)
    B = _mem({"embed_tokens.out": (emb, range(6)), "logits": (lg, range(100, 106))})
    rep = diff_archives(A, B)
    assert rep.result("logits").status == "no-overlap"
    assert not rep.agree and rep.exit_code == 1 and rep.first_divergence == "logits"
    assert rep.last_agreeing == "embed_tokens.out"
    from taps.diff import render_table
    render_table(rep)
    out = capsys.readouterr().out
    assert "AGREE" not in out and "FIRST DIVERGENCE: logits" in out and "not comparable" in out


def test_shape_mismatch_is_a_divergence():
    a = np.zeros((4, 3), np.float32)
    rep = diff_archives(_mem({"logits": (a, range(4))}), _mem({"logits": (np.zeros((4, 5), np.float32), range(4))}))
    assert rep.exit_code == 1 and rep.first_divergence == "logits" and "shape differs" in rep.result("logits").note


# ------------------------------------------------------------------ taps record selections and flags
@pytest.fixture(scope="module")
def ids_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ids") / "p.txt"
    p.write_text(" ".join(map(str, IDS)))
    return p


@pytest.mark.parametrize("args,flag", [
    (["--positions", "50:60"], "--positions"),       # beyond the 12 ids
    (["--layers", "99"], "--layers"),                # beyond the 6-layer model
    (["--layers", "2,99"], "--layers"),
    (["--taps", "nomatch*"], "--taps"),
    (["--layers", "abc"], "--layers"),               # a syntax error names the flag it came from
    (["--chunk-size", "0"], "--chunk-size"),
    (["--chunk-size", "-3"], "--chunk-size"),
    (["--cap", "-5"], "--cap"),
    (["--cap", "0"], "--cap"),
])
def test_record_bad_selection_or_value_exit_2_no_archive(tmp_path, capsys, ids_file, args, flag):
    out = tmp_path / "X"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qwen4exp taps record: error: " + flag), err
    assert not out.exists() and not list(tmp_path.glob("X.tmp-*"))


def test_record_messages_name_the_overwrite_flag_and_count_kept_positions(tmp_path, capsys, ids_file):
    out = tmp_path / "X"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--positions", "0:4",
                  "--taps", "logits"]) == 0
    assert "recorded 1 taps over 4 positions" in capsys.readouterr().out
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--taps", "logits"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen4exp taps record: error:") and "pass --overwrite" in err
    # a range partly beyond the ids keeps the part inside them
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--positions", "10:64",
                  "--taps", "logits", "--overwrite"]) == 0
    assert "over 2 positions" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["positions"] == [[10, 12]] and m["model"]["path"].endswith("tiny")


# ------------------------------------------------------------------ harness archives replay
def test_parity_harness_archives_carry_token_ids_and_model_for_replay(tmp_path, capsys):
    from parity.backends import truth_model
    from parity.harness.scenarios import cases_for
    from parity.harness.scenarios.common import TruthCache
    from parity.harness.scenarios.runner import run_case
    from parity.suites import faults
    fault = faults.ChunkDropsNgramContext          # fails in the first prefill: positions 0.. are recorded
    scenario, _ = faults.FAULTS[fault]
    fx = REPO / "fixtures" / "tiny"
    be = fault.open(fx)
    case = [c for c in cases_for(scenario, be.config, "ci") if c.name.startswith("chunk_inside-compress-block")][0]
    r = run_case(scenario, case, be, TruthCache(truth_model(fx)), archive_dir=tmp_path)
    assert r.status == "fail" and len(r.archives) == 2, (r.status, r.archives)
    ms = [json.loads((Path(a) / "manifest.json").read_text()) for a in r.archives]
    for m in ms:
        assert m["token_ids"] and m["model"]["path"] == str(fx) and m["model"]["config_hash"]
    assert ms[0]["token_ids"] == ms[1]["token_ids"]
    capsys.readouterr()
    assert _main(["tap-diff", *r.archives, "--replay", fx, "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["replay"]["verdict"] == "block", d["replay"]
