"""Fixtures of tests/engine (the op modules' devices: tests/engine/op_devices.py)."""
from __future__ import annotations

import pytest

from op_devices import DEVICES, NO_CUDA, cp


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """"cpu" or "cuda" (the latter marked ``gpu``, skipped without cupy / a GPU): a test with the same body on both."""
    if request.param == "cuda" and cp is None:
        pytest.skip(NO_CUDA)
    return request.param
