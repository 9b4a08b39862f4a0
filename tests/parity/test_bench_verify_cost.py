"""The verify-cost bench: the acceptance-curve arithmetic, and one CPU run on tiny-mtp
(the GPU run at real widths is ci/gpu_bench.sh step 3)."""
from __future__ import annotations

import json

import pytest

from parity.bench import verify_cost as VC


def test_expected_tokens_and_break_even():
    assert VC.expected_tokens(0.0, 3) == 1.0 and VC.expected_tokens(0.5, 2) == 1.75
    assert VC.expected_tokens(0.999999, 4) == pytest.approx(5.0, rel=1e-5)
    # a round costing 1.75 decode steps with k = 2 breaks even at a = 0.5 exactly (1 + a + a^2 = 1.75)
    assert VC.break_even(1.0, 1.75, 2) == pytest.approx(0.5, abs=1e-9)
    assert VC.break_even(1.0, 0.9, 3) == 0.0      # cheaper than one decode step: wins at a = 0
    assert VC.break_even(1.0, 10.0, 3) is None     # 4 tokens per round at most: never
    cur = VC.speedup_curve(2.0, 3.0, 2, alphas=(0.0, 0.5))
    assert cur[0]["speedup"] == pytest.approx(2 / 3) and cur[1]["speedup"] == pytest.approx(1.75 * 2 / 3)


def test_cpu_run_on_the_mtp_fixture(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert VC.main(["tiny-mtp", "--device", "cpu", "--context", "20", "--widths", "1,3", "--repeats", "1",
                    "--warmup", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["width"] for r in res["rows"]] == [1, 3] and res["decode_s"] > 0
    r3 = res["rows"][1]
    assert r3["draft_k"] == 2 and r3["round_s"] == pytest.approx(r3["draft_s"] + r3["verify_s"])
    assert len(r3["curve"]) == len(VC.ALPHAS)
    assert "break-even" in capsys.readouterr().out
    assert VC.main(["tiny", "--device", "cpu"]) == 2  # no MTP head: one line, exit 2
    assert "MTP head" in capsys.readouterr().err
