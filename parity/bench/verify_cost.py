"""Bench item: the cost of a speculative verify step at widths 1..5 against a decode step, the MTP draft
cost, and the tokens/s they imply as a function of the acceptance rate.

    python -m parity.bench.verify_cost --synthetic real-widths --layers 4 --device cuda --out verify.json
    python -m parity.bench.verify_cost MODEL_DIR --device cpu          # any checkpoint with an MTP head

At real widths the synthetic checkpoint (parity/bench/synthetic.py) is one period (3 GDN + 1 QSA layers,
PLE on layer 1) plus the MTP layer (``mtp_num_hidden_layers: 1``). Random weights accept nothing, so no
speedup is measured: the report gives the curve over an assumed per-position acceptance rate ``a``
(independent positions: a round of ``k`` drafts yields ``E(a) = (1 - a^(k+1)) / (1 - a)`` tokens) and the
break-even rate where speculative decoding matches plain decoding:
``tokens/s(a) = E(a) / (t_draft(k) + t_verify(k + 1))`` vs ``1 / t_decode``. The times at one period are
not the real model's (48 layers: 12 periods + the head; the head's share of a round is larger here than it
will be there); no extrapolation is made.

Timing: CUDA events around each call on the GPU (the host half included: the verify's PLE hashing, its
device->host copy of k+1 token ids), wall clock on the CPU; median of ``repeats`` after ``warmup``.
Written for ``ci/gpu`` (ci/gpu_bench.sh step 3); the CPU path runs it on the bundled ``tiny-mtp`` in tests.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

__all__ = ["expected_tokens", "speedup_curve", "break_even", "measure", "main"]

ALPHAS = tuple(round(0.1 * i, 1) for i in range(10)) + (0.95,)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round yields with ``k`` drafts when each is accepted with probability ``alpha`` given the
    previous ones were (the bonus token included): ``sum_{i=0..k} alpha^i``."""
    return float(sum(alpha ** i for i in range(k + 1)))


def speedup_curve(t_decode: float, t_round: float, k: int, alphas=ALPHAS) -> list[dict]:
    """``[{"alpha", "tokens_per_round", "tokens_per_s", "speedup"}]`` for a round of ``t_round`` seconds
    (``t_draft(k) + t_verify(k + 1)``) against plain decoding at ``t_decode`` seconds per token."""
    out = []
    for a in alphas:
        e = expected_tokens(a, k)
        out.append({"alpha": a, "tokens_per_round": e, "tokens_per_s": e / t_round,
                    "speedup": (e / t_round) * t_decode})
    return out


def break_even(t_decode: float, t_round: float, k: int) -> float | None:
    """The acceptance rate at which ``expected_tokens(a, k) / t_round == 1 / t_decode`` (bisection on [0, 1));
    0.0 when a round already beats a decode step at ``a = 0``, None when even ``a -> 1`` does not."""
    target = t_round / t_decode
    if expected_tokens(0.0, k) >= target:
        return 0.0
    if expected_tokens(1.0 - 1e-9, k) < target:
        return None
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if expected_tokens(mid, k) < target:
            lo = mid
        else:
            hi = mid
    return hi


def _timer(eng):
    if eng.device == "cuda":
        from parity.bench.stats import CupyEventTimer
        return lambda: CupyEventTimer(eng.xp)
    from parity.bench.stats import WallTimer
    return WallTimer


def measure(model_dir, *, device: str = "cpu", precision: str | None = None, context: int = 512,
            widths=(1, 2, 3, 4, 5), repeats: int = 5, warmup: int = 2, seed: int = 0) -> dict:
    """Time a decode step, ``verify_greedy`` at each width (then rolled back) and the MTP draft of ``w - 1``
    tokens (``mtp_draft_next``), all at ``context`` tokens of history, batch 1.

    Returns:
        ``{"device", "precision", "context", "decode_s", "rows": [{"width", "verify_s", "verify_over_decode",
        "draft_k", "draft_s", "round_s", "break_even_alpha", "curve"}], ...}`` (seconds: medians).
    Raises:
        InputError: the checkpoint has no MTP head, or bad sizes.
    """
    import engine as engine_pkg
    from parity.bench.stats import summarize
    from reference.checkpoint import Checkpoint
    from reference.errors import InputError

    ck = Checkpoint.open(model_dir)
    if not ck.has_mtp():
        raise InputError(f"verify-cost bench: expected a checkpoint with an MTP head, found none in {model_dir}")
    widths = [int(w) for w in widths]
    if not widths or min(widths) < 1 or context < 1:
        raise InputError(f"verify-cost bench: expected widths >= 1 and context >= 1, found {widths}, {context}")
    prec = precision or ("bf16" if device == "cuda" else "float32")
    W = max(widths)
    eng = engine_pkg.Engine(ck, precision=prec, device=device, max_seqs=2, kv_tokens=context + 4 * (W + 8) + 64,
                            mtp=True)
    rng = np.random.default_rng(seed)
    V = ck.config.vocab_size
    timer = _timer(eng)
    seq = eng.add_sequence()
    last = eng.prefill(seq, rng.integers(0, V, size=context), last_only=True)
    x = int(np.argmax(last))

    def timed(fn, after=None):
        ts = []
        for r in range(warmup + repeats):
            with timer() as t:
                fn()
            if after is not None:  # undo the step outside the timed region
                after()
            if r >= warmup:
                ts.append(t.seconds)
        return summarize(ts)["median"]

    eng.mtp_draft_next(seq, x, 1)  # the head catches up on the context once, before anything is timed
    snap = eng.snapshot(seq)
    t_dec = timed(lambda: eng.decode_greedy([seq], [x]), lambda: eng.restore(seq, snap))
    rows = []
    for w in widths:
        ids = rng.integers(0, V, size=w)
        t_ver = timed(lambda ids=ids: eng.verify_greedy(seq, ids), lambda ids=ids: eng.rollback(seq, len(ids)))
        row = {"width": w, "verify_s": t_ver, "verify_over_decode": t_ver / t_dec}
        k = w - 1
        if k >= 1:
            t_dr = timed(lambda k=k: eng.mtp_draft_next(seq, x, k))
            t_round = t_dr + t_ver
            row.update({"draft_k": k, "draft_s": t_dr, "round_s": t_round,
                        "break_even_alpha": break_even(t_dec, t_round, k),
                        "curve": speedup_curve(t_dec, t_round, k)})
        rows.append(row)
    eng.free(seq)
    return {"device": device, "precision": prec, "context": context, "layers": ck.config.num_hidden_layers,
            "decode_s": t_dec, "rows": rows,
            "note": "random weights accept nothing: tokens/s is given as a function of an assumed acceptance rate"}


def format_table(res: dict) -> str:
    """The result as a text table (one row per verify width)."""
    lines = [f"verify cost ({res['device']}, {res['precision']}, {res['layers']} layers + MTP head, context "
             f"{res['context']}): decode step {res['decode_s'] * 1e3:.2f} ms",
             f"{'width':>5} {'verify ms':>10} {'x decode':>9} {'k':>3} {'draft ms':>9} {'round ms':>9} "
             f"{'break-even a':>13} {'speedup a=0.6':>14} {'a=0.8':>7}"]
    for r in res["rows"]:
        if "draft_k" in r:
            cur = {c["alpha"]: c["speedup"] for c in r["curve"]}
            be = r["break_even_alpha"]
            lines.append(f"{r['width']:>5} {r['verify_s'] * 1e3:>10.2f} {r['verify_over_decode']:>9.2f} "
                         f"{r['draft_k']:>3} {r['draft_s'] * 1e3:>9.2f} {r['round_s'] * 1e3:>9.2f} "
                         f"{'never' if be is None else f'{be:.3f}':>13} {cur[0.6]:>14.2f} {cur[0.8]:>7.2f}")
        else:
            lines.append(f"{r['width']:>5} {r['verify_s'] * 1e3:>10.2f} {r['verify_over_decode']:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """CLI (see the module docstring). Returns 0, or 2 with one line on stderr for bad input."""
    ap = argparse.ArgumentParser(prog="python -m parity.bench.verify_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="checkpoint with an MTP head (or --synthetic real-widths)")
    ap.add_argument("--synthetic", choices=["real-widths"], default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--widths", default="1,2,3,4,5")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the result JSON here (atomically)")
    args = ap.parse_args(argv)
    from reference.errors import UserError
    try:
        if args.synthetic:
            from parity.bench.synthetic import cached_synthetic
            model = cached_synthetic(args.layers, overrides={"mtp_num_hidden_layers": 1})
        elif args.model:
            from reference.paths import resolve_model
            model = resolve_model(args.model)
        else:
            raise UserError("verify-cost bench: expected a MODEL directory or --synthetic real-widths, found neither")
        widths = [int(w) for w in args.widths.split(",")]
        t0 = time.perf_counter()
        res = measure(model, device=args.device, precision=args.precision, context=args.context, widths=widths,
                      repeats=args.repeats, warmup=args.warmup)
        res["seconds"] = time.perf_counter() - t0
        res["model"] = str(model)
    except (UserError, ValueError) as e:
        print(f"verify_cost: error: {e}", file=sys.stderr)
        return 2
    print(format_table(res))
    if args.out:
        from reference.atomic import atomic_write_bytes
        atomic_write_bytes(args.out, (json.dumps(res, indent=1, default=float) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
