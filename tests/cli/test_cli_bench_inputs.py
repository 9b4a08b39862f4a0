"""Bad bench arguments get one clear error before anything runs or is written; `taps list | head` is not an
error; a synthetic checkpoint that cannot fit the disk is refused before writing (fresh-eyes findings)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.cli import main
from fixture_helpers import one_line_error as _one_line_error

REPO_ROOT = Path(__file__).resolve().parents[2]




@pytest.mark.parametrize("argv, needles", [
    (["bench", "--precision", "fp4", "--backend", "engine", "--device", "cpu"], ["--precision", "fp4", "bf16"]),
    (["bench", "--backend", "reference", "--precision", "bf16"], ["--precision", "engine"]),
    (["bench", "--synthetic", "real-widths", "--layers", "999", "--backend", "reference"], ["--layers", "48", "999"]),
])
def test_bench_bad_arguments_exit_2_and_write_nothing(argv, needles, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    assert main(argv + ["--out", str(out), "--no-peer", "--no-extras"]) == 2
    _one_line_error(capsys, *needles)
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_bench_device_cuda_without_gpu(capsys, monkeypatch):
    import engine.backend as B
    monkeypatch.setattr(B, "gpu_available", lambda: False)
    assert main(["bench", "--device", "cuda", "--no-peer", "--no-extras"]) == 2
    _one_line_error(capsys, "--device cuda", "GPU")


def test_synthetic_refused_when_the_disk_is_too_small(tmp_path, monkeypatch):
    import shutil

    from parity.bench import synthetic as S
    from reference.errors import InputError
    cfg = S.real_width_config(1, vocab_size=1024)
    need = S.checkpoint_bytes(cfg)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need // 2))
    with pytest.raises(InputError, match="GiB free"):
        S.write_synthetic(tmp_path / "ck", cfg, progress=False)
    assert not (tmp_path / "ck").exists() and not list(tmp_path.glob(".ck.tmp*"))


def test_taps_list_into_a_closed_pipe_exits_0():
    """`qwen4exp taps list | head -1`: rich's writer used to turn the broken pipe into exit status 1."""
    code = "import sys; from parity.cli import main; sys.exit(main(['taps', 'list']))"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    p.stdout.close()  # the reader is gone before the table is written
    err = p.stderr.read().decode()
    assert p.wait() == 0 and "Traceback" not in err, err


def test_tap_archive_honours_the_umask(tmp_path):
    """Archives from `taps record` had mkdtemp's 0700 / mkstemp's 0600 modes, unlike every other output."""
    import stat

    import numpy as np

    from taps.archive import ArchiveWriter
    old = os.umask(0o022)
    try:
        w = ArchiveWriter(tmp_path / "a.taps")
        w.add("embed_tokens.out", np.zeros((2, 3), np.float32), np.arange(2))
        out = w.close({})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(os.stat(p).st_mode) == 0o644 for p in files)


@pytest.mark.parametrize("pre_existing", [False, True])
def test_parity_interrupted_leaves_no_taps_without_report(tmp_path, monkeypatch, pre_existing):
    """Ctrl-C after failing cases wrote their archives used to leave --out/taps/ without report.json (and a
    rerun then needed --overwrite)."""
    import parity.cli.parity as CP
    out = tmp_path / "out"
    if pre_existing:
        out.mkdir()

    def interrupted(*a, out_dir=None, **k):
        (Path(out_dir) / "taps" / "case0.taps").mkdir(parents=True)
        raise KeyboardInterrupt
    monkeypatch.setattr(CP, "run_parity", interrupted)
    assert main(["parity", "--out", str(out), "--no-progress"]) == 130
    assert not (out / "taps").exists() and not (out / "report.json").exists()
    assert out.exists() == pre_existing  # a directory the run created is gone; the user's own stays


def test_outside_backend_subclassing_ours_is_named_by_its_spec(tmp_path, monkeypatch):
    from parity.backends import open_backend
    from reference.paths import FIXTURES
    (tmp_path / "my_engine_be.py").write_text(
        "from parity.backends import EngineBackend\n\nclass Mine(EngineBackend):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    be = open_backend("my_engine_be:Mine", FIXTURES / "tiny", device="cpu")
    assert be.name == "my_engine_be:Mine"


def test_suites_unknown_backend_is_a_usage_error():
    """`pytest --pyargs parity.suites --qwen4exp-backend nosuch`: one usage error (exit 4), not a failure per case."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "parity.suites.plugin",
                        "--pyargs", "parity.suites", "--qwen4exp-backend", "nosuch", "-o", "addopts="], cwd=REPO_ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert p.returncode == 4, (p.returncode, p.stdout[-500:], p.stderr[-500:])
    assert "nosuch" in p.stderr and "failed" not in p.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_output_to_a_full_disk_is_one_line_exit_1():
    code = "import sys; from parity.cli import main; sys.exit(main(['info', '--json']))"
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE, text=True,
                           cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "could not write output" in p.stderr and len(p.stderr.strip().splitlines()) == 1
