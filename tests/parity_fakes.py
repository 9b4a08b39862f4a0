"""Faulty backends behind the parity protocol, importable as ``parity_fakes:Class`` (tests/ is on sys.path):
the reference with a hook on every returned row (:class:`_Wrap`, the one delegating wrapper every test helper
builds on: tests/kl_fakes.py, tests/known_fakes.py, the wrappers of test_locate_real_divergence.py and
test_generation_path_judged.py), one that crashes in decode, ones that perturb the returned logits from
position 10 (taps untouched), and the reference with dense attention."""
from __future__ import annotations

import numpy as np

from parity.backends import Backend, ReferenceBackend


#: optional protocol operations a :class:`_Wrap` may pass through to the reference (else the protocol's default:
#: fork through snapshot/restore, the others raising BackendError)
PASSTHROUGH_OPS = ("state_arrays", "fork", "last_logits", "dense_logits")


def reference_capabilities(*drop: str) -> dict:
    """The reference backend's declared capabilities without the keys ``drop`` (then the protocol's defaults)."""
    return {k: v for k, v in ReferenceBackend.capabilities.items() if k not in drop}


class _Wrap(Backend):
    """The reference behind the protocol by composition (``self.ref``), with a hook ``_fix(rows, start, op)`` on
    the rows every ``prefill`` / ``decode`` / ``forward_tokens`` returns (``rows``: a copy, ``[k, V]`` float32;
    ``start``: the absolute position of row 0; ``op``: 'prefill' | 'decode' | 'verify'; a decode batch calls it
    once per sequence, in batch order). Every wrapper of the test helpers is this class, parametrised by:

    * ``capabilities``: what it declares (each instance gets its own copy);
    * ``passthrough``: which of :data:`PASSTHROUGH_OPS` go to the reference unchanged (the others keep the
      protocol's default); ``prefill_batch``, ``prefill_last`` and ``decode_greedy`` keep the protocol's
      defaults (built on the hooked operations) unless a subclass overrides them;
    * ``name``: the reported name (None: ``t:<class name>``).

    ``open`` passes every option but ``page_size`` (a no-op for the reference) to the reference.
    """

    precision = "float32"
    name = None
    capabilities = {"page_sizes": None, "batched_decode": True, "perturb": False, "state_arrays": False,
                    "snapshot_file": False}
    passthrough: tuple = ()

    @classmethod
    def open(cls, model_path, **opts):
        self = cls()
        opts.pop("page_size", None)
        self.ref = ReferenceBackend.open(model_path, **opts)
        self.config = self.ref.config
        self.model_path = model_path
        self.name = cls.name or "t:" + cls.__name__
        self.capabilities = dict(cls.capabilities)
        return self

    def _fix(self, rows, start, op):
        return rows

    def new_sequence(self):
        return self.ref.new_sequence()

    def free(self, h):
        self.ref.free(h)

    def prefill(self, h, ids, chunk_size=None):
        p0 = self.ref.position(h)
        return self._fix(np.array(self.ref.prefill(h, ids, chunk_size=chunk_size), copy=True), p0, "prefill")

    def decode(self, hs, ids):
        p = [self.ref.position(h) for h in hs]
        out = np.array(self.ref.decode(hs, ids), copy=True)
        return np.stack([self._fix(out[i:i + 1], p[i], "decode")[0] for i in range(len(hs))])

    def forward_tokens(self, h, ids):
        p0 = self.ref.position(h)
        return self._fix(np.array(self.ref.forward_tokens(h, ids), copy=True), p0, "verify")

    def rollback(self, h, n):
        self.ref.rollback(h, n)

    def snapshot(self, h):
        return self.ref.snapshot(h)

    def restore(self, h, s):
        self.ref.restore(h, s)

    def position(self, h):
        return self.ref.position(h)

    # the optional operations: the reference's where passed through, else the protocol's default
    def _through(self, op):
        return getattr(self.ref if op in self.passthrough else super(), op)

    def state_arrays(self, h):
        return self._through("state_arrays")(h)

    def fork(self, h):
        return self._through("fork")(h)

    def last_logits(self, h):
        return self._through("last_logits")(h)

    def dense_logits(self, ids):
        return self._through("dense_logits")(ids)


class CrashInDecode(_Wrap):
    def decode(self, hs, ids):
        raise RuntimeError("CUDA error: illegal memory access")


class PerturbAfter10(_Wrap):
    """+``bump`` (0.5) on every 7th vocab entry of the RETURNED logits from position 10 (taps untouched)."""

    bump = 0.5

    def _fix(self, lg, p0, op):
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


class ReusedOutputBuffer(ReferenceBackend):
    """A CORRECT backend whose every answer is a view of one output buffer it reuses (overwritten by its next
    call), as llama.cpp's ``llama_get_logits`` and a torch engine's static output tensor are: the harness must
    copy each answer when it gets it, so this backend PASSes (before, the kl row's greedy stream kept the views
    and judged every decode row as the last one: a false FAIL with no location)."""

    def _out(self, rows):
        rows = np.asarray(rows)
        buf = getattr(self, "_buf", None)
        if buf is None or buf.size < rows.size:
            buf = self._buf = np.empty(max(rows.size, 1), rows.dtype)
        view = buf[:rows.size].reshape(rows.shape)
        view[...] = rows
        return view

    def prefill(self, h, ids, chunk_size=None):
        return self._out(super().prefill(h, ids, chunk_size=chunk_size))

    def decode(self, hs, ids):
        return self._out(super().decode(hs, ids))

    def forward_tokens(self, h, ids):
        return self._out(super().forward_tokens(h, ids))

    def logits(self, ids):
        return self._out(super().logits(ids))


class PaddedVocabLogits(ReferenceBackend):
    """The reference returning every logits array with 64 extra columns (a vocabulary padded to a multiple of 64,
    not sliced off): a wrong answer of the backend, which the kl row names as such."""

    @staticmethod
    def _pad(rows):
        rows = np.asarray(rows)
        return np.concatenate([rows, np.full(rows.shape[:-1] + (64,), -1e9, rows.dtype)], axis=-1)

    def prefill(self, h, ids, chunk_size=None):
        return self._pad(super().prefill(h, ids, chunk_size=chunk_size))

    def decode(self, hs, ids):
        return self._pad(super().decode(hs, ids))

    def logits(self, ids):
        return self._pad(super().logits(ids))
