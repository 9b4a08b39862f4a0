"""``parity --out``: when report.json cannot be written (a disk that filled up), the verdict is still printed,
the error names report.json at its place in --out (not the hidden staging directory, which is gone), nothing
is swapped in, and the exit code is 4."""
from __future__ import annotations

import errno

import parity.harness.report as report_mod
from parity.cli import main
import pytest

from reference.atomic import write_failed


@pytest.fixture
def full_disk(monkeypatch):
    """Every report / index write fails as on a full disk."""
    def write(path, doc, *a, **k):
        raise write_failed(path, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(report_mod, "write_json_atomic", write)


def test_a_report_that_cannot_be_written_is_exit_4_with_the_verdict_printed(tmp_path, full_disk, capsys):
    out = tmp_path / "res"
    rc = main(["parity", "tiny", "--backend", "reference", "--scenario", "kl", "--level", "ci", "--no-progress",
               "--format", "text", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 4
    assert "verdict: PASS" in cap.out
    assert f"output {str(out / 'report.json')!r} could not be written: No space left on device" in cap.err
    assert ".partial-" not in cap.err and "exit 4" in cap.err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_several_backends_whose_reports_cannot_be_written_are_exit_4_with_the_verdicts_printed(
        tmp_path, full_disk, capsys):
    out = tmp_path / "res"
    rc = main(["parity", "tiny", "--backend", "reference", "--backend", "reference:dtype=float64", "--scenario",
               "kl", "--level", "ci", "--no-progress", "--format", "text", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 4
    assert "verdict over 2 backends: exit 0" in cap.out
    assert f"output {str(out / '0' / 'report.json')!r} could not be written: No space left on device" in cap.err
    assert ".partial-" not in cap.err and "exit 4" in cap.err
    assert not out.exists() and list(tmp_path.iterdir()) == []
