"""Bug-class faults of the QSA block selection (the budget suite)."""
from __future__ import annotations

import numpy as np

from parity.suites.faults.base import _Fault
from reference.numba_kernels import block_topk_select as _block_topk_select


class TopkTiesHigherIndex(_Fault):
    """R03: exact score ties at the k-th block broken towards the HIGHER block index (an atomicAdd slot
    order), not the canonical lower index."""

    fault_name = "topk-ties-higher-index"

    def _inject(self):
        k = self.config.block_topk

        def hook(layer, pos, scores, sel):
            n = (np.asarray(pos) + 1) // self.config.indexer_compress_ratio
            rev = _block_topk_select(np.ascontiguousarray(scores[:, ::-1]), np.full(len(pos), scores.shape[1]),
                                     scores.shape[1])  # canonical on the reversed order = higher index first
            out = sel.copy()
            for t in range(len(pos)):
                cand = [scores.shape[1] - 1 - int(b) for b in rev[t] if b >= 0]
                cand = [b for b in cand if b < n[t]][:min(k, int(n[t]))]
                out[t, :len(cand)] = cand
            return out
        self._hook_selection(hook)


class DecodeSkipsBlockKeyPooling(_Fault):
    """R01: a block completed by a decode step is not pooled (its compressed key stays zero: the stale
    index keys of a single-sequence decode after a multi-sequence prefill)."""

    fault_name = "decode-skips-block-key-pooling"

    def _inject(self):
        model = self.model
        orig = model._qsa_step
        r = self.config.indexer_compress_ratio

        def step(i, st, x, pos, cos, sin, rec):
            if len(pos) == 1 and (int(pos[0]) + 1) % r == 0:
                st.block_keys.append(np.zeros((1, st.block_keys.data.shape[1]), st.block_keys.data.dtype))
            return orig(i, st, x, pos, cos, sin, rec)
        model._qsa_step = step


class BlockScoresWrongUnits(_Fault):
    """R05: the compressed block table counted in the wrong units (tokens / ratio**2 blocks visible), so
    the scores of the later complete blocks stay at -inf."""

    fault_name = "block-scores-wrong-units"

    def _inject(self):
        cfg = self.config
        r = cfg.indexer_compress_ratio

        def hook(layer, pos, scores, sel):
            n_true = (np.asarray(pos) + 1) // r
            n_bad = np.maximum(1, (np.asarray(pos) + 1) // (r * r))
            cols = np.arange(scores.shape[1])[None, :]
            scores[...] = np.where(cols < n_bad[:, None], scores, -np.inf)
            return _block_topk_select(scores, n_true, cfg.block_topk)
        self._hook_selection(hook)


class BlockScoresInBf16(_Fault):
    """R06: indexer block scores rounded to bf16 (8 mantissa bits) before the top-k."""

    fault_name = "block-scores-in-bf16"

    def _inject(self):
        cfg = self.config

        def hook(layer, pos, scores, sel):
            bits = scores.astype(np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)
            scores[...] = np.where(np.isfinite(scores), rounded, scores)
            return _block_topk_select(scores, (np.asarray(pos) + 1) // cfg.indexer_compress_ratio, cfg.block_topk)
        self._hook_selection(hook)


class DenseMaskPastBudget(_Fault):
    """R43: past the budget every complete block stays visible (a dense mask), as if selection were off."""

    fault_name = "dense-mask-past-budget"

    def _inject(self):
        r = self.config.indexer_compress_ratio

        def hook(layer, pos, scores, sel):
            n = (np.asarray(pos) + 1) // r
            width = max(int(n.max()) if n.size else 0, sel.shape[1], 1)
            allb = np.broadcast_to(np.arange(width), (len(pos), width))
            return np.where(allb < n[:, None], allb, -1)
        self._hook_selection(hook)


class NondeterministicSelection(_Fault):
    """R02: greedy output non-deterministic near the budget: past the bound, the last selected block is
    swapped for a random unselected one half of the time (an unseeded race; differs run to run)."""

    fault_name = "nondeterministic-selection"

    def _inject(self):
        r = self.config.indexer_compress_ratio
        rng = np.random.default_rng()  # deliberately unseeded: the fault is a race

        def hook(layer, pos, scores, sel):
            n = (np.asarray(pos) + 1) // r
            out = sel.copy()
            for t in range(len(pos)):
                chosen = set(int(b) for b in sel[t] if b >= 0)
                rest = [b for b in range(int(n[t])) if b not in chosen]
                if rest and chosen and rng.random() < 0.5:
                    j = max(i for i in range(sel.shape[1]) if sel[t, i] >= 0)
                    out[t, j] = rest[int(rng.integers(len(rest)))]
            return out
        self._hook_selection(hook)


class QsaPositionCap(_Fault):
    """R28: positions at and past ``cap`` (32768 in the report) are clamped to ``cap - 1`` in the RoPE of the
    QSA layers and the indexer (a kernel's position cap). Subclass with a smaller ``cap`` to reach it on a
    small fixture."""

    fault_name = "qsa-position-cap"
    cap = 32768

    def _inject(self):
        model = self.model
        orig = model.cos_sin
        cap = self.cap
        model.cos_sin = lambda positions: orig(np.minimum(np.asarray(positions), cap - 1))


class QsaPositionCapAt16(QsaPositionCap):
    """:class:`QsaPositionCap` with the cap lowered to 16 so the tiny fixtures (32768 positions at most)
    reach it; the real cap is reached by ``--level long``."""

    fault_name = "qsa-position-cap-16"
    cap = 16
