"""``qwen4exp logits``: output equals the reference forward; chunked / last-only / float64 variants; bad
input gives exit code 2 with one clear line; the output file is written atomically."""
from __future__ import annotations

import json

import numpy as np
import pytest

from parity.cli import main
from reference.checkpoint import Checkpoint
from reference.model import ReferenceModel


def test_logits_matches_reference(tiny, tmp_path, capsys):
    ids = [1, 5, 9, 300, 2, 7, 7, 40, 41, 42, 43, 44]
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(ids))
    out = tmp_path / "l.npy"
    assert main(["logits", str(tiny), "--ids", str(f), "--out", str(out)]) == 0
    got = np.load(out)
    want = ReferenceModel(Checkpoint.open(tiny)).forward(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), 512)
    assert np.array_equal(got, want)
    # whitespace/comma separated file, chunked, float64, last only
    g = tmp_path / "ids.txt"
    g.write_text(" ".join(map(str, ids[:6])) + ",\n" + ",".join(map(str, ids[6:])))
    out2 = tmp_path / "l2.npy"
    assert main(["logits", "tiny", "--ids", str(g), "--out", str(out2), "--dtype", "float64", "--chunk-size", "5",
                 "--last-only"]) == 0
    last = np.load(out2)
    assert last.shape == (1, 512) and last.dtype == np.float32
    # float64 vs float32 reference on the same weights: float32 rounding only
    assert np.abs(last[0] - want[-1]).max() <= 1e-4 * np.abs(want).max()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("content,msg", [("", "empty"), ("[]", "empty list"), ("1 2 x", "unparsable"),
                                         ("[1, 99999]", "vocab_size=512"), ("[1.5]", "integers"),
                                         ("[-3]", "vocab_size")])
def test_bad_ids_exit_2(tiny, tmp_path, capsys, content, msg):
    f = tmp_path / "ids.txt"
    f.write_text(content)
    out = tmp_path / "o.npy"
    assert main(["logits", str(tiny), "--ids", str(f), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not out.exists()


def test_missing_ids_file_and_bad_chunk(tiny, tmp_path, capsys):
    assert main(["logits", str(tiny), "--ids", str(tmp_path / "nope"), "--out", str(tmp_path / "o.npy")]) == 2
    assert "no such file" in capsys.readouterr().err
    f = tmp_path / "i.txt"
    f.write_text("1 2 3")
    assert main(["logits", str(tiny), "--ids", str(f), "--out", str(tmp_path / "o.npy"), "--chunk-size", "0"]) == 2
    assert "chunk-size" in capsys.readouterr().err


def test_engine_backend_cpu_matches_reference(tiny, tmp_path):
    """``--backend engine`` goes through the engine API (CPU twin here) and writes the same layout."""
    pytest.importorskip("engine.engine", reason="engine not importable")
    f = tmp_path / "ids.json"
    f.write_text("[1, 2, 3, 500, 7, 9, 100, 200, 300, 301, 302, 303, 304]")
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", str(tiny), "--ids", str(f), "--out", str(a)]) == 0
    assert main(["logits", str(tiny), "--ids", str(f), "--out", str(b), "--backend", "engine", "--device", "cpu",
                 "--precision", "float32"]) == 0
    ra, rb = np.load(a), np.load(b)
    assert ra.shape == rb.shape == (13, 512) and rb.dtype == np.float32
    # float32 engine vs float32 reference: the project's 1e-4 relative logit bound
    assert np.abs(ra - rb).max() <= 1e-4 * np.abs(ra).max()
