"""Scenario **chunk-boundary**: chunked prefill must equal single-shot prefill (and the truth).

Chunk sizes cut inside a QSA compress block (``compress_ratio + 1``), at the GDN chunk length (64,
``torch_chunk_gated_delta_rule``), inside the PLE conv window (``(ple_conv_kernel_size-1)*ngram_size - 1``,
``Qwen4ExpTextPLELayer._short_conv``), at the n-gram context (``ngram_size - 1``,
``Qwen4ExpTextNGramEmbedding.forward``), at 1 and at length - 1. The prompt holds EOS ids (the PLE
n-gram reset), one of them right before a chunk boundary. A batch case prefills several sequences
piecewise, interleaved, then decodes them together.
"""
from __future__ import annotations

from parity.harness.scenarios.common import Case, Run, sizes, token_stream

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
    return out
