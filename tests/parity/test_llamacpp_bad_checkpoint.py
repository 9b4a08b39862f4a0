"""A checkpoint the reference cannot run either (no weights, a tensor missing) is the user's input error, found
before llama.cpp's converter sees it: never verdict REFUSED, which blames the engine for refusing a checkpoint
the reference runs. Needs no llama-cpp-python: the check comes before the converter is looked for."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reference.paths import bundled_model

ROOT = Path(__file__).resolve().parents[2]


def _config_only(tmp_path):
    dst = tmp_path / "noweights"
    dst.mkdir()
    shutil.copy(bundled_model("tiny") / "config.json", dst / "config.json")
    return dst


def _one_tensor_dropped(tmp_path):
    from safetensors.numpy import load_file, save_file
    src = bundled_model("tiny")
    dst = tmp_path / "dropped"
    shutil.copytree(src, dst)
    ts = load_file(str(src / "model.safetensors"))
    del ts[next(n for n in ts if n.endswith("embed_tokens.weight"))]  # required: the reference cannot run
    save_file(ts, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("make,match", [
    (_config_only, "expected model.safetensors"),
    (_one_tensor_dropped, "missing|expected"),
])
def test_llamacpp_on_a_checkpoint_the_reference_cannot_run_is_a_checkpoint_error(tmp_path, make, match):
    from parity.backends import open_backend
    from reference.errors import CheckpointError
    with pytest.raises(CheckpointError, match=match):
        open_backend("llama.cpp", make(tmp_path))


def test_parity_llamacpp_without_weights_exits_2_not_refused(tmp_path):
    model = _config_only(tmp_path)
    r = subprocess.run([sys.executable, "-m", "parity.cli", "parity", str(model), "--backend", "llama.cpp",
                        "--scenario", "kl", "--no-progress"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "REFUSED" not in r.stdout and "expected model.safetensors" in r.stderr


def test_llamacpp_rs_error_says_zero_is_allowed():
    """rs= (n_rs_seq) accepts 0, so its error names the range it accepts, not 'a positive integer'."""
    from parity.backends import open_backend
    from reference.errors import InputError
    with pytest.raises(InputError, match=r"llama.cpp:rs='abc': expected an integer >= 0$"):
        open_backend("llama.cpp:rs=abc", bundled_model("tiny"))
    with pytest.raises(InputError, match=r"seqs: expected an integer >= 1, found 'x'$"):
        open_backend("llama.cpp:seqs=x", bundled_model("tiny"))
