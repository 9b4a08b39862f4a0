"""The sizes a model's scenario cases cut at (QSA bound, compress ratio, GDN chunk, PLE window, EOS ids), all
from the model config, and the deterministic token streams the cases and the floor are built from."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.config import qsa_visible_bound

__all__ = ["Sizes", "GDN_CHUNK", "sizes", "page_sizes_for", "token_stream"]


@dataclass(frozen=True)
class Sizes:
    """The sizes the suites cut at, all from the model config.

    ``bound`` = indexer_budget + indexer_compress_ratio - 1 (at and below it QSA keeps every token);
    ``ratio`` = indexer_compress_ratio; ``gdn_chunk`` = 64 (the chunked gated delta rule's block);
    ``ple_window`` = (ple_conv_kernel_size - 1) * ngram_size (carried PLE conv history);
    ``ngram_ctx`` = ngram_size - 1 (carried n-gram token context); ``eos`` = the PLE reset id.
    """

    bound: int
    ratio: int
    budget: int
    gdn_chunk: int
    ple_window: int
    ngram_ctx: int
    vocab: int
    eos: int | None
    has_qsa: bool
    has_ple: bool
    has_gdn: bool
    other_eos: tuple = ()  # EOS ids after the first: end generation but do NOT reset the n-gram history


GDN_CHUNK = 64  # torch_chunk_gated_delta_rule(chunk_size=64), modeling_qwen4_exp.py


def sizes(config) -> Sizes:
    """The :class:`Sizes` of a :class:`reference.config.ModelConfig`."""
    has_qsa = bool(config.qsa_enabled and "indexed_attention" in config.layer_types)
    ratio = config.indexer_compress_ratio if has_qsa else 4
    budget = config.indexer_budget if has_qsa else 8
    return Sizes(bound=qsa_visible_bound(budget, ratio), ratio=ratio, budget=budget, gdn_chunk=GDN_CHUNK,
                 ple_window=config.ple_conv_state_len, ngram_ctx=config.ngram_size - 1, vocab=config.vocab_size,
                 eos=config.ple_eos_token_id, has_qsa=has_qsa, has_ple=bool(config.ple_layer_ids),
                 has_gdn="linear_attention" in config.layer_types,
                 other_eos=tuple(int(e) for e in config.eos_token_ids[1:] if e != config.ple_eos_token_id))


def page_sizes_for(config) -> list[int]:
    """Paged-cache page sizes the suites run with: one equal to the compress ratio (divides it), one
    twice it (a multiple), and ratio + 1 (neither divides nor is divided by it, so compress blocks
    straddle pages)."""
    r = sizes(config).ratio
    out = [r, 2 * r, r + 1]
    return sorted(set(p for p in out if p >= 1))


def token_stream(config, n: int, seed: int, eos_every: int | None = None) -> list[int]:
    """``n`` deterministic pseudo-random token ids in [0, vocab) avoiding the EOS id, with an EOS
    inserted every ``eos_every`` tokens when given (to exercise the n-gram reset)."""
    s = sizes(config)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, s.vocab, size=n).tolist()
    if s.eos is not None:
        ids = [t if t != s.eos else (t + 1) % s.vocab for t in ids]
        if eos_every:
            for i in range(eos_every - 1, n, eos_every):
                ids[i] = s.eos
    return [int(t) for t in ids]
