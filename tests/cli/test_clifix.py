"""Findings of a user trying to break the ``qwen4exp`` CLI: each test fails on the code before its fix."""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from parity.cli import main
from reference.paths import bundled_model


def _nan_lm_head(tmp_path) -> Path:
    """A copy of fixtures/tiny whose every lm_head.weight value is the BF16 NaN 0x7fc0."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file
    dst = tmp_path / "nan"
    shutil.copytree(bundled_model("tiny"), dst)
    f = dst / "model.safetensors"
    d = load_file(str(f))
    w = d["lm_head.weight"]
    d["lm_head.weight"] = torch.full(w.shape, 0x7FC0, dtype=torch.int16).view(torch.bfloat16)
    save_file(d, str(f), metadata={"format": "pt"})
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
