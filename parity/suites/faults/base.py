"""The base of the bug-class faults (:class:`_Fault`) and the helpers several of them share."""
from __future__ import annotations

import numpy as np

from parity.backends import ReferenceBackend


class _Fault(ReferenceBackend):
    """Base of the bug-class faults: ``open`` names the backend ``fault:<fault_name>`` and calls
    :meth:`_inject` once the reference model is built."""

    fault_name = "fault"

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend with the fault of this class injected (see the class docstring)."""
        be = super().open(model_path, **opts)
        be.name = f"fault:{cls.fault_name}"
        be._inject()
        return be

    def _inject(self) -> None:
        """Patch the freshly built model (default: nothing; the fault lives in an overridden method)."""

    # --- helpers shared by several faults
    def _patch_ple_input(self, fn) -> None:
        """Route every PLE layer's hashing input through ``fn(config, context, ids) -> (context, ids)`` (the
        n-gram context and tokens the hash sees; the result is also what the context carries on)."""
        model = self.model
        orig = model._ple_step

        def step(i, st, x, ids, pos, rec):
            st.context, ids2 = fn(model.config, np.asarray(st.context), np.asarray(ids))
            return orig(i, st, x, np.asarray(ids2, dtype=np.int64), pos, rec)
        model._ple_step = step

    def _patch_rows(self, fn) -> None:
        """Route every gathered PLE table row block through ``fn(layer, rows, emb) -> emb`` (a loader fault:
        the hashed ids are right, the rows read for them are not)."""
        w = self.model.weights
        orig = w.ngram_rows
        w.ngram_rows = lambda layer, rows: fn(layer, rows, orig(layer, rows))

    def _hook_selection(self, fn) -> None:
        """Install ``fn(layer, pos, scores, sel) -> sel`` as the model's QSA selection hook (``scores`` may be
        changed in place: the ``block_scores`` tap is emitted from it afterwards)."""
        self.model.selection_hook = fn


def _eos_ids(cfg):
    return [int(e) for e in cfg.eos_token_ids]
