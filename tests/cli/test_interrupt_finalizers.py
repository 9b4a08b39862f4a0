"""A signal that lands inside a constructor leaves a half-built object whose finalizer fails when the unwound
stack is freed (llvmlite's PassBuilder when SIGTERM arrives while Numba compiles). ``python -m parity.cli``
(and the ``qwen4exp`` script) then prints the one-line "terminated" message and nothing else, with exit 143;
without a signal such a finalizer's error is still reported.

Each case runs the real entry point in a subprocess, with the verb's first step replaced by a driver: the
signal is sent to the process itself, so the moment it lands is fixed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import os, runpy, signal, sys
    import parity.cli as cli

    MODE = sys.argv[1]

    class HalfBuilt:
        def __init__(self, send):
            if send:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Terminated right after this call
            self.handle = 1

        def __del__(self):
            del self.handle  # AttributeError when __init__ did not finish (or del'd twice)

    def step(args):
        if MODE == "signal":
            HalfBuilt(send=True)
        else:  # no signal: a finalizer that fails anyway
            h = HalfBuilt(send=False)
            del h.handle
            del h

    cli._check_empty_model = step
    sys.argv = ["qwen4exp", "info", "tiny"]
    runpy.run_module("parity.cli", run_name="__main__", alter_sys=True)
""")


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    drv = tmp_path / "driver.py"
    drv.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(drv), mode], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_half_built_object_after_sigterm_prints_nothing(tmp_path):
    p = _run(tmp_path, "signal")
    assert p.returncode == 143, p.stderr
    assert p.stderr == "qwen4exp info: terminated (signal 15)\n", p.stderr


def test_failing_finalizer_without_a_signal_is_still_reported(tmp_path):
    p = _run(tmp_path, "plain")
    assert "Exception ignored in" in p.stderr and "AttributeError" in p.stderr, p.stderr
