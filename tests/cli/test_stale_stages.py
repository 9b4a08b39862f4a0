"""A run killed outright (SIGKILL, or an outside engine aborting the process: no handler runs) leaves its staged
``--out`` directory behind; the next run on the same ``--out`` removes it -- and only such leftovers: a live
run's stage, another host's and unrelated names stay."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from parity.cli.common import _stage_owner, remove_stale_stages, staged_dir

REPO = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_run_removes_the_stage_a_killed_parity_run_left(tmp_path):
    out = tmp_path / "res"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "parity.cli", "parity", "tiny", "--backend", "reference",
                          "--scenario", "kl", "--no-progress", "--out", str(out)], cwd=tmp_path, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob(".res.partial-*")) and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        left = list(tmp_path.glob(".res.partial-*"))
        assert left, "the run never staged its output (or finished before it could be killed)"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    # the negative control: SIGKILL runs no cleanup, so the stage is there, named by this host and that pid
    left = list(tmp_path.glob(".res.partial-*"))
    assert [d.name.split("-")[-2] for d in left] == [str(p.pid)]
    with staged_dir(out, ("report.json",)) as stage:
        (stage / "report.json").write_text("{}")
    assert not list(tmp_path.glob(".res.partial-*")), "the killed run's stage survived the next run"
    assert (out / "report.json").read_text() == "{}"


def test_only_dead_processes_of_this_host_lose_their_stage(tmp_path):
    owner = _stage_owner()
    host = owner.rsplit("-", 1)[0]
    dead = tmp_path / f".res.partial-{host}-{_dead_pid()}-abc"
    live = tmp_path / f".res.partial-{host}-{os.getppid()}-def"        # a live process: a run in progress
    other_host = tmp_path / f".res.partial-{host}x-{_dead_pid()}-ghi"  # another machine on a shared disk
    other_out = tmp_path / f".other.partial-{host}-{_dead_pid()}-jkl"  # another --out's stage
    old_style = tmp_path / ".res.partial-q1w2e3"                       # no owner in the name: unknown, kept
    for d in (dead, live, other_host, other_out, old_style):
        d.mkdir()
        (d / "report.json").write_text("x")
    removed = remove_stale_stages(tmp_path, ".res.partial-")
    assert removed == [dead]
    assert not dead.exists()
    assert all(d.is_dir() for d in (live, other_host, other_out, old_style))
