"""``qwen4exp taps check DIR`` (taps/check.py) against docs/tap-archive.md: archives our recorder writes are
valid; an archive written by hand with the ``safetensors`` library following only the doc is valid and
tap-diff compares it with ours (agreeing, and locating a perturbed tap); malformed archives -- each breaking
one rule of the doc -- are refused with a message naming the rule (negative controls)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from reference.config import load_config
from reference.model import ReferenceModel
from reference.checkpoint import Checkpoint
from reference.paths import bundled_model
from taps.archive import ArchiveError
from taps.check import check_archive
from taps.recorder import Recorder

IDS = [3, 17, 5, 440, 9, 21, 8, 100, 2, 64, 7, 33]


@pytest.fixture(scope="module")
def cfg():
    return load_config(bundled_model("tiny"))


@pytest.fixture(scope="module")
def ref_archive(tmp_path_factory, cfg):
    out = tmp_path_factory.mktemp("arc") / "ref.taps"
    ck = Checkpoint.open(bundled_model("tiny"))
    with Recorder(out, meta={"backend": "reference", "dtype": "float32", "token_ids": IDS,
                             "model": {"config_hash": cfg.config_hash()}}):
        ReferenceModel(ck).forward(IDS)
    return out


def _hand_written(dst, values: dict, ids, config_hash=None):
    """An archive written from docs/tap-archive.md alone: one safetensors file, a minimal manifest."""
    from safetensors.numpy import save_file
    dst.mkdir()
    tensors, taps = {}, {}
    for name, v in values.items():
        key = f"{name}#0"
        tensors[key] = np.ascontiguousarray(v)
        tensors[key + ".pos"] = np.arange(len(v), dtype=np.int64)
        kind = "index" if v.dtype == np.int64 else "activation"
        taps[name] = {"dtype": str(v.dtype), "tail": list(v.shape[1:]), "rows": len(v), "kind": kind,
                      "segments": [{"file": "data.safetensors", "key": key, "rows": len(v)}]}
    save_file(tensors, str(dst / "data.safetensors"))
    m = {"format": "qwen4exp-taps", "format_version": 1, "backend": "hand-written", "dtype": "float32",
         "token_ids": list(ids), "order": list(values), "taps": taps}
    if config_hash:
        m["model"] = {"config_hash": config_hash}
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_recorder_archives_are_valid(ref_archive, cfg):
    rep = check_archive(ref_archive, cfg)
    assert rep.ok, rep.problems
    assert rep.taps > 50 and not rep.warnings


def test_hand_written_archive_is_valid_and_diffable(ref_archive, cfg, tmp_path):
    """A dump an outside engine could write (here: the reference's own values, so they must agree) passes
    the check and tap-diff; the same dump with one tap perturbed is located at that tap."""
    from taps.archive import Archive
    from taps.diff import diff_archives
    ref = Archive.open(ref_archive)
    names = ["embed_tokens.out", "layers.0.attn_hyper_connection.out", "layers.2.mlp.gate.topk_ids",
             "layers.2.mlp.gate.router_logits", "layers.3.mlp.out", "logits"]
    vals = {n: np.asarray(ref.get(n)) for n in names}
    good = _hand_written(tmp_path / "good.taps", vals, IDS, cfg.config_hash())
    rep = check_archive(good, cfg)
    assert rep.ok and rep.taps == len(names), rep.problems
    d = diff_archives(ref_archive, good, "fp32")
    assert d.agree and {r.name for r in d.results if r.status == "agree"} == set(names)
    bad_vals = dict(vals, **{"layers.3.mlp.out": vals["layers.3.mlp.out"] * 1.05})
    bad = _hand_written(tmp_path / "bad.taps", bad_vals, IDS, cfg.config_hash())
    assert check_archive(bad, cfg).ok
    assert diff_archives(ref_archive, bad, "fp32").first_divergence == "layers.3.mlp.out"


def _mutate(src, dst, fn):
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    fn(m, dst)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _first_tap(m, suffix):
    return next(n for n in m["order"] if n.endswith(suffix))


def _rewrite(dst, m, name, fn):
    """Rewrite the data file holding tap ``name``'s first segment with ``fn(tensors)`` applied."""
    from safetensors.numpy import load_file, save_file
    sg = m["taps"][name]["segments"][0]
    f = dst / sg["file"]
    t = load_file(str(f))
    fn(t, sg["key"])
    save_file(t, str(f))
    m.pop("chunks", None)  # the data changed on purpose; the checksum rule is tested on its own


CASES = {
    "format": (lambda m, d: m.update(format="other"), "'format'"),
    "version": (lambda m, d: m.update(format_version=2), "format_version"),
    "no taps": (lambda m, d: m.pop("taps"), "'taps'"),
    "unknown tap": (lambda m, d: (m["taps"].__setitem__("layers.0.mlp.outt", m["taps"]["layers.0.mlp.out"]),
                                  m["order"].append("layers.0.mlp.outt")), "unknown name"),
    "order lacks a tap": (lambda m, d: m["order"].remove("logits"), "'order'"),
    "wrong kind": (lambda m, d: m["taps"]["layers.0.mlp.gate.topk_ids"].update(kind="activation"), ".kind"),
    "float index": (lambda m, d: m["taps"]["layers.0.mlp.gate.topk_ids"].update(dtype="float32"), ".dtype"),
    "tail vs model": (lambda m, d: m["taps"]["layers.0.mlp.out"].update(tail=[7]), ".tail"),
    "rows sum": (lambda m, d: m["taps"]["logits"].update(rows=m["taps"]["logits"]["rows"] + 1), "summing"),
    "missing file": (lambda m, d: m["taps"]["logits"]["segments"][0].update(file="nope.safetensors"), "nope.safetensors"),
    "checksum": (lambda m, d: next(iter(m["chunks"].values())).update(sha256="0" * 64), "sha256"),
    "identity": (lambda m, d: m["model"].update(config_hash="0" * 16), "config_hash"),
    "layer beyond model": (lambda m, d: (m["taps"].__setitem__("layers.9.mlp.out", m["taps"]["layers.0.mlp.out"]),
                                         m["order"].append("layers.9.mlp.out")), "num_hidden_layers"),
    "layer type": (lambda m, d: (m["taps"].__setitem__("layers.0.self_attn.out", m["taps"]["layers.0.mlp.out"]),
                                 m["order"].append("layers.0.self_attn.out")), "layer 0 is linear_attention"),
    "data dtype": (lambda m, d: _rewrite(d, m, "layers.0.mlp.out",
                                         lambda t, k: t.__setitem__(k, t[k].astype(np.float64))), "expected dtype"),
    "data shape": (lambda m, d: _rewrite(d, m, "layers.0.mlp.out", lambda t, k: t.__setitem__(k, t[k][:, :5])),
                   "expected shape"),
    "no pos": (lambda m, d: _rewrite(d, m, "layers.0.mlp.out", lambda t, k: t.pop(k + ".pos")), ".pos"),
    "negative pos": (lambda m, d: _rewrite(d, m, "layers.0.mlp.out",
                                           lambda t, k: t.__setitem__(k + ".pos", t[k + ".pos"] - 5)), ">= 0"),
    "pos beyond tokens": (lambda m, d: m.update(token_ids=IDS[:3]), "len(token_ids)"),
    "bad index": (lambda m, d: _rewrite(d, m, "layers.0.mlp.gate.topk_ids",
                                        lambda t, k: t.__setitem__(k, t[k] - 9)), ">= -1"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_archive_is_refused(case, ref_archive, cfg, tmp_path):
    fn, needle = CASES[case]
    bad = _mutate(ref_archive, tmp_path / "bad.taps", fn)
    rep = check_archive(bad, cfg)
    assert not rep.ok, case
    assert any(needle in p for p in rep.problems), (case, rep.problems)


def _damage(f, how):
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif how == "longer":
        f.write_bytes(data + b"\0" * 64)
    else:   # same size, the header overwritten: only the checksum tells
        f.write_bytes(b"\xff" * 64 + data[64:])


@pytest.mark.parametrize("how, needle", [("truncated", "(truncated;"), ("longer", "(longer than written;"),
                                         ("header overwritten", "expected sha256")])
def test_damaged_chunk_file_is_one_problem_naming_the_file(ref_archive, tmp_path, capsys, how, needle):
    """A data file that fails its 'chunks' entry is one problem line (the file, expected vs found), not one
    more for each tap whose segments it holds, nor an unreadable-safetensors line beside it."""
    from parity.cli import main
    bad = tmp_path / "bad.taps"
    shutil.copytree(ref_archive, bad)
    m = json.loads((bad / "manifest.json").read_text())
    fname, want = next(iter(m["chunks"].items()))
    _damage(bad / fname, how)
    rep = check_archive(bad)
    assert len(rep.problems) == 1, rep.problems
    assert rep.problems[0].startswith(f"{fname}: expected") and needle in rep.problems[0]
    if how != "header overwritten":
        size = (bad / fname).stat().st_size
        assert f"expected {want['bytes']} bytes" in rep.problems[0] and f"found {size}" in rep.problems[0]
    capsys.readouterr()
    assert main(["taps", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if ln.startswith("problem:")] == [f"problem: {rep.problems[0]}"]


def test_warnings_and_cli(ref_archive, cfg, tmp_path, capsys):
    """An index tap without its companion and a stray file are warnings (still valid); the CLI exits 0 / 1 / 2."""
    from parity.cli import main
    arc = _mutate(ref_archive, tmp_path / "w.taps", lambda m, d: (
        m["taps"].pop("layers.0.mlp.gate.router_logits"), m["order"].remove("layers.0.mlp.gate.router_logits"),
        (d / "notes.txt").write_text("x")))
    rep = check_archive(arc, cfg)
    assert rep.ok and any("companion" in w for w in rep.warnings) and any("notes.txt" in w for w in rep.warnings)
    assert main(["taps", "check", str(arc), "--model", "tiny"]) == 0
    bad = _mutate(ref_archive, tmp_path / "b.taps", lambda m, d: m.update(format="x"))
    capsys.readouterr()
    assert main(["taps", "check", str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "'format'" in doc["problems"][0]
    assert main(["taps", "check", str(tmp_path / "absent")]) == 2
    with pytest.raises(ArchiveError):
        check_archive(tmp_path / "absent")
