"""Bug-class faults only the self-consistency suite can catch (no truth needed)."""
from __future__ import annotations

import numpy as np

from parity.suites.faults.base import _Fault


class BatchDependentDecode(_Fault):
    """R17 (numerics: a matmul that is not batch-invariant): a batched decode's rows move by 1e-4 of the
    row's scale per extra sequence in the batch."""

    fault_name = "batch-dependent-decode"

    def decode(self, hs, ids):
        """Injected fault (see the class docstring)."""
        out = np.array(super().decode(hs, ids), copy=True)
        if len(hs) > 1:
            out += (len(hs) - 1) * 1e-4 * np.abs(out).max(axis=-1, keepdims=True) * np.cos(np.arange(out.shape[1]))
        return out


class BatchDependentPrefill(_Fault):
    """R16: a ragged batched prefill rounds differently from a single-request prefill (shape-dependent
    rounding): every row of a batch of more than one moves by 1e-4 of its scale."""

    fault_name = "batch-dependent-prefill"

    def prefill_batch(self, hs, id_lists, chunk_size=None):
        """Injected fault (see the class docstring)."""
        outs = super().prefill_batch(hs, id_lists, chunk_size)
        if len(outs) > 1:
            outs = [o + 1e-4 * np.abs(o).max(axis=-1, keepdims=True) * np.sin(np.arange(o.shape[1])) for o in outs]
        return outs


class VerifyWidthDependent(_Fault):
    """A verify whose rows depend on the number of drafted tokens (a width-dependent kernel): each row
    moves by 1e-4 of its scale per drafted token beyond the first."""

    fault_name = "verify-width-dependent"

    def forward_tokens(self, h, ids):
        """Injected fault (see the class docstring)."""
        out = np.array(super().forward_tokens(h, ids), copy=True)
        return out + (len(out) - 1) * 1e-4 * np.abs(out).max(axis=-1, keepdims=True) * np.cos(np.arange(out.shape[1]))


class SpecVerifyDrift(_Fault):
    """R17: speculative output drifts from plain greedy: verify rows carry a small extra bias (5e-3 of
    the row's scale) that flips near-tied argmaxes, so accepted tokens leave the greedy stream."""

    fault_name = "spec-verify-drift"

    def forward_tokens(self, h, ids):
        """Injected fault (see the class docstring)."""
        out = np.array(super().forward_tokens(h, ids), copy=True)
        return out + 5e-3 * np.abs(out).max(axis=-1, keepdims=True) * np.cos(7.0 * np.arange(out.shape[1]))


class SparseBelowBoundDropsBlock(_Fault):
    """R01: below the budget bound the sparse path is not the dense path: from 2 complete blocks on, the
    last-ranked complete block is dropped even though every block fits the budget."""

    fault_name = "sparse-below-bound-drops-block"

    def _inject(self):
        r = self.config.indexer_compress_ratio

        def hook(layer, pos, scores, sel):
            n = (np.asarray(pos) + 1) // r
            out = sel.copy()
            for t in range(len(pos)):
                valid = [j for j in range(sel.shape[1]) if sel[t, j] >= 0]
                if len(valid) >= 2 and len(valid) == int(n[t]):  # every block kept: below the bound
                    out[t, valid[-1]] = -1
            return out
        self._hook_selection(hook)

    def dense_logits(self, ids):
        """The dense path has no fault: selection off, every block kept."""
        hook = self.model.selection_hook
        self.model.selection_hook = None
        try:
            return super().dense_logits(ids)
        finally:
            self.model.selection_hook = hook
