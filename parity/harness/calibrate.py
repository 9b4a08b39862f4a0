"""Measure how close two backends come to a tolerance profile's limits (profile calibration).

``python -m parity.harness.calibrate MODEL [--positions N] [--chunk-size N] [--precision bf16] [--device cuda]``
records the reference (float32) and the engine on the same random token ids, diffs them under the
profile and prints, as JSON, the worst ``limit_ratio`` (1.0 = at a limit) per tap kind and the
index-tap flip / error counts: the evidence behind the bounds in ``taps/profiles/*.toml``.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def calibrate(model: str, n_positions: int = 128, chunk_size: int | None = 32, precision: str = "bf16",
              device: str = "auto", profile: str | None = None, seed: int = 0) -> dict:
    """Diff engine vs reference taps on ``n_positions`` random ids. Returns a JSON-able summary:
    ``{"agree", "first_divergence", "worst": [(tap, limit_ratio, rel_l2), ...top 5], "index": {...}}``."""
    from parity.harness.record import record
    from reference.checkpoint import Checkpoint
    from reference.paths import resolve_model
    from taps.diff import diff_archives
    ck = Checkpoint.open(resolve_model(model))
    cfg = ck.config
    ids = [int(x) for x in np.random.default_rng(seed).integers(0, cfg.vocab_size, n_positions)]
    A = record(ck, ids, None, backend="reference")
    B = record(ck, ids, None, backend="engine", precision=precision, chunk_size=chunk_size, device=device)
    prof = profile or ("bf16" if precision == "bf16" else "fp32")
    rep = diff_archives(A, B, prof)
    acts = [r for r in rep.results if r.kind == "activation" and r.metrics]
    worst = sorted(acts, key=lambda r: -r.metrics.get("limit_ratio", 0))[:5]
    idx = [r for r in rep.results if r.kind == "index" and r.metrics]
    return {"model": model, "precision": precision, "profile": prof, "positions": n_positions,
            "agree": rep.agree, "first_divergence": rep.first_divergence,
            "worst": [(r.name, r.metrics["limit_ratio"], r.metrics["rel_l2"], r.metrics["max_rel"]) for r in worst],
            "index": {"flips": sum(r.metrics["flips"] for r in idx), "errors": sum(r.metrics["errors"] for r in idx),
                      "max_flip_margin": max([r.metrics["max_flip_margin"] for r in idx] or [0.0]),
                      "min_exact_match": min([r.metrics["exact_match"] for r in idx] or [1.0])}}


def main(argv=None) -> int:
    """Command line: calibrate each model given (``--positions``, ``--chunk-size``, ``--precision``,
    ``--device``, ``--profile``) and print the results as one JSON list on stdout. Returns 0."""
    p = argparse.ArgumentParser(prog="python -m parity.harness.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--positions", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--precision", default="bf16", choices=["bf16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--profile", default=None)
    a = p.parse_args(argv)
    out = [calibrate(m, a.positions, a.chunk_size, a.precision, a.device, a.profile) for m in a.models]
    json.dump(out, sys.stdout, indent=1, default=float)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
