"""``qwen4exp info``: what a checkpoint (or just its config.json) holds.

  qwen4exp info [MODEL] [--config-only] [--json]

MODEL is a checkpoint directory or a bundled fixture name (default: the bundled ``tiny``). Prints the
config summary, the keys config.json leaves to the official default (``official defaults``), the layer
pattern (``L`` GatedDeltaNet, ``P`` GatedDeltaNet + PLE, ``Q`` QSA indexed attention; a space after each
``Q``), and parameter counts per component (backbone, routed experts,
PLE n-gram tables, MTP, vision) with the memory each takes in BF16. Counts come from the tensor
shapes in the checkpoint headers (no weights are read); ``--config-only`` derives them from
config.json alone (so it works on a real config without weights; MTP and vision are then unknown).
Exit codes: 0 success, 2 usage or input error.
"""
from __future__ import annotations

import json

def register(subparsers) -> None:
    """Add the ``info`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser("info", help="config summary, layer pattern and parameter counts of a checkpoint")
    from parity.cli.common import add_model
    add_model(p)
    p.add_argument("--config-only", action="store_true", help="use config.json only (no weights needed)")
    from parity.cli.common import add_format, add_traceback
    add_format(p, default_help="text")
    add_traceback(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Run ``qwen4exp info``: print the config summary, storage and parameter counts (from config.json
    only with ``--config-only``) as text or JSON. Returns 0; checkpoint/config errors propagate (a missing or
    mis-shaped tensor is a CheckpointError naming it, exit 2, as in every other verb)."""
    from reference.config import defaulted_summary, load_config
    from reference.params import COMPONENTS, LABELS, counts_from_config, fmt_bytes, fmt_count, fmt_gib, scan, summary
    from reference.paths import resolve_model

    path = resolve_model(args.model)
    ck = None
    if args.config_only:
        cfg = load_config(path)
        counts = counts_from_config(cfg)
    else:
        from reference.checkpoint import Checkpoint
        ck = Checkpoint.open(path)
        ck.validate()  # every required tensor present, header shapes against config.json: as logits (exit 2 naming it)
        cfg = ck.config
        counts, on_disk = scan(ck)
    known = {k: v for k, v in counts.items() if v is not None}
    total = sum(known.values())
    active = counts["backbone"] + (counts["routed_experts"] * cfg.num_experts_per_tok) // cfg.num_experts
    info = {"model": str(path), "source": "config.json" if args.config_only else "checkpoint headers",
            "config": summary(cfg), "params": counts, "total_params": total,
            "active_params_per_token": active, "bf16_bytes": {k: 2 * v for k, v in known.items()},
            "official_defaults": defaulted_summary(cfg)}
    if ck is not None:
        dtypes: dict[str, int] = {}
        for n in ck.names():
            dtypes[ck.dtype(n)] = dtypes.get(ck.dtype(n), 0) + 1
        fused = any(n.endswith("mlp.experts.gate_up_proj") for n in ck.names())
        info["storage"] = {"tensors": len(ck.names()), "dtypes": dtypes,
                           "expert_layout": "fused" if fused else "per-expert",
                           "files": len({e.file for e in ck._entries.values()}), "stored_bytes": on_disk}
    from parity.cli.common import output_format
    if output_format(args) == "json":
        print(json.dumps(info, indent=2))
        return 0
    print(f"model: {path}  ({info['source']})")
    for k, v in info["config"].items():
        print(f"  {k:20s} {v}")
    print("  layer legend         L = GatedDeltaNet, P = GatedDeltaNet + PLE, Q = QSA indexed attention")
    if info["official_defaults"]:
        print("  official defaults    not in config.json, so the official default is used: "
              + "; ".join(info["official_defaults"].values()))
    if "storage" in info:
        s = info["storage"]
        print(f"  storage              {s['tensors']} tensors in {s['files']} file(s), dtypes {s['dtypes']}, "
              f"{s['expert_layout']} experts")
    disk = info.get("storage", {}).get("stored_bytes")

    def row(label: str, *cells: str) -> str:
        return f"  {label:52s}" + "".join(f"  {c:>{w}s}" for c, w in zip(cells, (10, 12, 12)))

    print("parameters (count: K/M/B = thousand/million/billion; memory: in BF16 at 2 bytes a parameter"
          + (", and as stored on disk):" if disk else "):"))
    # the header names each column with its unit (each size cell also carries its own MiB / GiB)
    print(row("component", "parameters", "BF16 MiB/GiB", *(["disk MiB/GiB"] if disk else [])))
    print(row("-" * 52, "-" * 10, "-" * 12, *(["-" * 12] if disk else [])))
    for k in COMPONENTS:
        v = counts[k]
        if v is None:
            print(f"  {LABELS[k]:52s}  {'unknown (config only)'}")
        elif v or k in ("backbone", "routed_experts", "ple_table"):
            print(row(LABELS[k], fmt_count(v), fmt_gib(v), *([fmt_bytes(disk[k])] if disk else [])))
    print(row("total", fmt_count(total), fmt_gib(total), *([fmt_bytes(sum(disk.values()))] if disk else [])))
    print(row("active per token (backbone + top-k experts)", fmt_count(active)))
    return 0
