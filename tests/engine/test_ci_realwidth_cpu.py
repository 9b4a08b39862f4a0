"""ci/gpu_realwidth.sh on the CPU: the prompts file it writes is the --prompts format the harness reads, the two
backend runs, one after the other, print their verdicts into the summary and the second reads the floor the first
measured (QWEN4EXP_FLOOR_CACHE), and a run its budget kills is a TIMEOUT that fails the step (never a PASS). The real-width model and CUDA backends are replaced through REALWIDTH_MODEL /
REALWIDTH_BACKENDS; on the GPU machine ci/gpu runs it as written."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "gpu_realwidth.sh"


def _run(tmp_path, budget: int, lengths: str = "7 20"):
    env = {**os.environ, "OUT": str(tmp_path), "REALWIDTH_MODEL": "tiny", "REALWIDTH_LENGTHS": lengths,
           "REALWIDTH_BACKENDS": "reference engine:device=cpu,precision=float32", "REALWIDTH_BUDGET_S": str(budget)}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert subprocess.run(["bash", "-n", str(ROOT / "ci" / "gpu")], capture_output=True).returncode == 0


@pytest.mark.slow
def test_verdicts_of_both_runs_in_the_summary(tmp_path, request):
    # ~25 s on 2 shared cores (two parity runs on tiny): with the slow tests only
    if "slow" not in (request.config.option.markexpr or "") and not os.environ.get("QWEN4EXP_RUN_SLOW"):
        pytest.skip("slow: run with -m slow or QWEN4EXP_RUN_SLOW=1")
    r = _run(tmp_path, budget=800, lengths="7 20 bound")
    summary = (tmp_path / "realwidth_summary.txt").read_text()
    assert r.returncode == 0, r.stdout + r.stderr
    prompts = json.loads((tmp_path / "realwidth" / "prompts.json").read_text())
    from parity.backends import load_weights
    from parity.harness.floor import floor_prompts
    from reference.paths import resolve_model
    stream = floor_prompts(load_weights(resolve_model("tiny")).config, None)[-1]
    assert [len(p) for p in prompts[:2]] == [7, 20] and prompts[2] == stream   # "bound": the floor's own stream
    assert summary.count("verdict: PASS") == 2, summary
    for name in ("kl", "budget"):
        assert summary.count(f"    {name} ") == 2, summary
    # one floor measurement for both: the first run measured and kept it, the second read that entry
    src = [json.loads((tmp_path / "realwidth" / str(i) / "report.json").read_text())["meta"]["floor"]["source"]
           for i in (0, 1)]
    assert src[0].startswith("measured, kept in") and src[1].startswith("read from"), src
    assert src[0].split("kept in ")[1] == src[1].split("read from ")[1]
    # the stream, a KL prompt too, is measured once: the floor's positions are the three prompts', no more
    positions = json.loads((tmp_path / "realwidth" / "0" / "report.json").read_text())["meta"]["floor"]["positions"]
    assert positions == 7 + 20 + len(stream)


def test_a_run_killed_by_the_budget_is_a_timeout_and_fails(tmp_path):
    # negative control: a budget far below a run's cost must never read as a verdict, let alone a PASS
    r = _run(tmp_path, budget=1)   # the first run alone may finish a tiny model in 3 s
    summary = (tmp_path / "realwidth_summary.txt").read_text()
    assert r.returncode == 1
    assert summary.count("TIMEOUT") == 2 and "PASS" not in summary, summary
