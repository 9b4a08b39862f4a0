"""The first four injected faults, one per scenario suite that must catch it (``FAULTS``)."""
from __future__ import annotations

import numpy as np

from parity.backends import ReferenceBackend


class RollbackForgetsPLEConv(ReferenceBackend):
    """Rollback that forgets the PLE conv carry (keeps the post-draft conv history)."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:rollback-forgets-ple-conv'."""
        be = super().open(model_path, **opts)
        be.name = "fault:rollback-forgets-ple-conv"
        return be

    def rollback(self, h, n):
        """Injected fault: roll back, then put each PLE layer's conv state back to its pre-rollback value."""
        sess = self._sess(h)
        kept = {i: st.conv.copy() for i, st in sess.state.ple.items()}
        super().rollback(h, n)
        for i, conv in kept.items():
            sess.state.ple[i].conv = conv


class RestoreSkipsIndexerKeys(ReferenceBackend):
    """Restore that does not copy the QSA indexer keys (they come back zero-filled)."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:restore-skips-indexer-keys'."""
        be = super().open(model_path, **opts)
        be.name = "fault:restore-skips-indexer-keys"
        return be

    def restore(self, h, snap):
        """Injected fault: restore, then zero every QSA layer's index keys and block keys."""
        super().restore(h, snap)
        for st in self._sess(h).state.qsa.values():
            st.index_keys.data[...] = 0
            st.block_keys.data[...] = 0


class ChunkDropsNgramContext(ReferenceBackend):
    """Chunked prefill that drops the n-gram context at each chunk boundary (EOS-filled as at a new sequence)."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:chunk-drops-ngram-context'."""
        be = super().open(model_path, **opts)
        be.name = "fault:chunk-drops-ngram-context"
        return be

    def prefill(self, h, ids, chunk_size=None):
        """Injected fault: with ``chunk_size``, prefill chunk by chunk and reset every PLE layer's n-gram
        context to the EOS id before each chunk after the first; returns the concatenated logits ``[T, V]``."""
        if not chunk_size:
            return super().prefill(h, ids)
        sess = self._sess(h)
        eos = self.config.ple_eos_token_id
        outs = []
        ids = list(ids)
        for s in range(0, len(ids), chunk_size):
            if s > 0:
                for st in sess.state.ple.values():
                    st.context = np.full_like(st.context, eos)
            outs.append(super().prefill(h, ids[s:s + chunk_size]))
        return np.concatenate(outs, axis=0)


class BudgetOffByOne(ReferenceBackend):
    """QSA budget bound off by one: at exactly ``bound + 1`` visible tokens every block is kept (dense)."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:budget-off-by-one', with a selection hook that, at the
        position one past the QSA bound, adds one more block (the lowest complete block not selected) to the selection.
        """
        be = super().open(model_path, **opts)
        be.name = "fault:budget-off-by-one"
        cfg = be.config
        r, topk = cfg.indexer_compress_ratio, cfg.block_topk

        def hook(layer, pos, scores, sel):
            n_complete = (np.asarray(pos) + 1) // r
            extra = np.full((sel.shape[0], 1), -1, dtype=np.int64)
            hit = (np.asarray(pos) + 1) == cfg.qsa_bound + 1  # one past the bound: should select, keeps all
            for t in np.nonzero(hit)[0]:
                missing = sorted(set(range(int(n_complete[t]))) - set(int(b) for b in sel[t] if b >= 0))
                if missing:
                    extra[t, 0] = missing[0]
            return np.concatenate([sel, extra], axis=1)

        be.model.selection_hook = hook
        return be
