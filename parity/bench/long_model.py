"""The model ``--level long`` is meant for: one period of the real architecture at real widths.

3 GDN layers + 1 QSA layer, PLE on layer 1, hidden 2560, the real attention/GDN/indexer/hyper-connection
widths and the real ``indexer_budget`` 2048 / ``indexer_compress_ratio`` 4 (bound 2051), random BF16 weights
written by :func:`parity.bench.synthetic.cached_synthetic`. Scaled down (stated wherever a result is shown):
the vocabulary (``LONG_VOCAB``: the truth caches ``[T, V]`` logits for T past 32768), the n-gram table rows
and the number of experts (``LONG_EXPERTS`` of the real width 640, top-10 kept) -- the expert count sets
the checkpoint size, not any width or cap the long cases exercise.
"""
from __future__ import annotations

LONG_VOCAB = 8192
LONG_EXPERTS = 64
LONG_NGRAM_BASE = 2000


def long_model_config(num_experts: int = LONG_EXPERTS) -> dict:
    """The config dict of the long-level model (see the module docstring)."""
    from parity.bench.synthetic import real_width_config
    return real_width_config(4, vocab_size=LONG_VOCAB, ngram_vocab_size_base=LONG_NGRAM_BASE,
                             overrides={"num_experts": int(num_experts),
                                        "num_experts_per_tok": min(10, int(num_experts))})


def long_model(num_experts: int = LONG_EXPERTS, progress: bool = False):
    """Path of the long-level checkpoint, written once into the synthetic cache (``$QWEN4EXP_CACHE``)."""
    from parity.bench.synthetic import cached_synthetic, real_width_config  # noqa: F401
    cfg = long_model_config(num_experts)
    return cached_synthetic(4, vocab_size=LONG_VOCAB, ngram_vocab_size_base=LONG_NGRAM_BASE,
                            overrides={k: cfg[k] for k in ("num_experts", "num_experts_per_tok")}, progress=progress)


if __name__ == "__main__":  # python -m parity.bench.long_model [num_experts] -> prints the path
    import sys
    print(long_model(int(sys.argv[1]) if len(sys.argv) > 1 else LONG_EXPERTS, progress=False))
