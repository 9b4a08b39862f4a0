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
``BUG_CLASSES`` (end of the module) adds one fault per in-scope class of the public bug list, with the one
case that catches it and the block it is located at.

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
           "FAULTS", "BUG_CLASSES", "SharedExpertDownScaledOneLayer", "MTPStateNotRolledBack", "MTPHnormPerStream", "MTPStaleDraftSelection",
           "MTP_FAULTS"]


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


# ==============================================================================================# One injected fault per in-scope class of the public bug list (/work/shared/bug-classes.md,
# mapped in docs/parity.md "Bug classes"). Each is the reference backend with one realistic defect;
# BUG_CLASSES below names the case that catches it and the block it must be located at.
# =====================================================================================================
from parity.backends.base import load_weights
from reference.blocks.hyper_connection import hyper_connection as _hyper_connection
from reference.numba_kernels import block_topk_select as _block_topk_select


class _Fault(ReferenceBackend):
    """Base of the issue-14 faults: ``open`` names the backend ``fault:<fault_name>`` and calls
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


# ---------------------------------------------------------------- budget (QSA selection)
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


# ---------------------------------------------------------------- numerics / loader
class NormGainShiftedTwice(_Fault):
    """R12: zero-centred RMSNorm gains stored pre-shifted (``1 + w``) and loaded by a ``(1 + w)`` norm:
    every such gain is effectively ``2 + w`` (the gated GDN norm, a plain gain, is not affected)."""

    fault_name = "norm-gain-shifted-twice"

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend on weights whose zero-centred norm gains are all shifted by +1."""
        ck = load_weights(model_path, opts.pop("perturb", None))
        suffixes = ("hc_norm.weight", "q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight",
                    "norm_key.weight", "norm_query.weight", "norm_conv.weight")
        for name in [n for n in ck.names() if n.endswith(suffixes)]:
            ck = ck.with_override(name, ck.get(name, dtype=np.float32) + 1.0)
        return super().open(model_path, weights=ck, **opts)


class HcMeanRounded(_Fault):
    """R13: the hyper-connection stream mean uses ``1 / hc_count`` rounded to bf16 (exact for hc 2 and 4,
    off by 0.2% for hc 3)."""

    fault_name = "hc-mean-rounded"

    def _inject(self):
        model, cfg = self.model, self.config
        inv = np.float32(1.0 / cfg.hc_count)
        bits = inv.view(np.uint32)
        inv_bf16 = np.uint32((int(bits) + 0x7FFF + ((int(bits) >> 16) & 1)) & 0xFFFF0000).view(np.float32)
        scale = model.dtype.type(float(inv_bf16) * cfg.hc_count) if hasattr(model.dtype, "type") else \
            np.dtype(model.dtype).type(float(inv_bf16) * cfg.hc_count)

        def hc_step(prefix, x, pos, rec, combine=True):
            taps = {} if rec is not None else None
            mixed, inj = _hyper_connection(x, *model._hc_w(prefix, combine), cfg.hc_count, cfg.hidden_size,
                                           cfg.rms_norm_eps, taps=taps)
            mixed = mixed * scale
            if rec is not None:
                rec.emit(prefix + ".hc_norm.out", taps["hc_norm"], positions=pos)
                rec.emit(prefix + ".out", mixed, positions=pos)
                if inj is not None:
                    rec.emit(prefix + ".injection_weights", inj, positions=pos)
            return mixed, inj
        model._hc_step = hc_step


class PleTableScaleShadowed(_Fault):
    """R14: the PLE table's block scale shadowed (an NVFP4 scale read from the wrong place): every gathered
    row comes out at 3/4 of its value."""

    fault_name = "ple-table-scale-shadowed"

    def _inject(self):
        self._patch_rows(lambda layer, rows, emb: emb * np.asarray(0.75, dtype=emb.dtype))


class NgramRowReadsPastEnd(_Fault):
    """R15: n-gram table unpacking off by one element (bits not dividing 32): each head's row reads one
    element late, the last one from the next row."""

    fault_name = "ngram-row-reads-past-end"

    def _inject(self):
        def fn(layer, rows, emb):
            flat = np.asarray(emb)
            return np.roll(flat, -1, axis=-1)
        self._patch_rows(fn)


class PleTableRowsInterleaved(_Fault):
    """R36: a PLE table converted with another storage layout (interleaved files) read as the native one:
    row ``r`` comes back as row ``r ^ 1``."""

    fault_name = "ple-table-rows-interleaved"

    def _inject(self):
        w = self.model.weights
        orig = w.ngram_rows
        w.ngram_rows = lambda layer, rows: orig(layer, np.bitwise_xor(np.asarray(rows), 1))


class NanInReturnedLogits(_Fault):
    """R18: an output-path defect: every decode at a position ``p`` with ``p % 5 == 4`` returns a logits
    row holding NaN (the sampler then emits an impossible id such as 4294967295)."""

    fault_name = "nan-in-returned-logits"

    def decode(self, hs, ids):
        """Injected fault: rows decoded at positions 4, 9, 14 ... get a NaN."""
        pos = [self.position(h) for h in hs]
        out = np.array(super().decode(hs, ids), copy=True)
        for b, p in enumerate(pos):
            if p % 5 == 4:
                out[b, 0] = np.nan
        return out


# ---------------------------------------------------------------- hashing (PLE n-gram ids)
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


# ---------------------------------------------------------------- speculative rollback
class RewindResetsNgramHistory(_Fault):
    """R19: every rewind (rollback, restore) resets the n-gram history to EOS instead of restoring it."""

    fault_name = "rewind-resets-ngram-history"

    def _reset(self, h):
        for st in self._sess(h).state.ple.values():
            st.context = np.full_like(st.context, self.config.ple_eos_token_id)

    def rollback(self, h, n):
        """Injected fault: roll back, then reset the n-gram context."""
        super().rollback(h, n)
        if n:
            self._reset(h)

    def restore(self, h, snap):
        """Injected fault: restore, then reset the n-gram context."""
        super().restore(h, snap)
        self._reset(h)


class RollbackKeepsDraftNgramContext(_Fault):
    """R20: rollback restores the conv states but not the n-gram context (it keeps the drafts' tokens)."""

    fault_name = "rollback-keeps-draft-ngram-context"

    def rollback(self, h, n):
        """Injected fault: roll back, then put the post-draft n-gram context back."""
        sess = self._sess(h)
        kept = {i: st.context.copy() for i, st in sess.state.ple.items()}
        super().rollback(h, n)
        if n:
            for i, ctx in kept.items():
                sess.state.ple[i].context = ctx


class RollbackForgetsGdnConv(_Fault):
    """R25: no rollback plane for the GDN conv state (it keeps the rejected drafts' rows)."""

    fault_name = "rollback-forgets-gdn-conv"

    def rollback(self, h, n):
        """Injected fault: roll back, then put each GDN layer's post-draft conv state back."""
        sess = self._sess(h)
        kept = {i: st.conv.copy() for i, st in sess.state.gdn.items()}
        super().rollback(h, n)
        if n:
            for i, conv in kept.items():
                sess.state.gdn[i].conv = conv


class _KeepsPreRollback(_Fault):
    """Remembers, per handle, the GDN/PLE state from before its latest rollback (until the next step)."""

    def rollback(self, h, n):
        """Roll back, remembering the pre-rollback GDN/PLE state (the rejected drafts')."""
        sess = self._sess(h)
        pre = ({i: s.copy() for i, s in sess.state.gdn.items()}, {i: s.copy() for i, s in sess.state.ple.items()})
        super().rollback(h, n)
        if n:
            self.__dict__.setdefault("_pre", {})[h] = pre

    def _forget(self, hs):
        for h in hs:
            self.__dict__.setdefault("_pre", {}).pop(h, None)

    def prefill(self, h, ids, chunk_size=None):
        """Prefill (forgets the remembered state)."""
        self._forget([h])
        return super().prefill(h, ids, chunk_size)

    def decode(self, hs, ids):
        """Decode (forgets the remembered state)."""
        self._forget(hs)
        return super().decode(hs, ids)

    def forward_tokens(self, h, ids):
        """Verify (forgets the remembered state)."""
        self._forget([h])
        return super().forward_tokens(h, ids)


class SnapshotAfterRollbackKeepsDrafts(_KeepsPreRollback):
    """R30: a snapshot taken right after a rollback (before the next step) holds the rejected drafts'
    GDN/PLE state (the cache manager ignores the dropped speculative block)."""

    fault_name = "snapshot-after-rollback-keeps-drafts"

    def snapshot(self, h):
        """Injected fault (see the class docstring)."""
        snap = super().snapshot(h)
        pre = self.__dict__.get("_pre", {}).get(h)
        if pre is not None:
            snap.state.gdn = {i: s.copy() for i, s in pre[0].items()}
            snap.state.ple = {i: s.copy() for i, s in pre[1].items()}
        return snap


class ForkAfterRollbackCopiesDrafts(_KeepsPreRollback):
    """R04 / R30 (sequence copy): a fork right after a rollback copies the rejected drafts' GDN/PLE state."""

    fault_name = "fork-after-rollback-copies-drafts"

    def fork(self, h):
        """Injected fault (see the class docstring)."""
        c = super().fork(h)
        pre = self.__dict__.get("_pre", {}).get(h)
        if pre is not None:
            st = self._sess(c).state
            st.gdn = {i: s.copy() for i, s in pre[0].items()}
            st.ple = {i: s.copy() for i, s in pre[1].items()}
        return c


# ---------------------------------------------------------------- snapshot / restore / fork
class RollbackAfterRestoreLost(_Fault):
    """R32: after a restore the rollback wrapper is lost: a rollback on a restored sequence truncates the
    caches but leaves the GDN/PLE states at the rejected drafts'."""

    fault_name = "rollback-after-restore-lost"

    def restore(self, h, snap):
        """Restore, marking the handle as restored."""
        super().restore(h, snap)
        self.__dict__.setdefault("_restored", set()).add(h)

    def rollback(self, h, n):
        """Injected fault on restored handles (see the class docstring)."""
        if h not in self.__dict__.get("_restored", set()) or not n:
            return super().rollback(h, n)
        sess = self._sess(h)
        gdn = {i: s.copy() for i, s in sess.state.gdn.items()}
        ple = {i: s.copy() for i, s in sess.state.ple.items()}
        super().rollback(h, n)
        sess.state.gdn, sess.state.ple = gdn, ple


class FullHitHeldLogitsWrongRow(_Fault):
    """R34: on a full prefix-cache hit the logits held with the snapshot are the FIRST row of the last
    prefill, not the last (a row-index slip), so the first sampled token comes from the wrong position."""

    fault_name = "full-hit-held-logits-wrong-row"

    def prefill(self, h, ids, chunk_size=None):
        """Prefill, remembering the first returned row."""
        out = super().prefill(h, ids, chunk_size)
        self.__dict__.setdefault("_first", {})[h] = np.array(out[0], copy=True)
        return out

    def snapshot(self, h):
        """Injected fault: the snapshot carries the first row of the last prefill."""
        snap = super().snapshot(h)
        first = self.__dict__.get("_first", {}).get(h)
        if first is not None:
            self._held.snaps[id(snap)] = (snap, first)
        return snap


class ForkSkipsIndexerKeys(_Fault):
    """R04 (sequence copy): a fork copies KV, GDN and PLE state but not the QSA indexer keys (the child's
    raw and block keys come back zero)."""

    fault_name = "fork-skips-indexer-keys"

    def fork(self, h):
        """Injected fault (see the class docstring)."""
        c = super().fork(h)
        for st in self._sess(c).state.qsa.values():
            st.index_keys.data[...] = 0
            st.block_keys.data[...] = 0
        return c


class PrefixHitZeroesGdnState(_Fault):
    """R29: a prefix-cache hit restores an all-zero GDN (Mamba-style) state: conv and recurrent."""

    fault_name = "prefix-hit-zeroes-gdn-state"

    def restore(self, h, snap):
        """Injected fault: restore, then zero every GDN layer's conv and recurrent state."""
        super().restore(h, snap)
        for st in self._sess(h).state.gdn.values():
            st.conv = np.zeros_like(st.conv)
            st.recurrent = np.zeros_like(st.recurrent)


class SnapshotGdnFromPreviousStep(_Fault):
    """R31: the cached GDN state sits on the wrong block: a snapshot carries the GDN state from before the
    sequence's latest step (the previous cache boundary), not the one at its position."""

    fault_name = "snapshot-gdn-from-previous-step"

    def _remember(self, hs):
        d = self.__dict__.setdefault("_prev_gdn", {})
        for h in hs:
            d[h] = {i: s.copy() for i, s in self._sess(h).state.gdn.items()}

    def prefill(self, h, ids, chunk_size=None):
        """Prefill, remembering the GDN state before it."""
        self._remember([h])
        return super().prefill(h, ids, chunk_size)

    def decode(self, hs, ids):
        """Decode, remembering the GDN states before it."""
        self._remember(hs)
        return super().decode(hs, ids)

    def snapshot(self, h):
        """Injected fault (see the class docstring)."""
        snap = super().snapshot(h)
        prev = self.__dict__.get("_prev_gdn", {}).get(h)
        if prev is not None:
            snap.state.gdn = {i: s.copy() for i, s in prev.items()}
        return snap


# ---------------------------------------------------------------- self-consistency (no truth needed)
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


class QsaPositionCapAt16(QsaPositionCap):
    """:class:`QsaPositionCap` with the cap lowered to 16 so the tiny fixtures (32768 positions at most)
    reach it; the real cap is reached by ``--level long``."""

    fault_name = "qsa-position-cap-16"
    cap = 16


class PleChunkCapAt16(PleChunkCap):
    """:class:`PleChunkCap` with the cap lowered to 16 so the tiny fixtures' chunks exceed it; the real cap
    (8192) is exceeded by ``--level long``'s chunks."""

    fault_name = "ple-chunk-cap-16"
    cap = 16


class SharedExpertDownScaledOneLayer(_Fault):
    """A loader defect confined to one block: layer 1's shared-expert ``down_proj`` read with a 2% gain
    (a wrong per-tensor scale). Every operation that runs layer 1's MLP meets the same bug, below and past the
    QSA bound alike: the report must name it as one root cause, at ``layers.1.mlp``."""

    fault_name = "shared-expert-down-scaled-one-layer"

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend on weights whose layer-1 shared-expert down projection is scaled by 1.02."""
        ck = load_weights(model_path, opts.pop("perturb", None))
        name = "layers.1.mlp.shared_expert.down_proj.weight"
        ck = ck.with_override(name, ck.get(name, dtype=np.float32) * np.float32(1.02))
        return super().open(model_path, weights=ck, **opts)


#: The bug classes of /work/shared/bug-classes.md implemented as faults: ``(class ids, fault, scenario, case
#: name prefix, fixture, substring the located divergence must contain)``. Each fault is caught by that case
#: (tests/parity/test_bug_classes.py runs exactly that one case) and located at that block. docs/parity.md
#: ("Bug classes") maps every class, the out-of-scope ones with the reason.
BUG_CLASSES = [
    (("R01",), DecodeSkipsBlockKeyPooling, "budget", "decode_across_bound", "tiny", "self_attn.indexer.block_keys"),
    (("R01",), SparseBelowBoundDropsBlock, "self_consistency", "dense_vs_sparse_below_bound", "tiny",
     "dense-vs-sparse below the bound"),
    (("R02",), NondeterministicSelection, "budget", "prefill_far-above", "tiny", "nondeterministic"),
    (("R03",), TopkTiesHigherIndex, "budget", "forced_exact_ties_in_block_selection", "tiny",
     "self_attn.indexer.selected_blocks"),
    (("R04",), ForkSkipsIndexerKeys, "snapshot_restore", "fork_then_diverge_both", "tiny",
     "self_attn.indexer.block_keys"),
    (("R04", "R30"), ForkAfterRollbackCopiesDrafts, "speculative_rollback", "fork_after_rollback", "tiny",
     "linear_attn.conv_state"),
    (("R05",), BlockScoresWrongUnits, "budget", "prefill_far-above", "tiny", "self_attn.indexer.block_scores"),
    (("R06",), BlockScoresInBf16, "budget", "near_ties_below_bf16_resolution", "tiny",
     "self_attn.indexer.block_scores"),
    (("R07", "R21"), PrefillBatchTailLosesContext, "chunk_boundary", "ragged_prefill_batch_vs_one_by_one", "tiny",
     "ple.ple_embedding.ngram_ids"),
    (("R12",), NormGainShiftedTwice, "budget", "prefill_bound_len", "tiny",
     "layers.0.attn_hyper_connection.hc_norm.out"),
    (("R13",), HcMeanRounded, "budget", "prefill_bound_len", "tiny-hc3", "attn_hyper_connection.out"),
    (("R14",), PleTableScaleShadowed, "budget", "prefill_bound_len", "tiny", "ple.ple_embedding.out"),
    (("R15",), NgramRowReadsPastEnd, "budget", "prefill_bound_len", "tiny", "ple.ple_embedding.out"),
    (("R36",), PleTableRowsInterleaved, "budget", "prefill_bound_len", "tiny", "ple.ple_embedding.out"),
    (("R16",), BatchDependentPrefill, "self_consistency", "batch_invariance_ragged_prefill", "tiny",
     "batch-dependence: prefill_batch"),
    (("R17",), BatchDependentDecode, "self_consistency", "batch_invariance_decode", "tiny",
     "batch-dependence: decode row"),
    (("R17",), SpecVerifyDrift, "self_consistency", "speculative_vs_plain_greedy", "tiny", "spec-vs-greedy drift"),
    (("R17",), VerifyWidthDependent, "self_consistency", "verify_rows_vs_decode_rows", "tiny",
     "verify-width dependence"),
    (("R18",), NanInReturnedLogits, "budget", "decode_across_bound", "tiny", "returned logits"),
    (("R19",), RewindResetsNgramHistory, "speculative_rollback", "accept_each_j", "tiny",
     "ple.ple_embedding.ngram_ids"),
    (("R20",), RollbackKeepsDraftNgramContext, "speculative_rollback", "accept_each_j", "tiny",
     "ple.ple_embedding.ngram_ids"),
    (("R20", "R25"), RollbackForgetsPLEConv, "speculative_rollback", "accept_each_j", "tiny", "ple.conv_out"),
    (("R21",), ChunkDropsNgramContext, "chunk_boundary", "chunk_inside-compress-block", "tiny",
     "ple.ple_embedding.ngram_ids"),
    (("R22",), NgramResetsOnEveryEos, "chunk_boundary", "eos_ids_after_the_first_do_not_reset", "tiny-hc2",
     "ple.ple_embedding.ngram_ids"),
    (("R22",), NgramIgnoresEos, "chunk_boundary", "chunk_eos_before_boundary", "tiny", "ple.ple_embedding.ngram_ids"),
    (("R23",), BatchedDecodeSharesNgramContext, "budget", "batch_mixed_sides_of_bound", "tiny",
     "ple.ple_embedding.ngram_ids"),
    (("R24",), ReusedSlotNotReset, "speculative_rollback", "accept_each_j", "tiny", "state leaks between runs"),
    (("R25",), RollbackForgetsGdnConv, "speculative_rollback", "accept_each_j", "tiny", "linear_attn.conv_state"),
    (("R28",), PleChunkCapAt16, "chunk_boundary", "chunk_length-1", "tiny", "ple.ple_embedding.ngram_ids"),
    # the indexer query at position 16 is the first capped value (its block key is pooled at position 19)
    (("R28",), QsaPositionCapAt16, "budget", "prefill_far-above", "tiny", "self_attn.indexer.block_scores"),
    (("R29",), PrefixHitZeroesGdnState, "snapshot_restore", "shared_prefix_hit_several_left", "tiny",
     "linear_attn.conv_state"),
    (("R30",), SnapshotAfterRollbackKeepsDrafts, "speculative_rollback", "snapshot_after_rollback", "tiny",
     "linear_attn.conv_state"),
    (("R31",), SnapshotGdnFromPreviousStep, "snapshot_restore", "restore_same_handle_at-bound", "tiny",
     "linear_attn.conv_state"),
    (("R32",), RollbackAfterRestoreLost, "snapshot_restore", "verify_and_rollback_after_restore", "tiny",
     "linear_attn.conv_state"),
    (("R33", "R01"), RestoreSkipsIndexerKeys, "snapshot_restore", "restore_fresh_handle_twice", "tiny",
     "self_attn.indexer.block_keys"),
    (("R34",), FullHitHeldLogitsWrongRow, "snapshot_restore", "shared_prefix_hit_none_left_restored_logits", "tiny",
     "held last-position logits"),
    (("R43",), DenseMaskPastBudget, "budget", "prefill_far-above", "tiny", "self_attn.indexer.selected_blocks"),
    (("R43",), BudgetOffByOne, "budget", "decode_across_bound", "tiny", "self_attn.indexer.selected_blocks"),
]
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
