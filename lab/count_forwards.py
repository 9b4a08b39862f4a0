"""Count the reference's forwards of one ``qwen4exp`` command, run in this process.

    python -m lab.count_forwards [--min-tokens N] -- parity tiny --backend reference --scenario kl budget ...

Every pass of the reference model over tokens goes through ``ReferenceModel._run`` (full forwards, prefills,
``prefill_last``, decode and verify steps); it is wrapped here, class-wide, and each call is classified by the
model's dtype, whether it starts from an empty state (a forward or a prefill) and its logits mode. A call of at
least ``--min-tokens`` tokens from an empty state is a "long pass" (what the real-width step's host time is
made of); decode steps and short chunks are counted apart. Prints the command's own output, then one JSON line
``{"rc", "seconds", "long_passes", "by_kind", "tokens"}`` on stderr (``--json FILE`` also writes it there).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter


def main(argv=None) -> int:
    """Run the command after ``--`` with the reference's passes counted; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-tokens", type=int, default=2, help="a long pass: at least this many tokens (default 2)")
    p.add_argument("--json", default=None, help="also write the counts to this file")
    a = p.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    import numpy as np

    from parity.cli import main as cli_main
    from reference.model import ReferenceModel
    real = ReferenceModel._run
    kinds, long_passes, tokens = Counter(), Counter(), Counter()

    def counted(self, state, ids, logits="all", residual_out=None):
        T, dt = len(ids), np.dtype(self.dtype).name
        fresh = state.position == 0
        rounded = getattr(self, "store_round", None) is not None
        kind = f"{dt}{'+stores' if rounded else ''} {'from empty' if fresh else 'continued'} logits={logits}"
        kinds[kind] += 1
        if fresh and T >= a.min_tokens:
            long_passes[f"{dt}{'+stores' if rounded else ''} T={T}"] += 1
            tokens[dt] += T
        return real(self, state, ids, logits, residual_out)
    ReferenceModel._run = counted
    t0 = time.perf_counter()
    try:
        rc = cli_main(cmd)
    finally:
        ReferenceModel._run = real
    doc = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "min_tokens": a.min_tokens,
           "long_passes": sum(long_passes.values()), "long_by_length": dict(sorted(long_passes.items())),
           "by_kind": dict(sorted(kinds.items())), "tokens": dict(tokens)}
    print(json.dumps(doc), file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
