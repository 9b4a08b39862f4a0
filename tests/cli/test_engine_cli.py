"""``qwen4exp logits MODEL --backend engine`` on the CPU path (the GPU path runs in ci/gpu via the same code).

Compared with ``--backend reference`` at 1e-4 relative (float32 acceptance; measured ~1e-6).
Negative control: an out-of-vocabulary id is refused with exit code 2 and one clear message.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference.paths import FIXTURES

needs_tiny = pytest.mark.skipif(not (FIXTURES / "tiny" / "config.json").exists(), reason="fixtures/tiny not built")


@needs_tiny
def test_logits_engine_backend_matches_reference(tmp_path):
    from parity.cli import main
    ids = tmp_path / "ids.json"
    ids.write_text("[3, 17, 440, 5, 9, 101, 7, 7, 300]")
    e, r = tmp_path / "e.npy", tmp_path / "r.npy"
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(e), "--backend", "engine", "--device", "cpu"]) == 0
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(r), "--backend", "reference"]) == 0
    a, b = np.load(e), np.load(r)
    assert a.shape == b.shape == (9, 512)
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-4


@needs_tiny
def test_logits_engine_backend_bad_id_is_a_clear_error(tmp_path, capsys):
    from parity.cli import main
    ids = tmp_path / "ids.json"
    ids.write_text("[3, 99999]")
    rc = main(["logits", "tiny", "--ids", str(ids), "--out", str(tmp_path / "x.npy"), "--backend", "engine:device=cpu"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "99999" in err and err.count("\n") == 1
    assert not (tmp_path / "x.npy").exists()
