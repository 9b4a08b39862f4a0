"""PLE n-gram table placement for the engine.

The table (``ple.ple_embedding.ngram_embedding``, ``padded_rows x head_dim``; 51.2B values on the real
model) is host-resident by default: the shared :class:`reference.checkpoint.Checkpoint` memory-maps its
shards and only the hashed rows of a step are read. Modes (``PLETable.mode``):

- ``numpy``: the NumPy engine; :meth:`Checkpoint.ngram_rows` gathers the rows on the host.
- ``pinned``: placement ``host`` on a CUDA device that cannot read pageable host memory (e.g. H200 on
  x86): rows are gathered on the host into a reusable pinned staging buffer, then one asynchronous
  host->device copy (no device->host traffic: n-gram ids are hashed on the host from the token ids).
- ``unified``: placement ``host`` on a device whose ``cudaDevAttrPageableMemoryAccess`` is 1 (GB10 /
  Grace with ATS), or placement ``unified`` (forced): each shard's memory map is wrapped as device-readable
  memory (``cupy.cuda.UnownedMemory`` owned by the map) and the kernel ``ple_gather_rows``
  (engine/kernels/cuda/ple_gather.cu) gathers and upcasts the hashed rows in place on the device; no
  host-side row copy. Only the row ids (``[T, heads]`` int64) go host->device.
- ``device``: placement ``device`` uploads the whole table (float32) once and gathers rows on the device.

**The unified path has NOT been run on GB10 (or any ATS) hardware.** What is checked: the kernel compiles
with nvcc for sm_90 and sm_121 (tests/engine/test_engine_nvcc.py), its selection logic (attribute mocked), and a
NumPy twin of the kernel (:func:`gather_twin`: same shard search, dtype decode by bit manipulation and
scale) against :meth:`Checkpoint.ngram_rows` on the fixtures. GPU tests comparing the CUDA kernel with the
twin exist (tests/engine/test_engine_ple_table.py, ``@pytest.mark.gpu``) but need a device that reports
pageable-memory access.

Source of the table layout: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.__init__`` / ``forward``
(rows of ``head_dim`` values, one row per (token, hash head), heads concatenated).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange

from reference.errors import CheckpointError, InputError

__all__ = ["PLETable", "PLACEMENTS", "TableShards", "table_shards", "gather_twin", "decode_twin",
           "unified_memory_supported", "device_memory_attributes", "select_mode", "DTYPE_CODES"]

PLACEMENTS = ("host", "device", "unified")

#: dtype codes of ple_gather.cu (PLE_F32 / PLE_BF16 / PLE_F8E4M3 / PLE_F8E5M2)
DTYPE_CODES = {"F32": 0, "BF16": 1, "F8_E4M3": 2, "F8_E5M2": 3}
_ITEMSIZE = {0: 4, 1: 2, 2: 1, 3: 1}

# CUDA runtime enum values (driver_types.h, cudaDeviceAttr), used when cupy lacks the named constant
_ATTR_FALLBACK = {"cudaDevAttrPageableMemoryAccess": 88, "cudaDevAttrPageableMemoryAccessUsesHostPageTables": 100,
                  "cudaDevAttrIntegrated": 18}


def _attr(cp, name: str) -> int:
    return int(getattr(cp.cuda.runtime, name, _ATTR_FALLBACK[name]))


def device_memory_attributes(cp, dev: int) -> dict[str, int]:
    """Memory attributes of CUDA device ``dev`` that decide the PLE path.

    Returns: ``{'pageable_memory_access': cudaDevAttrPageableMemoryAccess, 'uses_host_page_tables':
    cudaDevAttrPageableMemoryAccessUsesHostPageTables, 'integrated': cudaDevAttrIntegrated}`` (ints, 0/1).
    """
    rt = cp.cuda.runtime
    return {"pageable_memory_access": int(rt.deviceGetAttribute(_attr(cp, "cudaDevAttrPageableMemoryAccess"), dev)),
            "uses_host_page_tables": int(rt.deviceGetAttribute(
                _attr(cp, "cudaDevAttrPageableMemoryAccessUsesHostPageTables"), dev)),
            "integrated": int(rt.deviceGetAttribute(_attr(cp, "cudaDevAttrIntegrated"), dev))}


def unified_memory_supported(cp, dev: int) -> bool:
    """True when CUDA device ``dev`` can dereference pageable host memory directly
    (``cudaDevAttrPageableMemoryAccess == 1``: GB10 / Grace with ATS, or HMM-enabled systems)."""
    return device_memory_attributes(cp, dev)["pageable_memory_access"] == 1


def unified_memory_preferred(cp, dev: int) -> bool:
    """True when ``placement='host'`` should read the table in place: pageable access backed by hardware
    coherence (the host page tables, as with ATS on GB10/Grace, or an integrated GPU). A discrete GPU whose
    pageable access comes from HMM (x86 + recent drivers) would fault and migrate pages on every gather,
    so it keeps pinned staging there unless ``placement='unified'`` is asked for."""
    try:
        a = device_memory_attributes(cp, dev)
    except Exception:  # a runtime that cannot answer keeps the path the H200 runs (pinned staging)
        return False
    return a["pageable_memory_access"] == 1 and (a["uses_host_page_tables"] == 1 or a["integrated"] == 1)


def _device_id(xp) -> int:
    return int(xp.cuda.Device().id)


def select_mode(placement: str, xp) -> str:
    """The PLE table mode for ``placement`` on array module ``xp`` (numpy or cupy).

    ``host`` -> ``numpy`` on NumPy, else ``unified`` when :func:`unified_memory_preferred`, else ``pinned``;
    ``device`` -> ``device``; ``unified`` -> ``unified`` or an error.
    Raises:
        InputError: unknown placement; ``unified`` forced on NumPy or on a device without pageable-memory
            access (names the attribute and the device).
    """
    if placement not in PLACEMENTS:
        raise InputError(f"ple_placement: expected one of {list(PLACEMENTS)}, found {placement!r}")
    if placement == "device":
        return "device"
    if xp is np:
        if placement == "unified":
            raise InputError("ple_placement 'unified': expected a CUDA device (cupy), found the NumPy backend "
                             "(use 'host')")
        return "numpy"
    dev = _device_id(xp)
    if placement == "host":
        return "unified" if unified_memory_preferred(xp, dev) else "pinned"
    if not unified_memory_supported(xp, dev):
        try:
            attrs = device_memory_attributes(xp, dev)
        except Exception:  # pragma: no cover - attribute query itself failing
            attrs = {}
        raise InputError(f"ple_placement 'unified': expected CUDA device {dev} to report "
                         f"cudaDevAttrPageableMemoryAccess = 1 (device reads pageable host memory in place, e.g. "
                         f"GB10 / Grace with ATS), found {attrs.get('pageable_memory_access', 0)} "
                         f"(attributes {attrs}); use ple_placement 'host' (pinned staging) or 'device'")
    return "unified"


# --------------------------------------------------------------------------- host view of the shards
@dataclass
class TableShards:
    """The stored shards of one PLE layer's n-gram table, as host arrays (memory-mapped views of the
    checkpoint files for a file checkpoint; each view keeps its ``np.memmap`` alive through ``.base``).

    Attributes:
        arrays: per shard, the stored bytes as uint8 ``[rows_k, head_dim * itemsize]`` (C-contiguous).
        starts: int64 ``[n_shards + 1]`` first global row of each shard (last = padded rows).
        codes: int32 ``[n_shards]`` dtype codes (:data:`DTYPE_CODES`).
        scales: float32 ``[n_shards]`` per-tensor multiplier (FP8 scale; 1 for F32 / BF16).
        head_dim: values per row.
    """
    arrays: tuple
    starts: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    head_dim: int
    _jit: tuple | None = field(default=None, repr=False, compare=False)  # (shard list, tables) of _gather_rows


def table_shards(ck, layer: int) -> TableShards:
    """Raw views of PLE layer ``layer``'s n-gram table shards (no copy for a file checkpoint).

    Uses the checkpoint's table description (shard order and start rows, as :meth:`Checkpoint.ngram_rows`)
    and :meth:`Checkpoint.get_raw` for each shard.
    Raises:
        CheckpointError: a shard dtype the gather kernel does not decode, an FP8 shard without a
            per-tensor scale, or a scale that is not one value.
    """
    t = ck._table(int(layer))
    arrays, codes, scales = [], [], []
    for name in t.shards:
        dt = ck.dtype(name)
        if dt not in DTYPE_CODES:
            raise CheckpointError(f"PLE layer {layer}: n-gram shard {name!r}: expected dtype one of "
                                  f"{sorted(DTYPE_CODES)}, found {dt}")
        code = DTYPE_CODES[dt]
        raw = ck.get_raw(name)
        if raw.ndim != 2 or raw.shape[1] != t.head_dim:
            raise CheckpointError(f"PLE layer {layer}: n-gram shard {name!r}: expected [rows, {t.head_dim}], "
                                  f"found {list(raw.shape)}")
        if not raw.flags.c_contiguous:
            raw = np.ascontiguousarray(raw)
        arrays.append(raw.view(np.uint8).reshape(raw.shape[0], t.head_dim * _ITEMSIZE[code]))
        scale = 1.0
        if code in (2, 3):
            scale = ck.ngram_shard_scale(name)
        codes.append(code)
        scales.append(scale)
    return TableShards(tuple(arrays), np.asarray(t.starts, np.int64), np.asarray(codes, np.int32),
                       np.asarray(scales, np.float32), int(t.head_dim))


def _decode_bits(b: np.ndarray, code: int) -> np.ndarray:
    """The bit manipulation of ``ple_decode`` (ple_gather.cu) on stored values: uint8 ``b`` (codes 2 / 3) or
    uint16 ``b`` (code 1) -> float32 of the same shape."""
    if code == 1:
        return (b.astype(np.uint32) << 16).view(np.float32)
    v = b.astype(np.uint32)
    sign = (v & 0x80) << 24
    if code == 2:
        e, m = (v >> 3) & 0xF, v & 0x7
        normal = (sign | ((e + 120) << 23) | (m << 20)).view(np.float32)
        sub = m.astype(np.float32) * np.float32(2.0 ** -9)
        out = np.where(e == 0, np.where(sign != 0, -sub, sub), normal)
        return np.where((e == 0xF) & (m == 0x7), np.float32(np.nan), out).astype(np.float32)
    e, m = (v >> 2) & 0x1F, v & 0x3
    normal = (sign | ((e + 112) << 23) | (m << 21)).view(np.float32)
    sub = m.astype(np.float32) * np.float32(2.0 ** -16)
    out = np.where(e == 0, np.where(sign != 0, -sub, sub), normal)
    special = (sign | np.where(m != 0, 0x7FC00000, 0x7F800000).astype(np.uint32)).view(np.float32)
    return np.where(e == 0x1F, special, out).astype(np.float32)


_LUTS: dict[int, np.ndarray] = {}


def _lut(code: int) -> np.ndarray:
    """float32 value of every stored bit pattern of a 1- or 2-byte code (256 / 65,536 entries), built once by
    :func:`_decode_bits`: a gather then decodes with one table lookup per value (the formula's ~10 array passes
    took 45 us per prefill token on the GPU host, longer than the 4-layer forward)."""
    lut = _LUTS.get(code)
    if lut is None:
        pats = np.arange(1 << (8 * _ITEMSIZE[code]), dtype=np.uint16 if code == 1 else np.uint8)
        lut = _LUTS[code] = _decode_bits(pats, code)
        lut.flags.writeable = False
    return lut


def decode_twin(raw_bytes: np.ndarray, code: int, scale: float = 1.0, out: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of ``ple_decode`` in ple_gather.cu: stored bytes -> float32 by bit manipulation (tabulated
    per bit pattern), times the shard's float32 ``scale`` (one float32 multiply per value, as the kernel).

    Args:
        raw_bytes: uint8 ``[..., n * itemsize]`` (little-endian stored values).
        code: dtype code (:data:`DTYPE_CODES`).
        scale: the shard's scale (FP8 shards; 1 elsewhere).
        out: optional float32 ``[..., n]`` written in full.
    Returns: float32 ``[..., n]`` (``out`` when given).
    Raises:
        InputError: an unknown code.
    """
    if code not in _ITEMSIZE:
        raise InputError(f"decode_twin: code: expected one of {sorted(_ITEMSIZE)}, found {code}")
    b = np.ascontiguousarray(raw_bytes)
    if code == 0:
        vals = b.view(np.float32)
        if out is None:
            out = vals.copy()
        else:
            out[...] = vals
        if scale != 1:
            out *= np.float32(scale)
        return out
    lut = _lut(code)
    if scale != 1:  # float32(lut) * float32(scale): the kernel's one rounding per value
        with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN patterns: as the kernel would make them
            lut = lut * np.float32(scale)
    return np.take(lut, b.view(np.uint16) if code == 1 else b, out=out)


def gather_twin(sh: TableShards, rows, out: np.ndarray | None = None) -> np.ndarray:
    """Host twin of the ``ple_gather_rows`` kernel: same shard search (last shard whose start <= row),
    decode and per-shard scale (float32 multiply), reading the shard views in place (one compiled call over
    all rows, :func:`_gather_rows`). Also the engine's host gather (modes ``numpy`` and ``pinned``).

    Args:
        sh: :func:`table_shards` of the layer.
        rows: int ``[T, heads]`` global row ids (head offsets added), in ``[0, starts[-1])``.
        out: optional float32 ``[T, heads * head_dim]`` host array written in full (e.g. pinned staging).
    Returns: float32 ``[T, heads * head_dim]`` (``out`` when given).
    Raises:
        InputError: ids outside the table, or ``out`` of the wrong shape/dtype.
    """
    rows = np.asarray(rows, dtype=np.int64)
    T, H = rows.shape
    flat = rows.reshape(-1)
    total = int(sh.starts[-1])
    if flat.size and (flat.min() < 0 or flat.max() >= total):
        raise InputError(f"gather_twin: rows: expected ids in [0, {total}), found [{flat.min()}, {flat.max()}]")
    if out is None:
        out = np.empty((T, H * sh.head_dim), np.float32)
    elif out.shape != (T, H * sh.head_dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InputError(f"gather_twin: out: expected C-contiguous float32 {(T, H * sh.head_dim)}, found "
                         f"{out.dtype} {out.shape}")
    o2 = out.reshape(flat.size, sh.head_dim)
    _gather_rows(*_compiled_view(sh), np.ascontiguousarray(flat), o2, o2.view(np.uint32))
    return out


def _compiled_view(sh: TableShards) -> tuple:
    """``(shards, starts, codes, scales, luts)`` of :func:`_gather_rows` for ``sh``, built once per table: the
    shard views as one typed list (read-only: one element type for file maps and in-memory shards alike), the
    per-shard arrays contiguous, and each FP8 shard's table of its 256 scaled values."""
    if sh._jit is None:
        from numba.typed import List
        n = len(sh.arrays)
        views = []
        for a in sh.arrays:
            v = a.view()
            v.flags.writeable = False
            views.append(v)
        luts = np.zeros((n, 256), np.float32)
        for k in range(n):
            if int(sh.codes[k]) in (2, 3):
                luts[k] = decode_twin(np.arange(256, dtype=np.uint8), int(sh.codes[k]), sh.scales[k])
        sh._jit = (List(views), np.ascontiguousarray(sh.starts[:n], dtype=np.int64),
                   np.ascontiguousarray(sh.codes, dtype=np.int32), np.ascontiguousarray(sh.scales, dtype=np.float32),
                   luts)
    return sh._jit


@njit(cache=True, nogil=True, parallel=True)
def _gather_rows(shards, starts, codes, scales, luts, flat, out, out_bits):  # pragma: no cover - compiled
    """Rows ``flat`` of a sharded table into ``out [rows, head_dim]`` (float32; ``out_bits`` its uint32 view):
    the shard search and decode of :func:`decode_twin` row by row, in one call (one NumPy pass per shard touched
    took ~20 us each, ~110 shards for a 16-token decode step)."""
    n = starts.shape[0]
    hd = out.shape[1]
    for r in prange(flat.shape[0]):
        g = flat[r]
        lo, hi = 0, n - 1  # the last shard whose start <= g
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if starts[mid] <= g:
                lo = mid
            else:
                hi = mid - 1
        row = shards[lo][g - starts[lo]]
        c = codes[lo]
        if c == 2 or c == 3:  # FP8: the shard's scaled table
            for j in range(hd):
                out[r, j] = luts[lo, row[j]]
            continue
        if c == 0:
            for j in range(hd):
                out_bits[r, j] = (np.uint32(row[4 * j]) | (np.uint32(row[4 * j + 1]) << 8)
                                  | (np.uint32(row[4 * j + 2]) << 16) | (np.uint32(row[4 * j + 3]) << 24))
        else:  # BF16: the stored bits are the float32's upper half
            for j in range(hd):
                out_bits[r, j] = (np.uint32(row[2 * j]) | (np.uint32(row[2 * j + 1]) << 8)) << 16
        s = scales[lo]
        if s != 1:
            for j in range(hd):
                out[r, j] = out[r, j] * s


# --------------------------------------------------------------------------- the table
class PLETable:
    """Row gatherer of one PLE layer's n-gram table.

    Args:
        ck: the checkpoint (``ngram_rows(layer, rows)`` and, for the unified path, the shard views).
        layer: 0-based PLE layer index.
        xp: numpy or cupy (where the gathered rows are needed).
        placement: 'host' (memory map, default: in place on unified-memory devices, else pinned staging),
            'device' (whole table on the device) or 'unified' (force the in-place path).
    Attributes:
        mode: 'numpy', 'pinned', 'unified' or 'device' (see the module docstring).
    Raises:
        InputError: unknown placement, or 'unified' where the device cannot read pageable host memory.
        CheckpointError: (unified) a shard the kernel cannot decode or an FP8 shard without its scale.
    """

    def __init__(self, ck, layer: int, xp, placement: str = "host"):
        self.mode = select_mode(placement, xp)
        self.ck = ck
        self.layer = int(layer)
        self.xp = xp
        self.placement = placement
        lay = ck.config.ple_layout(layer)
        self.rows_total = lay.padded_rows
        self.head_dim = lay.head_dim
        self._pinned = None
        self._shards = None  # host views of the shards (numpy / pinned modes), mapped on first use
        self._table = None
        self._unified = None
        self.rows_moved = 0  # rows copied host->device (bench/perf accounting; 0 in unified/device modes)
        if self.mode == "device":
            self._table = xp.empty((self.rows_total, self.head_dim), np.float32)
            step = 1 << 20
            for a in range(0, self.rows_total, step):
                b = min(self.rows_total, a + step)
                self._table[a:b] = xp.asarray(self._host_rows(np.arange(a, b, dtype=np.int64)))
        elif self.mode == "unified":
            self._setup_unified()
        self.resident = False
        if self.mode == "pinned":
            self.resident = self.make_resident()

    def make_resident(self, limit_bytes: int | None = None) -> bool:
        """Copy a host-resident table into process memory when it is at most ``limit_bytes`` (default
        ``$QWEN4EXP_PLE_RESIDENT_BYTES`` or 8 GiB), so a decode step's row gather reads RAM instead of
        the memory-mapped file: a row read through the map costs a page-cache access (measured ~10 us per
        row in the sandboxed H200 machine, where a batch of 16 reads 256 rows). Larger tables (the real
        model's ~100 GB) stay memory-mapped. Returns whether the table was copied."""
        import os
        if self.mode not in ("numpy", "pinned"):
            return False
        if limit_bytes is None:
            limit_bytes = int(os.environ.get("QWEN4EXP_PLE_RESIDENT_BYTES", 8 << 30))
        if self._shards is None:
            self._shards = table_shards(self.ck, self.layer)
        sh = self._shards
        if sum(int(a.nbytes) for a in sh.arrays) > limit_bytes:
            return False
        if len(set(sh.codes.tolist())) == 1 and len(set(sh.scales.tolist())) == 1:
            # one dtype and scale: one array in global row order (one fancy index per gather, no shard search)
            self._shards = TableShards((np.concatenate(sh.arrays, axis=0),), np.array([0, sh.starts[-1]], np.int64),
                                       sh.codes[:1].copy(), sh.scales[:1].copy(), sh.head_dim)
        else:
            self._shards = TableShards(tuple(np.array(a, copy=True) for a in sh.arrays), sh.starts, sh.codes,
                                       sh.scales, sh.head_dim)
        return True

    def _setup_unified(self) -> None:
        """Wrap each shard's mapped host address as device memory (owner = the host view, which keeps the
        memory map alive) and upload the small shard tables the kernel reads."""
        cp = self.xp
        sh = table_shards(self.ck, self.layer)
        dev = _device_id(cp)
        views = []
        for a in sh.arrays:
            ptr = int(a.__array_interface__["data"][0])
            mem = cp.cuda.UnownedMemory(ptr, int(a.nbytes), a, device_id=dev)
            views.append(cp.ndarray(a.shape, np.uint8, cp.cuda.MemoryPointer(mem, 0)))
        from engine.backend import load_module
        self._unified = {
            "shards": sh,  # host views (hold the maps)
            "views": views,  # device views over the same memory (hold the host views)
            "ptrs": cp.asarray(np.asarray([v.data.ptr for v in views], np.uint64)),
            "starts": cp.asarray(sh.starts),
            "codes": cp.asarray(sh.codes),
            "scales": cp.asarray(sh.scales),
            "kernel": load_module("ple_gather.cu").get_function("ple_gather_rows"),
        }

    def _host_rows(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.ck.ngram_rows(self.layer, rows), dtype=np.float32)

    def nbytes_device(self) -> int:
        """Device bytes held by the table (0 when host-resident, apart from staging)."""
        return 0 if self._table is None else int(self._table.nbytes)

    def describe(self) -> str:
        """One phrase naming the path in use, e.g. ``'unified (in place, pageable memory access)'``."""
        return {"numpy": "host memmap (NumPy)", "pinned": "host memmap, pinned staging",
                "unified": "host memmap read in place (pageable memory access)",
                "device": "device-resident"}[self.mode]

    def gather(self, rows: np.ndarray):
        """Rows of the table for hashed ids ``rows``.

        Args:
            rows: host int64 ``[T, ngram_heads]`` (head offsets already added).
        Returns:
            ``xp`` float32 ``[T, ngram_heads * head_dim]`` (heads concatenated).
        Raises:
            InputError: ids outside the table.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows_total):
            raise InputError(f"PLE layer {self.layer}: n-gram row ids: expected in [0, {self.rows_total}), found "
                             f"[{rows.min()}, {rows.max()}]")
        T, H = rows.shape
        xp = self.xp
        if self._table is not None:
            return self._table[xp.asarray(rows.reshape(-1))].reshape(T, H * self.head_dim)
        if self._unified is not None:
            return self._gather_unified(rows)
        host = self.gather_host(rows)
        if xp is np:
            return host
        return self._upload(host)

    def gather_host(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Host rows (modes ``numpy`` and ``pinned``): the hashed rows read from the memory-mapped shards
        (:func:`gather_twin`), written into ``out`` when given (the decode graphs' pinned staging).

        Args:
            rows: host int64 ``[T, ngram_heads]``; out: optional float32 ``[T, ngram_heads * head_dim]``.
        Returns: float32 ``[T, ngram_heads * head_dim]`` host array.
        Raises:
            InputError: ids outside the table; a mode whose rows are gathered on the device.
        """
        if self.mode not in ("numpy", "pinned"):
            raise InputError(f"PLE layer {self.layer}: gather_host: expected mode 'numpy' or 'pinned', found "
                             f"{self.mode!r} (rows are gathered on the device)")
        if self._shards is None:
            self._shards = table_shards(self.ck, self.layer)
        rows = np.asarray(rows, dtype=np.int64)
        self.rows_moved += rows.size
        return gather_twin(self._shards, rows, out=out)

    def _gather_unified(self, rows: np.ndarray):
        """``ple_gather_rows`` over the in-place shard views: float32 ``[T, H * head_dim]`` on the device."""
        cp = self.xp
        u = self._unified
        T, H = rows.shape
        out = cp.empty((T, H * self.head_dim), np.float32)
        n = T * H * self.head_dim
        if n == 0:
            return out
        d_rows = cp.asarray(rows.reshape(-1))
        threads = 256
        u["kernel"](((n + threads - 1) // threads,), (threads,),
                    (u["ptrs"], u["starts"], u["codes"], u["scales"], np.int32(len(u["views"])), d_rows,
                     np.int64(T * H), np.int32(self.head_dim), out))
        return out

    def _upload(self, host: np.ndarray):
        """Copy ``host`` rows to the device through a ring of two pinned buffers (async copy; a buffer is
        reused only after its previous copy's event completed, which in steady state it already has)."""
        import cupy as cp
        import cupyx
        n = host.size
        if self._pinned is None:
            self._pinned = [None, None]
            self._events = [None, None]
            self._ring = 0
        k = self._ring
        self._ring ^= 1
        if self._events[k] is not None:
            self._events[k].synchronize()
        if self._pinned[k] is None or self._pinned[k].size < n:
            self._pinned[k] = cupyx.empty_pinned((max(n, 1 << 16),), np.float32)
        stage = self._pinned[k][:n].reshape(host.shape)
        stage[...] = host
        stream = cp.cuda.get_current_stream()
        out = cp.empty(host.shape, np.float32)
        out.set(stage, stream=stream)  # asynchronous: the source is pinned
        self._events[k] = stream.record()
        return out
