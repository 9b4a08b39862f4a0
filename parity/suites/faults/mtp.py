"""Faults of the MTP head (``MTP_FAULTS``: on a checkpoint with an MTP head, caught by speculative-rollback's
``mtp_*`` cases and located at the first divergent ``mtp.*`` tap)."""
from __future__ import annotations

import numpy as np

from parity.backends import ReferenceBackend
from reference.session import SessionState


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
