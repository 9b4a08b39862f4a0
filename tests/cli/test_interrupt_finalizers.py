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
import time
from pathlib import Path

import pytest

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


CALLBACK_DRIVER = textwrap.dedent("""
    import ctypes, os, signal, sys, time
    from parity.bench.runner import Terminated, terminate_on_signals

    # Python's own SIGINT handler, as in a terminal (a parent that ignores SIGINT, such as a pytest-xdist worker,
    # passes SIG_IGN on, and then no handler would be installed)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    libc = ctypes.CDLL(None)
    CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    sent = []

    def cmp(a, b):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.%s)  # the handler raises right after this call, inside the callback
        return 0

    arr = (ctypes.c_int * 8)(*range(8))
    try:
        with terminate_on_signals():
            libc.qsort(arr, 8, ctypes.sizeof(ctypes.c_int), CMP(cmp))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.005)
            print("ran on")
    except Terminated as e:
        print("terminated", e.signum)
    except KeyboardInterrupt:
        print("interrupted")
""")


@pytest.mark.parametrize("sig, said", [("SIGTERM", "terminated 15"), ("SIGINT", "interrupted")])
def test_signal_swallowed_by_a_ctypes_callback_is_raised_again(tmp_path, sig, said):
    """The handler's exception lands in a ctypes callback, which can only drop it (llvmlite's object-cache
    notify while Numba compiles): the signal is delivered again once the callback has returned, so the block
    unwinds instead of running on."""
    drv = tmp_path / "driver.py"
    drv.write_text(CALLBACK_DRIVER % sig)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(drv)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.strip() == said, (p.stdout, p.stderr)
    assert p.stderr == "", p.stderr
    assert time.monotonic() - t0 < 15
