"""Tap recorder: the one hook every producer (reference, engine) calls.

Producers do::

    from reference import taphook
    rec = taphook.current()
    if rec is not None:
        rec.emit("layers.3.self_attn.indexer.selected_blocks", ids, positions=pos, scores=block_scores)

When no recorder is active ``current()`` returns None and nothing is computed or copied. A producer
may also ask ``rec.wants(name)`` before building an expensive tap value.

A :class:`Recorder` is a context manager that makes itself ``current()`` for its block::

    with Recorder("run.taps", include=["layers.*.mlp.*"], layers=range(0, 4), positions="0:64",
                  cap_bytes=2 << 30, meta={"backend": "reference", "token_ids": ids}) as rec:
        model.forward(ids)
    arc = rec.archive()            # taps.archive.Archive (or MemoryArchive without a directory)

With a directory, rows stream to disk as they are emitted (bounded memory; see
:mod:`taps.archive`) and the archive appears at the directory only when the block exits without
an exception. Without one, everything is kept in memory (tests, the harness).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from reference.errors import UserError
from taps import registry
from taps.archive import _same_shape, ArchiveWriter, MemoryArchive, TapSource, storable, FORMAT_NAME, FORMAT_VERSION, \
    PRODUCER, producer_version

from reference.taphook import current, reset_current, set_current  # noqa: E402  (the one hook; re-exported)

__all__ = ["current", "Recorder", "TapError", "TapCapError", "parse_positions", "parse_layers", "tap_row_shape",
           "format_ranges", "position_ranges"]


class TapError(UserError, ValueError):
    """A bad tap request or emit: unknown filter syntax, mismatched positions, wrong shapes."""


class TapCapError(TapError):
    """Recording would exceed the recorder's byte cap."""


# ---------------------------------------------------------------- filters
_RANGE_RE = re.compile(r"^\s*(-?\d*)\s*:\s*(-?\d*)\s*(?::\s*(\d+)\s*)?$")


def parse_positions(spec, what: str = "positions") -> np.ndarray | None:
    """A positions spec -> sorted unique int64 array of absolute positions, or None for all.

    Accepts None / ``"all"`` / ``""``, an iterable of ints, a ``range``, or a string of comma-separated
    items each ``N`` or ``A:B`` / ``A:B:S`` (half-open, like Python slices; ``A`` defaults to 0).

    Raises:
        TapError: syntax errors, negative positions, an open-ended ``A:`` range. Messages start with
            ``what`` (e.g. ``"--layers"``), the name of the option the spec came from.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "all")):
        return None
    if isinstance(spec, range) or (not isinstance(spec, str) and hasattr(spec, "__iter__")):
        arr = np.asarray(list(spec), dtype=np.int64)
    else:
        out: list[int] = []
        for item in str(spec).split(","):
            m = _RANGE_RE.match(item)
            if m:
                a = int(m.group(1)) if m.group(1) else 0
                if not m.group(2):
                    raise TapError(f"{what} {spec!r}: item {item.strip()!r}: expected a closed range A:B "
                                   f"(the total length is not known while recording), found an open end")
                b = int(m.group(2))
                s = int(m.group(3)) if m.group(3) else 1
                out.extend(range(a, b, s))
            else:
                try:
                    out.append(int(item))
                except ValueError:
                    raise TapError(f"{what} {spec!r}: item {item.strip()!r}: expected N, A:B or A:B:S") from None
        arr = np.asarray(out, dtype=np.int64)
    if len(arr) and arr.min() < 0:
        raise TapError(f"{what} {spec!r}: expected {'layer indices' if 'layer' in what else 'absolute positions'} >= 0, found {int(arr.min())}")
    return np.unique(arr)


def parse_layers(spec, what: str = "layers") -> set[int] | None:
    """A layers filter -> set of 0-based layer indices, or None for all. Accepts None, a ``range``,
    an iterable of ints, or the string syntax of :func:`parse_positions` (errors name ``what``)."""
    p = parse_positions(spec, what)
    return None if p is None else set(int(x) for x in p)


def _shape_env(config, n_positions: int) -> dict:
    env = {f: getattr(config, f) for f in ("hidden_size", "hc_count", "num_attention_heads", "head_dim",
                                            "num_experts", "num_experts_per_tok", "ple_embed_dim",
                                            "linear_num_value_heads", "linear_value_head_dim", "vocab_size",
                                            "num_key_value_heads", "linear_conv_kernel_dim", "indexer_n_heads",
                                            "indexer_head_dim")}
    env["key_dim"] = config.linear_key_dim
    env["value_dim"] = config.linear_value_dim
    env["ngram_heads"] = config.ngram_heads
    if config.indexer_compress_ratio:
        env["block_topk"] = config.block_topk
        env["indexer_budget"] = config.indexer_budget
        env["indexer_compress_ratio"] = config.indexer_compress_ratio
        env["n_blocks"] = max(1, math.ceil(n_positions / config.indexer_compress_ratio))
    return env


def tap_row_shape(spec: registry.TapSpec, config, n_positions: int = 1) -> tuple[int, ...]:
    """The per-position shape (everything after ``T``) of a tap spec for ``config``; ``n_blocks`` is
    taken for a sequence of ``n_positions`` tokens (its maximum)."""
    dims = [d.strip() for d in spec.shape.strip()[1:-1].split(",")][1:]
    env = _shape_env(config, n_positions)
    out = []
    for d in dims:
        out.append(int(eval(d, {"__builtins__": {}}, env)))  # registry-owned expressions over config fields
    return tuple(out)


def format_ranges(ranges) -> str:
    """Half-open ``[[start, stop), ...]`` runs (a manifest's ``positions``) as ``'9..9, 13..20'``."""
    return ", ".join(f"{int(a)}..{int(b) - 1}" for a, b in ranges) if ranges else "none"


def position_ranges(positions) -> list[list[int]]:
    """Positions (any order, repeats allowed) as sorted half-open ``[start, stop)`` runs."""
    return _ranges(np.unique(np.asarray(list(positions), dtype=np.int64)))


def _ranges(pos: np.ndarray) -> list[list[int]]:
    """Sorted unique positions as half-open ``[start, stop)`` runs (the manifest's ``positions``)."""
    if len(pos) == 0:
        return []
    cuts = np.nonzero(np.diff(pos) != 1)[0] + 1
    return [[int(r[0]), int(r[-1]) + 1] for r in np.split(pos, cuts)]


# ---------------------------------------------------------------- recorder
class Recorder:
    """Record emitted taps, filtered by name glob, layer and position, into an archive.

    Args:
        out_dir: archive directory to create (must not exist), or None for in-memory recording.
        include: name globs (``fnmatch``, e.g. ``layers.*.mlp.*``); None records every tap. An included
            index tap brings its companion score tap along (tap-diff needs it to judge flips).
        layers: 0-based layer filter (range / ints / ``"0:4,7"``); taps outside layers always pass.
        positions: absolute positions to keep (see :func:`parse_positions`); None keeps all. Rows
            dropped by it are summarised in the manifest's ``outside_positions`` ({positions: runs,
            taps: names}; only when something was dropped) -- tap-diff treats such a tap as no-overlap.
        cap_bytes: maximum bytes of tap data; an emit that would exceed it raises :class:`TapCapError`
            (inside the recorded run, so a directory recording is then discarded).
        store_dtype: cast float taps to this dtype when stored (e.g. ``"float32"`` for a float64 run).
        flush_bytes: buffered bytes that trigger writing a chunk file (directory mode).
        meta: manifest fields: ``backend``, ``dtype``, ``model`` ({config_hash, weights_fingerprint}),
            ``token_ids``, ``scenario`` ... (also settable later with :meth:`set_meta`).
        overwrite: replace an existing ``out_dir`` at close.
    """

    def __init__(self, out_dir=None, include=None, layers=None, positions=None, cap_bytes: int | None = None,
                 store_dtype=None, flush_bytes: int = 64 << 20, meta: dict | None = None, overwrite: bool = False):
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.include = list(include) if include else None
        if isinstance(include, str):
            self.include = [include]
        self.layers = parse_layers(layers)
        self.positions = parse_positions(positions)
        self.cap_bytes = cap_bytes
        self.store_dtype = None if store_dtype is None else np.dtype(store_dtype)
        self.flush_bytes = flush_bytes
        self.overwrite = overwrite
        self.meta: dict = dict(meta or {})
        self.bytes_recorded = 0
        self.n_emits = 0
        self._writer: ArchiveWriter | None = None
        self._mem: dict[str, list] = {}
        self._kinds: dict[str, str] = {}
        self._order: list[str] = []
        self._explicit: set[str] = set()
        self._wants: dict[str, bool] = {}
        self._last_pos: dict[str, int] = {}
        self._mem_tap: dict[str, dict] = {}
        self._seen = np.zeros(0, np.int64)
        self._outside = np.zeros(0, np.int64)   # positions emitted but outside the ``positions`` filter
        self._outside_names: dict[str, None] = {}
        self._token = None
        self._result: TapSource | None = None
        self._closed = False

    # -- filters
    def wants(self, name: str) -> bool:
        """Whether an emit of ``name`` would record anything (name and layer filters only)."""
        w = self._wants.get(name)
        if w is None:
            w = self._name_ok(name)
            layer = registry.layer_of(name)
            if w and self.layers is not None and layer is not None and layer not in self.layers:
                w = False
            self._wants[name] = w
        return w

    def _name_ok(self, name: str) -> bool:
        if registry.matches(name, self.include):
            return True
        # companion score taps ride along with an included index tap
        layer = registry.layer_of(name)
        for s in registry.specs() + registry.mtp_specs():
            if s.companion is not None:
                comp = s.companion if layer is None else s.companion.replace("{i}", str(layer))
                if comp == name:
                    idx = s.pattern if layer is None else s.pattern.replace("{i}", str(layer))
                    if registry.matches(idx, self.include):
                        return True
        return False

    # -- context management
    def __enter__(self) -> "Recorder":
        if self._token is not None or self._closed:
            raise TapError("Recorder: expected a fresh recorder, found one already entered or closed")
        if self.out_dir is not None:
            self._writer = ArchiveWriter(self.out_dir, flush_bytes=self.flush_bytes, overwrite=self.overwrite)
        self._token = set_current(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        reset_current(self._token)
        self._token = None
        self._closed = True
        if self._writer is not None:
            if exc_type is None:
                self._writer.close(self._manifest_fields())
            else:
                self._writer.abort()
        return False

    def set_meta(self, **fields) -> None:
        """Add or replace manifest fields (backend, dtype, model, token_ids, scenario, ...)."""
        self.meta.update(fields)

    def _manifest_fields(self) -> dict:
        f = {"backend": None, "dtype": None, "model": {}, "token_ids": None, "scenario": None}
        f.update({k: v for k, v in self.meta.items()})
        if f.get("token_ids") is not None:
            f["token_ids"] = [int(x) for x in f["token_ids"]]
        f["registry_version"] = registry.REGISTRY_VERSION
        f["filters"] = {"include": self.include,
                        "layers": None if self.layers is None else sorted(self.layers),
                        "positions": None if self.positions is None else [int(p) for p in self.positions]}
        f["bytes"] = int(self.bytes_recorded)
        f["positions"] = _ranges(self._seen)
        if len(self._outside):   # what the positions filter dropped: tells a wrong-position run from a silent one
            f["outside_positions"] = {"positions": _ranges(self._outside), "taps": list(self._outside_names)}
        return f

    def archive(self) -> TapSource:
        """The finished recording: :class:`taps.archive.Archive` (directory) or :class:`MemoryArchive`.

        Raises:
            TapError: the recorder is still active, or its run failed (nothing was written).
        """
        if not self._closed:
            raise TapError("Recorder.archive(): expected a finished recording, found it still active")
        if self._result is None:
            if self._writer is not None:
                if not self._writer.closed or not self.out_dir.exists():
                    raise TapError(f"Recorder.archive(): the recording to {str(self.out_dir)!r} was aborted")
                from taps.archive import Archive
                self._result = Archive.open(self.out_dir)
            else:
                taps = {n: dict(self._mem_tap[n]) for n in self._order}
                manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                            "producer": {"name": PRODUCER, "version": producer_version()},
                            **self._manifest_fields(), "order": list(self._order), "taps": taps}
                self._result = MemoryArchive(manifest, self._mem)
        return self._result

    # -- the hook
    def emit(self, name: str, value, positions=None, scores=None) -> None:
        """Record ``value`` (``[T, ...]``) of tap ``name`` at absolute ``positions`` (int ``[T]``).

        ``positions=None`` continues after the tap's previous rows (0, 1, ... on the first emit).
        ``scores``: for index taps, the companion scores (``[T, ...]``) the selection was made on;
        recorded under the registry's companion name unless the producer emits that tap itself.

        Raises:
            TapError: ``len(positions) != value.shape[0]``, a 0-d value, or shapes changing between emits.
            TapCapError: the cap would be exceeded.
        """
        if not self.wants(name):
            if scores is not None:
                self._emit_scores(name, scores, positions)
            return
        self._explicit.add(name)
        self._record(name, value, positions)
        if scores is not None:
            self._emit_scores(name, scores, positions)

    def _emit_scores(self, name, scores, positions):
        spec = registry.spec_for(name)
        if spec is None or spec.companion is None:
            return
        layer = registry.layer_of(name)
        comp = spec.companion if layer is None else spec.companion.replace("{i}", str(layer))
        if comp in self._explicit or not self.wants(comp):
            return
        self._record(comp, scores, positions)

    def _record(self, name, value, positions):
        a = storable(value)
        if a.ndim == 0:
            raise TapError(f"tap {name!r}: expected a value of shape [T, ...], found a scalar")
        if positions is None:
            prev = self._last_pos.get(name, -1)
            pos = np.arange(prev + 1, prev + 1 + a.shape[0], dtype=np.int64)
        else:
            pos = storable(positions).astype(np.int64, copy=False).reshape(-1)   # host copy (cupy ok)
            if len(pos) != a.shape[0]:
                raise TapError(f"tap {name!r}: expected {a.shape[0]} positions (value shape {a.shape}), "
                               f"found {len(pos)}")
        if len(pos):
            self._last_pos[name] = int(pos[-1])
        if self.positions is not None:
            keep = np.isin(pos, self.positions)
            if not keep.all():
                self._outside = np.union1d(self._outside, pos[~keep])
                self._outside_names[name] = None
                a, pos = a[keep], pos[keep]
        if a.shape[0] == 0:
            return
        if self.store_dtype is not None and a.dtype.kind == "f" and a.dtype != self.store_dtype:
            a = a.astype(self.store_dtype)
        nbytes = a.nbytes + pos.nbytes
        if self.cap_bytes is not None and self.bytes_recorded + nbytes > self.cap_bytes:
            raise TapCapError(f"tap recording: cap of {self.cap_bytes} bytes exceeded at tap {name!r} "
                              f"({self.bytes_recorded} recorded + {nbytes} more); narrow --taps/--layers/"
                              f"--positions or raise the cap")
        self.bytes_recorded += nbytes
        self._seen = np.union1d(self._seen, pos)
        self.n_emits += 1
        spec = registry.spec_for(name)
        kind = spec.kind if spec is not None else "activation"
        ragged = spec is not None and "n_blocks" in spec.shape
        if self._writer is not None:
            self._writer.add(name, a, pos, kind, ragged=ragged)
        else:
            if name not in self._mem:
                self._mem[name] = []
                self._kinds[name] = kind
                self._order.append(name)
                self._mem_tap[name] = {"dtype": str(a.dtype), "tail": list(a.shape[1:]), "rows": 0, "kind": kind,
                                       "segments": [], **({"ragged": True} if ragged else {})}
            t = self._mem_tap[name]
            if not _same_shape(t, a):
                raise TapError(f"tap {name!r}: expected rows of shape {tuple(t['tail'])} {t['dtype']} like its "
                               f"earlier emits, found {a.shape[1:]} {a.dtype}")
            if ragged and a.ndim > 1:
                t["tail"][-1] = max(t["tail"][-1], a.shape[-1])
            t["rows"] += len(a)
            self._mem[name].append((pos.copy(), np.array(a, copy=True)))

    # -- sizing
    @staticmethod
    def estimate(config, n_positions: int, include=None, layers=None, dtype_bytes: int = 4) -> int:
        """Bytes a recording of ``n_positions`` positions would take for ``config`` with these filters.

        Float taps count ``dtype_bytes`` per element, index taps 8 (int64), plus 8 bytes per row of
        positions. ``n_blocks`` taps are counted at their maximum width (a slight over-estimate).
        """
        rec = Recorder(include=include, layers=layers)
        total = 0
        for name in registry.tap_names(config):
            if not rec.wants(name):
                continue
            spec = registry.spec_for(name)
            row = int(np.prod(tap_row_shape(spec, config, n_positions), dtype=np.int64))
            item = 8 if spec.dtype == "int64" else dtype_bytes
            total += n_positions * (row * item + 8)
        return int(total)
