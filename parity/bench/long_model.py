"""The model ``--level long`` is meant for: one period of the architecture with every LENGTH-related value real.

3 GDN layers + 1 QSA layer, PLE on layer 1 (0-based), random BF16 weights written by
:func:`parity.bench.synthetic.cached_synthetic`. Two widths:

* ``reduced`` (default, :data:`REDUCED_WIDTHS`): what ``--level long`` exists for is length -- RoPE at positions
  past 32768, the QSA bound / block selection, chunk boundaries past 8192, GDN state over long histories,
  snapshot/rollback at long positions. Every config value those depend on stays real: ``rope_theta`` 1e7,
  ``partial_rotary_factor`` 0.25 with ``head_dim`` 256 (rotary dim 64, mrope sections [11, 11, 10]),
  ``indexer_budget`` 2048 / ``indexer_compress_ratio`` 4 (bound 2051, block top-k 512), the whole indexer
  (4 heads of 128), the GDN head dims (128 / 128, chunk 64) and conv kernel, the hyper-connection count, the
  PLE n-gram settings. The widths are cut (hidden 256, 4 query / 2 KV heads, GDN 2 / 6 heads, experts of
  width 64): they set the cost of every token, not any cap or length a long case reaches, and the real
  widths are covered by the other levels (bench, KL harness on real-width checkpoints). At real width the
  NumPy truth of one 32776-token history takes far beyond the GPU run's budget (measured: ~30 s per
  2060 tokens on 16 cores).
* ``real``: the real widths (hidden 2560 ...; the previous default), for a run without a time budget.

Scaled down in both (stated wherever a result is shown): the vocabulary (:data:`LONG_VOCAB`: the truth and
every prefill return ``[T, V]`` float32 logits for T past 32768), the n-gram table rows and the number of
experts -- neither a width nor a cap the long cases exercise.

    python -m parity.bench.long_model [--width reduced|real] [--experts N]   # prints the checkpoint path

The cache folder is named after the width: ``reducedwidth-L4-<hash>`` (default), ``realwidth-L4-<hash>``
(``--width real``, the same folder as before the reduced width existed).
"""
from __future__ import annotations

LONG_VOCAB = 2048
LONG_EXPERTS = 16
LONG_NGRAM_BASE = 2000
WIDTHS = ("reduced", "real")

#: The cut widths of ``--width reduced`` (see the module docstring): every value a length depends on is absent
#: here, i.e. stays at :data:`parity.bench.synthetic.REAL_TEXT_CONFIG`.
REDUCED_WIDTHS = {
    "hidden_size": 256, "ple_embed_dim": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "hc_lowrank": 32,
}
#: Fields ``--width reduced`` must leave at their real values (tests hold the config to it).
LENGTH_FIELDS = ("head_dim", "rope_parameters", "partial_rotary_factor", "indexer_budget", "indexer_compress_ratio",
                 "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "hc_count", "ple_conv_kernel_size", "ngram_size",
                 "heads_per_ngram", "max_position_embeddings", "rms_norm_eps")


def _check_width(width: str) -> str:
    from reference.errors import InputError
    if width not in WIDTHS:
        raise InputError(f"--width: expected one of {', '.join(WIDTHS)}, found {width!r}")
    return width


def _overrides(width: str, num_experts: int) -> dict:
    out = dict(REDUCED_WIDTHS) if _check_width(width) == "reduced" else {}
    out.update(num_experts=int(num_experts), num_experts_per_tok=min(10, int(num_experts)))
    return out


def long_model_config(num_experts: int = LONG_EXPERTS, width: str = "reduced") -> dict:
    """The config dict of the long-level model (see the module docstring).

    Raises:
        InputError: unknown ``width``.
    """
    from parity.bench.synthetic import real_width_config
    return real_width_config(4, vocab_size=LONG_VOCAB, ngram_vocab_size_base=LONG_NGRAM_BASE,
                             overrides=_overrides(width, num_experts))


def _synthetic_args(num_experts: int, width: str) -> dict:
    # the folder is named after the width it holds: reducedwidth-L4-<hash> / realwidth-L4-<hash>
    return dict(vocab_size=LONG_VOCAB, ngram_vocab_size_base=LONG_NGRAM_BASE,
                overrides=_overrides(width, num_experts), kind=f"{width}width")


def long_model_dir(num_experts: int = LONG_EXPERTS, width: str = "reduced"):
    """The cache folder of the long-level checkpoint (written or not): ``reducedwidth-L4-<hash>`` for the
    default reduced width, ``realwidth-L4-<hash>`` for ``width='real'``
    (:func:`parity.bench.synthetic.synthetic_dir`).

    Raises:
        InputError: unknown ``width``.
    """
    from parity.bench.synthetic import synthetic_dir
    return synthetic_dir(4, **_synthetic_args(num_experts, width))


def long_model(num_experts: int = LONG_EXPERTS, progress: bool = False, width: str = "reduced"):
    """Path of the long-level checkpoint, written once into the synthetic cache (``$QWEN4EXP_CACHE``): the folder
    :func:`long_model_dir`.

    Raises:
        InputError: unknown ``width``.
    """
    from parity.bench.synthetic import cached_synthetic
    return cached_synthetic(4, progress=progress, **_synthetic_args(num_experts, width))


def main(argv=None) -> int:
    """``python -m parity.bench.long_model [--width reduced|real] [--experts N]``: print the checkpoint path."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m parity.bench.long_model", description=__doc__.split("\n")[0])
    p.add_argument("--width", choices=WIDTHS, default="reduced")
    p.add_argument("--experts", type=int, default=LONG_EXPERTS)
    a = p.parse_args(argv)
    print(long_model(a.experts, progress=False, width=a.width))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
