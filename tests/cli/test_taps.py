"""``qwen4exp taps list / record / diff`` (and the ``tap-diff`` alias) on the command line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fixture_helpers import one_line_error
from parity.cli import main


REPO = Path(__file__).resolve().parents[2]

def _ids(tmp_path, n=12) -> Path:
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(str((5 * i) % 500) for i in range(n)))
    return f

def _fifo(tmp_path, data: bytes, name="fifo") -> tuple[Path, threading.Thread]:
    """A named pipe (what `<(...)` gives) fed with ``data`` by a thread."""
    p = tmp_path / name
    os.mkfifo(p)

    def feed():
        with open(p, "wb") as f:
            f.write(data)
    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return p, t

def _diverging_archives(tmp_path):
    from parity.backends import truth_model
    from parity.harness.scenarios import cases_for
    from parity.harness.scenarios.common import TruthCache
    from parity.harness.scenarios.runner import run_case
    from parity.suites import faults
    fault = faults.ChunkDropsNgramContext
    scenario, _ = faults.FAULTS[fault]
    fx = REPO / "fixtures" / "tiny"
    be = fault.open(fx)
    case = [c for c in cases_for(scenario, be.config, "ci") if c.name.startswith("chunk_inside-compress-block")][0]
    r = run_case(scenario, case, be, TruthCache(truth_model(fx)), archive_dir=tmp_path / "arc")
    assert r.status == "fail" and len(r.archives) == 2
    return r.archives

REPO_ROOT = Path(__file__).resolve().parents[2]

def _archive(path, token_ids=(1, 2, 3)):
    from taps.archive import ArchiveWriter
    w = ArchiveWriter(path)
    w.add("embed", np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(3, dtype=np.int64))
    w.close({"backend": "reference", "dtype": "float32", "token_ids": list(token_ids)})
    return path


def test_taps_list_into_a_closed_pipe_exits_0():
    """`qwen4exp taps list | head -1`: a broken pipe is not exit status 1 (rich's writer must not turn it into one)."""
    code = "import sys; from parity.cli import main; sys.exit(main(['taps', 'list']))"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    p.stdout.close()  # the reader is gone before the table is written
    err = p.stderr.read().decode()
    assert p.wait() == 0 and "Traceback" not in err, err


def test_tap_archive_honours_the_umask(tmp_path):
    """Archives from `taps record` had mkdtemp's 0700 / mkstemp's 0600 modes, unlike every other output."""
    import stat

    import numpy as np

    from taps.archive import ArchiveWriter
    old = os.umask(0o022)
    try:
        w = ArchiveWriter(tmp_path / "a.taps")
        w.add("embed_tokens.out", np.zeros((2, 3), np.float32), np.arange(2))
        out = w.close({})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(os.stat(p).st_mode) == 0o644 for p in files)


@pytest.mark.parametrize("field, value, needles", [
    ("taps", 5, ["'taps'", "an integer (5)"]),
    ("chunks", "x", ["'chunks'", "a string"]),
    ("token_ids", "abc", ["'token_ids'", "a string"]),
    ("token_ids", [1, "b", 3], ["'token_ids'", "index 1"]),
    ("format_version", "1", ["'format_version'", "a string"]),
    ("order", ["nope"], ["'order'", "'nope'"]),
])
def test_tap_diff_refuses_a_malformed_manifest_naming_the_field(tmp_path, capsys, field, value, needles):
    a = _archive(tmp_path / "a.taps")
    xm = tmp_path / "xm"
    shutil.copytree(a, xm)
    assert main(["tap-diff", str(a), str(xm)]) == 0  # negative control: the intact copy agrees
    capsys.readouterr()
    m = json.loads((xm / "manifest.json").read_text())
    m[field] = value
    (xm / "manifest.json").write_text(json.dumps(m))
    assert main(["tap-diff", str(a), str(xm)]) == 2
    line = one_line_error(capsys, "xm", *needles, absent=("token ids differ", "newer than"))
    assert "manifest.json" in line


@pytest.mark.parametrize("edit, needle", [
    (lambda order: order[:-1], "missing from it"),      # a tap recorded but not listed: a diff would skip it
    (lambda order: order + order[:1], "each tap once"),
])
def test_an_order_that_does_not_list_each_tap_once_is_refused_by_diff_and_check(tmp_path, capsys, edit, needle):
    from taps.archive import ArchiveWriter
    a = tmp_path / "a.taps"
    w = ArchiveWriter(a)
    for name in ("embed_tokens.out", "norm.out"):
        w.add(name, np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(3, dtype=np.int64))
    w.close({"backend": "reference", "dtype": "float32", "token_ids": [1, 2, 3]})
    xm = tmp_path / "xm"
    shutil.copytree(a, xm)
    m = json.loads((xm / "manifest.json").read_text())
    assert len(m["order"]) >= 2
    (xm / "manifest.json").write_text(json.dumps({**m, "order": edit(m["order"])}))
    assert main(["tap-diff", str(a), str(xm)]) == 2
    line = one_line_error(capsys, "xm", "'order'", needle)
    assert "manifest.json" in line
    assert main(["taps", "check", str(xm)]) == 1
    assert needle in capsys.readouterr().out


def test_tap_diff_format_version_newer_and_null_token_ids(tmp_path, capsys):
    a = _archive(tmp_path / "a.taps")
    xm = tmp_path / "xm"
    shutil.copytree(a, xm)
    m = json.loads((xm / "manifest.json").read_text())
    (xm / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    assert main(["tap-diff", str(a), str(xm)]) == 2
    one_line_error(capsys, "newer than this reader supports")
    # token_ids null is what a recording without known ids writes: the identity is reported unverified
    (xm / "manifest.json").write_text(json.dumps({**m, "token_ids": None}))
    assert main(["tap-diff", str(a), str(xm), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "token ids differ" not in json.dumps(rep)


@pytest.mark.parametrize("inside", ["nothing", "a directory"])
def test_taps_check_and_diff_give_one_input_error_for_a_directory_without_manifest(tmp_path, capsys, inside):
    """A directory that holds no manifest.json is no tap archive: ``taps check`` and ``taps diff`` both exit 2
    with the same one-line error naming the directory, the manifest expected and what was found."""
    a = _archive(tmp_path / "a.taps")
    d = tmp_path / "not-an-archive"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    if inside == "a directory":
        (d / "manifest.json").mkdir()
    found = "found none" if inside == "nothing" else "found a directory"
    capsys.readouterr()
    assert main(["taps", "check", str(d), "--json"]) == 2
    assert capsys.readouterr().out == ""   # no report of an archive that is not there
    assert main(["taps", "check", str(d)]) == 2
    check_line = one_line_error(capsys, "taps check", "not-an-archive", "expected manifest.json", found)
    assert main(["taps", "diff", str(a), str(d)]) == 2
    diff_line = one_line_error(capsys, "taps diff", "not-an-archive", "expected manifest.json", found)
    assert check_line.split(": error: ", 1)[1] == diff_line.split(": error: ", 1)[1]


def test_taps_record_full_disk_is_one_line_exit_4(tmp_path, capsys, monkeypatch):
    import safetensors.numpy as SN
    from safetensors import SafetensorError
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3")
    real = SN.save_file

    def full(tensors, path, *a, **k):
        Path(path).write_bytes(b"x" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(SN, "save_file", full)
    out = tmp_path / "t.taps"
    assert main(["taps", "record", "tiny", "--ids", str(f), "--out", str(out), "--taps", "logits"]) == 4  # EXIT_ENVIRONMENT
    one_line_error(capsys, "t.taps", "could not be written", "No space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.txt"], "a temp archive was left"
    monkeypatch.setattr(SN, "save_file", real)  # negative control
    assert main(["taps", "record", "tiny", "--ids", str(f), "--out", str(out), "--taps", "logits"]) == 0
    assert (out / "manifest.json").is_file()


def test_table_never_splits_a_tap_name_on_80_columns_and_not_at_all_in_pipes(monkeypatch):
    """On an 80-column terminal the "first divergence" column is wide enough and never splits tap names
    mid-word; piped CI logs keep names whole too."""
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    name = "layers.3.self_attn.indexer.selected_blocks"
    div = f"prefill_bound+1_len16 [page 4]: first divergence {name} at position 9 (last agreeing layers.2.mlp.out)"
    rep = ParityReport("b", "m", [ScenarioRow("speculative-rollback", 12, 1, 0.5, 1.0, div, 1.0, "fail",
                                              thresholds={"max_kl": 1e-5, "min_top1": 0.98})])
    monkeypatch.setenv("COLUMNS", "80")
    text = render_table(rep)
    assert all(len(ln) <= 80 for ln in text.splitlines()[:-1]), text
    parts = name.split(".")
    for ln in text.splitlines():  # every piece of the name on a line is whole parts, never a cut part
        for tok in ln.split():
            if tok.startswith("layers.3.") or tok.rstrip(".") in parts[1:]:
                assert all(p in parts for p in tok.strip(".").split(".")), tok
    monkeypatch.delenv("COLUMNS")
    piped = render_table(rep)  # stdout is not a terminal here: a pipe / CI log
    assert div in piped


def test_taps_list_keeps_whole_names_and_every_column(monkeypatch, capsys):
    """`taps list` on a narrow terminal keeps whole names (no "...") and every column."""
    from parity.cli.taps import _LIST_COLUMNS, list_text
    from taps import registry
    rows = [[s.pattern, s.module, s.shape, s.dtype, s.kind, s.layer_type or "all", s.meaning] for s in registry.specs()]
    lines = list_text(rows, 80)
    assert all(c in lines[0] for c in _LIST_COLUMNS)
    text = "\n".join(lines)
    assert "..." not in text.replace("[T, ...]", "")
    for s in registry.specs():
        assert any(ln.startswith(s.pattern + " ") for ln in lines), s.pattern
    assert main(["taps", "list", "--format", "rich"]) == 0
    out = capsys.readouterr().out
    assert all(c in out.splitlines()[1] for c in _LIST_COLUMNS)
    assert all(s.pattern in out for s in registry.specs()) and "…" not in out


def test_ids_from_dev_stdin_and_a_pipe(tmp_path, capsys):
    """`--ids /dev/stdin` and `--ids <(...)` are read (pipes are files too)."""
    out = tmp_path / "a.npy"
    p = subprocess.run([sys.executable, "-m", "parity.cli", "logits", "tiny", "--ids", "/dev/stdin", "--out",
                        str(out)], cwd=REPO, input=b"1 2 3 4", capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert np.load(out).shape == (4, 512)
    fifo, t = _fifo(tmp_path, b"[1, 2, 3]")
    assert main(["taps", "record", "tiny", "--ids", str(fifo), "--out", str(tmp_path / "t.taps"), "--taps",
                 "logits"]) == 0
    t.join(5)
    from taps.archive import Archive
    assert Archive.open(tmp_path / "t.taps").manifest["token_ids"] == [1, 2, 3]
    assert main(["logits", "tiny", "--ids", str(tmp_path / "nope"), "--out", str(tmp_path / "b.npy")]) == 2
    one_line_error(capsys, "--ids", "no such file")  # negative control: a missing file is still one clear error


def test_tap_diff_replay_refuses_other_weights(tiny, tmp_path, capsys):
    """`tap-diff --replay` refuses a checkpoint with the same config but other weights."""
    a, b = _diverging_archives(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    st = other / "model.safetensors"
    raw = bytearray(st.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start] ^= 0xFF  # one byte of the first tensor: same config, other weights
    st.write_bytes(bytes(raw))
    assert main(["taps", "diff", a, b, "--replay", str(other)]) == 2
    one_line_error(capsys, "--replay", "weights fingerprint", "other weights")
    assert main(["taps", "diff", a, b, "--replay", str(tiny), "--json"]) == 1  # negative control: the right model
    assert json.loads(capsys.readouterr().out)["replay"]["verdict"] == "block"


def test_taps_diff_and_the_tap_diff_alias(tmp_path, capsys):
    """`qwen4exp taps diff` (nested, as list/record), `tap-diff` kept as an alias."""
    ids = _ids(tmp_path)
    for n in ("A", "B"):
        assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(tmp_path / n), "--taps", "logits"]) == 0
    capsys.readouterr()
    assert main(["taps", "diff", str(tmp_path / "A"), str(tmp_path / "B"), "--format", "json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["tap-diff", str(tmp_path / "A"), str(tmp_path / "B"), "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    a.pop("elapsed_s"), b.pop("elapsed_s")
    assert a == b and a["agree"]


def _selection_archive(path, rows, token_ids):
    from taps.archive import ArchiveWriter
    w = ArchiveWriter(path)
    w.add("layers.2.self_attn.indexer.selected_blocks", np.asarray(rows, np.int64),
          np.arange(len(rows), dtype=np.int64), kind="index")
    w.close({"backend": "reference", "dtype": "float32", "token_ids": list(token_ids)})
    return path


def test_taps_diff_compares_selections_padded_to_other_widths(tmp_path, capsys):
    """Two archives whose selected_blocks rows are padded to different widths (2 and 4, as an outside engine pads):
    the same ids agree (exit 0); one changed id at position 3 is the first divergence there (exit 1)."""
    ids = list(range(6))
    rows = [[-1, -1], [-1, -1], [0, -1], [0, -1], [1, 0], [0, 1]]
    wide = [r + [-1, -1] for r in rows]
    a = str(_selection_archive(tmp_path / "A", rows, ids))
    b = str(_selection_archive(tmp_path / "B", [[x for x in r[::-1]] for r in wide], ids))
    capsys.readouterr()
    assert main(["taps", "diff", a, b, "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["agree"] and rep["taps"][0]["status"] == "agree", rep["taps"][0]
    bad = [list(r) for r in wide]
    bad[3] = [2, -1, -1, -1]                    # negative control: another block at position 3
    c = str(_selection_archive(tmp_path / "C", bad, ids))
    assert main(["taps", "diff", a, c]) == 1
    out = capsys.readouterr().out
    assert "FIRST DIVERGENCE: layers.2.self_attn.indexer.selected_blocks (layer 2, position 3)" in out, out


@pytest.mark.parametrize("into", ["model", "parent"])
def test_taps_record_out_never_replaces_the_model_it_reads(tmp_path, capsys, into):
    """``taps record M --out M --overwrite`` (or --out the folder holding M): the archive replaced the
    checkpoint; exit 2 before anything is written, naming --out and the model, the model left as it was."""
    import shutil

    from fixture_helpers import one_line_error
    from parity.cli import main
    from reference.paths import bundled_model
    m = tmp_path / "a" / "m"
    shutil.copytree(bundled_model("tiny"), m)
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    before = sorted(p.name for p in m.iterdir())
    out = m if into == "model" else m.parent
    assert main(["taps", "record", str(m), "--ids", str(ids), "--out", str(out), "--overwrite",
                 "--taps", "logits"]) == 2
    one_line_error(capsys, "--out", str(m))
    assert sorted(p.name for p in m.iterdir()) == before


def test_taps_record_takes_device_cpu_on_the_reference_as_logits_does(tmp_path, capsys):
    """One grammar for every verb: ``logits tiny --device cpu`` runs the reference (it runs on the CPU), so
    ``taps record tiny --device cpu`` does too (before: exit 2, '--device applies to another backend'); the
    archive equals the one recorded without the flag. ``--device cuda`` on the reference stays refused (exit 2)."""
    ids = _ids(tmp_path, n=4)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(a), "--taps", "embed_tokens.*"]) == 0
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(b), "--taps", "embed_tokens.*",
                 "--device", "cpu"]) == 0
    capsys.readouterr()
    chunks = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors")
    assert chunks and chunks == sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors")
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in chunks)
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(c), "--device", "cuda"]) == 2
    one_line_error(capsys, "--device", "reference")
    assert not c.exists()
