"""Failure modes of the ``qwen4exp`` CLI: NaN truths, full disks, raising backends, bad shapes, filters
matching nothing, help and message grammar; each test asserts the documented outcome and exit code."""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from parity.cli import main
from reference.checkpoint import Checkpoint, write_safetensors
from reference.paths import bundled_model


def _nan_lm_head(tmp_path) -> Path:
    """A copy of fixtures/tiny whose every lm_head.weight value is the BF16 NaN 0x7fc0."""
    dst = tmp_path / "nan"
    shutil.copytree(bundled_model("tiny"), dst)
    f = dst / "model.safetensors"
    with Checkpoint.open(dst) as ck:
        d = {ck.stored_name(n): np.array(ck.get_raw(n)) for n in ck.names()}
    w = d["lm_head.weight"]
    assert w.dtype == ml_dtypes.bfloat16, w.dtype
    d["lm_head.weight"] = np.full(w.shape, 0x7FC0, dtype=np.uint16).view(ml_dtypes.bfloat16)
    write_safetensors(f, d, metadata={"format": "pt"})
    return dst


# --- 1: non-finite truth
def test_parity_nan_truth_is_inconclusive(tmp_path, capsys):
    ck = _nan_lm_head(tmp_path)
    rc = main(["parity", str(ck), "--scenario", "kl", "budget", "--level", "ci", "--format", "json",
               "--no-progress"])
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert rc == 3, out
    assert doc["verdict"] == "inconclusive"
    rows = {r["scenario"]: r for r in doc["scenarios"]}
    assert set(rows) == {"kl", "budget"}
    for r in rows.values():
        assert r["status"] == "inconclusive"
        assert "not finite at position 0" in r["first_divergence"]


def test_logits_nan_warns_and_exits_3(tmp_path, capsys):
    ck = _nan_lm_head(tmp_path)
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    out = tmp_path / "l.npy"
    rc = main(["logits", str(ck), "--ids", str(ids), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 3
    assert "not finite" in err and "position 0" in err
    assert np.isnan(np.load(out)).all()  # written as computed: the warning says what it is


# --- 2: disk full while writing --out
@pytest.mark.parametrize("where", ["archives", "report"])
def test_parity_disk_full_keeps_old_results_exit_4(tmp_path, capsys, monkeypatch, where):
    import errno
    import os

    import parity.harness.report as R
    import parity.harness.run as P
    from parity.harness.report import ParityReport, ScenarioRow
    out = tmp_path / "out"
    (out / "taps" / "old").mkdir(parents=True)
    (out / "report.json").write_text('{"old": true}')

    def fake_run(model, spec, scen, *, out_dir=None, **k):
        (Path(out_dir) / "taps" / "budget" / "case0").mkdir(parents=True)
        (Path(out_dir) / "taps" / "budget" / "case0" / "truth.taps").write_text("half")  # backend.taps failed
        arch = ([f"(archives not written: OutputWriteError: output '{out_dir}/taps/budget/case0/backend.taps' "
                 f"could not be written: No space left on device)"] if where == "archives" else [])
        row = ScenarioRow("budget", 1, 1, 1.0, 1.0, "op 0", 0.1, "fail", "diverged",
                          failures=[{"case": "case0", "archives": arch}])
        return ParityReport(backend="reference", model="tiny", rows=[row])
    monkeypatch.setattr(P, "run_parity", fake_run)
    if where == "report":
        import reference.atomic as A
        real = A.atomic_write_json

        def full(path, *a, **k):  # the simulated full disk: the write itself fails with ENOSPC
            if Path(path).name == "report.json":
                raise A.write_failed(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
            return real(path, *a, **k)
        monkeypatch.setattr(A, "atomic_write_json", full)
    rc = main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(out), "--overwrite",
               "--json"])
    err = capsys.readouterr().err
    assert rc == 4, err
    assert "Traceback" not in err and str(out) in err
    assert (out / "report.json").read_text() == '{"old": true}'
    assert sorted(p.name for p in (out / "taps").iterdir()) == ["old"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no staging folder left


# --- 3: taps diff --force never relaxes the --replay model check
def test_taps_diff_force_keeps_replay_model_checks(tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3, 4]")
    a = tmp_path / "A"
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(a), "--layers", "0"]) == 0
    capsys.readouterr()
    other_weights = _nan_lm_head(tmp_path)  # tiny's config, other weights
    # another config: refused, with or without --force
    for extra in ([], ["--force"]):
        assert main(["taps", "diff", str(a), str(a), "--replay", "tiny-hc2", *extra]) == 2
        err = capsys.readouterr().err
        assert "--replay" in err and "config hash" in err, err
    # same config, other weights: --force is not enough, --replay-other-weights is
    assert main(["taps", "diff", str(a), str(a), "--force", "--replay", str(other_weights)]) == 2
    assert "weights fingerprint" in capsys.readouterr().err
    assert main(["taps", "diff", str(a), str(a), "--replay", str(other_weights), "--replay-other-weights"]) == 0
    # negative control: the right model replays
    assert main(["taps", "diff", str(a), str(a), "--force", "--replay", "tiny"]) == 0


# --- 4: a module:Class backend raising is the one "backend raised" outcome of every verb
RAISING = '''
from parity.backends import ReferenceBackend


class Raise(ReferenceBackend):
    EXC = None

    def prefill(self, h, ids, chunk_size=None):
        raise self.EXC  # LINE-MARK

    def prefill_last(self, h, ids):
        raise self.EXC  # LINE-MARK


class RaiseRuntime(Raise):
    EXC = RuntimeError("kernel launch failed")


class RaiseMemory(Raise):
    EXC = MemoryError()


class RaiseExit(Raise):
    EXC = SystemExit(0)
'''


@pytest.fixture
def raising(tmp_path, monkeypatch):
    (tmp_path / "clifix_raise.py").write_text(RAISING)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("clifix_raise", None)
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    return ids


@pytest.mark.parametrize("cls, needle", [("RaiseRuntime", "RuntimeError: kernel launch failed"),
                                         ("RaiseMemory", "MemoryError (out of host memory)"),
                                         ("RaiseExit", "SystemExit(0)")])
@pytest.mark.parametrize("verb", ["logits", "taps record"])
def test_backend_raising_is_exit_1_error_line(raising, tmp_path, capsys, verb, cls, needle):
    spec = f"clifix_raise:{cls}"
    out = tmp_path / "o"
    argv = [*verb.split(), "tiny", "--backend", spec, "--ids", str(raising), "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"qwen4exp {verb}: ERROR: backend {spec!r} raised {needle}" in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert not out.exists()
    assert main([*argv, "--traceback"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "LINE-MARK" in err


def test_crash_outside_the_backend_is_still_internal(raising, monkeypatch, capsys):
    """Negative control: an exception of qwen4exp's own code is not blamed on the backend."""
    import parity.harness.logits as L

    def boom(*a, **k):
        raise ZeroDivisionError("ours")
    monkeypatch.setattr(L, "compute_logits", boom)
    assert main(["logits", "tiny", "--backend", "clifix_raise:RaiseRuntime", "--ids", str(raising), "--out",
                 "-"]) == 4
    assert "internal error" in capsys.readouterr().err


# --- 5: generate drives any module:Class backend (the one --backend grammar)
GOOD = '''
from parity.backends import ReferenceBackend


class Mine(ReferenceBackend):
    pass
'''


def test_generate_outside_backend(tmp_path, monkeypatch, capsys, raising):
    (tmp_path / "clifix_good.py").write_text(GOOD)
    sys.modules.pop("clifix_good", None)
    argv = ["generate", "--prompt", "hello", "--greedy", "--max-new-tokens", "4", "--json"]
    assert main([*argv, "--backend", "clifix_good:Mine"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main([*argv, "--backend", "reference"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert mine["token_ids"] == ref["token_ids"] and mine["backend"] == "clifix_good:Mine"
    # a raising outside backend is the one "backend raised" outcome
    assert main([*argv, "--backend", "clifix_raise:RaiseRuntime"]) == 1
    assert "qwen4exp generate: ERROR: backend 'clifix_raise:RaiseRuntime' raised RuntimeError" in capsys.readouterr().err
    # deprecated engine flags do not apply to an outside backend
    assert main([*argv, "--backend", "clifix_good:Mine", "--device", "cpu"]) == 2


LATE = '''
from parity.backends import ReferenceBackend


class RaiseOnThirdDecode(ReferenceBackend):
    calls = 0

    def decode(self, handles, token_ids):
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("late")
        return super().decode(handles, token_ids)
'''


def test_generate_ends_the_streamed_line_before_a_backend_error(tmp_path, monkeypatch, capsys, raising):
    """Text streamed before the backend raised ends with a newline, so the error is a line of its own on a
    terminal (stdout and stderr share it); the control: nothing streamed, nothing added."""
    (tmp_path / "clifix_late.py").write_text(LATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("clifix_late", None)
    argv = ["generate", "--prompt", "hello", "--greedy", "--max-new-tokens", "6", "--backend",
            "clifix_late:RaiseOnThirdDecode"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert out and out.endswith("\n") and out.count("\n") == 1, repr(out)
    assert main([*argv[:-2], "--backend", "clifix_raise:RaiseRuntime"]) == 1   # raises before any text
    assert capsys.readouterr().out == ""


# --- 6 / 7: --format is shared by bench and generate; bench's text is plain; --warmup's help says >= 0
def test_bench_format_text_is_plain_and_shared(monkeypatch, capsys):
    from parity.bench import runner
    canned = {"kind": "reference", "prefill": [{"tokens": 64, "median_s": 0.5, "tok_per_s": 128.0}]}
    monkeypatch.setattr(runner, "table_rows", lambda results: [["reference CPU", "prefill 64", "128.0 tok/s", ""]])
    monkeypatch.setattr(runner, "run_worker", lambda spec, **k: dict(canned, kind=spec["kind"]))
    base = ["bench", "--backend", "reference", "--no-peer", "--no-extras"]
    assert main(base) == 0  # capsys is a pipe: text is the default
    out = capsys.readouterr().out
    assert "reference CPU  prefill 64" in out and not any(c in out for c in "┏━│└")
    assert main([*base, "--format", "rich"]) == 0
    assert "└" in capsys.readouterr().out
    assert main([*base, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]
    assert main([*base, "--json", "--format", "text"]) == 2


def test_generate_takes_format_json(capsys):
    argv = ["generate", "--backend", "reference", "--prompt", "hi", "--greedy", "--max-new-tokens", "2"]
    assert main([*argv, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*argv, "--format", "text"]) == 0
    with pytest.raises(json.JSONDecodeError):
        json.loads(capsys.readouterr().out)


def test_bench_warmup_help_says_zero_is_allowed(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "-h"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ">= 1" not in help_text and "runs, >= 0" in help_text


# --- 8: logits of the wrong shape contribute no KL figure; the message says which side is which
SHORT = '''
import ml_dtypes
import numpy as np
from parity.backends import ReferenceBackend


class Short(ReferenceBackend):
    """Returns only the first 10 vocabulary entries of every logits row."""

    def prefill(self, h, ids, chunk_size=None):
        return np.asarray(super().prefill(h, ids, chunk_size=chunk_size))[:, :10]

    def decode(self, hs, ids):
        return np.asarray(super().decode(hs, ids))[:, :10]

    def forward_tokens(self, h, ids):
        return np.asarray(super().forward_tokens(h, ids))[:, :10]
'''


def test_wrong_logits_shape_shows_no_kl_figures(tmp_path, monkeypatch, capsys):
    (tmp_path / "clifix_short.py").write_text(SHORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("clifix_short", None)
    rc = main(["parity", "--backend", "clifix_short:Short", "--scenario", "budget", "--level", "ci", "--json",
               "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1
    row = doc["scenarios"][0]
    assert row["status"] == "fail" and row["failed_cases"] == row["cases"] > 0
    assert row["worst_kl"] is None and row["worst_logit_err"] is None  # was 2.58e-12: KL of the rows before
    # nor does the relative error figure the next step quotes: 0 would read as a perfect case
    assert all(f["worst_logit_err_rel"] is None for f in row["failures"]), row["failures"]
    assert doc["next_step"]["worst_logit_err_rel"] is None
    assert "backend returned logits of shape (" in row["detail"] and "= [positions, vocab_size]" in row["detail"]
    from reference.config import load_config
    assert f", {load_config(bundled_model('tiny')).vocab_size}) = [positions, vocab_size]" in row["detail"]
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    text = render_table(ParityReport("clifix_short:Short", "tiny",
                                     [ScenarioRow(**{k: v for k, v in row.items()})]))
    cells = text.splitlines()[2].split()
    assert cells[2] == "-" and cells[3].startswith(("KL<=", "err<=")) and "-" in cells[4:7], text
    from parity.harness.report import next_step_lines
    lines = next_step_lines(ParityReport("clifix_short:Short", "tiny", [ScenarioRow(**{k: v for k, v in row.items()})]))
    assert lines and not any("worst logit err" in ln for ln in lines), lines  # was '(worst logit err 0.00e+00xscale)'


# --- 9 / 10: taps diff summary adds up, names no Python None; the --taps hints
def test_taps_diff_summary_counts_every_tap_and_no_none(tmp_path, capsys):
    from taps.diff import DiffReport, TapResult, render_table, summary_counts
    res = [TapResult("logits", "dense", "diverged", 3, {}, 0, "x"), TapResult("embed", "dense", "agree", 3),
           TapResult("layers.0.a", "dense", "missing-in-b"), TapResult("layers.0.b", "dense", "missing-in-a"),
           TapResult("layers.0.c", "dense", "no-overlap"), TapResult("layers.0.d", "dense", "flip", 3)]
    s = summary_counts(res)
    assert s == ("6 taps, 1 agree, 1 with flips only, 1 diverged, 1 not comparable (no common position), "
                 "1 only in A (missing in B), 1 only in B (missing in A)")
    import io
    buf = io.StringIO()
    rep = DiffReport(a="A", b="B", profile="fp32", results=[res[0]], identity={}, first_divergence="logits",
                     last_agreeing=None)
    render_table(rep, file=buf)
    out = buf.getvalue()
    assert "None" not in out and "FIRST DIVERGENCE: logits (position 0)" in out
    assert "last agreeing tap before it: none" in out


def test_taps_filters_matching_nothing_say_so(tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    a = tmp_path / "A"
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(a), "--layers", "0"]) == 0
    capsys.readouterr()
    assert main(["taps", "diff", str(a), str(a), "--taps", "zzz*"]) == 2
    err = capsys.readouterr().err
    assert "--taps zzz*" in err and "found 0 matching" in err and "after --taps" not in err
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(tmp_path / "B"), "--taps", "nomatch*"]) == 2
    err = capsys.readouterr().err
    assert "qwen4exp taps list tiny" in err and "--model" not in err


# --- 11: help texts list the fixtures that exist; parity -h lists 3 and 128+N; the verdict line's grammar
def test_help_lists_existing_fixtures_and_every_exit_code(capsys):
    from reference.paths import FIXTURES, bundled_fixtures
    names = bundled_fixtures()
    assert {"tiny", "tiny-nvfp4", "tiny-mtp", "tiny-hc3-mtp"} <= set(names)
    assert names == ["tiny", *sorted(d.name for d in FIXTURES.iterdir() if (d / "config.json").exists()
                                     and d.name != "tiny")]
    for verb in (["info"], ["logits"], ["parity"], ["generate"], ["bench"], ["taps", "record"]):
        with pytest.raises(SystemExit):
            main([*verb, "-h"])
        text = " ".join(capsys.readouterr().out.split())
        assert ", ".join(names) in text, verb
    with pytest.raises(SystemExit):
        main(["parity", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3 inconclusive" in text and "128+N" in text and "kv_tokens=N" in text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    fixtures_section = readme.split("## Fixtures", 1)[1]
    for n in ("tiny-nvfp4", "tiny-mtp", "tiny-hc3-mtp"):
        assert f"`{n}`" in fixtures_section


def test_parity_verdict_line_uses_the_current_grammar(capsys):
    from parity.harness.run import _current_spelling
    assert _current_spelling("engine-cpu") == "engine:device=cpu"
    assert _current_spelling("reference-f64") == "reference:dtype=float64"
    assert _current_spelling("t:Mine") == "t:Mine"  # negative control: an outside name is kept
    rc = main(["parity", "--backend", "engine:device=cpu", "--scenario", "budget", "--level", "ci", "--format",
               "text", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "(backend engine:device=cpu," in out and "engine-cpu" not in out


# --- 12: info validates the checkpoint like the other verbs
def _drop_lm_head(tmp_path) -> Path:
    """A copy of fixtures/tiny whose safetensors header no longer lists lm_head.weight (data left in place)."""
    import struct
    dst = tmp_path / "incomplete"
    shutil.copytree(bundled_model("tiny"), dst)
    f = dst / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    del header["lm_head.weight"]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))  # same header length: every data offset stays valid
    f.write_bytes(raw[:8] + new + raw[8 + n:])
    return dst


def test_info_incomplete_checkpoint_is_exit_2_like_logits(tmp_path, capsys):
    ck = _drop_lm_head(tmp_path)
    assert main(["info", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "lm_head.weight" in err and "missing" in err
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2]")
    assert main(["logits", str(ck), "--ids", str(ids), "--out", str(tmp_path / "l.npy")]) == 2
    assert "lm_head.weight" in capsys.readouterr().err
    assert main(["info", "tiny"]) == 0  # negative control
    assert main(["info", str(ck), "--config-only"]) == 0  # config.json only: no weights read


# --- progress, prompt bytes, labels, interrupts, symlinked outputs
def test_generate_progress_off_when_stderr_is_not_a_tty(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    argv = ["generate", "--backend", "reference", "--prompts", str(prompts), "--greedy", "--max-new-tokens", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "it/s" not in err and "tok/s]" not in err and "\r" not in err, err  # no tqdm bar into a pipe / log
    with pytest.raises(SystemExit) as e:
        main(["generate", "--no-progress", "-h"])
    assert e.value.code == 0


def test_bad_prompt_bytes_are_prefixed_with_the_command(capsys):
    import os
    bad = os.fsdecode(b"caf\xe9")  # not UTF-8: Python hands it over as a surrogate escape
    assert main(["generate", "--prompt", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen4exp generate: error: ") and "--prompt" in err


def test_kl_greedy_line_is_labelled_and_perturb_names_the_option(capsys):
    assert main(["kl", "--b", "reference", "--greedy-tokens", "2", "--no-progress", "--format", "text"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "greedy agreement" in ln)
    assert "prompt 0: 2" in line and "of 2 greedy tokens" in line
    assert main(["kl", "--b", "reference", "--perturb", "no.such.weight", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--perturb 'no.such.weight'" in err and "error: perturb:" not in err


KBI = '''
from parity.backends import ReferenceBackend


class RaisesKbi(ReferenceBackend):
    def decode(self, hs, ids):
        raise KeyboardInterrupt("raised by the backend")
'''


def test_keyboardinterrupt_raised_by_backend_is_an_error_row_not_130(tmp_path, monkeypatch, capsys):
    (tmp_path / "clifix_kbi.py").write_text(KBI)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("clifix_kbi", None)
    rc = main(["parity", "--backend", "clifix_kbi:RaisesKbi", "--scenario", "budget", "--level", "ci", "--json",
               "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["scenarios"][0]["status"] == "error"
    assert "KeyboardInterrupt" in doc["scenarios"][0]["detail"]
    # negative control: outside a tracked command (library use) a KeyboardInterrupt still stops the run
    from parity.backends import open_backend
    from parity.harness.scenarios import cases_for
    from parity.harness.scenarios.common import TruthCache
    from parity.harness.scenarios.runner import run_case
    from parity.backends import truth_model
    be = open_backend("clifix_kbi:RaisesKbi", bundled_model("tiny"))
    case = next(c for c in cases_for("budget", be.config, "ci") if "decode" in c.name)
    with pytest.raises(KeyboardInterrupt):
        run_case("budget", case, be, TruthCache(truth_model(bundled_model("tiny"))))


def test_overwrite_on_a_symlinked_out_writes_the_target(tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2]")
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "l.npy"
    target.write_bytes(b"old")
    link = tmp_path / "link.npy"
    link.symlink_to(target)
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(link)]) == 2  # existing: needs --overwrite
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(link), "--overwrite"]) == 0
    assert link.is_symlink() and np.load(target).shape[0] == 2  # the link kept, its target replaced
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["l.npy"]  # no temp file left
