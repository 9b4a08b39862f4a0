"""``qwen4exp info``: what a checkpoint (or just its config.json) holds.

  qwen4exp info [MODEL] [--config-only] [--json]

MODEL is a checkpoint directory or a bundled fixture name (default: the bundled ``tiny``). Prints the
config summary, the layer pattern (``L`` GatedDeltaNet, ``P`` GatedDeltaNet + PLE, ``Q`` QSA indexed
attention; a space after each ``Q``), and parameter counts per component (backbone, routed experts,
PLE n-gram tables, MTP, vision) with the memory each takes in BF16. Counts come from the tensor
shapes in the checkpoint headers (no weights are read); ``--config-only`` derives them from
config.json alone (so it works on a real config without weights; MTP and vision are then unknown).
Exit codes: 0 success, 2 usage or input error.
"""
from __future__ import annotations

import json
import math

COMPONENTS = ("backbone", "routed_experts", "ple_table", "mtp", "vision")
_LABELS = {"backbone": "backbone (everything else, incl. embed + lm_head)",
           "routed_experts": "routed experts", "ple_table": "PLE n-gram tables", "mtp": "MTP head",
           "vision": "vision tower"}


def register(subparsers) -> None:
    """Add the ``info`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser("info", help="config summary, layer pattern and parameter counts of a checkpoint")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or bundled fixture name (default: bundled 'tiny')")
    p.add_argument("--config-only", action="store_true", help="use config.json only (no weights needed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


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
    return _scan(ck)[0]


def stored_bytes(ck) -> dict:
    """Bytes each component occupies on disk as stored (scales counted with their component)."""
    return _scan(ck)[1]


def _scan(ck) -> tuple[dict, dict]:
    from reference.checkpoint import _INT, DTYPES

    c = dict.fromkeys(COMPONENTS, 0)
    b = dict.fromkeys(COMPONENTS, 0)
    for n in ck.names():
        dt = ck.dtype(n)
        comp = classify(n)
        size = math.prod(ck.shape(n))
        if dt in _INT:
            continue
        if comp is None:  # a quantisation scale: bytes to the component of its tensor
            comp = classify(n.rsplit("_scale", 1)[0])
        else:
            c[comp] += size
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


def _fmt(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _gib(n_params: int) -> str:
    b = 2 * n_params
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def _bytes(b: int) -> str:
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


def run(args) -> int:
    """Run ``qwen4exp info``: print the config summary, storage and parameter counts (from config.json
    only with ``--config-only``) as text or JSON. Returns 0; checkpoint/config errors propagate."""
    from reference.config import load_config
    from reference.paths import resolve_model

    path = resolve_model(args.model)
    ck = None
    if args.config_only:
        cfg = load_config(path)
        counts = counts_from_config(cfg)
    else:
        from reference.checkpoint import Checkpoint
        ck = Checkpoint.open(path)
        ck.validate(require_complete=False)  # header shapes against config.json (names the first bad tensor)
        cfg = ck.config
        counts, on_disk = _scan(ck)
    known = {k: v for k, v in counts.items() if v is not None}
    total = sum(known.values())
    active = counts["backbone"] + (counts["routed_experts"] * cfg.num_experts_per_tok) // cfg.num_experts
    info = {"model": str(path), "source": "config.json" if args.config_only else "checkpoint headers",
            "config": summary(cfg), "params": counts, "total_params": total,
            "active_params_per_token": active, "bf16_bytes": {k: 2 * v for k, v in known.items()}}
    if ck is not None:
        dtypes: dict[str, int] = {}
        for n in ck.names():
            dtypes[ck.dtype(n)] = dtypes.get(ck.dtype(n), 0) + 1
        fused = any(n.endswith("mlp.experts.gate_up_proj") for n in ck.names())
        info["storage"] = {"tensors": len(ck.names()), "dtypes": dtypes,
                           "expert_layout": "fused" if fused else "per-expert",
                           "files": len({e.file for e in ck._entries.values()}), "stored_bytes": on_disk}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model: {path}  ({info['source']})")
    for k, v in info["config"].items():
        print(f"  {k:20s} {v}")
    print("  layer legend         L = GatedDeltaNet, P = GatedDeltaNet + PLE, Q = QSA indexed attention")
    if "storage" in info:
        s = info["storage"]
        print(f"  storage              {s['tensors']} tensors in {s['files']} file(s), dtypes {s['dtypes']}, "
              f"{s['expert_layout']} experts")
    disk = info.get("storage", {}).get("stored_bytes")
    print("parameters (memory in BF16" + (", as stored):" if disk else "):"))
    for k in COMPONENTS:
        v = counts[k]
        if v is None:
            print(f"  {_LABELS[k]:52s} {'unknown (config only)':>10s}")
        elif v or k in ("backbone", "routed_experts", "ple_table"):
            print(f"  {_LABELS[k]:52s} {_fmt(v):>10s} {_gib(v):>12s}" + (f" {_bytes(disk[k]):>12s}" if disk else ""))
    print(f"  {'total':52s} {_fmt(total):>10s} {_gib(total):>12s}"
          + (f" {_bytes(sum(disk.values())):>12s}" if disk else ""))
    print(f"  {'active per token (backbone + top-k experts)':52s} {_fmt(active):>10s}")
    return 0
