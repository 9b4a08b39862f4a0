"""Parameter counts of a checkpoint per component (backbone, routed experts, PLE n-gram tables, MTP,
vision), from the stored tensor shapes or from config.json alone, and the config summary ``qwen4exp info``
prints: part of the model definition."""
from __future__ import annotations

import math

COMPONENTS = ("backbone", "routed_experts", "ple_table", "mtp", "vision")
LABELS = {"backbone": "backbone (everything else, incl. embed + lm_head)",
           "routed_experts": "routed experts", "ple_table": "PLE n-gram tables", "mtp": "MTP head",
           "vision": "vision tower"}


def layer_pattern(cfg) -> str:
    """``L`` / ``P`` / ``Q`` per layer, a space after every ``Q`` (e.g. ``LPQ LLQ``)."""
    out = []
    for i, t in enumerate(cfg.layer_types):
        out.append("Q " if t == "indexed_attention" else ("P" if i in cfg.ple_layers else "L"))
    return "".join(out).strip()


def classify(name: str) -> str | None:
    """Component of a canonical tensor name; None for quantisation scales (not parameters)."""
    if name.endswith(("_scale_inv", "_scale", ".input_scale", ".weight_scale_2")):
        return None
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("visual."):
        return "vision"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".ple_embedding.ngram_embedding." in name:
        return "ple_table"
    return "backbone"


def counts_from_checkpoint(ck) -> dict:
    """Parameters per component from stored shapes (integer buffers and FP8 scales excluded)."""
    return scan(ck)[0]


def stored_bytes(ck) -> dict:
    """Bytes each component occupies on disk as stored (scales counted with their component)."""
    return scan(ck)[1]


def scan(ck) -> tuple[dict, dict]:
    """(parameters, stored bytes) per component of checkpoint ``ck``: integer buffers are not parameters, an
    NVFP4 weight's U8 bytes hold two parameters each, quantisation scales count as bytes of their tensor's
    component."""
    from reference.checkpoint import _INT, DTYPES

    c = dict.fromkeys(COMPONENTS, 0)
    b = dict.fromkeys(COMPONENTS, 0)
    for n in ck.names():
        dt = ck.dtype(n)
        comp = classify(n)
        size = math.prod(ck.shape(n))
        nvfp4 = dt == "U8" and ck.is_nvfp4(n)   # two E2M1 codes per stored byte
        if dt in _INT and not nvfp4:
            continue
        if comp is None:  # a quantisation scale: bytes to the component of its tensor
            comp = classify(n.rsplit("_scale", 1)[0])
        else:
            c[comp] += 2 * size if nvfp4 else size
        b[comp] += size * (DTYPES[dt].itemsize if dt in DTYPES else 0)
    return c, b


def counts_from_config(cfg) -> dict:
    """Parameters per component from config.json alone (fused expert and whole-table forms)."""
    from reference.checkpoint import expected_shapes

    c = dict.fromkeys(COMPONENTS, 0)
    for n, shp in expected_shapes(cfg).items():
        if n == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in n and not n.endswith(("gate_up_proj", "down_proj")):
            continue  # the per-expert form duplicates the fused one
        if n.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")):
            continue
        c[classify(n)] += math.prod(shp)
    c["mtp"] = c["vision"] = None
    return c


def fmt_count(n: int) -> str:
    """A parameter count with a K/M/B/T suffix (``1.23M``)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def fmt_gib(n_params: int) -> str:
    """The memory ``n_params`` parameters take in BF16 (2 bytes each), in MiB or GiB."""
    b = 2 * n_params
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def fmt_bytes(b: int) -> str:
    """A byte count in MiB or GiB."""
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def summary(cfg) -> dict:
    """A flat dict of the config facts printed by ``info``."""
    s = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "hc_count": cfg.hc_count, "hc_lowrank": cfg.hc_lowrank,
        "attention": f"{cfg.num_attention_heads} q heads / {cfg.num_key_value_heads} kv heads x {cfg.head_dim} "
                     f"(rotary {cfg.rotary_dim}, theta {cfg.rope_theta:g}), gated output",
        "gdn": f"{cfg.linear_num_key_heads} k heads x {cfg.linear_key_head_dim} / {cfg.linear_num_value_heads} v "
               f"heads x {cfg.linear_value_head_dim}, conv {cfg.linear_conv_kernel_dim}, output gate {cfg.output_gate}",
        "moe": f"{cfg.num_experts} experts x {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok} "
               f"(norm_topk_prob {cfg.norm_topk_prob}), shared expert {cfg.shared_expert_intermediate_size} (gated)",
        "qsa": (f"{cfg.indexer_n_heads} index heads x {cfg.indexer_head_dim}, budget {cfg.indexer_budget}, "
                f"compress {cfg.indexer_compress_ratio} (dense up to {cfg.qsa_bound} visible tokens)")
               if cfg.qsa_enabled else "off",
        "ple": (f"layers {list(cfg.ple_layer_ids)} (1-based), embed {cfg.ple_embed_dim}, ngram {cfg.ngram_size}, "
                f"{cfg.ngram_heads} heads x {cfg.ple_embed_dim // cfg.ngram_heads}, conv {cfg.ple_conv_kernel_size}, "
                f"{cfg.split_ngram_parts} shards, rows/layer {cfg.ple_layout(cfg.ple_layers[0]).padded_rows}")
               if cfg.ple_layer_ids else "off",
        "eos_token_id": list(cfg.eos_token_ids), "tie_word_embeddings": cfg.tie_word_embeddings,
        "layer_pattern": layer_pattern(cfg),
    }
    return s


