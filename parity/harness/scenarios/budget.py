"""Scenario **budget**: the QSA token budget bound.

At and below ``bound = indexer_budget + indexer_compress_ratio - 1`` visible tokens the indexer keeps
every token (all complete blocks fit in ``block_topk`` plus the incomplete tail); above it the top-k
block selection starts to drop blocks. Source: modeling_qwen4_exp.py ``Qwen4ExpTextQSAIndexer.forward``
(``block_topk = token_budget // compress_ratio``; the selected-token buffer of
``token_budget + compress_ratio - 1``).

Cases: prompt lengths at the bound and one either side, far below and far above, each prefilled and
then decoded; a decode that walks across the bound; a batch mixing sequences on both sides of it; a
prompt with an exact block-score tie at the k-th selected block, decoded across the tie.
"""
from __future__ import annotations

from parity.harness.scenarios.common import Case, Run, sizes, token_stream
from parity.harness.scenarios import long
from parity.harness.scenarios.suite import Suite

NAME = "budget"


def _lengths(config) -> dict[str, int]:
    s = sizes(config)
    return {"bound-1": s.bound - 1, "bound": s.bound, "bound+1": s.bound + 1,
            "far-below": max(1, s.ratio - 1), "far-above": 2 * s.bound + s.ratio + 1}


def cases(config, level: str = "full") -> list[Case]:
    """The budget cases for ``config`` (sizes from indexer_budget / indexer_compress_ratio)."""
    s = sizes(config)
    out = []
    for tag, L in _lengths(config).items():
        def prefill_then_decode(run: Run, L=L, tag=tag):
            ids = token_stream(run.config, L + 3, seed=100 + L)
            run.plan(ids)
            a = run.new(f"len-{tag}")
            run.prefill(a, ids[:L])
            for t in ids[L:L + 3]:
                run.decode([a], [t])
        out.append(Case(f"prefill_{tag}_len{L}_then_decode", prefill_then_decode))

    def decode_across(run: Run):
        start = max(1, s.bound - 2)
        ids = token_stream(run.config, start + 5, seed=7)
        run.plan(ids)
        a = run.new("across")
        run.prefill(a, ids[:start])
        for t in ids[start:]:
            run.decode([a], [t], desc=f"decode at position {len(a.hist)} ({len(a.hist) + 1} visible "
                                                f"tokens, bound {s.bound} visible tokens)")
    out.append(Case("decode_across_bound", decode_across))

    def batch_both_sides(run: Run):
        seqs, streams = [], []
        for k, (tag, L) in enumerate(_lengths(run.config).items()):
            ids = token_stream(run.config, L + 3, seed=200 + k)
            run.plan(ids)
            sq = run.new(f"batch-{tag}")
            run.prefill(sq, ids[:L])
            seqs.append(sq)
            streams.append(ids[L:])
        for step in range(3):
            run.decode(seqs, [st[step] for st in streams], desc=f"batched decode step {step}")
    out.append(Case("batch_mixed_sides_of_bound", batch_both_sides, batch=True))
    return out + tie_cases(config, level)


# ------------------------------------------------------------------ forced exact ties
_TIE_CACHE: dict = {}
TIE_SEEDS = 64  # prompts searched for an exact tie at the k-th block (the tiny fixtures need <= 10)


def _bf16(x):
    """float32 -> nearest bf16 value (round to nearest even), as float32."""
    import numpy as np
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def tie_prompt(run: Run, kind: str = "exact") -> tuple[list[int], int | None, str | None]:
    """A deterministic prompt whose truth has, at some position past the bound, the k-th selected block and
    the best unselected one

    * ``kind='exact'``: at EXACTLY equal scores (relu-summed scores are exactly 0 for a block every head
      scores negative, so ties at 0 occur on real and random weights alike);
    * ``kind='bf16'``: at different scores that round to the same bf16 value, the selected one having the
      HIGHER block index (a bf16 scorer turns them into a tie the canonical rule resolves the other way);

    found by recording the truth's ``indexer.block_scores`` over seeded prompts. Returns ``(ids, position,
    layer tap)``; position None when none of :data:`TIE_SEEDS` seeds has one (the case then still walks the
    bound). Cached per model config and kind."""
    import numpy as np
    from taps.recorder import Recorder

    s = run.sizes
    key = (run.config.config_hash(), kind)
    if key in _TIE_CACHE:
        return _TIE_CACHE[key]
    n = s.bound + 6 * s.ratio + 5
    k = run.config.block_topk if s.has_qsa else 0
    found = None
    ids = token_stream(run.config, n, seed=5000)
    for seed in range(TIE_SEEDS if s.has_qsa else 0):
        ids = token_stream(run.config, n, seed=5000 + seed)
        with Recorder(None, include=["*indexer.block_scores"]) as rec:
            run.truth.model.forward(ids)  # the model itself: a cached truth would emit no taps
        arc = rec.archive()
        for name in arc.names():
            for row, p in zip(np.asarray(arc.get(name), dtype=np.float32), arc.positions(name)):
                fin = np.nonzero(np.isfinite(row))[0]
                if len(fin) <= k or int(p) < 2:
                    continue
                order = fin[np.argsort(-row[fin], kind="stable")]  # canonical: score desc, lower index first
                a, b = int(order[k - 1]), int(order[k])  # the k-th selected, the best unselected
                hit = (row[a] == row[b]) if kind == "exact" else \
                    (row[a] != row[b] and _bf16(row[a]) == _bf16(row[b]) and a > b)
                if hit and (found is None or int(p) < found[1]):
                    found = (ids, int(p), name)
        if found is not None:
            break
    out = found if found is not None else (ids, None, None)
    _TIE_CACHE[key] = out
    return out


def tie_cases(config, level: str = "full") -> list[Case]:
    """Forced ties in block selection: a prompt with an exact block-score tie at the k-th block, and one
    with two scores closer than bf16 resolution there; prefill to just before the tied position, then
    decode across it (the canonical rule, lower block index first, decides an exact tie; float32 scoring
    tells the near-tie apart)."""
    out = []
    for kind, name in (("exact", "forced_exact_ties_in_block_selection"),
                       ("bf16", "near_ties_below_bf16_resolution")):
        def forced(run: Run, kind=kind):
            ids, p, _tap = tie_prompt(run, kind)
            if p is None:
                p = min(len(ids) - 3, run.sizes.bound + 1)
            ids = ids[:p + 3]
            run.plan(ids)
            a = run.new(f"{kind}-tie")
            L = max(1, p - 2)
            run.prefill(a, ids[:L], desc=f"prefill {L} tokens (a {kind} block-score tie at position {p})")
            for t in ids[L:]:
                run.decode([a], [t], desc=f"decode at position {len(a.hist)} ({kind} tie at {p})")
        out.append(Case(name, forced))
    return out


SUITE = Suite(NAME, cases,
              "the QSA indexer_budget bound: sequences just below, at and above indexer_budget + "
              "compress_ratio - 1 visible tokens, where the indexer starts dropping blocks",
              long_cases=long.budget_cases)
