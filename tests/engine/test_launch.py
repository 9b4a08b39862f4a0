"""Kernel launches (engine.backend.Kernel): the arguments as cupy passes them, and programmatic dependent launch
inside a captured graph keeping a chain of dependent kernels in order."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine import backend
from engine.backend import CUDA_DIR, Module, _arg_holder, _dim3, pdl_capture
from op_devices import cp, on_cuda


def _bytes(h) -> bytes:
    return ctypes.string_at(ctypes.addressof(h), ctypes.sizeof(h))


class _FakeDeviceArray:
    class data:
        ptr = 0x7F00_1234_5678


def test_arguments_are_held_by_value_as_cupy_passes_them():
    assert _bytes(_arg_holder(np.int32(-3))) == np.int32(-3).tobytes()
    assert _bytes(_arg_holder(np.float32(1.5))) == np.float32(1.5).tobytes()
    assert _bytes(_arg_holder(np.uint64(0))) == bytes(8)
    assert _bytes(_arg_holder(np.array([7], np.int16))) == np.int16(7).tobytes()
    assert _bytes(_arg_holder(5)) == np.int64(5).tobytes()  # a Python int is an int64, as in cupy
    assert _bytes(_arg_holder(2.0)) == np.float64(2.0).tobytes()
    assert _bytes(_arg_holder(True)) == np.bool_(True).tobytes()  # a Python bool is a NumPy bool in cupy 14
    assert _bytes(_arg_holder(None)) == bytes(8)  # a null pointer
    assert _bytes(_arg_holder(_FakeDeviceArray())) == np.uint64(0x7F00_1234_5678).tobytes()


def test_negative_control_an_argument_cupy_would_refuse_is_refused():
    with pytest.raises(TypeError, match="kernel argument"):
        _arg_holder("text")
    with pytest.raises(TypeError, match="kernel argument"):
        _arg_holder(np.zeros(3, np.float32))  # a host array is no scalar


def test_launch_dimensions():
    assert _dim3(7) == [7, 1, 1]
    assert _dim3((3, 2)) == [3, 2, 1]
    assert _dim3([1, 2, 3]) == [1, 2, 3]
    # an extent of 0 is launched as 1, as cupy's Function.__call__ does (max(1, ...)); the driver refuses 0
    assert _dim3(0) == [1, 1, 1]
    assert _dim3((5, 0)) == [5, 1, 1]
    assert _dim3((np.int64(2), 0, 3)) == [2, 1, 3]


_CHAIN_SRC = (CUDA_DIR / "grid_dep.cuh").read_text() + r'''
extern "C" __global__ void step(const float* prev, float* next, int n, float add) {
    GRID_DEP_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = prev[i];
        for (int r = 0; r < 64; ++r) v = v * 1.0000001f;  // some work, so a kernel scheduled early would overtake
        next[i] = v + add;
    }
}
'''


@on_cuda()
def test_a_captured_chain_of_dependent_kernels_keeps_its_order():
    """Each kernel reads what the one before it wrote (ping-pong buffers, so a kernel that ran early would read
    a value two steps old): the replayed graph, launched with programmatic dependent launch where the device
    has it, equals the eager chain bit for bit."""
    mod = Module(cp.RawModule(code=_CHAIN_SRC, options=("-std=c++17",)))
    k = mod.get_function("step")
    n, steps = 1 << 20, 40
    a0 = cp.arange(n, dtype=cp.float32) * 1e-3

    def chain(a, b):
        bufs = [a, b]
        for s in range(steps):
            k(((n + 255) // 256,), (256,), (bufs[s % 2], bufs[(s + 1) % 2], np.int32(n), np.float32(s + 1)))
        return bufs[steps % 2]

    eager = chain(a0.copy(), cp.zeros_like(a0)).copy()
    a, b = a0.copy(), cp.zeros_like(a0)
    stream = cp.cuda.Stream()
    before = backend.pdl_launches
    with stream, pdl_capture():
        stream.begin_capture()
        try:
            out = chain(a, b)
        finally:
            graph = stream.end_capture()
    used = backend.pdl_launches - before
    if backend._pdl_launcher() is not None:
        assert used == steps, "inside pdl_capture every launch is a programmatic dependent launch"
    for _ in range(3):
        a[...] = a0
        graph.launch(stream=stream)
        stream.synchronize()
        assert cp.array_equal(out, eager)


def test_a_memory_pointer_is_passed_as_its_address():
    class _Pointer:
        ptr = 0x1000
    assert _bytes(_arg_holder(_Pointer())) == np.uint64(0x1000).tobytes()
