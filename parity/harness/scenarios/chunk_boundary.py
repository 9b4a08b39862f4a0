"""Scenario **chunk-boundary**: chunked prefill must equal single-shot prefill (and the truth).

Chunk sizes cut inside a QSA compress block (``compress_ratio + 1``), at the GDN chunk length (64,
``torch_chunk_gated_delta_rule``), inside the PLE conv window (``(ple_conv_kernel_size-1)*ngram_size - 1``,
``Qwen4ExpTextPLELayer._short_conv``), at the n-gram context (``ngram_size - 1``,
``Qwen4ExpTextNGramEmbedding.forward``), at 1 and at length - 1. The prompt holds EOS ids (the PLE
n-gram reset), one of them right before a chunk boundary. A batch case prefills several sequences
piecewise, interleaved, then decodes them together. Streams holding the EOS ids after the first (not a
reset) are prefilled in chunks; ragged prompts go through one ``prefill_batch`` call and must leave the
state a one-by-one prefill leaves.
"""
from __future__ import annotations

from parity.harness.scenarios.common import Case, Run, sizes, token_stream
from parity.harness.scenarios import long
from parity.harness.scenarios.suite import Suite

NAME = "chunk_boundary"


def prompt_length(config) -> int:
    """Long enough to cross the GDN chunk, the QSA bound and several PLE windows."""
    s = sizes(config)
    return max(s.gdn_chunk + s.ratio + s.ple_window + 3, s.bound + 2 * s.ratio + 2)


def chunk_sizes(config) -> dict[str, int]:
    """Chunk sizes by the boundary they cut at (sizes that coincide are merged into one case)."""
    s = sizes(config)
    n = prompt_length(config)
    raw = {"inside-compress-block": s.ratio + 1, "gdn-chunk": s.gdn_chunk,
           "inside-ple-window": max(1, s.ple_window - 1), "ngram-context": max(1, s.ngram_ctx),
           "one": 1, "length-1": n - 1}
    by_size: dict[int, list[str]] = {}
    for tag, c in raw.items():  # one case per distinct size, named after every boundary it stands for
        by_size.setdefault(c, []).append(tag)
    return {"+".join(tags): c for c, tags in by_size.items()}


def cases(config, level: str = "full") -> list[Case]:
    """The chunk-boundary cases for ``config``: one per chunk size of :func:`chunk_sizes`, an EOS right
    before a chunk boundary, and a batch prefilled piecewise, interleaved. ``level`` is not used."""
    s = sizes(config)
    n = prompt_length(config)
    out = []
    for tag, c in chunk_sizes(config).items():
        def chunked(run: Run, c=c):
            ids = token_stream(run.config, n + 2, seed=300 + c, eos_every=11)
            run.plan(ids)
            a = run.new(f"chunk{c}")
            run.prefill(a, ids[:n], chunk_size=c)
            run.decode([a], [ids[n]])
            run.decode([a], [ids[n + 1]])
        out.append(Case(f"chunk_{tag}_{c}", chunked))

    def eos_at_boundary(run: Run):
        c = s.ratio + 1
        ids = token_stream(run.config, n + 1, seed=350)
        if s.eos is not None:
            for i in range(c - 1, n, 3 * c):
                ids[i] = s.eos  # an EOS right before every third chunk boundary
        run.plan(ids)
        a = run.new(f"eos-boundary{c}")
        run.prefill(a, ids[:n], chunk_size=c)
        run.decode([a], [ids[n]])
    out.append(Case("chunk_eos_before_boundary", eos_at_boundary))

    def interleaved(run: Run):
        plan = [(n, s.ratio + 1), (n - 7, s.gdn_chunk), (max(3, s.bound + 1), max(1, s.ple_window - 1))]
        seqs, streams = [], []
        for k, (L, c) in enumerate(plan):
            ids = token_stream(run.config, L + 2, seed=400 + k, eos_every=13)
            run.plan(ids)
            seqs.append(run.new(f"piecewise-{L}-by-{c}"))
            streams.append((ids, L, c))
        offs = [0] * len(plan)
        while any(o < L for o, (_, L, _c) in zip(offs, streams)):
            for i, (ids, L, c) in enumerate(streams):
                if offs[i] < L:
                    piece = ids[offs[i]:min(L, offs[i] + c)]
                    run.prefill(seqs[i], piece, desc=f"piece [{offs[i]}, {offs[i] + len(piece)}) of seq {i}")
                    offs[i] += len(piece)
        for step in range(2):
            run.decode(seqs, [ids[L + step] for ids, L, _c in streams], desc=f"batched decode step {step}")
    out.append(Case("batch_interleaved_pieces", interleaved, batch=True))
    return out + more_cases(config, level)


# ------------------------------------------------------------------ second EOS id, ragged batch
def more_cases(config, level: str = "full") -> list[Case]:
    """Token streams holding the EOS ids after the first (they end generation but do NOT reset the PLE
    n-gram history: the official reset id is ``eos_token_id[0]``), prefilled in chunks and decoded; ragged
    prompts prefilled in one ``prefill_batch`` call vs one by one (state compared)."""
    s = sizes(config)
    n = prompt_length(config)
    out = []

    def second_eos(run: Run):
        ids = token_stream(run.config, n + 3, seed=360, eos_every=17)
        for i, e in enumerate(run.sizes.other_eos or ()):
            for j in range(2 + i, n + 3, 5):  # every 5th token an EOS id that is not the reset id
                ids[j] = e
        run.plan(ids)
        a = run.new("second-eos")
        c = s.ratio + 1
        run.prefill(a, ids[:n], chunk_size=c, desc=f"prefill {n} tokens holding non-reset EOS ids {list(run.sizes.other_eos)}"
                                                    f" in chunks of {c}")
        for t in ids[n:]:
            run.decode([a], [t])
    out.append(Case("eos_ids_after_the_first_do_not_reset", second_eos))

    def ragged(run: Run):
        lens = [n, s.bound + 1, 1, s.ratio + 2]  # ragged; the last one ends in a partial tile of a packed batch
        streams = [token_stream(run.config, L + 2, seed=420 + k, eos_every=9) for k, L in enumerate(lens)]
        run.plan(*streams)
        seqs = [run.new(f"ragged{k}-len{L}") for k, L in enumerate(lens)]
        run.prefill_batch(seqs, [st[:L] for st, L in zip(streams, lens)])
        for step in range(2):
            run.decode(seqs, [st[L + step] for st, L in zip(streams, lens)], desc=f"batched decode step {step}")
        for k, (sq, st) in enumerate(zip(seqs, streams)):
            alone = run.new(f"alone{k}")
            run.prefill(alone, sq.hist)
            run.compare_state(sq, alone, f"state of ragged request {k} vs the same prompt prefilled alone")
            run.free(alone)
    out.append(Case("ragged_prefill_batch_vs_one_by_one", ragged, batch=True, needs=("batched_prefill",)))
    return out


SUITE = Suite(NAME, cases,
              "chunked prefill equals one-shot prefill, at chunk sizes that cut a QSA compress block, "
              "the GDN chunk (64), the PLE conv window and the n-gram context",
              long_cases=long.chunk_boundary_cases)
