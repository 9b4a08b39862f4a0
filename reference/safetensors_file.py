"""The safetensors file format: its dtype names, the header reader with its corruption checks, and the one
writer every part of the tree uses (checkpoints, fixtures, slices, synthetic checkpoints, benchmarks).

Layout (the format's specification, huggingface/safetensors ``docs``): an 8-byte little-endian header length
``n``, ``n`` bytes of JSON (``name -> {dtype, shape, data_offsets}`` plus an optional ``__metadata__`` of
strings; padded with spaces to a multiple of 8 here), then the tensor bytes, each tensor at its
``data_offsets`` relative to the end of the header. The ``safetensors`` library writes whole in-memory
dictionaries only; the writer here streams each tensor from an iterable of buffers (a slice copies rows
out of a memory map, a synthetic checkpoint of hundreds of GB draws its values in pieces, a benchmark
leaves the data sparse), and writes every dtype of :data:`DTYPES` (BF16 and FP8 through ``ml_dtypes``).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence
import os

import ml_dtypes
import numpy as np

from reference.errors import CheckpointError

__all__ = ["DTYPES", "StreamedTensor", "write_streamed", "write_safetensors"]

# safetensors dtype name -> numpy dtype (little-endian, as the format stores)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
# valid safetensors dtypes this reader does not decode: accepted when a file opens (a checkpoint may carry
# them in tensors we never read, e.g. quantisation metadata), refused with a clear error when read
_OTHER_ST_BITS = {"U16": 16, "U32": 32, "U64": 64, "F8_E8M0": 8, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_INT = ("I64", "I32", "I16", "I8", "U8", "BOOL")
_NP_TO_ST = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def _st_dtype_name(a: np.ndarray) -> str:
    try:
        return _NP_TO_ST[a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype]
    except KeyError:
        raise CheckpointError(f"array dtype {a.dtype}: expected one of the safetensors dtypes "
                              f"{sorted(DTYPES)}, found {a.dtype}") from None


# --------------------------------------------------------------------------- safetensors files
@dataclass
class _Entry:
    file: Path
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header dict, data start, file size) of one safetensors file, with the corruption checks."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file: expected an 8-byte header length, "
                                      f"found a {size}-byte file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file: header length {n} bytes "
                                      f"runs beyond the file ({size} bytes)")
            blob = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        hdr = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: expected JSON, found undecodable bytes ({e})") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: expected a JSON object, found {type(hdr).__name__}")
    return hdr, 8 + n, size


def _parse_file(path: Path) -> tuple[list[_Entry], dict]:
    hdr, data0, size = _read_header(path)
    meta = hdr.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__: expected a JSON object, "
                              f"found {type(meta).__name__}")
    out = []
    def is_uint(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    for name, info in hdr.items():
        try:
            dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}: expected dtype, shape and "
                                  f"data_offsets, found {info!r}") from None
        if not (isinstance(shape, list) and all(is_uint(x) for x in shape)):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r}: shape: expected a list of "
                                  f"integers >= 0, found {shape!r}")
        if not (is_uint(b) and is_uint(e)):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r}: data_offsets: expected two "
                                  f"integers >= 0, found {[b, e]!r}")
        if not isinstance(dt, str) or (dt not in DTYPES and dt not in _OTHER_ST_BITS):
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype: expected a safetensors dtype (one of "
                                  f"{sorted(set(DTYPES) | set(_OTHER_ST_BITS))}), found {dt!r}")
        shape = tuple(shape)
        if e < b:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r}: data_offsets: expected start "
                                  f"<= end, found [{b}, {e}]")
        if data0 + e > size:
            raise CheckpointError(f"{path}: truncated or corrupt file: tensor {name!r} data_offsets [{b}, {e}] run "
                                  f"beyond the data section ({size - data0} bytes)")
        # Python ints: no overflow on absurd shapes; sub-byte dtypes pack (rounded up to whole bytes)
        bits = DTYPES[dt].itemsize * 8 if dt in DTYPES else _OTHER_ST_BITS[dt]
        want = -(-math.prod(shape) * bits // 8)
        if want != e - b:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} {dt}{list(shape)} needs {want} bytes, "
                                  f"data_offsets give {e - b}")
        out.append(_Entry(path, name, dt, shape, data0 + b, e - b))
    return out, meta


# --------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class StreamedTensor:
    """One tensor for :func:`write_streamed`: ``name`` (as stored), ``dtype`` (a safetensors dtype name, e.g.
    ``BF16``), ``shape``, ``nbytes`` (its data size in bytes) and ``chunks``: an iterable of buffers (bytes or
    C-contiguous arrays, written in order, ``nbytes`` in all), or None to leave the data as zeros (a sparse
    region of the file)."""

    name: str
    dtype: str
    shape: tuple
    nbytes: int
    chunks: Iterable | None


def _raw(chunk) -> memoryview:
    # bytes-like as is; arrays as their bytes (ml_dtypes' BF16 / FP8 have no buffer format of their own)
    if isinstance(chunk, np.ndarray):
        return memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
    return memoryview(chunk).cast("B")


def write_streamed(path: str | os.PathLike, tensors: Sequence[StreamedTensor], metadata: dict | None = None, *,
                   atomic: bool = True) -> int:
    """Write one safetensors file, tensors laid out in the order given, each streamed from its ``chunks``.

    Args:
        path: the file. ``atomic``: written under a temporary name and renamed into place
            (:func:`reference.atomic.atomic_open`); False only inside a folder that is itself published
            atomically (``reference.atomic.atomic_dir``: slices, synthetic checkpoints).
        tensors: :class:`StreamedTensor` entries (names unique).
        metadata: the header's ``__metadata__`` (values written as strings).
    Returns:
        The bytes of tensor data written (the file is 8 + header + that).
    Raises:
        CheckpointError: a tensor whose chunks do not add up to its ``nbytes``, or a name given twice.
    """
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for t in tensors:
        if t.name in header:
            raise CheckpointError(f"{path}: tensor {t.name!r}: expected each name once, found it twice")
        header[t.name] = {"dtype": t.dtype, "shape": [int(x) for x in t.shape], "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    from reference.atomic import atomic_open
    with (atomic_open(path, "wb") if atomic else open(path, "wb")) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            if t.chunks is None:
                f.seek(t.nbytes, os.SEEK_CUR)  # a hole: reads as zeros, takes no disk
                continue
            done = 0
            for c in t.chunks:
                mv = _raw(c)
                f.write(mv)
                done += mv.nbytes
            if done != t.nbytes:
                raise CheckpointError(f"{path}: tensor {t.name!r}: expected {t.nbytes} bytes of data, found {done}")
        f.truncate(8 + len(blob) + off)  # the size, also when the file ends in a hole
    return off


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    """Write in-memory arrays as a safetensors file atomically (temp name in the same directory, then rename).

    Any dtype of :data:`DTYPES` (incl. ml_dtypes bfloat16 / float8) is written; tensors are laid out in
    name order. Used by fixtures and tests to create FP8 / BF16 / sharded checkpoints.

    Raises:
        CheckpointError: an array of a dtype safetensors has no name for.
    """
    arrs = []
    for n in sorted(tensors):
        a = np.ascontiguousarray(tensors[n])
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        arrs.append(StreamedTensor(n, _st_dtype_name(a), a.shape, a.nbytes, (a,)))
    write_streamed(path, arrs, metadata)
    return Path(path)
