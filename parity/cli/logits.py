"""``qwen4exp logits``: write the float32 logits ``[T, vocab_size]`` of the token ids in a file.

  qwen4exp logits MODEL --ids FILE --out OUT.npy [--backend reference|engine] [--dtype float32|float64]
                        [--chunk-size N] [--last-only]

FILE holds a ``.npy`` integer array, a JSON list of integers (or ``{"ids": [...]}``) or whitespace/comma
separated integers (:mod:`reference.ids_file`).
``--last-only`` writes ``[1, vocab_size]`` (the last position's logits). The file is written to a temp
name and renamed. Exit codes: 0 success, 2 usage or input error.
"""
from __future__ import annotations

import numpy as np


def register(subparsers) -> None:
    """Add the ``logits`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser("logits", help="write the float32 logits [T, vocab] of token ids (reference or engine)")
    p.add_argument("model", help="checkpoint directory or bundled fixture name")
    p.add_argument("--ids", required=True, metavar="FILE",
                   help="a FILE holding token ids: a .npy integer array, a JSON list (or {\"ids\": [...]}), or "
                        "integers separated by whitespace or commas")
    p.add_argument("--out", required=True,
                   help="output .npy file (float32 [T, vocab_size]); its folder must exist, an existing file "
                        "needs --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--backend", choices=["reference", "engine"], default="reference")
    p.add_argument("--dtype", choices=["float32", "float64"], default=None,
                   help="reference compute dtype (default float32; the file is float32 either way); the engine's "
                        "is --precision")
    p.add_argument("--precision", choices=["float32", "bf16"], default=None,
                   help="engine precision (default float32): bf16 rounds weights to BF16 and accumulates in "
                        "float32, so on a checkpoint stored in BF16 it equals float32; the reference backend "
                        "uses --dtype instead")
    p.add_argument("--device", default="auto",
                   help="engine device: cuda, cpu or auto (cuda when a GPU is present); the reference runs on the "
                        "CPU (auto or cpu)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one chunk)")
    p.add_argument("--last-only", action="store_true", help="only the last position's logits ([1, vocab_size])")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run ``qwen4exp logits``: write the float32 logits ``[T, vocab_size]`` (or the last row only with
    ``--last-only``) of the ids file to ``--out`` (atomically). Returns 0.

    Raises:
        InputError: ``--out``'s parent directory missing, an existing file without ``--overwrite``, bad ids,
            or a precision the backend does not support.
    """
    from reference.atomic import atomic_save_npy, check_output_path
    from reference.checkpoint import Checkpoint
    from reference.paths import resolve_model

    from pathlib import Path

    from reference.errors import InputError
    # the same rule as `taps record`: the parent must exist (nothing is created), an existing file needs --overwrite
    check_output_path(args.out, "file", overwrite=args.overwrite)
    parent = Path(args.out).parent
    if not parent.is_dir():
        found = "a file" if parent.exists() else "nothing"
        raise InputError(f"--out {args.out!r}: expected an existing parent directory {str(parent)!r}, found {found}")
    from parity.harness.logits import check_backend_options, check_precision, compute_logits
    from reference.session import check_length
    check_backend_options(args.backend, device=args.device, dtype=args.dtype)
    if args.backend == "reference":
        check_precision("reference", args.precision)
    dtype = args.dtype or "float32"
    ck = Checkpoint.open(resolve_model(args.model))
    from reference.ids_file import read_ids_file
    ids = read_ids_file(args.ids, vocab_size=ck.config.vocab_size)
    check_length(len(ids), ck.config.max_position_embeddings)
    check_precision(args.backend, args.precision, ck)
    logits = compute_logits(args.model, ids, backend=args.backend, dtype=dtype, chunk_size=args.chunk_size,
                            last_only=args.last_only, precision=args.precision or "float32", device=args.device)
    atomic_save_npy(args.out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} ({args.backend}"
          f"{', ' + dtype if args.backend == 'reference' else ''})")
    return 0
