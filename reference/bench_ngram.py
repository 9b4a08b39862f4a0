"""Benchmark of the PLE n-gram row gather (:meth:`reference.checkpoint.Checkpoint.ngram_rows`): rows/s and
resident-memory growth on a sparse synthetic table of any size."""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from reference.checkpoint import Checkpoint
from reference.config import ModelConfig
from reference.safetensors_file import DTYPES, StreamedTensor, write_streamed

# --------------------------------------------------------------------------- benchmark
def _statm_rss_bytes() -> tuple[int, int]:
    """(resident, resident - shared) bytes of this process from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        parts = f.read().split()
    page = os.sysconf("SC_PAGE_SIZE")
    return int(parts[1]) * page, (int(parts[1]) - int(parts[2])) * page


def bench_ngram_gather(min_table_bytes: int = 256 * 1024 * 1024, *, head_dim: int = 160, n_shards: int = 8,
                       n_gathers: int = 200, rows_per_gather: int = 4096, dtype: str = "BF16",
                       directory: str | os.PathLike | None = None, seed: int = 0, progress: bool = False) -> dict:
    """Gather random rows from a synthetic sharded n-gram table on disk; report speed and memory.

    A sparse table (``min_table_bytes`` or more, split into ``n_shards`` safetensors files that hold
    ``layers.0.ple.ple_embedding.ngram_embedding.shard_{k}.weight``) is written to a temp dir (files
    are sparse, so a table far larger than RAM costs no disk), opened with :class:`Checkpoint`, and
    ``n_gathers`` random batches of ``rows_per_gather`` rows are gathered with :meth:`ngram_rows`.

    Returns:
        dict: ``rows_per_s``, ``table_bytes``, ``rows`` (total gathered), ``rss_growth_bytes`` (statm
        resident, after minus before the gathers, measured after a warm-up gather), ``anon_growth_bytes``
        (resident minus shared), ``seconds``.
    """
    from tqdm import tqdm

    st_dt = DTYPES[dtype]
    row_bytes = head_dim * st_dt.itemsize
    rows_per_shard = max(1, math.ceil(min_table_bytes / row_bytes / n_shards))
    ngram_heads = 2
    total = n_shards * rows_per_shard
    with tempfile.TemporaryDirectory(dir=directory, prefix="ngram-bench-") as td:
        root = Path(td)
        # a config whose layer-0 PLE table has exactly `total` padded rows: two prime-sized heads near
        # total / 4 (sum < total) padded to a multiple of `total`
        base = max(3, total // (2 * ngram_heads))
        cfg_d = dict(model_type="qwen4_exp_text", vocab_size=256, hidden_size=8, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=8, linear_key_head_dim=4,
                     linear_value_head_dim=4, linear_num_key_heads=1, linear_num_value_heads=1,
                     moe_intermediate_size=4, shared_expert_intermediate_size=4, num_experts=1,
                     num_experts_per_tok=1, hc_count=2, hc_lowrank=2, layer_types=["linear_attention"],
                     ple_layer_ids=[1], ple_embed_dim=head_dim * ngram_heads, ngram_size=2,
                     heads_per_ngram=ngram_heads, ngram_vocab_size_base=base,
                     make_ngram_vocab_size_divisible_by=total, split_ngram_parts=n_shards, eos_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
        cfg = ModelConfig.from_dict(cfg_d)
        lay = cfg.ple_layout(0)
        if lay.padded_rows != total:
            raise RuntimeError(f"bench config: padded rows {lay.padded_rows} != {total}")
        (root / "config.json").write_text(json.dumps(cfg_d))
        wmap = {}
        for k in range(n_shards):
            name = f"model.layers.0.ple.ple_embedding.ngram_embedding.shard_{k}.weight"
            fn = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
            write_streamed(root / fn, [StreamedTensor(name, dtype, (rows_per_shard, head_dim),
                                                      rows_per_shard * row_bytes, None)],  # sparse: reads as zeros
                           atomic=False)
            wmap[name] = fn
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        rng = np.random.default_rng(seed)
        with Checkpoint.open(root) as ck:
            ck.ngram_rows(0, rng.integers(0, total, size=rows_per_gather))  # warm-up
            rss0, anon0 = _statm_rss_bytes()
            t0 = time.perf_counter()
            for _ in tqdm(range(n_gathers), disable=not progress, desc="gather", unit="batch"):
                out = ck.ngram_rows(0, rng.integers(0, total, size=rows_per_gather))
                del out
            dt = time.perf_counter() - t0
            rss1, anon1 = _statm_rss_bytes()
    n = n_gathers * rows_per_gather
    return {"rows_per_s": n / dt if dt > 0 else float("inf"), "table_bytes": total * row_bytes, "rows": n,
            "rss_growth_bytes": rss1 - rss0, "anon_growth_bytes": anon1 - anon0, "seconds": dt}
