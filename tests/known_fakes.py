"""A backend with a known, placeable fault for the ``--known`` tests (tests/parity/test_known_baseline.py,
tests/cli/test_known_cli.py): the spec ``known_fakes:Faulty`` names the same backend whatever its fault, as an
engine's spec does before and after a code change."""
from __future__ import annotations

import numpy as np

from parity.backends.base import Backend
from parity.backends.reference import ReferenceBackend


class Faulty(Backend):
    """The reference, with its returned logits perturbed at absolute positions (composition, after the
    tester's /work/tb/mybe.py): ``noise`` = {position: relative size} adds ``size x max|logit|`` seeded noise
    there; ``flip`` = positions where the top-2 logits are swapped (a wrong argmax)."""

    precision = "float32"
    name = "test:Faulty"
    noise: dict = {}
    flip: tuple = ()

    @classmethod
    def open(cls, model_path, **opts):
        self = cls()
        self.inner = ReferenceBackend.open(model_path)
        self.config = self.inner.config
        self.model_path = model_path
        self.capabilities = dict(ReferenceBackend.capabilities)
        return self

    # every other protocol operation is the reference's
    def new_sequence(self): return self.inner.new_sequence()
    def free(self, h): return self.inner.free(h)
    def position(self, h): return self.inner.position(h)
    def snapshot(self, h): return self.inner.snapshot(h)
    def restore(self, h, s): return self.inner.restore(h, s)
    def rollback(self, h, n): return self.inner.rollback(h, n)
    def state_arrays(self, h): return self.inner.state_arrays(h)
    def fork(self, h): return self.inner.fork(h)
    def last_logits(self, h): return self.inner.last_logits(h)
    def dense_logits(self, ids): return self.inner.dense_logits(ids)

    def forward_tokens(self, h, ids):
        start = self.inner.position(h)
        return self._perturb(self.inner.forward_tokens(h, ids), start)

    def _perturb(self, rows, start):
        rows = np.array(rows, copy=True)
        for k in range(rows.shape[0]):
            p = start + k
            if p in self.noise:
                r = rows[k]
                rng = np.random.default_rng(0)   # fixed: the same fault gives the same error on every run
                rows[k] = r + self.noise[p] * np.abs(r).max() * rng.standard_normal(r.shape).astype(r.dtype)
            if p in self.flip:
                r = rows[k]
                a, b = np.argsort(r)[-2:][::-1]
                r[a], r[b] = r[b], r[a]
        return rows

    def prefill(self, h, ids, chunk_size=None):
        start = self.inner.position(h)
        return self._perturb(self.inner.prefill(h, ids, chunk_size=chunk_size), start)

    def decode(self, hs, ids):
        starts = [self.inner.position(h) for h in hs]
        out = np.array(self.inner.decode(hs, ids), copy=True)
        for i, s in enumerate(starts):
            out[i:i + 1] = self._perturb(out[i:i + 1], s)
        return out
