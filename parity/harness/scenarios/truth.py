"""The truth a scenario case is judged against: the reference model's full forward over a sequence's history,
cached (:class:`TruthCache`), and the inconclusive outcome of a truth that is not finite."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from parity.harness.floor import logged_logits
from reference.errors import InconclusiveError, first_nonfinite

__all__ = ["TruthCache", "NonFiniteTruth", "check_truth_finite"]


class NonFiniteTruth(InconclusiveError):
    """The truth (the reference's full-forward logits) holds NaN or infinity: nothing can be judged
    against it (exit 3). ``position``: the first non-finite position."""

    def __init__(self, position: int, value: float, what: str = "reference logits"):
        super().__init__(f"the truth is invalid: {what} at position {position} are not finite (found {value}); "
                         f"the checkpoint's weights or inputs give NaN/Inf, so no backend can be judged against it "
                         f"(check the checkpoint: `qwen4exp info MODEL`)")
        self.position = position


def check_truth_finite(logits, what: str = "reference logits") -> None:
    """Raise :class:`NonFiniteTruth` naming the first position of ``logits`` ``[T, V]`` that is NaN/Inf."""
    bad = first_nonfinite(logits)
    if bad is not None:
        raise NonFiniteTruth(bad[0], bad[1], what)


class TruthCache:
    """Truth logits: ``model.forward(history)`` (one full forward), cached. A cached forward over a
    longer history also answers every prefix of it (the model is causal). At most ``max_bytes`` of
    logits are kept (oldest evicted first: a real vocabulary makes each entry ~1 MB per token)."""

    def __init__(self, model, max_bytes: int = 2 << 30):
        self.model = model
        self.max_bytes = int(max_bytes)
        self._cache: dict[tuple, np.ndarray] = {}

    def logits(self, hist: Sequence[int]) -> np.ndarray:
        """``[len(hist), V]`` truth logits of every position of ``hist``."""
        key = tuple(int(t) for t in hist)
        n = len(key)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        for k, v in self._cache.items():
            if len(k) > n and k[:n] == key:
                return v[:n]
        out = np.asarray(self.model.forward(list(key)))
        check_truth_finite(out)
        self._put(key, out)
        return out

    def _put(self, key: tuple, out: np.ndarray) -> None:
        n = len(key)
        # drop cached prefixes of the new entry (they are answered by it now)
        for k in [k for k in self._cache if len(k) < n and key[:len(k)] == k]:
            del self._cache[k]
        self._cache[key] = out
        while len(self._cache) > 1 and sum(v.nbytes for v in self._cache.values()) > self.max_bytes:
            del self._cache[next(iter(self._cache))]

    def logged(self, hist: Sequence[int]):
        """``(logits [T, V], SelectionLog)`` of the truth's canonical forward over ``hist``
        (:func:`parity.harness.floor.logged_logits`: every block score and selection), answered from a logged
        forward over a longer history when one is kept (the model is causal: rows and visible blocks sliced), else
        computed once (its logits also serve :meth:`logits`). One logged forward is kept (the latest)."""
        key = tuple(int(t) for t in hist)
        n = len(key)
        got = getattr(self, "_logged", None)
        if got is None or len(got[0]) < n or got[0][:n] != key:
            out, log = logged_logits(self.model, list(key))
            check_truth_finite(out)
            self._logged = got = (key, out, log)
            if not any(len(k) >= n and k[:n] == key for k in self._cache):
                self._put(key, out)
        _, out, log = got
        return out[:n], log.prefix(n, self.model.config.indexer_compress_ratio)

    def prime(self, hist: Sequence[int]) -> None:
        """Compute (once) the truth over a history the case will reach piece by piece, so every
        intermediate comparison is answered by this one forward."""
        self.logits(hist)
