"""Scenario **budget**: the QSA token budget bound.

At and below ``bound = indexer_budget + indexer_compress_ratio - 1`` visible tokens the indexer keeps
every token (all complete blocks fit in ``block_topk`` plus the incomplete tail); above it the top-k
block selection starts to drop blocks. Source: modeling_qwen4_exp.py ``Qwen4ExpTextQSAIndexer.forward``
(``block_topk = token_budget // compress_ratio``; the selected-token buffer of
``token_budget + compress_ratio - 1``).

Cases: prompt lengths at the bound and one either side, far below and far above, each prefilled and
then decoded; a decode that walks across the bound; a batch mixing sequences on both sides of it.
"""
from __future__ import annotations

from parity.harness.scenarios.common import Case, Run, sizes, token_stream

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
            run.decode([a], [t], desc=f"decode at position {len(a.hist)} (bound {s.bound})")
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
    return out
