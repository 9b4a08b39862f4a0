"""PLE n-gram table placement (engine/ple_table.py): path selection, the in-place ('unified') gather.

CPU: the selection logic with the device attribute mocked (a fake cupy runtime and a monkeypatched
``unified_memory_supported``), the forced-unified error, and the NumPy twin of the ``ple_gather_rows``
kernel (engine/kernels/cuda/ple_gather.cu) over the checkpoint's memory maps checked against
``Checkpoint.ngram_rows`` on tiny (BF16, 4 shards), tiny-fp8 (FP8 + table-wide scale) and tiny-hc3 (two
PLE layers, 2 shards of unequal size), rows at every shard boundary included. Negative controls: an
off-by-one shard boundary and a dropped FP8 scale are caught (and located). GPU (skipped without cupy /
a device): the CUDA kernel vs the twin, over device copies of the shards (any GPU) and in place over the
host maps (only where the device reports pageable-memory access; never run on GB10 so far).

Tolerance: exact equality throughout. Both sides decode the stored bits exactly into float32 and apply
the same single float32 multiply by the scale, so any difference is a logic error, not rounding.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import engine.ple_table as P
from engine.ple_table import (DTYPE_CODES, PLETable, TableShards, decode_twin, gather_twin, select_mode,
                              table_shards, unified_memory_supported)
from fixture_helpers import fixture_dir
from reference.checkpoint import Checkpoint
from reference.errors import CheckpointError, InputError

TABLE_FIXTURES = ("tiny", "tiny-fp8", "tiny-hc3")


# ----------------------------------------------------------------------------- fakes
def _fake_cp(pageable: int, dev: int = 3, host_tables: int = 1, integrated: int = 1):
    """A stand-in for the cupy module: ``cuda.Device().id`` and ``runtime.deviceGetAttribute``
    answering by the CUDA enum values (88, 100, 18) for device ``dev`` only."""
    vals = {88: pageable, 100: host_tables, 18: integrated}
    calls = []

    def get_attr(attr, d):
        calls.append((attr, d))
        if d != dev:
            raise AssertionError(f"attribute queried for device {d}, expected {dev}")
        return vals[attr]

    rt = types.SimpleNamespace(deviceGetAttribute=get_attr)
    cuda = types.SimpleNamespace(runtime=rt, Device=lambda: types.SimpleNamespace(id=dev))
    return types.SimpleNamespace(cuda=cuda, calls=calls)


def _boundary_rows(starts: np.ndarray, heads: int, seed: int = 0) -> np.ndarray:
    """[T, heads] row ids: every shard's first and last row, row 0, the last row, plus random rows."""
    total = int(starts[-1])
    edge = {0, total - 1}
    for s in starts[1:-1]:
        edge |= {int(s) - 1, int(s), int(s) + 1}
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.array(sorted(edge)), rng.integers(0, total, size=8 * heads)])
    pad = (-ids.size) % heads
    ids = np.concatenate([ids, rng.integers(0, total, size=pad)])
    return ids.reshape(-1, heads).astype(np.int64)


def _layers():
    for name in TABLE_FIXTURES:
        ck = Checkpoint.open(fixture_dir(name))
        for i in ck.config.ple_layers:
            yield name, ck, i


# ----------------------------------------------------------------------------- selection
def test_attribute_query_reads_pageable_memory_access():
    cp = _fake_cp(pageable=1)
    assert unified_memory_supported(cp, 3) is True
    assert (88, 3) in cp.calls  # cudaDevAttrPageableMemoryAccess on the device asked about
    assert unified_memory_supported(_fake_cp(pageable=0), 3) is False
    attrs = P.device_memory_attributes(_fake_cp(pageable=1, host_tables=0, integrated=1), 3)
    assert attrs == {"pageable_memory_access": 1, "uses_host_page_tables": 0, "integrated": 1}


@pytest.mark.parametrize("pageable, host_tables, integrated, expected", [
    (1, 1, 0, "unified"),   # Grace + ATS: hardware-coherent pageable access
    (1, 0, 1, "unified"),   # integrated GPU (GB10-like)
    (1, 0, 0, "pinned"),    # discrete GPU with HMM only: in-place reads would fault and migrate pages
    (0, 0, 0, "pinned"),    # no pageable access (H200 on x86 without HMM)
])
def test_host_placement_picks_path_from_attributes(pageable, host_tables, integrated, expected):
    cp = _fake_cp(pageable=pageable, dev=5, host_tables=host_tables, integrated=integrated)
    assert select_mode("host", cp) == expected
    assert cp.calls and all(d == 5 for _, d in cp.calls)  # asked about the current device only
    assert select_mode("device", _fake_cp(pageable=pageable)) == "device"


def test_host_placement_keeps_pinned_when_attribute_query_fails():
    cp = _fake_cp(pageable=1, dev=5)
    cp.cuda.runtime.deviceGetAttribute = lambda attr, d: (_ for _ in ()).throw(RuntimeError("unsupported"))
    assert select_mode("host", cp) == "pinned"


def test_forced_unified_allowed_with_hmm_only():
    assert select_mode("unified", _fake_cp(pageable=1, host_tables=0, integrated=0)) == "unified"


def test_forced_unified_where_supported(monkeypatch):
    monkeypatch.setattr(P, "unified_memory_supported", lambda cp, dev: True)
    assert select_mode("unified", _fake_cp(pageable=1)) == "unified"


def test_forced_unified_unsupported_names_attribute_and_device():
    with pytest.raises(InputError) as e:
        select_mode("unified", _fake_cp(pageable=0, dev=2))
    msg = str(e.value)
    assert "cudaDevAttrPageableMemoryAccess" in msg and "device 2" in msg and "found 0" in msg


def test_numpy_backend_modes_and_errors():
    assert select_mode("host", np) == "numpy"
    with pytest.raises(InputError, match="unified"):
        select_mode("unified", np)
    with pytest.raises(InputError, match="ple_placement"):
        select_mode("hots", np)
    ck = Checkpoint.open(fixture_dir("tiny"))
    i = ck.config.ple_layers[0]
    t_host, t_dev = PLETable(ck, i, np, "host"), PLETable(ck, i, np, "device")
    assert (t_host.mode, t_dev.mode) == ("numpy", "device")
    rows = _boundary_rows(ck._table(i).starts, len(ck.config.ple_layout(i).head_vocab_sizes))
    np.testing.assert_array_equal(t_host.gather(rows), t_dev.gather(rows))
    with pytest.raises(InputError):
        PLETable(ck, i, np, "unified")


def test_engine_reports_ple_path():
    from engine import Engine
    eng = Engine(Checkpoint.open(fixture_dir("tiny")), device="cpu", max_seqs=1, kv_tokens=32)
    assert eng.limits["ple_table"] == ["numpy"]
    assert "PLE table: numpy" in eng.describe_limits()


# ----------------------------------------------------------------------------- the twin
@pytest.mark.parametrize("code, dt", [(2, "float8_e4m3fn"), (3, "float8_e5m2")])
def test_fp8_decode_all_bytes_matches_ml_dtypes(code, dt):
    import ml_dtypes
    b = np.arange(256, dtype=np.uint8)
    ref = b.view(getattr(ml_dtypes, dt)).astype(np.float32)
    np.testing.assert_array_equal(decode_twin(b, code), ref)  # NaN positions compared as equal


def test_bf16_f32_decode_matches_ml_dtypes():
    import ml_dtypes
    x = np.random.default_rng(1).standard_normal(257).astype(np.float32) * 1e3
    bf = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(decode_twin(bf.view(np.uint8), 1), bf.astype(np.float32))
    np.testing.assert_array_equal(decode_twin(x.view(np.uint8), 0), x)


def test_bf16_decode_every_bit_pattern_matches_ml_dtypes():
    """The tabulated BF16 decode over all 65,536 patterns (NaNs compared as equal)."""
    import ml_dtypes
    pats = np.arange(1 << 16, dtype=np.uint16)
    np.testing.assert_array_equal(decode_twin(pats.view(np.uint8), 1),
                                  pats.view(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("code", [0, 1, 2, 3])
def test_decode_scale_is_one_float32_multiply(code):
    """A shard scale multiplies each decoded value once in float32 (the kernel's arithmetic), also into ``out``."""
    rng = np.random.default_rng(code)
    raw = rng.integers(0, 256, (5, 8 * P._ITEMSIZE[code]), dtype=np.uint8)
    if code == 0:
        raw = rng.standard_normal((5, 8)).astype(np.float32).view(np.uint8)
    scale = np.float32(0.0123)
    want = decode_twin(raw, code) * scale
    out = np.empty_like(want)
    got = decode_twin(raw, code, scale, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(decode_twin(raw, code, np.float32(0.0124)), want)  # control: the scale is used


def test_decode_unknown_code_is_an_input_error():
    with pytest.raises(InputError, match="code: expected one of"):
        decode_twin(np.zeros(4, np.uint8), 7)


def test_twin_f32_unequal_shards():
    """F32 shards (no fixture stores one): three unequal shards split from one table."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((37, 4)).astype(np.float32)
    cuts = [0, 5, 6, 37]
    sh = TableShards(tuple(np.ascontiguousarray(table[a:b]).view(np.uint8) for a, b in zip(cuts, cuts[1:])),
                     np.asarray(cuts, np.int64), np.zeros(3, np.int32), np.ones(3, np.float32), 4)
    rows = _boundary_rows(sh.starts, 2)
    np.testing.assert_array_equal(gather_twin(sh, rows), table[rows].reshape(rows.shape[0], -1))


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_twin_sharded_gather_every_code(scale):
    """The sharded gather (one compiled call over all rows) against each row decoded alone, for shards of every
    code in one table, with and without a scale, over boundary rows and many random ones (the parallel loop)."""
    rng = np.random.default_rng(11)
    hd, codes, sizes = 6, [0, 1, 2, 3, 2, 1], [3, 1, 5, 4, 7, 2]
    arrays = []
    for c, n in zip(codes, sizes):
        if c == 0:
            arrays.append(rng.standard_normal((n, hd)).astype(np.float32).view(np.uint8))
        else:
            arrays.append(rng.integers(0, 256, (n, hd * P._ITEMSIZE[c]), dtype=np.uint8))
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    scales = np.array([scale if k % 2 else 1.0 for k in range(len(codes))], np.float32)
    sh = TableShards(tuple(arrays), starts, np.asarray(codes, np.int32), scales, hd)
    rows = np.concatenate([_boundary_rows(starts, 2).reshape(-1), rng.integers(0, starts[-1], 3000)]).reshape(-1, 2)
    k_of = np.searchsorted(starts[:-1], rows.reshape(-1), side="right") - 1
    want = np.stack([decode_twin(arrays[k][g - starts[k]], codes[k], scales[k])
                     for g, k in zip(rows.reshape(-1), k_of)]).reshape(rows.shape[0], -1)
    np.testing.assert_array_equal(gather_twin(sh, rows), want)
    in2 = rows[(k_of.reshape(rows.shape) == 2).all(axis=1)]  # rows of shard 2 (E4M3) only
    wrong = TableShards(tuple(arrays), starts, np.asarray([0, 1, 3, 3, 2, 1], np.int32), scales, hd)
    assert len(in2) and not np.array_equal(gather_twin(wrong, in2), gather_twin(sh, in2))  # control: the code is read


def test_twin_matches_ngram_rows_on_fixtures():
    seen_codes = set()
    for name, ck, i in _layers():
        sh = table_shards(ck, i)
        seen_codes |= set(sh.codes.tolist())
        assert len(sh.arrays) >= 2, name  # fixtures are sharded: boundaries exist
        heads = len(ck.config.ple_layout(i).head_vocab_sizes)
        rows = _boundary_rows(sh.starts, heads, seed=i)
        want = ck.ngram_rows(i, rows).reshape(rows.shape[0], -1)
        np.testing.assert_array_equal(gather_twin(sh, rows), want, err_msg=f"{name} layer {i}")
        if name == "tiny-fp8":
            assert np.all(sh.scales != 1.0)
    assert seen_codes == {DTYPE_CODES["BF16"], DTYPE_CODES["F8_E4M3"]}


def test_shard_views_are_in_place_and_outlive_close():
    ck = Checkpoint.open(fixture_dir("tiny-hc3"))
    i = ck.config.ple_layers[0]
    sh = table_shards(ck, i)
    for a in sh.arrays:  # each view is a slice of the file's np.memmap (no copy)
        base = a
        while base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap)
    rows = _boundary_rows(sh.starts, len(ck.config.ple_layout(i).head_vocab_sizes))
    want = ck.ngram_rows(i, rows).reshape(rows.shape[0], -1)
    ck.close()  # the checkpoint drops its maps; the views keep theirs alive
    np.testing.assert_array_equal(gather_twin(sh, rows), want)


# ----------------------------------------------------------------------------- negative controls
def test_negative_control_off_by_one_shard_boundary_is_caught_and_located():
    for name, ck, i in _layers():
        sh = table_shards(ck, i)
        heads = len(ck.config.ple_layout(i).head_vocab_sizes)
        rows = _boundary_rows(sh.starts, heads, seed=i)
        # the faulty table reads shard k from one row early, so the last table row would fall past the
        # last shard's end (an out-of-bounds read, not a comparable value): leave it out
        rows = np.where(rows == sh.starts[-1] - 1, 0, rows)
        want = ck.ngram_rows(i, rows).reshape(rows.size, -1)
        bad_starts = sh.starts.copy()
        bad_starts[1:-1] -= 1  # each interior boundary one row early
        bad = TableShards(sh.arrays, bad_starts, sh.codes, sh.scales, sh.head_dim)
        got = gather_twin(bad, rows).reshape(rows.size, -1)
        wrong = set(np.unique(rows.reshape(-1)[np.any(got != want, axis=1)]).tolist())
        first = int(sh.starts[1]) - 1
        # located: nothing before the first boundary is wrong; the row before it and every shard's
        # first row are
        assert wrong and min(wrong) == first, (name, i, sorted(wrong)[:5])
        assert {first} | set(sh.starts[1:-1].tolist()) <= wrong, (name, i)


def test_negative_control_missing_scale_is_caught():
    ck = Checkpoint.open(fixture_dir("tiny-fp8"))
    i = ck.config.ple_layers[0]
    sh = table_shards(ck, i)
    rows = _boundary_rows(sh.starts, len(ck.config.ple_layout(i).head_vocab_sizes))
    want = ck.ngram_rows(i, rows).reshape(rows.shape[0], -1)
    unscaled = TableShards(sh.arrays, sh.starts, sh.codes, np.ones_like(sh.scales), sh.head_dim)
    assert not np.array_equal(gather_twin(unscaled, rows), want)
    ck._scale_for = lambda name: None  # the checkpoint loses the table's scale: refused, not guessed
    with pytest.raises(CheckpointError, match="scale"):
        table_shards(ck, i)


# ----------------------------------------------------------------------------- GPU
def _cp():
    cp = pytest.importorskip("cupy", reason="cupy not installed: PLE gather kernel tests skipped")
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA device visible: PLE gather kernel tests skipped")
    return cp


@pytest.mark.gpu
def test_gpu_kernel_matches_twin_on_device_copies():
    """The kernel's shard search / decode / scale on any GPU: shards copied to device memory."""
    cp = _cp()
    from engine.backend import load_module
    k = load_module("ple_gather.cu").get_function("ple_gather_rows")
    for name, ck, i in _layers():
        sh = table_shards(ck, i)
        dev = [cp.asarray(a) for a in sh.arrays]
        rows = _boundary_rows(sh.starts, len(ck.config.ple_layout(i).head_vocab_sizes), seed=i)
        out = cp.empty((rows.shape[0], rows.shape[1] * sh.head_dim), np.float32)
        n = out.size
        k(((n + 255) // 256,), (256,),
          (cp.asarray(np.asarray([d.data.ptr for d in dev], np.uint64)), cp.asarray(sh.starts),
           cp.asarray(sh.codes), cp.asarray(sh.scales), np.int32(len(dev)), cp.asarray(rows.reshape(-1)),
           np.int64(rows.size), np.int32(sh.head_dim), out))
        np.testing.assert_array_equal(out.get(), gather_twin(sh, rows), err_msg=f"{name} layer {i}")


@pytest.mark.gpu
def test_gpu_host_placement_path_and_values():
    """'host' picks unified iff the device says so; either path equals the twin. The in-place read runs
    only on a device with pageable-memory access (GB10 / Grace); elsewhere forcing it must raise."""
    cp = _cp()
    dev = cp.cuda.Device().id
    ok = unified_memory_supported(cp, dev)
    for name, ck, i in _layers():
        t = PLETable(ck, i, cp, "host")
        assert t.mode == ("unified" if ok else "pinned")
        rows = _boundary_rows(ck._table(i).starts, len(ck.config.ple_layout(i).head_vocab_sizes), seed=i)
        np.testing.assert_array_equal(t.gather(rows).get(), gather_twin(table_shards(ck, i), rows))
        if ok:
            assert t.rows_moved == 0
        else:
            with pytest.raises(InputError, match="cudaDevAttrPageableMemoryAccess"):
                PLETable(ck, i, cp, "unified")
