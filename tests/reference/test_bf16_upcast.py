"""bf16_upcast (the threaded BF16 -> float32/float64 cast the lm_head, the experts and Checkpoint.get use) is
bitwise NumPy's ml_dtypes cast, for every one of the 65,536 BF16 bit patterns."""
import numpy as np
import pytest

from fixture_helpers import fixture_dir


def _same(a, b):
    """Bitwise equality of two float arrays (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_bf16_bit_pattern_upcasts_as_numpy_does(dtype):
    import ml_dtypes

    from reference.numba_kernels import bf16_upcast
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)          # +-0, denormals, inf, every nan payload
    want = bits.view(ml_dtypes.bfloat16).astype(dtype)
    assert _same(bf16_upcast(bits, dtype), want)
    assert _same(bf16_upcast(bits.view(ml_dtypes.bfloat16), dtype), want)  # either spelling of the bits
    sq = bits.reshape(256, 256)[::3, 7:200]                                 # a 2-D non-contiguous view
    assert _same(bf16_upcast(sq, dtype), sq.view(ml_dtypes.bfloat16).astype(dtype))
    # negative control: one flipped bit shows at that element alone
    bad = bits.copy()
    bad[12345] ^= 1
    got, ref = bf16_upcast(bad, dtype), want
    assert [i for i in range(bits.size) if got[i:i + 1].tobytes() != ref[i:i + 1].tobytes()] == [12345]
    with pytest.raises(TypeError, match="float32 or float64"):
        bf16_upcast(bits, np.float16)
    with pytest.raises(TypeError, match="bfloat16 or uint16"):
        bf16_upcast(bits.astype(np.int32), dtype)


def test_checkpoint_get_upcasts_large_bf16_tensors_on_threads_exactly(monkeypatch):
    from reference import checkpoint as C
    ck = C.Checkpoint.open(fixture_dir("tiny"))
    names = [n for n in ck.names() if ck.dtype(n) == "BF16"]
    plain = {n: ck.get(n, np.float64) for n in names}
    monkeypatch.setattr(C, "_THREADED_UPCAST", 1)                          # every BF16 tensor through the kernel
    for n in names:
        for dt in (np.float32, np.float64):
            assert _same(ck.get(n, dt), np.array(ck.get_raw(n), dtype=dt)), n
        assert _same(ck.get(n, np.float64), plain[n])
