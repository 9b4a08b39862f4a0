"""Faulty backends behind the parity protocol, importable as ``parity_fakes:Class`` (tests/ is on sys.path):
the reference with a hook on every returned row, one that crashes in decode, and ones that perturb the
returned logits from position 10 (taps untouched)."""
from __future__ import annotations

import numpy as np

from parity.backends import Backend, ReferenceBackend


class _Wrap(Backend):
    """The reference behind the protocol, with a hook ``_fix(logits, first_position)`` on every returned row."""

    precision = "float32"
    capabilities = {"page_sizes": None, "batched_decode": True, "perturb": False, "state_arrays": False,
                    "snapshot_file": False}

    @classmethod
    def open(cls, model_path, **opts):
        self = cls()
        opts.pop("page_size", None)
        self.ref = ReferenceBackend.open(model_path, **opts)
        self.config = self.ref.config
        self.model_path = model_path
        self.name = "t:" + cls.__name__
        return self

    def new_sequence(self):
        return self.ref.new_sequence()

    def free(self, h):
        self.ref.free(h)

    def prefill(self, h, ids, chunk_size=None):
        p0 = self.ref.position(h)
        return self._fix(self.ref.prefill(h, ids, chunk_size=chunk_size), p0)

    def decode(self, hs, ids):
        p = [self.ref.position(h) for h in hs]
        out = self.ref.decode(hs, ids)
        return np.stack([self._fix(out[i:i + 1], p[i])[0] for i in range(len(hs))])

    def forward_tokens(self, h, ids):
        p0 = self.ref.position(h)
        return self._fix(self.ref.forward_tokens(h, ids), p0)

    def rollback(self, h, n):
        self.ref.rollback(h, n)

    def snapshot(self, h):
        return self.ref.snapshot(h)

    def restore(self, h, s):
        self.ref.restore(h, s)

    def position(self, h):
        return self.ref.position(h)

    def _fix(self, lg, p0):
        return lg


class CrashInDecode(_Wrap):
    def decode(self, hs, ids):
        raise RuntimeError("CUDA error: illegal memory access")


class PerturbAfter10(_Wrap):
    """+``bump`` (0.5) on every 7th vocab entry of the RETURNED logits from position 10 (taps untouched)."""

    bump = 0.5

    def _fix(self, lg, p0):
        lg = np.array(lg, dtype=np.float32, copy=True)
        for r in range(lg.shape[0]):
            if p0 + r >= 10:
                lg[r, ::7] += self.bump
        return lg


class PerturbAfter10Bf16(PerturbAfter10):
    """The same fault on a backend declaring bf16, sized above the coarse all-BF16-store tolerance of tiny (0.58 x
    the logit scale): the logit error is judged with the row's offset removed (softmax ignores it), and +b on
    every 7th entry is an offset b/7 plus a residual 6b/7 -- 0.43 for b = 0.5, within that tolerance; b = 1.0
    (residual 0.86) is beyond it."""
    precision = "bf16"
    bump = 1.0


class DenseAttention(ReferenceBackend):
    """The reference with QSA selection off: every complete block visible (dense attention: right at and below
    the QSA bound, wrong past it). The negative control perturbs the reference (``perturb`` not declared: this
    backend's own selection hook must not be replaced by the control's forced picks)."""

    capabilities = {**ReferenceBackend.capabilities, "perturb": False}

    @classmethod
    def open(cls, model_path, **opts):
        opts.pop("page_size", None)
        self = super().open(model_path, **opts)
        self.name = "t:DenseAttention"
        ratio = self.config.indexer_compress_ratio

        def every_block(layer, pos, scores, sel):
            n = (np.asarray(pos) + 1) // ratio
            width = max(int(n.max()) if n.size else 0, 1)
            allb = np.broadcast_to(np.arange(width), (len(pos), width))
            return np.where(allb < n[:, None], allb, -1)
        self.model.selection_hook = every_block
        return self
