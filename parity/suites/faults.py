"""Fault-injecting backends: the negative controls of the scenario suites.

Each is the reference backend with one realistic porting bug, openable like any outside engine
(``--backend parity.suites.faults:RollbackForgetsPLEConv``). The suites must catch each one and NAME it
(the failing scenario/case and the first divergent tap or state):

* :class:`RollbackForgetsPLEConv` -- rollback restores everything but the PLE dilated-conv history,
  which keeps the rejected drafts' rows (speculative-rollback must catch it);
* :class:`RestoreSkipsIndexerKeys` -- restore copies KV, GDN and PLE state but leaves the QSA
  indexer keys zero-filled (snapshot-restore);
* :class:`ChunkDropsNgramContext` -- chunked prefill resets the PLE n-gram context to EOS at every
  chunk boundary (chunk-boundary);
* :class:`BudgetOffByOne` -- QSA treats ``indexer_budget + indexer_compress_ratio`` visible tokens as
  still within budget (dense), one past the true bound (budget).

``FAULTS`` maps each to the scenario that must catch it and the substring its divergence must name.

MTP faults (on a checkpoint with an MTP head; ``MTP_FAULTS``, caught by speculative-rollback's ``mtp_*``
cases and located at the first divergent ``mtp.*`` tap):

* :class:`MTPStateNotRolledBack` -- an incremental head that consumes the verified positions' pairs at verify
  time and is not rolled back with the trunk (a rejected draft's pairs stay in its caches);
* :class:`MTPHnormPerStream` -- ``pre_fc_norm_hidden`` applied per stream (llama.cpp's grouping) instead of
  one RMS over all streams;
* :class:`MTPStaleDraftSelection` -- later draft steps reuse draft step 0's QSA block selection.
"""
from __future__ import annotations

import numpy as np

from parity.backends import ReferenceBackend

__all__ = ["RollbackForgetsPLEConv", "RestoreSkipsIndexerKeys", "ChunkDropsNgramContext", "BudgetOffByOne",
           "FAULTS", "MTPStateNotRolledBack", "MTPHnormPerStream", "MTPStaleDraftSelection", "MTP_FAULTS"]


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


#: fault class -> (scenario that must catch it, substring the located divergence must contain)
FAULTS = {
    RollbackForgetsPLEConv: ("speculative_rollback", "ple"),
    RestoreSkipsIndexerKeys: ("snapshot_restore", "indexer"),
    ChunkDropsNgramContext: ("chunk_boundary", "ple"),
    BudgetOffByOne: ("budget", "indexer"),
}


# ----------------------------------------------------------------------------------------------- MTP faults
class MTPStateNotRolledBack(ReferenceBackend):
    """An incremental MTP head (its own caches, fed the trunk's residuals) that is advanced over every verified
    position and never rolled back: after a rejection it holds the rejected drafts' pairs."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:mtp-state-not-rolled-back'."""
        be = super().open(model_path, **opts)
        be.name = "fault:mtp-state-not-rolled-back"
        be._heads = {}
        return be

    def _feed(self, h):
        """Advance the head over every pair whose next token the session holds (residuals recomputed from the
        session's tokens: the reference keeps none)."""
        sess = self._sess(h)
        toks = np.asarray(sess.tokens, np.int64)
        head = self._heads.setdefault(h, self.model.new_mtp_session())
        R = self._residuals(toks)
        m, n = head.position, len(toks)
        if n - 1 > m:
            head.step(R[m:n - 1], toks[m + 1:n])
        return head, R

    def _residuals(self, toks):
        from reference.session import SessionState
        res: list = []
        self.model._run(SessionState.empty(self.config, self.model.dtype), toks, "none", residual_out=res)
        return res[0]

    def forward_tokens(self, h, ids):
        """Verify, then (the fault) advance the head over the verified positions at once."""
        out = super().forward_tokens(h, ids)
        self._feed(h)
        return out

    def draft(self, h, next_id, k):
        """Draft from the incremental head (its state is whatever it has consumed, rejected positions included)."""
        head, R = self._feed(h)
        n = len(self._sess(h).tokens)
        keep = head.snapshot()
        try:
            ids, lg = head.draft(R[n - 1:n], [int(next_id)], k)
        finally:
            head.restore(keep)
        return np.asarray(ids, np.int64), np.asarray(lg)


class MTPHnormPerStream(ReferenceBackend):
    """The head's ``pre_fc_norm_hidden`` as llama.cpp applies it: an RMS per stream, not one over all streams."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:mtp-hnorm-per-stream'."""
        be = super().open(model_path, **opts)
        be.name = "fault:mtp-hnorm-per-stream"
        return be

    def draft(self, h, next_id, k):
        """Injected fault: ``hnorm='per_stream'``."""
        ids, lg = self._sess(h).mtp_draft_next(int(next_id), k, hnorm="per_stream")
        return np.asarray(ids, np.int64), np.asarray(lg)


class MTPStaleDraftSelection(ReferenceBackend):
    """Later draft steps reuse draft step 0's QSA block selection (vLLM's ``set_skip_topk``) where the truth
    selects afresh at every step."""

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend, named 'fault:mtp-stale-draft-selection'."""
        be = super().open(model_path, **opts)
        be.name = "fault:mtp-stale-draft-selection"
        return be

    def draft(self, h, next_id, k):
        """Injected fault: ``draft_selection='reuse_step0'``."""
        ids, lg = self._sess(h).mtp_draft_next(int(next_id), k, draft_selection="reuse_step0")
        return np.asarray(ids, np.int64), np.asarray(lg)


#: MTP fault class -> (scenario that must catch it, case, substring the located divergence must name)
MTP_FAULTS = {
    MTPStateNotRolledBack: ("speculative_rollback", "mtp_accept_each_j", "not rolled back"),
    MTPHnormPerStream: ("speculative_rollback", "mtp_accept_each_j", "mtp.fc_hidden.out"),
    MTPStaleDraftSelection: ("speculative_rollback", "mtp_accept_each_j", "mtp.layers.0.self_attn.indexer"),
}
