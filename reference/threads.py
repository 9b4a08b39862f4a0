"""The host threads the reference spreads row-independent NumPy work over (NumPy releases the GIL inside its
loops, so row blocks run in parallel; a function of each row alone gives bitwise the result of one pass)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["host_threads", "map_rows", "MAP_MIN_ELEMENTS"]

#: below this many elements an array is processed in one pass (a thread hand-off costs ~20 us; 1M float32
#: elements of an element-wise function take ~1-3 ms on one core)
MAP_MIN_ELEMENTS = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_n = 0
_lock = threading.Lock()
_inside = threading.local()


def host_threads() -> int:
    """The CPUs this process may run on, at most ``$OMP_NUM_THREADS`` when that is set (a run given part of the
    cores keeps to them); at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    cap = os.environ.get("OMP_NUM_THREADS", "")
    if cap.isdigit() and int(cap) > 0:
        n = min(n, int(cap))
    return max(1, n)


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_n
    with _lock:
        if _pool is None or _pool_n != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_n = ThreadPoolExecutor(n, thread_name_prefix="reference-rows"), n
        return _pool


def map_rows(fn, x: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    """``fn(x, *rest)`` computed on blocks of rows (axis 0) on :func:`host_threads` threads and concatenated.

    ``fn`` must treat each row of its arguments alone (element-wise functions, per-row norms): the result is then
    bitwise ``fn(x, *rest)``. ``rest``: arrays with the same first axis as ``x``, cut alike. Small arrays
    (< :data:`MAP_MIN_ELEMENTS`), 0-d arrays and calls from inside a block run in one pass.
    Returns what ``fn`` returns for the whole array (shape along axis 0 preserved).
    """
    n = host_threads()
    if n == 1 or x.ndim == 0 or x.shape[0] < 2 or x.size < MAP_MIN_ELEMENTS or getattr(_inside, "on", False):
        return fn(x, *rest)
    k = min(n, x.shape[0])
    edges = np.linspace(0, x.shape[0], k + 1).astype(int)

    def part(i):
        _inside.on = True
        try:
            s, e = edges[i], edges[i + 1]
            return fn(x[s:e], *(r[s:e] for r in rest))
        finally:
            _inside.on = False
    return np.concatenate(list(_executor(n).map(part, range(k))), axis=0)
