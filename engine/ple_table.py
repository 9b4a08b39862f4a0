"""PLE n-gram table placement for the engine.

The table (``ple.ple_embedding.ngram_embedding``, ``padded_rows x head_dim``; 51.2B values on the real
model) is host-resident by default: the shared :class:`reference.checkpoint.Checkpoint` memory-maps its
shards and :meth:`Checkpoint.ngram_rows` gathers only the hashed rows of a step. On a CUDA device those
rows go through a reusable pinned staging buffer and one asynchronous host->device copy (no
device->host traffic: the n-gram ids are hashed on the host from the token ids the host feeds).
``placement="device"`` uploads the whole table once and gathers rows on the device.

Source of the table layout: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.__init__`` / ``forward``
(rows of ``head_dim`` values, one row per (token, hash head), heads concatenated).
"""
from __future__ import annotations

import numpy as np

from reference.errors import InputError

__all__ = ["PLETable"]


class PLETable:
    """Row gatherer of one PLE layer's n-gram table.

    Args:
        ck: the checkpoint (``ngram_rows(layer, rows)`` is used).
        layer: 0-based PLE layer index.
        xp: numpy or cupy (where the gathered rows are needed).
        placement: 'host' (memory map, default) or 'device' (whole table on the device).
    Raises:
        InputError: unknown placement.
    """

    def __init__(self, ck, layer: int, xp, placement: str = "host"):
        if placement not in ("host", "device"):
            raise InputError(f"ple_placement: expected 'host' or 'device', found {placement!r}")
        self.ck = ck
        self.layer = int(layer)
        self.xp = xp
        self.placement = placement
        lay = ck.config.ple_layout(layer)
        self.rows_total = lay.padded_rows
        self.head_dim = lay.head_dim
        self._pinned = None
        self._table = None
        self.rows_moved = 0  # rows copied host->device (bench/perf accounting)
        if placement == "device":
            self._table = xp.empty((self.rows_total, self.head_dim), np.float32)
            step = 1 << 20
            for a in range(0, self.rows_total, step):
                b = min(self.rows_total, a + step)
                self._table[a:b] = xp.asarray(self._host_rows(np.arange(a, b, dtype=np.int64)))

    def _host_rows(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.ck.ngram_rows(self.layer, rows), dtype=np.float32)

    def nbytes_device(self) -> int:
        """Device bytes held by the table (0 when host-resident, apart from staging)."""
        return 0 if self._table is None else int(self._table.nbytes)

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
        host = self._host_rows(rows.reshape(-1)).reshape(T, H * self.head_dim)
        self.rows_moved += rows.size
        if xp is np:
            return host
        return self._upload(host)

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
