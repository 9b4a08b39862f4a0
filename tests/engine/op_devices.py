"""The devices of the op tests (tests/engine/test_<op>.py): not a test module.

Each op module holds that op's CPU tests (the NumPy twins, against independent float64 formulas) and its CUDA
tests (the kernels, against the twins and float64). A CUDA test carries the ``gpu`` marker, so ``pytest -m gpu``
selects exactly the CUDA cases (ci/gpu runs ``pytest -m gpu tests/``) and ``-m "not gpu"`` the CPU ones; without
cupy or a GPU a CUDA case is collected and skipped with the reason, never an error, and the CPU cases of the same
module run. The two sides are separate tests where their inputs or bounds differ (the CPU twins at small shapes
against float64 loops, the kernels at the real widths against the twins).

The helpers the op modules share are in op_helpers.py, their shared fixtures (the poisoning of outputs) in
conftest.py.
"""
from __future__ import annotations

import pytest

from engine.backend import cupy_or_none

cp = cupy_or_none()  # the cupy module where cupy imports and sees a CUDA device, else None
NO_CUDA = "no CUDA GPU visible to cupy (GPU tests need cupy: pip install '.[gpu]')"


def on_cuda(*fixtures: str, skipif: tuple[bool, str] | None = None):
    """Decorator of a CUDA test: the ``gpu`` marker, a skip without cupy / a GPU (and ``skipif`` = (condition,
    reason) where given), and ``fixtures`` set up before the test (the module's poisoning of outputs, say)."""
    marks = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=NO_CUDA)]
    if skipif is not None:
        marks.append(pytest.mark.skipif(skipif[0], reason=skipif[1]))
    if fixtures:
        marks.append(pytest.mark.usefixtures(*fixtures))

    def apply(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn
    return apply
