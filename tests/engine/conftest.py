"""Fixtures shared by the op tests (tests/engine/test_<op>.py), found by pytest by name (``on_cuda("poison")``).

Two ways of making an output a kernel forgot to write fail its test: ``poison`` fills what the dense ops allocate
with NaN / -7 (``dense_common.POISON``), ``poisoned_allocations`` (the sequence kernels) starts every cupy
allocation as bytes 0x7F (float 3.4e38, int 0x7F7F7F7F; ``op_helpers.no_poison``). A module whose CUDA tests need
more set up defines its own ``poison``, which pytest takes over this one. Helpers: op_helpers.py.
"""
from __future__ import annotations

import pytest

from engine.kernels import dense_common
from op_devices import cp


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)


@pytest.fixture
def poisoned_allocations():
    """Every cupy allocation made during a test starts as bytes 0x7F."""
    pool = cp.get_default_memory_pool()

    def alloc(size):
        mp = pool.malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mp.ptr, 0x7F, size, cp.cuda.get_current_stream().ptr)
        return mp

    cp.cuda.set_allocator(alloc)
    yield
    cp.cuda.set_allocator(pool.malloc)
