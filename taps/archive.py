"""Tap archives: safetensors data segments plus a JSON manifest, written incrementally and atomically,
read lazily.

Layout of an archive directory ``DIR``::

    DIR/manifest.json            format version, producer, backend, dtype, model identity, token ids,
                                 positions, scenario, per-tap dtype / shape / kind / segments
    DIR/chunk-00000.safetensors  one file per flush; holds, per tap flushed, ``<tap>#<seg>`` (rows)
    DIR/chunk-00001.safetensors  and ``<tap>#<seg>.pos`` (int64 absolute positions of those rows)

The manifest's ``chunks`` maps each chunk file to its ``sha256`` and ``bytes``; a reader verifies a
chunk before its first use and refuses a corrupt or truncated one with :class:`ArchiveError` naming
the file. Archives written before ``chunks`` existed are still read (without the checksum check).

Each emit of a tap appends rows (positions first, ``[T, ...]``); repeated emits (chunked prefill,
decode steps) concatenate along positions. The writer builds everything inside ``DIR.tmp-XXXX``
next to ``DIR`` and renames it to ``DIR`` only at :meth:`ArchiveWriter.close`, so an interrupted
run never leaves a half archive at ``DIR``.

Readers (:class:`Archive` on disk, :class:`MemoryArchive` in memory) share the :class:`TapSource`
interface that tap-diff consumes: ``names()``, ``info(name)``, ``positions(name)``,
``read_rows(name, rows)``, ``get(name)``, ``iter_chunks(name, chunk_rows)``.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from reference.errors import EXIT_ENVIRONMENT, UserError

FORMAT_NAME = "qwen4exp-taps"
FORMAT_VERSION = 1
PRODUCER = "qwen4exp-parity"
MANIFEST = "manifest.json"

__all__ = ["ArchiveError", "ArchiveWriteError", "FORMAT_VERSION", "TapInfo", "TapSource", "Archive", "MemoryArchive", "ArchiveWriter",
           "producer_version", "require_manifest", "storable"]


class ArchiveError(UserError, ValueError):
    """A tap archive that is missing, unreadable, corrupt, from a newer format version, or lacks a tap."""


class ArchiveWriteError(ArchiveError):
    """A tap archive that could not be written (full or read-only disk, I/O error); the CLI exits 4
    (``exit_code`` = EXIT_ENVIRONMENT, as :class:`reference.atomic.OutputWriteError`) and nothing is left at the output."""

    exit_code = EXIT_ENVIRONMENT


def require_manifest(p: Path) -> Path:
    """The manifest file of the tap archive directory ``p``: what every reader (and ``taps check``) requires
    before it can look at an archive at all.

    Raises:
        ArchiveError: ``p`` is no directory, or holds no manifest file (naming an interrupted recording's
            leftover directory when one sits beside it).
    """
    tmp = sorted(p.parent.glob(p.name + ".tmp-*")) if p.parent.is_dir() else []
    hint = f" (an interrupted recording left {tmp[0].name} -- delete it)" if tmp else ""
    if not p.is_dir():
        raise ArchiveError(f"tap archive {str(p)!r}: expected a directory holding {MANIFEST}, found "
                           f"{'a file' if p.exists() else 'nothing'}{hint}")
    mf = p / MANIFEST
    if not mf.is_file():
        raise ArchiveError(f"tap archive {str(p)!r}: expected {MANIFEST}, found "
                           f"{'a directory' if mf.is_dir() else 'none'}{hint}")
    return mf


def _write_failed(out, e: BaseException) -> ArchiveWriteError:
    from reference.atomic import write_failure_reason
    return ArchiveWriteError(f"archive output {str(out)!r}: could not be written: {write_failure_reason(e)}")


def file_sha256(path) -> tuple[str, int]:
    """``(sha256 hex digest, size in bytes)`` of file ``path``, read in 1 MiB blocks (bounded memory)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def producer_version() -> str:
    """This package's version string (``qwen4exp-parity``), or ``0+unknown`` when not installed."""
    try:
        from importlib.metadata import version
        return version("qwen4exp-parity")
    except Exception:
        return "0+unknown"


def storable(value) -> np.ndarray:
    """Convert an emitted tap value to a host NumPy array that safetensors can store.

    Accepts NumPy arrays, CuPy arrays (``.get()``), torch tensors and array-likes. Half precision
    floats (float16, ml_dtypes bfloat16 / float8) are upcast exactly to float32; bools and integers
    other than int64/int32 are kept as int64; float32/float64 are kept.

    Returns: a C-contiguous ndarray (a copy when a conversion was needed).
    """
    if hasattr(value, "get") and not isinstance(value, np.ndarray) and type(value).__module__.startswith("cupy"):
        value = value.get()
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    a = np.asarray(value)
    if a.dtype in (np.float32, np.float64, np.int64):
        return np.ascontiguousarray(a)
    if a.dtype.kind == "f" or a.dtype.kind == "V" or "float" in str(a.dtype):  # float16 / ml_dtypes types
        return np.ascontiguousarray(a.astype(np.float32))
    if a.dtype.kind in "iub":
        return np.ascontiguousarray(a.astype(np.int64))
    raise ArchiveError(f"tap value: expected a numeric array, found dtype {a.dtype}")


@dataclass(frozen=True)
class TapInfo:
    """What an archive holds for one tap: ``rows`` recorded positions of ``tail`` shape each."""

    name: str
    dtype: str
    tail: tuple[int, ...]
    rows: int
    kind: str

    @property
    def shape(self) -> tuple[int, ...]:
        """Full array shape ``(rows, *tail)``."""
        return (self.rows, *self.tail)

    @property
    def row_bytes(self) -> int:
        """Bytes per recorded position: ``prod(tail) * itemsize(dtype)``."""
        return int(np.prod(self.tail, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class TapSource:
    """The read interface tap-diff uses. Subclasses implement ``names``, ``info``, ``positions`` and
    ``_segments`` (a list of ``(row_start, row_stop, loader)``; ``loader(a, b)`` returns rows
    ``a:b`` of that segment)."""

    manifest: dict

    # -- metadata
    @property
    def backend(self) -> str | None:
        """The recording backend's name from the manifest (None when absent)."""
        return self.manifest.get("backend")

    @property
    def dtype(self) -> str | None:
        """The recording's compute dtype from the manifest (None when absent)."""
        return self.manifest.get("dtype")

    @property
    def model(self) -> dict:
        """The model description from the manifest (``{}`` when absent)."""
        return self.manifest.get("model") or {}

    @property
    def token_ids(self) -> list[int] | None:
        """The recorded run's token ids from the manifest (None when absent)."""
        return self.manifest.get("token_ids")

    @property
    def scenario(self):
        """The manifest's ``scenario`` entry (None when absent)."""
        return self.manifest.get("scenario")

    def names(self) -> list[str]:
        """Recorded tap names in recording order."""
        return list(self.manifest["order"])

    def has(self, name: str) -> bool:
        """True when tap ``name`` was recorded."""
        return name in self.manifest["taps"]

    def info(self, name: str) -> TapInfo:
        """Dtype, per-row shape, row count and kind of tap ``name``. Raises ArchiveError if absent."""
        t = self._tap(name)
        return TapInfo(name, t["dtype"], tuple(t["tail"]), int(t["rows"]), t.get("kind", "activation"))

    def _tap(self, name: str) -> dict:
        try:
            return self.manifest["taps"][name]
        except KeyError:
            raise ArchiveError(f"{self.where}: tap {name!r}: not recorded in this archive "
                               f"({len(self.manifest['taps'])} taps recorded)") from None

    # -- data
    def positions(self, name: str) -> np.ndarray:
        """int64 ``[rows]``: the absolute position of each recorded row of ``name`` (emit order)."""
        raise NotImplementedError

    def _segments(self, name: str) -> list[tuple[int, int, object]]:
        raise NotImplementedError

    def read_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int array of row indices, any order) of tap ``name``: ``[len(rows), *tail]``.

        Only the segments touched are read; each is sliced to the span of rows needed.
        """
        info = self.info(name)
        rows = np.asarray(rows, dtype=np.int64)
        ragged = self._tap(name).get("ragged", False)
        if ragged:  # rows of different widths (e.g. n_blocks grows with the sequence): pad with -inf
            out = np.full((len(rows), *info.tail), -np.inf, dtype=np.dtype(info.dtype))
        else:
            out = np.empty((len(rows), *info.tail), dtype=np.dtype(info.dtype))
        if len(rows) == 0:
            return out
        if rows.min() < 0 or rows.max() >= info.rows:
            raise ArchiveError(f"{self.where}: tap {name!r}: row index out of range [0, {info.rows})")
        segs = self._segments(name)
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        if hi - lo == len(rows) and np.array_equal(rows, np.arange(lo, hi)):   # fast path: one contiguous run
            for a, b, loader in segs:
                if a <= lo and hi <= b:
                    block = loader(lo - a, hi - a)
                    if tuple(block.shape[1:]) == info.tail:
                        return np.asarray(block)
                    break
        starts = np.array([a for a, _, _ in segs], dtype=np.int64)
        seg_of = np.searchsorted(starts, rows, side="right") - 1
        order = np.argsort(seg_of, kind="stable")
        bounds = np.searchsorted(seg_of[order], np.arange(len(segs) + 1))
        for k in np.unique(seg_of):
            a, b, loader = segs[k]
            sel = order[bounds[k]:bounds[k + 1]]
            lo, hi = int(rows[sel].min()), int(rows[sel].max()) + 1
            block = loader(lo - a, hi - a)
            if ragged and block.shape[-1] != info.tail[-1]:
                out[sel, ..., :block.shape[-1]] = block[rows[sel] - lo]
            else:
                out[sel] = block[rows[sel] - lo]
        return out

    def get(self, name: str) -> np.ndarray:
        """The whole tap ``[rows, *tail]`` in emit order (repeated emits concatenated)."""
        return self.read_rows(name, np.arange(self.info(name).rows))

    def iter_chunks(self, name: str, chunk_rows: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(positions [n], rows [n, *tail])`` of ``name`` in emit order, ``n <= chunk_rows``."""
        pos = self.positions(name)
        for s in range(0, len(pos), max(1, chunk_rows)):
            idx = np.arange(s, min(s + chunk_rows, len(pos)))
            yield pos[idx], self.read_rows(name, idx)

    @property
    def where(self) -> str:
        """How error messages name this source ('archive')."""
        return "archive"


class MemoryArchive(TapSource):
    """An archive held in memory (the Recorder's in-memory mode; tests and the harness)."""

    def __init__(self, manifest: dict, data: dict[str, list[tuple[np.ndarray, np.ndarray]]]):
        self.manifest = manifest
        self._data = data

    def positions(self, name: str) -> np.ndarray:
        """Positions recorded for tap ``name``: int64 ``[rows]``, in row order.

        Raises:
            ArchiveError: ``name`` was not recorded.
        """
        self._tap(name)
        parts = [p for p, _ in self._data[name]]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _segments(self, name):
        out, r = [], 0
        for _, v in self._data[name]:
            out.append((r, r + len(v), (lambda a, b, v=v: v[a:b])))
            r += len(v)
        return out

    @property
    def where(self) -> str:
        """How error messages name this source: 'in-memory archive'."""
        return "in-memory archive"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def json_kind(v) -> str:
    """A JSON value's type as a user reads it, with a short excerpt: ``a string ("1")``."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
    return kind if v is None else f"{kind} ({json.dumps(v)[:40]})"


def check_manifest_schema(m: dict) -> str | None:
    """Check the types of a manifest's fields (format version 1). Returns None when well-formed, else
    one phrase naming the field, what was expected and what was found.

    Checked: ``taps`` (object of tap name -> {dtype str, tail list of ints >= 0, rows int >= 0, kind str,
    ragged bool, segments list of {file: plain file name, key str, rows int >= 0}}, segment rows summing to
    ``rows``), ``order`` (list of recorded tap names), ``chunks`` (absent or an object of file name ->
    {sha256 str, bytes int}), ``token_ids`` (absent, null = not recorded, or a list of ints >= 0),
    ``model`` (absent, null or an object), ``backend``/``dtype`` (absent, null or a string).
    """
    taps = m.get("taps")
    if not isinstance(taps, dict):
        return f"'taps': expected an object of tap name -> entry, found {json_kind(taps)}"
    for name, t in taps.items():
        at = f"'taps'[{name!r}]"
        if not isinstance(t, dict):
            return f"{at}: expected an object, found {json_kind(t)}"
        if not isinstance(t.get("dtype"), str):
            return f"{at}.dtype: expected a string, found {json_kind(t.get('dtype'))}"
        try:
            np.dtype(t["dtype"])
        except TypeError:
            return f"{at}.dtype: expected a numpy dtype name, found {json_kind(t['dtype'])}"
        tail = t.get("tail")
        if not isinstance(tail, list) or not all(_is_int(x) and x >= 0 for x in tail):
            return f"{at}.tail: expected a list of integers >= 0, found {json_kind(tail)}"
        if not _is_int(t.get("rows")) or t["rows"] < 0:
            return f"{at}.rows: expected an integer >= 0, found {json_kind(t.get('rows'))}"
        if "kind" in t and not isinstance(t["kind"], str):
            return f"{at}.kind: expected a string, found {json_kind(t['kind'])}"
        if "ragged" in t and not isinstance(t["ragged"], bool):
            return f"{at}.ragged: expected true or false, found {json_kind(t['ragged'])}"
        segs = t.get("segments")
        if not isinstance(segs, list):
            return f"{at}.segments: expected a list, found {json_kind(segs)}"
        total = 0
        for i, sg in enumerate(segs):
            if not isinstance(sg, dict):
                return f"{at}.segments[{i}]: expected an object, found {json_kind(sg)}"
            f = sg.get("file")
            if not isinstance(f, str) or not f or "/" in f or "\\" in f or f in (".", ".."):
                return f"{at}.segments[{i}].file: expected a file name inside the archive, found {json_kind(f)}"
            if not isinstance(sg.get("key"), str):
                return f"{at}.segments[{i}].key: expected a string, found {json_kind(sg.get('key'))}"
            if not _is_int(sg.get("rows")) or sg["rows"] < 0:
                return f"{at}.segments[{i}].rows: expected an integer >= 0, found {json_kind(sg.get('rows'))}"
            total += sg["rows"]
        if total != t["rows"]:
            return f"{at}: expected segment rows summing to rows={t['rows']}, found {total}"
    order = m.get("order")
    if not isinstance(order, list) or not all(isinstance(x, str) for x in order):
        return f"'order': expected a list of tap names, found {json_kind(order)}"
    missing = [x for x in order if x not in taps]
    if missing:
        return f"'order': expected names of recorded taps, found {missing[0]!r} not in 'taps'"
    extra = [n for n in taps if n not in order]
    if extra:   # a reader lists the taps by 'order': a tap outside it would be silently left out of a diff
        return f"'order': expected every recorded tap, found {extra[0]!r} missing from it"
    if len(set(order)) != len(order):
        return "'order': expected each tap once, found a repeat"
    if "chunks" in m:
        ch = m["chunks"]
        if not isinstance(ch, dict):
            return f"'chunks': expected an object of file name -> {{sha256, bytes}}, found {json_kind(ch)}"
        for fname, e in ch.items():
            if not isinstance(e, dict):
                return f"'chunks'[{fname!r}]: expected an object with sha256 and bytes, found {json_kind(e)}"
            if "sha256" in e and not isinstance(e["sha256"], str):
                return f"'chunks'[{fname!r}].sha256: expected a string, found {json_kind(e['sha256'])}"
            if "bytes" in e and (not _is_int(e["bytes"]) or e["bytes"] < 0):
                return f"'chunks'[{fname!r}].bytes: expected an integer >= 0, found {json_kind(e['bytes'])}"
    if m.get("token_ids") is not None:
        ids = m["token_ids"]
        if not isinstance(ids, list):
            return f"'token_ids': expected a list of integers (or null: not recorded), found {json_kind(ids)}"
        bad = next((i for i, x in enumerate(ids) if not _is_int(x) or x < 0), None)
        if bad is not None:
            return f"'token_ids': expected integers >= 0, found {json_kind(ids[bad])} at index {bad}"
    if m.get("model") is not None and not isinstance(m["model"], dict):
        return f"'model': expected an object (or null), found {json_kind(m['model'])}"
    for k in ("backend", "dtype"):
        if m.get(k) is not None and not isinstance(m[k], str):
            return f"'{k}': expected a string (or null), found {json_kind(m[k])}"
    return None


class Archive(TapSource):
    """A tap archive on disk, read lazily (manifest at open; data per segment slice on demand)."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self._handles: dict[str, object] = {}
        self._pos_cache: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, path) -> "Archive":
        """Open archive directory ``path``.

        Raises:
            ArchiveError: not a directory / no manifest / unreadable manifest / not a tap archive /
                written by a newer format version than this reader understands.
        """
        p = Path(path)
        mf = require_manifest(p)
        try:
            manifest = json.loads(mf.read_text())
        except (OSError, ValueError) as e:
            raise ArchiveError(f"tap archive {str(p)!r}: {MANIFEST} is not readable JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise ArchiveError(f"tap archive {str(p)!r}: expected format {FORMAT_NAME!r}, found "
                               f"{manifest.get('format') if isinstance(manifest, dict) else type(manifest).__name__!r}")
        ver = manifest.get("format_version")
        if not _is_int(ver) or ver < 1:
            raise ArchiveError(f"tap archive {str(p)!r}: {MANIFEST} 'format_version': expected an integer >= 1, "
                               f"found {json_kind(ver) if 'format_version' in manifest else 'none'}")
        if ver > FORMAT_VERSION:
            raise ArchiveError(f"tap archive {str(p)!r}: format version {ver!r} is newer than this reader supports "
                               f"(up to {FORMAT_VERSION}); upgrade qwen4exp-parity (producer was "
                               f"{manifest.get('producer')})")
        for k in ("taps", "order"):
            if k not in manifest:
                raise ArchiveError(f"tap archive {str(p)!r}: {MANIFEST} lacks {k!r}")
        problem = check_manifest_schema(manifest)
        if problem:
            raise ArchiveError(f"tap archive {str(p)!r}: {MANIFEST} {problem}")
        return cls(p, manifest)

    @property
    def where(self) -> str:
        """How error messages name this source: ``tap archive '<path>'``."""
        return f"tap archive {str(self.path)!r}"

    def _corrupt(self, fname: str, why: str) -> ArchiveError:
        return ArchiveError(f"{self.where}: data file {fname!r} is corrupt or truncated ({why}); re-record "
                            f"the archive")

    def verify_file(self, fname: str) -> None:
        """Check chunk ``fname`` against the manifest's ``chunks`` entry (size and sha256).

        Archives without a ``chunks`` entry for the file (older writers) pass unchecked.

        Raises:
            ArchiveError: the file is missing, or its size or sha256 differs from the manifest.
        """
        fp = self.path / fname
        if not fp.is_file():
            raise ArchiveError(f"{self.where}: data file {fname!r} named in the manifest is missing")
        want = (self.manifest.get("chunks") or {}).get(fname)
        if not isinstance(want, dict):
            return
        size = fp.stat().st_size
        if "bytes" in want and size != int(want["bytes"]):
            raise self._corrupt(fname, f"expected {int(want['bytes'])} bytes, found {size}")
        if "sha256" in want:
            got, _ = file_sha256(fp)
            if got != want["sha256"]:
                raise self._corrupt(fname, f"sha256 expected {want['sha256'][:16]}..., found {got[:16]}...")

    def _file(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            from safetensors import safe_open
            self.verify_file(fname)
            try:
                h = safe_open(str(self.path / fname), framework="np")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise self._corrupt(fname, f"safetensors: {e}") from None
            self._handles[fname] = h
        return h

    def _load(self, fname: str, key: str, a: int | None = None, b: int | None = None) -> np.ndarray:
        """Tensor ``key`` of chunk ``fname`` (rows ``a:b`` when given); read errors name the file."""
        h = self._file(fname)
        try:
            return h.get_tensor(key) if a is None else h.get_slice(key)[a:b]
        except Exception as e:  # noqa: BLE001
            raise self._corrupt(fname, f"reading {key!r}: {type(e).__name__}: {e}") from None

    def positions(self, name: str) -> np.ndarray:
        """Positions recorded for tap ``name``: int64 ``[rows]``, in row order (read once, then cached).

        Raises:
            ArchiveError: ``name`` was not recorded, or a segment's position count differs from its ``rows``.
        """
        if name not in self._pos_cache:
            t = self._tap(name)
            parts = []
            for s in t["segments"]:
                p = np.asarray(self._load(s["file"], s["key"] + ".pos")).reshape(-1)
                if len(p) != int(s["rows"]):
                    raise self._corrupt(s["file"], f"{s['key']}.pos: expected {int(s['rows'])} positions, "
                                                   f"found {len(p)}")
                parts.append(p)
            self._pos_cache[name] = (np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64))
        return self._pos_cache[name]

    def _segments(self, name):
        out, r = [], 0
        for s in self._tap(name)["segments"]:
            n = int(s["rows"])

            def load(a, b, s=s):
                return self._load(s["file"], s["key"], a, b)
            out.append((r, r + n, load))
            r += n
        return out


def _same_shape(t: dict, rows: np.ndarray) -> bool:
    """Does ``rows`` fit tap entry ``t`` (same dtype and per-row shape; any last dim when ragged)?"""
    if t["dtype"] != str(rows.dtype) or len(t["tail"]) != rows.ndim - 1:
        return False
    if t.get("ragged"):
        return tuple(t["tail"][:-1]) == tuple(rows.shape[1:-1])
    return tuple(t["tail"]) == tuple(rows.shape[1:])


def _concat_rows(parts: list[np.ndarray], ragged: bool) -> np.ndarray:
    """Concatenate emitted row blocks; ragged blocks are padded to the widest with -inf."""
    if ragged and len({p.shape[-1] for p in parts}) > 1:
        w = max(p.shape[-1] for p in parts)
        parts = [p if p.shape[-1] == w else np.concatenate(
            [p, np.full((*p.shape[:-1], w - p.shape[-1]), -np.inf, dtype=p.dtype)], axis=-1) for p in parts]
    return np.concatenate(parts)


class ArchiveWriter:
    """Incremental, atomic archive writer.

    ``add(name, rows, positions, kind)`` buffers; once ``flush_bytes`` are buffered everything
    pending goes to a new ``chunk-NNNNN.safetensors``. ``close(manifest_fields)`` flushes, writes the
    manifest and renames ``DIR.tmp-XXXX`` to ``DIR``; ``abort()`` removes the temporary directory.

    Raises:
        ArchiveError: ``DIR`` already exists (and ``overwrite`` is False), or its parent is missing.
    """

    def __init__(self, out_dir, flush_bytes: int = 64 << 20, overwrite: bool = False):
        from reference.atomic import write_target
        self.out = Path(out_dir)
        # a symbolic link is written through: its target gets the archive and the link is kept (README "Paths")
        self.dest = write_target(self.out)
        if self.dest.exists() and not self.dest.is_dir():   # even with overwrite: never replace a file by an archive
            raise ArchiveError(f"archive output {str(self.out)!r}: expected a directory path (an archive is a "
                               f"directory), found an existing file")
        if self.dest.exists() and not overwrite:
            raise ArchiveError(f"archive output {str(self.out)!r}: expected a new path, found an existing "
                               f"directory (remove it or pass --overwrite)")
        parent = self.dest.parent
        if parent.exists() and not parent.is_dir():
            raise ArchiveError(f"archive output {str(self.out)!r}: expected a parent directory, found "
                               f"{str(parent)!r} is a file")
        if not parent.is_dir():
            raise ArchiveError(f"archive output {str(self.out)!r}: parent directory does not exist")
        self.overwrite = overwrite
        self.tmp = Path(tempfile.mkdtemp(prefix=self.dest.name + ".tmp-", dir=self.dest.parent))
        self.flush_bytes = int(flush_bytes)
        self._pending: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._pending_bytes = 0
        self._taps: dict[str, dict] = {}
        self._order: list[str] = []
        self._chunk = 0
        self._chunks: dict[str, dict] = {}
        self.closed = False

    def add(self, name: str, rows: np.ndarray, positions: np.ndarray, kind: str = "activation",
            ragged: bool = False) -> None:
        """Append ``rows [T, ...]`` at int64 ``positions [T]`` to tap ``name``. ``ragged``: the last
        dimension may differ between emits (the reader pads narrower rows with -inf).

        Raises:
            ArchiveError: the per-row shape or dtype differs from the tap's earlier emits.
        """
        t = self._taps.get(name)
        if t is None:
            t = {"dtype": str(rows.dtype), "tail": list(rows.shape[1:]), "rows": 0, "kind": kind, "segments": []}
            if ragged:
                t["ragged"] = True
            self._taps[name] = t
            self._order.append(name)
        elif not _same_shape(t, rows):
            raise ArchiveError(f"tap {name!r}: expected rows of shape {tuple(t['tail'])} {t['dtype']} like its "
                               f"earlier emits, found {tuple(rows.shape[1:])} {rows.dtype}")
        if t.get("ragged") and rows.ndim > 1:
            t["tail"][-1] = max(t["tail"][-1], rows.shape[-1])
        t["rows"] += len(rows)
        self._pending.setdefault(name, []).append((positions, rows))
        self._pending_bytes += rows.nbytes + positions.nbytes
        if self._pending_bytes >= self.flush_bytes:
            try:
                self.flush()
            except ArchiveWriteError:
                self.abort()
                raise

    def flush(self) -> None:
        """Write everything pending to the next chunk file (written to a temp name, then renamed)."""
        if not self._pending:
            return
        from safetensors.numpy import save_file
        fname = f"chunk-{self._chunk:05d}.safetensors"
        tensors = {}
        for name, parts in self._pending.items():
            t = self._taps[name]
            key = f"{name}#{len(t['segments'])}"
            pos = np.concatenate([p for p, _ in parts]).astype(np.int64)
            rows = _concat_rows([r for _, r in parts], t.get("ragged", False))
            tensors[key] = np.ascontiguousarray(rows)
            tensors[key + ".pos"] = np.ascontiguousarray(pos)
            t["segments"].append({"file": fname, "key": key, "rows": int(len(rows)),
                                  "pos_min": int(pos.min()) if len(pos) else 0,
                                  "pos_max": int(pos.max()) if len(pos) else -1})
        # written straight into the unpublished temp directory: the whole archive appears at once in close()
        try:
            save_file(tensors, str(self.tmp / fname))
            digest, size = file_sha256(self.tmp / fname)
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (no errno) on a full disk, OSError
            raise _write_failed(self.out, e) from None
        self._chunks[fname] = {"sha256": digest, "bytes": size}
        self._pending.clear()
        self._pending_bytes = 0
        self._chunk += 1

    def close(self, fields: dict) -> Path:
        """Flush, write the manifest (``fields`` merged into it) and publish ``DIR``. Returns ``DIR``.

        Raises:
            ArchiveWriteError: a chunk or the manifest could not be written (the temporary directory is
                removed: nothing is left at or beside ``DIR``).
        """
        try:
            self.flush()
        except BaseException:
            self.abort()
            raise
        manifest = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "producer": {"name": PRODUCER, "version": producer_version()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **fields,
            "order": list(self._order), "taps": self._taps, "chunks": dict(self._chunks),
        }
        try:
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if self.dest.exists() or self.dest.is_symlink():
                if not self.dest.is_dir() or self.dest.is_symlink():
                    raise ArchiveError(f"archive output {str(self.out)!r}: expected a directory path, found "
                                       f"an existing file")
                if not self.overwrite:
                    raise ArchiveError(f"archive output {str(self.out)!r}: expected a new path, found an "
                                       f"existing directory (remove it or pass --overwrite)")
            from reference.atomic import swap_in_dir
            swap_in_dir(self.tmp, self.dest)  # umask modes; an old archive set aside and restored on failure
        except BaseException as e:
            shutil.rmtree(self.tmp, ignore_errors=True)   # nothing half-written is left behind
            if isinstance(e, OSError):
                raise _write_failed(self.out, e) from None
            raise
        self.closed = True
        return self.out

    def abort(self) -> None:
        """Discard the temporary directory (nothing appears at ``DIR``)."""
        self._pending.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.closed = True
