"""``qwen4exp logits``: float32 logits of token ids on the reference or the engine -- ids files (and
pipes), the backend grammar and precisions, the one --out rule (``-`` = stdout)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixture_helpers import one_line_error
from parity.cli import main
from reference.checkpoint import Checkpoint
from reference.model import ReferenceModel
from reference.paths import FIXTURES


REPO = Path(__file__).resolve().parents[2]

def _ids(tmp_path, n=12) -> Path:
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(str((5 * i) % 500) for i in range(n)))
    return f

def ids_file(tmp_path, content="1 2 3 4 5 6", name="ids.txt"):
    f = tmp_path / name
    f.write_text(content)
    return f

needs_tiny = pytest.mark.skipif(not (FIXTURES / "tiny" / "config.json").exists(), reason="fixtures/tiny not built")


def test_logits_out_directory_is_exit_2(tiny, tmp_path, capsys, monkeypatch):
    import parity.harness.logits as L
    monkeypatch.setattr(L, "compute_logits", lambda *a, **k: pytest.fail("computed before checking --out"))
    d = tmp_path / "nu"
    d.mkdir()
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path)), "--out", str(d)]) == 2
    one_line_error(capsys, "--out", "found a directory")


@pytest.mark.parametrize("content,needles", [
    ("99999999999999999999999", ["vocab_size=512", "99999999999999999999999"]),
    ("1,2,,3", ["empty item", "item 2"]),
])
def test_logits_bad_ids_exit_2(tiny, tmp_path, capsys, content, needles):
    out = tmp_path / "o.npy"
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path, content)), "--out", str(out)]) == 2
    one_line_error(capsys, "--ids", *needles)
    assert not out.exists()


def test_logits_reads_npy_ids(tiny, tmp_path, capsys):
    ids = np.array([1, 5, 9, 300, 2], dtype=np.int32)
    f = tmp_path / "ids.npy"
    np.save(f, ids)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(a)]) == 0
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path, "1 5 9 300 2")), "--out", str(b)]) == 0
    assert np.array_equal(np.load(a), np.load(b)) and np.load(a).shape == (5, 512)


def test_logits_help_says_ids_is_a_file(capsys):
    with pytest.raises(SystemExit):
        main(["logits", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a FILE holding token ids" in out and ".npy" in out


def test_logits_bf16_with_reference_is_exit_2(tiny, tmp_path, capsys):
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path)), "--out", str(tmp_path / "o.npy"),
                 "--precision", "bf16"]) == 2
    one_line_error(capsys, "--precision bf16", "reference")


def test_logits_engine_bf16_notes_bf16_exact_weights(tiny, tmp_path, capsys):
    pytest.importorskip("engine.engine", reason="engine not importable")
    from reference.checkpoint import Checkpoint
    from parity.harness.logits import weights_bf16_exact
    assert weights_bf16_exact(Checkpoint.open(tiny))  # tiny is stored in BF16
    f = ids_file(tmp_path)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(a), "--backend", "engine:device=cpu,precision=bf16"]) == 0
    err = capsys.readouterr().err
    assert "stored in BF16 already" in err and err.count("note:") == 1
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(b), "--backend", "engine", "--device", "cpu",
                 "--precision", "float32"]) == 0
    assert "BF16" not in capsys.readouterr().err
    # the notice states a fact: numerics are unchanged, so the two outputs are identical
    assert np.array_equal(np.load(a), np.load(b))


def test_bf16_exact_is_false_for_float32_weights(tmp_path):
    from parity.harness.logits import weights_bf16_exact

    class Ck:
        def __init__(self, dts):
            self.d = dts

        def names(self):
            return list(self.d)

        def dtype(self, n):
            return self.d[n]
    assert weights_bf16_exact(Ck({"a": "BF16", "b": "I64"}))
    assert not weights_bf16_exact(Ck({"a": "BF16", "b": "F32"}))
    assert not weights_bf16_exact(Ck({"a": "F8_E4M3", "a_scale_inv": "F32"}))


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


def test_logits_full_disk_is_one_line_exit_4(tmp_path, capsys, monkeypatch):
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3")

    def short_write(fh, arr, **k):  # what numpy raises on a full disk: an OSError without errno
        fh.write(b"\x93NUMPY")
        raise OSError("153600 requested and 16352 written")
    monkeypatch.setattr(np, "save", short_write)
    out = tmp_path / "o.npy"
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(out)]) == 4  # EXIT_ENVIRONMENT (a full disk is not the divergence code)
    one_line_error(capsys, "o.npy", "could not be written", "153600")
    assert list(tmp_path.iterdir()) == [f], "a temp file or partial output was left"
    monkeypatch.undo()  # negative control: the same command writes when the disk has room
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(out)]) == 0
    assert np.load(out).shape[0] == 3


def test_logits_and_taps_refuse_ids_beyond_max_positions(tmp_path, capsys, monkeypatch):
    import parity.harness.logits as L
    monkeypatch.setattr(L, "compute_logits", lambda *a, **k: pytest.fail("computed before the length check"))
    f = tmp_path / "ids32769.txt"
    f.write_text(" ".join(["1"] * 32769))
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(tmp_path / "o.npy")]) == 2
    one_line_error(capsys, "--ids", "max_position_embeddings=32768", "32769")
    assert main(["taps", "record", "tiny", "--ids", str(f), "--out", str(tmp_path / "t.taps")]) == 2
    one_line_error(capsys, "max_position_embeddings=32768", "32769")
    assert not (tmp_path / "o.npy").exists() and not (tmp_path / "t.taps").exists()
    from reference.session import check_length
    check_length(32768, 32768)  # negative control: exactly max_position_embeddings ids are allowed
    from reference.errors import InputError
    with pytest.raises(InputError):
        check_length(32769, 32768)


def test_two_d_npy_ids_refused(tmp_path):
    from reference.errors import InputError
    from reference.ids_file import read_ids_file
    p = tmp_path / "ids.npy"
    np.save(p, np.arange(6).reshape(2, 3))
    with pytest.raises(InputError, match=r"1-D .*2-D array of shape \[2, 3\]"):
        read_ids_file(p)
    np.save(p, np.arange(6))  # negative control
    assert read_ids_file(p).tolist() == list(range(6))


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
                                         ("[2, true]", "True at item 1"), ('{"idz": [1]}', "keys ['idz']"),
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


def test_logits_out_dash_is_stdout(tmp_path):
    """`logits --out -` writes to stdout, not a file named `-`."""
    ids = _ids(tmp_path)
    dash = REPO / "-"
    assert not dash.exists()
    try:
        p = subprocess.run([sys.executable, "-m", "parity.cli", "logits", "tiny", "--ids", str(ids), "--out", "-"],
                           cwd=REPO, capture_output=True, timeout=120)
        assert p.returncode == 0, p.stderr
        import io
        assert np.load(io.BytesIO(p.stdout)).shape == (12, 512)
        assert not dash.exists(), "--out - wrote a file named '-'"
    finally:
        dash.unlink(missing_ok=True)


def test_logits_out_parent_must_exist_and_existing_needs_overwrite(tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 5 9 2")
    missing = tmp_path / "nonexist" / "l.npy"
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(missing)]) == 2
    assert "parent directory" in capsys.readouterr().err and not missing.parent.exists()
    out = tmp_path / "l.npy"
    out.write_bytes(b"old")
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_bytes() == b"old"
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(out), "--overwrite"]) == 0
    assert np.load(out).shape[0] == 4


def test_logits_of_the_wrong_shape_from_a_backend_are_refused(tmp_path, capsys, monkeypatch):
    """A module:Class backend whose prefill returns logits of another shape ([T, V-1], or transposed) is one
    ERROR line naming the backend, the expected and the found shape, exit 1, and nothing is written -- not a
    file of that shape with exit 0 (the file is [T, vocab_size] by contract)."""
    (tmp_path / "shapebe.py").write_text(
        "import numpy as np\n"
        "from parity.backends.reference import ReferenceBackend\n"
        "class Cut(ReferenceBackend):\n"
        "    def prefill(self, h, ids, chunk_size=None):\n"
        "        return np.asarray(super().prefill(h, ids, chunk_size=chunk_size))[:, :-1]\n"
        "class Turned(ReferenceBackend):\n"
        "    def prefill(self, h, ids, chunk_size=None):\n"
        "        return np.asarray(super().prefill(h, ids, chunk_size=chunk_size)).T.copy()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ids = ids_file(tmp_path)
    V = Checkpoint.open(FIXTURES / "tiny").config.vocab_size
    for cls, found in (("Cut", [6, V - 1]), ("Turned", [V, 6])):
        out = tmp_path / f"{cls}.npy"
        assert main(["logits", "tiny", "--ids", str(ids), "--out", str(out), "--backend", f"shapebe:{cls}"]) == 1
        one_line_error(capsys, f"shapebe:{cls}", f"expected logits of shape [6, {V}]", f"found {found}")
        assert not out.exists()
    out = tmp_path / "ok.npy"  # negative control: the same backend's correct logits are written
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(out), "--backend", "shapebe:ReferenceBackend"]) == 0
    assert np.load(out).shape == (6, V)
