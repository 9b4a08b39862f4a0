"""Every long verb (parity, taps record, kl, bench, logits) is killed by SIGTERM, SIGINT or
SIGHUP at a seeded random moment while it replaces an existing output with ``--overwrite``; afterwards the
output is either the old one, untouched, or the complete new one -- never a mix, never empty, and no
temporary file or folder is left beside it. Each verb also runs once to completion (the negative control:
the checks below do recognise a new output).

What it guards: SIGTERM must unwind (no ``OUT.tmp-XXXX`` beside ``taps record``'s output, no ``taps/`` without
``report.json`` under ``parity --out``) and ``--overwrite`` must not delete the old results before the run
has finished.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
OLD = b"OLD RESULTS\n"
# temp names our writers use: atomic_open (.NAME.XXXX.tmp), atomic_dir / archives (NAME.tmp-XXXX, .NAME.old),
# the staged --out directory (.partial-XXXX, .NAME.partial-XXXX)
TEMP_MARKS = (".tmp", ".partial-", ".old")


def _cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    return subprocess.Popen([sys.executable, "-m", "parity.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _leftovers(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if any(m in p.name for m in TEMP_MARKS))


def _ids(d: Path) -> Path:
    f = d / "ids.txt"
    f.write_text(" ".join(str((7 * i) % 500) for i in range(48)))
    return f


# verb -> (arguments given the work dir, the output path, how to make the old output, is-new check)
def _parity(d):
    out = d / "p"
    return (["parity", "--backend", "reference", "--scenario", "kl", "--no-progress", "--out", str(out),
             "--overwrite"], out)


def _make_old_dir(out: Path):
    out.mkdir()
    (out / "report.json").write_bytes(OLD)
    (out / "taps").mkdir()
    (out / "taps" / "old-case.txt").write_bytes(OLD)
    (out / "mine.txt").write_bytes(OLD)  # not ours: left alone whatever happens


def _parity_state(out: Path) -> str:
    assert (out / "mine.txt").read_bytes() == OLD, "a file that is not ours was touched"
    rj = (out / "report.json").read_bytes()
    if rj == OLD:
        assert (out / "taps" / "old-case.txt").read_bytes() == OLD, "old report next to new (or no) archives"
        return "old"
    doc = json.loads(rj)
    assert doc["verdict"] == "pass", doc
    assert not (out / "taps" / "old-case.txt").exists(), "new report next to the old run's archives"
    return "new"


def _record(d):
    out = d / "t.taps"
    return (["taps", "record", "tiny", "--ids", str(_ids(d)), "--out", str(out), "--overwrite"], out)


def _record_state(out: Path) -> str:
    files = sorted(p.name for p in out.iterdir())
    if files == ["old.txt"]:
        assert (out / "old.txt").read_bytes() == OLD
        return "old"
    assert "old.txt" not in files and "manifest.json" in files, files
    from taps.archive import Archive
    assert Archive.open(out).names(), "an archive without taps"
    return "new"


def _make_old_record(out: Path):
    out.mkdir()
    (out / "old.txt").write_bytes(OLD)


def _kl(d):
    out = d / "kl.json"
    return (["kl", "--b", "reference", "--no-progress", "--greedy-tokens", "2", "--out", str(out), "--overwrite"], out)


def _json_state(out: Path) -> str:
    b = out.read_bytes()
    if b == OLD:
        return "old"
    json.loads(b)
    return "new"


def _bench(d):
    out = d / "bench.json"
    return (["bench", "--backend", "reference", "--no-peer", "--no-extras", "--repeats", "1", "--out", str(out),
             "--overwrite"], out)


def _logits(d):
    out = d / "l.npy"
    return (["logits", "tiny", "--ids", str(_ids(d)), "--out", str(out), "--overwrite"], out)


def _npy_state(out: Path) -> str:
    b = out.read_bytes()
    if b == OLD:
        return "old"
    assert np.load(out).shape == (48, 512)
    return "new"


VERBS = {
    "parity": (_parity, _make_old_dir, _parity_state),
    "taps-record": (_record, _make_old_record, _record_state),
    "kl": (_kl, lambda o: o.write_bytes(OLD), _json_state),
    "bench": (_bench, lambda o: o.write_bytes(OLD), _json_state),
    "logits": (_logits, lambda o: o.write_bytes(OLD), _npy_state),
}
# one signal per verb (all three catchable ones are covered); the kill moment is drawn from a fixed seed,
# as a fraction of the verb's measured run time, so every run of this test kills at the same points
SIGNALS = {"parity": signal.SIGTERM, "taps-record": signal.SIGTERM, "kl": signal.SIGHUP, "bench": signal.SIGINT,
           "logits": signal.SIGHUP}


@pytest.mark.parametrize("verb", list(VERBS))
def test_killed_verb_leaves_old_or_new_output_never_a_mix(verb, tmp_path):
    make_args, make_old, state = VERBS[verb]
    # negative control: an uninterrupted run replaces the old output, and the checks see it as new
    d0 = tmp_path / "full"
    d0.mkdir()
    args, out = make_args(d0)
    make_old(out)
    t0 = time.monotonic()
    p = _cli(args, REPO)
    _, err = p.communicate(timeout=300)
    runtime = time.monotonic() - t0
    assert p.returncode == 0, err.decode()
    assert state(out) == "new" and not _leftovers(d0)
    rng = np.random.default_rng(sorted(VERBS).index(verb))  # fixed seed per verb
    outcomes = []
    for k, frac in enumerate(rng.uniform(0.15, 0.95, size=2)):
        d = tmp_path / f"kill{k}"
        d.mkdir()
        args, out = make_args(d)
        make_old(out)
        p = _cli(args, REPO)
        time.sleep(frac * runtime)
        p.send_signal(SIGNALS[verb])
        try:
            _, err = p.communicate(timeout=60)  # bounded: the verb must unwind promptly
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail(f"{verb} did not stop within 60 s of signal {SIGNALS[verb]}")
        outcomes.append(state(out))
        assert not _leftovers(d), (verb, frac, _leftovers(d), err.decode()[-500:])
        assert b"Traceback" not in err, err.decode()[-2000:]
        if outcomes[-1] == "old":  # stopped by the signal: the documented 128 + N (or killed before Python's handler)
            assert p.returncode in (128 + SIGNALS[verb], -SIGNALS[verb], 130 if SIGNALS[verb] == signal.SIGINT
                                    else 128 + SIGNALS[verb]), (p.returncode, err.decode()[-500:])
