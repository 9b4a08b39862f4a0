"""Bug-class faults of the PLE n-gram hashing (its context, EOS resets, batching and chunk caps)."""
from __future__ import annotations

import numpy as np

from parity.suites.faults.base import _Fault, _eos_ids


class NgramResetsOnEveryEos(_Fault):
    """R22 (EOS edge case): every id of the EOS list resets the n-gram history, not only
    ``eos_token_id[0]`` (needs a checkpoint with two EOS ids, e.g. fixtures/tiny-hc2)."""

    fault_name = "ngram-resets-on-every-eos"

    def _inject(self):
        def fn(cfg, ctx, ids):
            first, others = cfg.ple_eos_token_id, [e for e in _eos_ids(cfg)[1:] if e != cfg.ple_eos_token_id]
            return ctx, np.where(np.isin(ids, others), first, ids) if others else ids
        self._patch_ple_input(fn)


class NgramIgnoresEos(_Fault):
    """R22: another model's n-gram id algorithm (no segment reset at EOS: the hash runs straight across it)."""

    fault_name = "ngram-ignores-eos"

    def _inject(self):
        def fn(cfg, ctx, ids):  # an id no prompt holds stands in for EOS in the hash: no reset ever happens
            e = cfg.ple_eos_token_id
            alt = (e + 1) % cfg.vocab_size
            return ctx, np.where(ids == e, alt, ids)
        self._patch_ple_input(fn)


class BatchedDecodeSharesNgramContext(_Fault):
    """R23: a batched decode hashes every sequence's n-grams with the FIRST sequence's context."""

    fault_name = "batched-decode-shares-ngram-context"

    def decode(self, hs, ids):
        """Injected fault: before a batch of more than one, every sequence's PLE context := the first's."""
        if len(hs) > 1:
            first = self._sess(hs[0]).state.ple
            for h in hs[1:]:
                for i, st in self._sess(h).state.ple.items():
                    st.context = first[i].context.copy()
        return super().decode(hs, ids)


class ReusedSlotNotReset(_Fault):
    """R24: a new sequence reuses the slot of the last freed one without resetting its PLE state (conv
    history and n-gram context)."""

    fault_name = "reused-slot-not-reset"

    def free(self, h):
        """Injected fault: remember the freed session's PLE state for the next new sequence."""
        sess = self._sessions.get(h)
        if sess is not None:
            self._stale_ple = {i: st.copy() for i, st in sess.state.ple.items()}
        super().free(h)

    def new_sequence(self):
        """Injected fault: the new session starts with the last freed session's PLE state."""
        h = super().new_sequence()
        stale = getattr(self, "_stale_ple", None)
        if stale:
            self._sessions[h].state.ple = {i: st.copy() for i, st in stale.items()}
        return h


class PrefillBatchTailLosesContext(_Fault):
    """R07 / R21 (ragged requests): in a ragged ``prefill_batch``, the partial last tile (``len % 4``
    tokens) of the last request is run as a separate packed row that starts from a fresh n-gram context."""

    fault_name = "prefill-batch-tail-loses-context"
    tile = 4

    def prefill_batch(self, hs, id_lists, chunk_size=None):
        """Injected fault (see the class docstring); the other requests are prefilled correctly."""
        hs, id_lists = list(hs), [list(x) for x in id_lists]
        outs = super().prefill_batch(hs[:-1], id_lists[:-1], chunk_size) if len(hs) > 1 else []
        ids = id_lists[-1]
        full = len(ids) - len(ids) % self.tile
        parts = []
        if full:
            parts.append(super().prefill(hs[-1], ids[:full], chunk_size))
        if full < len(ids):
            if full:
                for st in self._sess(hs[-1]).state.ple.values():
                    st.context = np.full_like(st.context, self.config.ple_eos_token_id)
            parts.append(super().prefill(hs[-1], ids[full:], chunk_size))
        return outs + [np.concatenate(parts, axis=0)]


class PleChunkCap(_Fault):
    """R28: the PLE buffer holds ``cap`` tokens (8192 in the report) while the prefill chunk is larger:
    a chunk longer than ``cap`` is hashed and convolved in pieces of ``cap`` that restart the PLE state.
    Subclass with a smaller ``cap`` to reach it on a small fixture."""

    fault_name = "ple-chunk-cap"
    cap = 8192

    def prefill(self, h, ids, chunk_size=None):
        """Injected fault: every piece of ``cap`` tokens after the first of a chunk restarts the PLE state."""
        ids = list(ids)
        c = chunk_size or len(ids)
        if c <= self.cap:
            return super().prefill(h, ids, chunk_size)
        outs = []
        for a in range(0, len(ids), c):
            for b in range(a, min(len(ids), a + c), self.cap):
                if b > a:
                    for st in self._sess(h).state.ple.values():
                        st.context = np.full_like(st.context, self.config.ple_eos_token_id)
                        st.conv = np.zeros_like(st.conv)
                outs.append(super().prefill(h, ids[b:min(a + c, b + self.cap)]))
        return np.concatenate(outs, axis=0)


class PleChunkCapAt16(PleChunkCap):
    """:class:`PleChunkCap` with the cap lowered to 16 so the tiny fixtures' chunks exceed it; the real cap
    (8192) is exceeded by ``--level long``'s chunks."""

    fault_name = "ple-chunk-cap-16"
    cap = 16
