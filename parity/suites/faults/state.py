"""Bug-class faults of the carried state: speculative rollback, snapshot / restore and fork."""
from __future__ import annotations

import numpy as np

from parity.suites.faults.base import _Fault


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
