"""Backends for the KL harness's own rules, importable as ``kl_fakes:Class`` (tests/ is on sys.path): the
reference behind the protocol with a hook on every returned row (``parity_fakes._Wrap``), each changing the rows
the way an outside engine might -- a softmax-invariant per-row offset (correct), log-probabilities instead of
logits (correct), a top-k truncated tail (-inf: wrong), run-to-run noise with or without a determinism claim.

Noise is seeded by a per-instance call counter: two calls differ, and every test run sees the same values."""
from __future__ import annotations

import numpy as np

from parity_fakes import _Wrap

#: the largest |logit| of the row times this is the noise of the noisy fakes (1e-7: float32-level, well below any
#: measured tolerance, ~7e-5 of the logit scale on tiny; the ``Large`` variants use 1e-4, ~4e-4 of the scale)
JITTER = 1e-7
JITTER_LARGE = 1e-4


class RowShift(_Wrap):
    """Every returned row + 3: the same distribution (softmax ignores a per-row offset)."""

    def _fix(self, lg, p0, op):
        return np.asarray(lg, dtype=np.float32) + np.float32(3.0)


class LogProbs(_Wrap):
    """log_softmax of every row returned instead of the logits: the same distribution."""

    def _fix(self, lg, p0, op):
        x = np.asarray(lg, dtype=np.float64)
        m = x.max(axis=-1, keepdims=True)
        return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


class RampShift(_Wrap):
    """Negative control of the offset rule: + 3 + a ramp over the vocabulary, 1e-3 x max |logit| from the first to
    the last entry (an offset that differs across the entries of a row: a real error)."""

    def _fix(self, lg, p0, op):
        x = np.asarray(lg, dtype=np.float32)
        ramp = np.linspace(0.0, 1e-3, x.shape[-1], dtype=np.float32) * np.abs(x).max(axis=-1, keepdims=True)
        return x + np.float32(3.0) + ramp


class ShiftPlusNoiseAt5(_Wrap):
    """+ 3 on every row and 1e-3 x max |logit| seeded noise at position 5: the offset must not hide the error."""

    def _fix(self, lg, p0, op):
        x = np.array(lg, dtype=np.float32, copy=True) + np.float32(3.0)
        i = 5 - p0
        if 0 <= i < x.shape[0]:
            rng = np.random.default_rng(5)
            x[i] += (1e-3 * np.abs(x[i] - 3.0).max() * rng.standard_normal(x.shape[-1])).astype(np.float32)
        return x


class TopKTail(_Wrap):
    """Top-50 truncation: every entry but the 50 largest set to -inf (the truth gives them probability > 0)."""

    def _fix(self, lg, p0, op):
        x = np.array(lg, dtype=np.float32, copy=True)
        idx = np.argsort(x, axis=-1)[:, :-50]
        np.put_along_axis(x, idx, -np.inf, axis=-1)
        return x


class Jitter(_Wrap):
    """Run-to-run noise of :data:`JITTER` x max |logit| on every row; does not declare ``deterministic``."""

    rel = JITTER

    def _fix(self, lg, p0, op):
        self._calls = getattr(self, "_calls", 0) + 1
        rng = np.random.default_rng(self._calls)
        x = np.asarray(lg, dtype=np.float32)
        return x + (self.rel * np.abs(x).max() * rng.standard_normal(x.shape)).astype(np.float32)


class JitterLarge(Jitter):
    """Run-to-run noise of :data:`JITTER_LARGE` x max |logit|: above the tolerance on tiny."""

    rel = JITTER_LARGE


class JitterLargeFaultAt5(JitterLarge):
    """The large jitter plus 3e-2 x max |logit| seeded noise at position 5: far beyond tolerance + the spread."""

    def _fix(self, lg, p0, op):
        x = np.array(super()._fix(lg, p0, op), copy=True)
        i = 5 - p0
        if 0 <= i < x.shape[0]:
            rng = np.random.default_rng(5)
            x[i] += (3e-2 * np.abs(x[i]).max() * rng.standard_normal(x.shape[-1])).astype(np.float32)
        return x


class JitterClaimsDeterministic(Jitter):
    """The small jitter, but declaring ``deterministic``: must repeat bitwise, so it FAILs."""

    capabilities = {**_Wrap.capabilities, "deterministic": True}


class SmallAt3LargeAt9(_Wrap):
    """1e-3 x max |logit| seeded noise at position 3 and 3e-2 x at position 9: both beyond tolerance, the worst
    logit error later than the first failing position."""

    def _fix(self, lg, p0, op):
        x = np.array(lg, dtype=np.float32, copy=True)
        for pos, size in ((3, 1e-3), (9, 3e-2)):
            i = pos - p0
            if 0 <= i < x.shape[0]:
                rng = np.random.default_rng(pos)
                x[i] += (size * np.abs(x[i]).max() * rng.standard_normal(x.shape[-1])).astype(np.float32)
        return x
