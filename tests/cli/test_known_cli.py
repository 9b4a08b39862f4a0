"""``qwen4exp parity --known / --write-known`` on the command line: a baseline of noise at one position
must not excuse a wrong argmax at another, the verdict line of an excused run, baselines of another model or backend (exit 2), and the output rules every output
path follows (``parity.cli.common.check_out``: no overwrite without --overwrite, no missing folder created,
a symbolic link's target folder checked too)."""
from __future__ import annotations

import json
import os

import pytest

from known_fakes import Faulty
from parity.cli import main
from reference.paths import bundled_model

TINY = str(bundled_model("tiny"))
SPEC = "known_fakes:Faulty"


def _run(capsys, monkeypatch, *args, noise=None, flip=(), fmt="--json"):
    monkeypatch.setattr(Faulty, "noise", dict(noise or {}))
    monkeypatch.setattr(Faulty, "flip", tuple(flip))
    rc = main(["parity", TINY, "--backend", SPEC, "--scenario", "budget", "--level", "ci", "--no-progress",
               *([fmt] if fmt == "--json" else ["--format", fmt]), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


@pytest.mark.slow  # four parity runs of the budget suite (~18 s)
def test_known_noise_baseline_does_not_excuse_a_wrong_argmax_elsewhere(tmp_path, capsys, monkeypatch):
    """The tester's repro, same backend spec (the engine after a code change): a baseline written for noise at
    position 5 must FAIL a wrong argmax at position 7 (before: 'PASS', exit 0); a larger noise at 5 FAILs; the
    same fault again PASSes with its known count in the verdict line (exit 0, as an xfail list)."""
    k = tmp_path / "known.json"
    rc, out, _ = _run(capsys, monkeypatch, "--write-known", str(k), noise={5: 1e-3})
    assert rc == 1 and json.loads(out)["verdict"] == "fail"
    base = json.loads(k.read_text())
    assert base["backend_spec"] == SPEC and base["model"]["weights_fingerprint"] and base["tol_rel"] > 0
    assert all(list(c["positions"]) == ["position 5"] and c["worst_logit_err_rel"] > 0 for c in base["causes"])

    rc, out, _ = _run(capsys, monkeypatch, "--known", str(k), flip=(7,))
    doc = json.loads(out)
    assert rc == 1 and doc["verdict"] == "fail" and doc["known_cases"] == 0
    notes = [c.get("known_note") or "" for c in doc["root_causes"]]
    assert notes and all("new failing position(s) position 7" in n for n in notes), notes

    rc, out, _ = _run(capsys, monkeypatch, "--known", str(k), noise={5: 3e-3})
    doc = json.loads(out)
    assert rc == 1 and doc["known_cases"] == 0
    assert all("larger than the known one" in (c.get("known_note") or "") for c in doc["root_causes"])

    rc, out, _ = _run(capsys, monkeypatch, "--known", str(k), noise={5: 1e-3}, fmt="text")
    n = sum(len(c["cases"]) for c in base["causes"])
    assert rc == 0 and f"verdict: PASS (with {n} known divergences excused by --known)" in out, out
    assert f"({n} known)" in out


def test_known_baseline_of_another_model_or_backend_is_exit_2(tmp_path, capsys):
    """A baseline written on tiny is refused on tiny-hc2, naming both models; one of another --backend is
    refused naming both specs; both before anything runs."""
    from parity.harness.causes import model_identity, write_known
    k = write_known(tmp_path / "k.json", [], {"model": {**model_identity(TINY), "path": TINY}, "backend_spec": SPEC})
    other = str(bundled_model("tiny-hc2"))
    rc = main(["parity", other, "--backend", SPEC, "--known", str(k), "--no-progress"])
    err = capsys.readouterr().err
    want = model_identity(other)
    assert rc == 2 and "another model" in err and TINY in err and want["config_hash"] in err, err
    assert json.loads(k.read_text())["model"]["config_hash"] in err
    rc = main(["parity", TINY, "--backend", "reference", "--known", str(k), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "'reference'" in err and repr(SPEC) in err, err


def test_write_known_follows_the_output_rules(tmp_path, capsys):
    """--write-known: an existing file needs --overwrite (left untouched), a missing folder is exit 2 naming it
    and is not created -- checked before the run."""
    old = tmp_path / "known.json"
    old.write_text("mine")
    rc = main(["parity", TINY, "--backend", SPEC, "--write-known", str(old), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--write-known" in err and "--overwrite" in err and old.read_text() == "mine", err
    missing = tmp_path / "nonexist" / "k.json"
    rc = main(["parity", TINY, "--backend", SPEC, "--write-known", str(missing), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and str(missing.parent) in err and not missing.parent.exists(), err


def test_logits_out_dangling_symlink_creates_no_folder(tmp_path, capsys):
    """``logits --out LINK`` where LINK points into a missing folder: exit 2 naming that folder, nothing created
    (before: the target's folders were made and the file written there)."""
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    link = tmp_path / "dangling.npy"
    target = tmp_path / "nonexist" / "deep" / "zz.npy"
    os.symlink(target, link)
    rc = main(["logits", TINY, "--ids", str(ids), "--out", str(link)])
    err = capsys.readouterr().err
    assert rc == 2 and str(target.parent) in err and "symbolic link" in err, err
    assert not (tmp_path / "nonexist").exists() and link.is_symlink()
    target.parent.mkdir(parents=True)   # the same link with its folder present: written through to the target
    assert main(["logits", TINY, "--ids", str(ids), "--out", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and target.is_file()


def test_known_baseline_of_other_prompts_is_exit_2(tmp_path, capsys):
    """A baseline written with --prompts p1 must not excuse a divergence on p2 (other ids, same length), whose
    "prompt I position P" places name other tokens: refused (exit 2, naming both prompt sets); the same prompts
    are accepted (the run goes on: not exit 2)."""
    from parity.harness.causes import model_identity, prompts_identity, write_known
    p1, p2 = tmp_path / "p1.json", tmp_path / "p2.json"
    p1.write_text(json.dumps([[1, 2, 3, 4, 5, 6]]))
    p2.write_text(json.dumps([[7, 8, 9, 10, 11, 12]]))
    k = write_known(tmp_path / "k.json", [], {"model": {**model_identity(TINY), "path": TINY}, "backend_spec": "reference",
                                               "prompts": prompts_identity([[1, 2, 3, 4, 5, 6]])})
    rc = main(["parity", TINY, "--backend", "reference", "--scenario", "kl", "--prompts", str(p2), "--known", str(k),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "other prompts" in err and "this run's kl prompts" in err, err
    rc = main(["parity", TINY, "--backend", "reference", "--scenario", "kl", "--prompts", str(p1), "--known", str(k),
               "--no-progress"])
    assert rc != 2, capsys.readouterr().err
    # a baseline that recorded no prompts (written before this check) cannot be matched either
    k0 = write_known(tmp_path / "k0.json", [], {"model": {**model_identity(TINY), "path": TINY},
                                                 "backend_spec": "reference"})
    rc = main(["parity", TINY, "--backend", "reference", "--scenario", "kl", "--prompts", str(p1), "--known", str(k0),
               "--no-progress"])
    assert rc == 2 and "unrecorded prompts" in capsys.readouterr().err


@pytest.mark.parametrize("fresh", [True, False])
def test_write_known_onto_the_out_report_is_refused(tmp_path, capsys, fresh):
    """``--write-known DIR/report.json --out DIR``: the baseline and the report would replace one another (the
    report was lost, exit 0); refused before anything runs, exit 2, naming both flags; nothing written."""
    from fixture_helpers import one_line_error
    d = tmp_path / "res"
    d.mkdir()
    if not fresh:   # an earlier run's results, replaced with --overwrite
        (d / "report.json").write_text("{}")
    rc = main(["parity", TINY, "--backend", "reference", "--scenario", "kl", "--level", "ci", "--no-progress",
               "--out", str(d), "--write-known", str(d / "report.json"), *([] if fresh else ["--overwrite"])])
    assert rc == 2
    one_line_error(capsys, "--write-known", "--out")
    assert list(d.iterdir()) == [] if fresh else (d / "report.json").read_text() == "{}"
    # negative control: a baseline beside the results directory is another file
    from parity.cli.common import check_distinct_outputs
    check_distinct_outputs(("--out", d / "report.json"), ("--write-known", tmp_path / "known.json"))


@pytest.mark.parametrize("inside", [False, True])
def test_write_known_at_or_in_the_out_taps_folder_is_refused(tmp_path, capsys, monkeypatch, inside):
    """``--write-known DIR/taps --out DIR``: on a failing run DIR/taps became the tap archives' folder and the
    baseline then met a directory after the run (exit 4, no verdict printed); inside an earlier run's DIR/taps
    the folder is replaced under it. Refused before anything runs, exit 2, naming both flags; nothing written."""
    import parity.harness.run as P
    from fixture_helpers import one_line_error
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: pytest.fail("ran with --write-known in --out's taps/"))
    d = tmp_path / "res"
    d.mkdir()
    known = d / "taps"
    if inside:   # an earlier failing run's results: DIR/taps is a folder, replaced with --overwrite
        known.mkdir()
        (d / "report.json").write_text("{}")
        known = known / "known.json"
    rc = main(["parity", TINY, "--backend", "reference", "--scenario", "kl", "--level", "ci", "--no-progress",
               "--out", str(d), "--write-known", str(known), *(["--overwrite"] if inside else [])])
    assert rc == 2
    one_line_error(capsys, "--write-known", "--out", "taps")
    assert not known.exists()
    assert sorted(p.name for p in d.iterdir()) == (["report.json", "taps"] if inside else [])
    # negative control: a baseline beside the results directory, or named like the folder elsewhere, is fine
    from parity.cli.common import check_distinct_outputs
    for fine in (tmp_path / "known.json", d / "taps.json"):
        check_distinct_outputs(("--out", d / "report.json"), ("--out", d / "taps", "dir"), ("--write-known", fine))


@pytest.mark.parametrize("content,found", [(None, "found no such file"), ("{not json", "found invalid JSON"),
                                           ('{"a": 1}', "found dict with keys ['a']")])
def test_known_file_missing_or_not_a_baseline_is_one_line_exit_2(tmp_path, capsys, content, found):
    """--known names the file, what it expected (a baseline written by --write-known) and what it found; nothing
    runs (exit 2 before the floor)."""
    k = tmp_path / "known.json"
    if content is not None:
        k.write_text(content)
    rc = main(["parity", TINY, "--backend", "reference", "--known", str(k), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--known {str(k)!r}: expected a" in err and "--write-known" in err and found in err, err
