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
``BUG_CLASSES`` adds one fault per in-scope class of the public bug list, with the one case that catches it and
the block it is located at; those faults live in one module per area (:mod:`.selection`, :mod:`.numerics`,
:mod:`.hashing`, :mod:`.state`, :mod:`.self_consistency`, on the base :mod:`.base`), the first four in
:mod:`.scenario`. Every fault is importable from this package.

MTP faults (on a checkpoint with an MTP head; ``MTP_FAULTS``, caught by speculative-rollback's ``mtp_*``
cases and located at the first divergent ``mtp.*`` tap):

* :class:`MTPStateNotRolledBack` -- an incremental head that consumes the verified positions' pairs at verify
  time and is not rolled back with the trunk (a rejected draft's pairs stay in its caches);
* :class:`MTPHnormPerStream` -- ``pre_fc_norm_hidden`` applied per stream (llama.cpp's grouping) instead of
  one RMS over all streams;
* :class:`MTPStaleDraftSelection` -- later draft steps reuse draft step 0's QSA block selection.
"""
from __future__ import annotations

from parity.suites.faults.scenario import (RollbackForgetsPLEConv, RestoreSkipsIndexerKeys, ChunkDropsNgramContext,
                                           BudgetOffByOne)  # noqa: F401
from parity.suites.faults.selection import (TopkTiesHigherIndex, DecodeSkipsBlockKeyPooling, BlockScoresWrongUnits,
                                            BlockScoresInBf16, DenseMaskPastBudget, NondeterministicSelection,
                                            QsaPositionCap, QsaPositionCapAt16)  # noqa: F401
from parity.suites.faults.numerics import (NormGainShiftedTwice, HcMeanRounded, PleTableScaleShadowed,
                                           NgramRowReadsPastEnd, PleTableRowsInterleaved, NanInReturnedLogits,
                                           SharedExpertDownScaledOneLayer)  # noqa: F401
from parity.suites.faults.hashing import (NgramResetsOnEveryEos, NgramIgnoresEos, BatchedDecodeSharesNgramContext,
                                          ReusedSlotNotReset, PrefillBatchTailLosesContext, PleChunkCap,
                                          PleChunkCapAt16)  # noqa: F401
from parity.suites.faults.state import (RewindResetsNgramHistory, RollbackKeepsDraftNgramContext,
                                        RollbackForgetsGdnConv, SnapshotAfterRollbackKeepsDrafts,
                                        ForkAfterRollbackCopiesDrafts, RollbackAfterRestoreLost,
                                        FullHitHeldLogitsWrongRow, ForkSkipsIndexerKeys, PrefixHitZeroesGdnState,
                                        SnapshotGdnFromPreviousStep)  # noqa: F401
from parity.suites.faults.self_consistency import (BatchDependentDecode, BatchDependentPrefill, VerifyWidthDependent,
                                                   SpecVerifyDrift, SparseBelowBoundDropsBlock)  # noqa: F401
from parity.suites.faults.mtp import MTPStateNotRolledBack, MTPHnormPerStream, MTPStaleDraftSelection  # noqa: F401

__all__ = ["RollbackForgetsPLEConv", "RestoreSkipsIndexerKeys", "ChunkDropsNgramContext", "BudgetOffByOne",
           "FAULTS", "BUG_CLASSES", "SharedExpertDownScaledOneLayer", "MTPStateNotRolledBack", "MTPHnormPerStream", "MTPStaleDraftSelection",
           "MTP_FAULTS"]


#: fault class -> (scenario that must catch it, substring the located divergence must contain)
FAULTS = {
    RollbackForgetsPLEConv: ("speculative_rollback", "ple"),
    RestoreSkipsIndexerKeys: ("snapshot_restore", "indexer"),
    ChunkDropsNgramContext: ("chunk_boundary", "ple"),
    BudgetOffByOne: ("budget", "indexer"),
}


#: The bug classes of /work/shared/bug-classes.md implemented as faults: ``(class ids, fault, scenario, case
#: name prefix, fixture, substring the located divergence must contain)``. Each fault is caught by that case
#: (tests/parity/test_bug_classes.py runs exactly that one case) and located at that block, except
#: TopkTiesHigherIndex (R03): its picks differ only inside exact tie sets, a valid resolution the case must pass
#: as tie-equivalent. docs/parity.md
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


#: MTP fault class -> (scenario that must catch it, case, substring the located divergence must name)
MTP_FAULTS = {
    MTPStateNotRolledBack: ("speculative_rollback", "mtp_accept_each_j", "not rolled back"),
    MTPHnormPerStream: ("speculative_rollback", "mtp_accept_each_j", "mtp.fc_hidden.out"),
    MTPStaleDraftSelection: ("speculative_rollback", "mtp_accept_each_j", "mtp.layers.0.self_attn.indexer"),
}
