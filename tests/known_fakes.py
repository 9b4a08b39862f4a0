"""A backend with a known, placeable fault for the ``--known`` tests (tests/parity/test_known_baseline.py,
tests/cli/test_known_cli.py): the spec ``known_fakes:Faulty`` names the same backend whatever its fault, as an
engine's spec does before and after a code change."""
from __future__ import annotations

import numpy as np

from parity_fakes import PASSTHROUGH_OPS, _Wrap, reference_capabilities


class Faulty(_Wrap):
    """The reference, with its returned logits perturbed at absolute positions (composition, after the
    tester's /work/tb/mybe.py): ``noise`` = {position: relative size} adds ``size x max|logit|`` seeded noise
    there; ``flip`` = positions where the top-2 logits are swapped (a wrong argmax). Declares what the
    reference declares and passes every optional operation through to it."""

    name = "test:Faulty"
    capabilities = reference_capabilities()
    passthrough = PASSTHROUGH_OPS
    noise: dict = {}
    flip: tuple = ()

    def _fix(self, rows, start, op):
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
