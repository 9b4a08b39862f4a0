"""``qwen4exp slice SRC DST``: cut a checkpoint into a small valid qwen4exp model (logic: :mod:`reference.slice`).

    qwen4exp slice SRC DST [--layers N] [--experts K | --experts 0,5,9] [--vocab N | --vocab 0,1,...] [--overwrite]

Exit codes: 0 written; 2 bad arguments, an unreadable source, an output that exists without --overwrite,
or a slice the layout cannot give (e.g. rows of a tensor with FP8 block scales).
"""
from __future__ import annotations


def _count_or_ids(text: str, flag: str):
    from reference.errors import InputError
    items = [x.strip() for x in str(text).split(",")]
    try:
        vals = [int(x) for x in items]
    except ValueError:
        raise InputError(f"{flag}: expected a count N or comma-separated ids, found {text!r}") from None
    return vals[0] if len(vals) == 1 and "," not in str(text) else vals


def register(subparsers) -> None:
    """Add the ``slice`` subcommand."""
    p = subparsers.add_parser("slice", help="cut a checkpoint into a CI-sized valid qwen4exp model",
                              description="Keep the first N decoder layers (and optionally a subset of experts and of "
                                          "the vocabulary) of a checkpoint, streamed shard by shard; the result is a "
                                          "valid qwen4exp checkpoint (see reference/slice.py for what is kept).")
    p.add_argument("src", help="source checkpoint directory or bundled fixture name")
    p.add_argument("dst", help="output directory (built in a temporary directory, then renamed)")
    p.add_argument("--layers", type=int, default=None, help="keep decoder layers 0..N-1 (default: all)")
    p.add_argument("--experts", default=None, metavar="K|I,J,...",
                   help="keep the first K experts, or these distinct ids (an id given twice is refused, exit 2); "
                        "kept in ascending id order and renumbered 0..k-1; when fewer experts are kept than the "
                        "model's top-k (num_experts_per_tok), top-k becomes their count and a note on stderr "
                        "says so")
    p.add_argument("--vocab", default=None, metavar="N|I,J,...",
                   help="keep token ids 0..N-1 (or the set of these ids: a repeat is the same id), plus "
                        "EOS/PAD/BOS and added tokens")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    from parity.cli.common import add_traceback
    add_traceback(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Write the slice and print what it kept. Returns 0."""
    from reference.paths import resolve_model
    from reference.slice import slice_checkpoint
    experts = None if args.experts is None else _count_or_ids(args.experts, "--experts")
    vocab = None if args.vocab is None else _count_or_ids(args.vocab, "--vocab")
    plan = slice_checkpoint(resolve_model(args.src), args.dst, layers=args.layers, experts=experts, vocab=vocab,
                            overwrite=args.overwrite)
    import sys
    for c in plan.changed:
        print(f"note: {c}", file=sys.stderr)
    print(f"slice: {args.dst}: " + "; ".join(plan.notes))
    return 0
