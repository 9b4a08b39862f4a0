"""`taps record` / `tap-diff` outputs: output paths follow the shared rules
(reference/atomic.check_output_path; one line, exit 2, nothing written), `--backend` takes the parity
backend names and the manifest names the device, a run that emitted taps only at positions outside
the filter is reported as such (and tap-diff calls that a divergence, exit 1), and tap-diff validates
`--memory-mb` / `--replay` up front."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from taps.archive import ArchiveError, ArchiveWriter
from taps.diff import DiffRefused, diff_archives
from taps.recorder import Recorder
from taps.synthetic import fake_forward, tiny_config

CFG = tiny_config()
IDS = list(range(2, 14))


def _main(argv):
    from parity.cli import main
    return main([str(a) for a in argv])


@pytest.fixture()
def ids_file(tmp_path):
    p = tmp_path / "ids.txt"
    p.write_text(" ".join(map(str, IDS)))
    return p


def _one_error_line(capsys, prefix="qwen4exp taps record: error: --out"):
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix), cap.err
    assert "Traceback" not in cap.err
    return err[0]


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp" in p.name or ".old" in p.name)


# ------------------------------------------------------------------ output paths (items 5, 7, 14)
def test_out_existing_file_with_overwrite_is_refused_before_running(tmp_path, capsys, ids_file):
    f = tmp_path / "afile"
    f.write_text("keep me")
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", f, "--overwrite", "--taps", "logits"]) == 2
    assert "found an existing file" in _one_error_line(capsys)
    assert f.read_text() == "keep me" and _leftovers(tmp_path) == []
    # control: a directory archive IS replaced with --overwrite
    d = tmp_path / "arc"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", d, "--taps", "logits"]) == 0
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", d, "--taps", "logits",
                  "--positions", "0:3", "--overwrite"]) == 0
    assert json.loads((d / "manifest.json").read_text())["positions"] == [[0, 3]]
    assert _leftovers(tmp_path) == []


def test_out_under_a_file_or_proc_or_missing_parent(tmp_path, capsys, ids_file):
    (tmp_path / "afile").write_text("x")
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", tmp_path / "afile" / "x.taps"]) == 2
    line = _one_error_line(capsys)
    assert "is a file" in line and "does not exist" not in line
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", "/proc/new.taps"]) == 2
    assert "/proc" in _one_error_line(capsys)
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", tmp_path / "nodir" / "x.taps"]) == 2
    assert "parent" in _one_error_line(capsys) and not (tmp_path / "nodir").exists()


def test_writer_failure_at_publish_removes_tmp_and_keeps_the_old_archive(tmp_path, monkeypatch):
    out = tmp_path / "arc"
    with Recorder(out, meta={"token_ids": IDS}) as rec:
        fake_forward(CFG, IDS)
    old = rec.archive().get("logits")
    real = os.replace

    def failing_rename(a, b):  # publishing the new archive fails; restoring the set-aside old one works
        if Path(b) == out and ".tmp" in Path(a).name:
            raise PermissionError(13, "Permission denied")
        return real(a, b)
    monkeypatch.setattr(os, "replace", failing_rename)
    with pytest.raises(ArchiveError, match="could not be written"):
        with Recorder(out, meta={"token_ids": IDS}, overwrite=True):
            fake_forward(CFG, IDS, chunk_size=5)
    monkeypatch.undo()
    assert _leftovers(tmp_path) == []                          # no DIR.tmp-XXXX, no set-aside copy
    from taps.archive import Archive
    np.testing.assert_array_equal(Archive.open(out).get("logits"), old)   # the old archive is back
    # the writer itself refuses a regular file even with overwrite (library callers, not only the CLI)
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ArchiveError, match="existing file"):
        ArchiveWriter(f, overwrite=True)
    with pytest.raises(ArchiveError, match="is a file"):
        ArchiveWriter(f / "x.taps")


# ------------------------------------------------------------------ backend names
PLUGIN = textwrap.dedent('''
    from parity.backends import ReferenceBackend

    class Plug(ReferenceBackend):
        @classmethod
        def open(cls, model_path, **opts):
            be = super().open(model_path, **opts)
            be.name = "plugmod:Plug"
            return be

    class Boom(Plug):
        def prefill(self, h, ids, chunk_size=None):
            raise RuntimeError("kernel exploded")
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    d = tmp_path / "plug"
    d.mkdir()
    (d / "plugmod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(d))
    yield
    sys.modules.pop("plugmod", None)


def test_record_accepts_the_parity_backend_names_and_names_the_device(tmp_path, capsys, ids_file, plugin):
    ref = tmp_path / "ref"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", ref, "--taps", "logits"]) == 0
    for name, want_backend, want_dtype in [("reference-f64", "reference-f64", "float64"),
                                           ("engine-cpu", "engine-cpu", "float32"),
                                           ("plugmod:Plug", "plugmod:Plug", "float32")]:
        out = tmp_path / name.replace(":", "_")
        assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--backend", name,
                      "--taps", "logits"]) == 0, capsys.readouterr().err
        m = json.loads((out / "manifest.json").read_text())
        assert (m["backend"], m["dtype"]) == (want_backend, want_dtype)
        capsys.readouterr()
        assert _main(["tap-diff", ref, out]) == 0   # every backend here computes the same model
    # `engine --device cpu` is engine-cpu in the manifest (the device is recorded, not just "engine")
    out = tmp_path / "eng"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--backend", "engine",
                  "--device", "cpu", "--taps", "logits"]) == 0
    assert json.loads((out / "manifest.json").read_text())["backend"] == "engine-cpu"
    capsys.readouterr()


@pytest.mark.parametrize("args,needle", [
    (["--backend", "bogus"], "--backend"),
    (["--backend", "nosuchmod:X"], "--backend"),
    (["--backend", "engine-cpu", "--device", "cuda"], "--device"),
    (["--backend", "engine-cpu", "--dtype", "float64"], "--dtype"),
    (["--backend", "reference-f64", "--dtype", "float32"], "--dtype"),
])
def test_record_bad_backend_choice_exit_2_nothing_written(tmp_path, capsys, ids_file, plugin, args, needle):
    out = tmp_path / "X"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--taps", "logits", *args]) == 2
    _one_error_line(capsys, "qwen4exp taps record: error: " + needle)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_record_plugin_raising_is_backend_raised_exit_1(tmp_path, capsys, ids_file, plugin):
    """The plugin raises while running: one ERROR line (the "backend raised" outcome, exit 1), nothing written."""
    out = tmp_path / "X"
    assert _main(["taps", "record", "tiny", "--ids", ids_file, "--out", out, "--taps", "logits", "--backend",
                  "plugmod:Boom"]) == 1
    _one_error_line(capsys, "qwen4exp taps record: ERROR: backend 'plugmod:Boom' raised")
    assert not out.exists() and _leftovers(tmp_path) == []


# ------------------------------------------------------------------ taps outside the filter
def _rec(positions, emit_at, names=("embed_tokens.out", "logits")):
    rng = np.random.default_rng(0)
    with Recorder(None, positions=positions, meta={"token_ids": IDS}) as rec:
        for n in names:
            rec.emit(n, rng.normal(size=(len(emit_at), 3)).astype(np.float32), positions=emit_at)
    return rec.archive()


def test_taps_emitted_at_the_wrong_positions_are_named_and_diverge(tmp_path, capsys):
    from parity.harness.scenarios.locate import diff_archives as locate_line
    truth = _rec([9], [9])
    wrong = _rec([9], [13])                      # e.g. position() under-reports after a rollback
    assert wrong.names() == [] and wrong.manifest["outside_positions"]["positions"] == [[13, 14]]
    line = locate_line(truth, wrong)
    assert "emitted taps at positions 13..13, expected 9..9" in line and "no taps" not in line
    rep = diff_archives(truth, wrong)
    assert rep.exit_code == 1 and rep.first_divergence == "embed_tokens.out"
    assert rep.result("logits").status == "no-overlap" and "13..13" in rep.result("logits").note
    # the same through archives on disk and the CLI: a divergence (1), not "nothing to compare" (2)
    from parity.harness.scenarios.locate import _save
    a, b = _save(tmp_path, "s", "c", None, truth, wrong)
    assert _main(["tap-diff", a, b]) == 1
    assert "FIRST DIVERGENCE: embed_tokens.out" in capsys.readouterr().out
    # negative controls: a run that emitted nothing at all is still "no taps" / nothing to compare,
    # and a tap that only one side selected (--taps) stays missing-in-b, not a divergence
    silent = _rec([9], [9], names=())
    assert "backend emitted no taps" in locate_line(truth, silent)
    with pytest.raises(DiffRefused, match="none to compare"):
        diff_archives(truth, silent)
    rep2 = diff_archives(truth, _rec([9], [9], names=("embed_tokens.out",)))
    assert rep2.exit_code == 0 and rep2.result("logits").status == "missing-in-b"


def test_tap_diff_all_taps_at_disjoint_positions_is_exit_1(tmp_path, capsys):
    from parity.harness.scenarios.locate import _save
    a, b = _save(tmp_path, "s", "c", None, _rec(None, [0, 1]), _rec(None, [5, 6]))
    assert _main(["tap-diff", a, b]) == 1
    assert "FIRST DIVERGENCE" in capsys.readouterr().out


# ------------------------------------------------------------------ tap-diff flags
def test_tap_diff_validates_memory_and_replay_up_front(tmp_path, capsys):
    for d in ("A", "B"):
        with Recorder(tmp_path / d, meta={"token_ids": IDS, "model": {"config_hash": CFG.config_hash()}}) as rec:
            fake_forward(CFG, IDS)
    capsys.readouterr()
    assert _main(["tap-diff", tmp_path / "A", tmp_path / "B"]) == 0   # control: they agree
    capsys.readouterr()
    for mb in ("0", "-5"):
        assert _main(["tap-diff", tmp_path / "A", tmp_path / "B", "--memory-mb", mb]) == 2
        _one_error_line(capsys, "qwen4exp tap-diff: error: --memory-mb")
    assert _main(["tap-diff", tmp_path / "A", tmp_path / "B", "--replay", "nosuchmodel"]) == 2
    _one_error_line(capsys, "qwen4exp tap-diff: error: --replay 'nosuchmodel'")
