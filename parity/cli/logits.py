"""``qwen4exp logits``: write the float32 logits ``[T, vocab_size]`` of the token ids in a file.

  qwen4exp logits MODEL --ids FILE --out OUT.npy [--backend SPEC] [--chunk-size N] [--last-only] [--overwrite]

SPEC: ``reference`` (``reference:dtype=float64``), ``engine`` (``engine:device=cpu,precision=bf16``) or
``module:Class``. FILE holds a ``.npy`` integer array, a JSON list of integers (or ``{"ids": [...]}``) or
whitespace/comma separated integers (:mod:`reference.ids_file`); ``-`` or ``/dev/stdin`` reads a pipe.
``--last-only`` writes ``[1, vocab_size]`` (the last position's logits). ``--out -`` writes the .npy bytes
to stdout; a file is written to a temp name and renamed. Exit codes: ``qwen4exp -h``; logits holding NaN/Inf
are written as computed with a warning naming the first such position, exit 3 (inconclusive).
"""
from __future__ import annotations


def register(subparsers) -> None:
    """Add the ``logits`` subcommand and its options to ``subparsers``."""
    from parity.cli.common import add_backend, add_model, add_out, add_traceback
    from reference.ids_file import IDS_FILE_HELP
    p = subparsers.add_parser("logits", help="write the float32 logits [T, vocab] of token ids (reference or engine)")
    add_model(p, required=True)
    p.add_argument("--ids", required=True, metavar="FILE", help=IDS_FILE_HELP + " ('-' reads stdin)")
    add_out(p, "output .npy file (float32 [T, vocab_size]), '-' for stdout; its folder must exist, an existing "
               "file needs --overwrite", required=True, metavar="OUT.npy")
    add_backend(p, "reference")
    p.add_argument("--dtype", choices=["float32", "float64"], default=None,
                   help="deprecated: --backend reference:dtype=float64 (the file is float32 either way)")
    p.add_argument("--precision", choices=["float32", "bf16"], default=None,
                   help="deprecated: --backend engine:precision=bf16 (bf16 rounds weights to BF16 and accumulates "
                        "in float32, so on a checkpoint stored in BF16 it equals float32)")
    p.add_argument("--device", default=None, help="deprecated: --backend engine:device=cuda|cpu")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one chunk)")
    p.add_argument("--last-only", action="store_true", help="only the last position's logits ([1, vocab_size])")
    add_traceback(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Run ``qwen4exp logits``: write the float32 logits ``[T, vocab_size]`` (or the last row only with
    ``--last-only``) of the ids file to ``--out`` (atomically; ``-``: stdout). Returns 0.

    Raises:
        InputError: a bad ``--out`` (see :func:`parity.cli.common.check_out`), bad ids, a bad backend spec or
            a precision the backend does not support.
    """
    import io
    import sys

    from parity.cli.common import backend_spec, check_out, legacy_device
    from parity.harness.logits import check_precision, compute_logits
    from reference.atomic import atomic_save_npy
    from reference.checkpoint import Checkpoint
    from reference.ids_file import read_ids_file
    from reference.paths import resolve_model
    from reference.session import check_length

    out = check_out(args.out, kind="file", overwrite=args.overwrite, stdout_ok=True)
    if args.precision == "bf16" and args.backend == "reference" and args.dtype is None:
        check_precision("reference", "bf16")  # the reference computes in float32/float64 only
    sp = backend_spec(args, legacy={"--dtype": args.dtype, "--precision": args.precision,
                                    "--device": legacy_device(args.device, args.backend)})
    model_dir = resolve_model(args.model)  # once: a fixture-name note is said once
    ck = Checkpoint.open(model_dir)
    ids = read_ids_file(args.ids, vocab_size=ck.config.vocab_size)
    check_length(len(ids), ck.config.max_position_embeddings)
    o = sp.options
    if sp.name == "engine":
        check_precision("engine", o.get("precision"), ck)
        backend, kw = "engine", {"precision": o.get("precision", "float32"), "device": o.get("device", "auto")}
    elif sp.name == "reference" and set(o) <= {"dtype"}:
        backend, kw = "reference", {"dtype": o.get("dtype", "float32")}
    else:
        backend, kw = str(sp), {}
    logits = compute_logits(str(model_dir), ids, backend=backend, chunk_size=args.chunk_size, last_only=args.last_only,
                            **kw)
    from reference.errors import EXIT_INCONCLUSIVE, EXIT_OK, first_nonfinite
    bad = first_nonfinite(logits)
    rc = EXIT_OK
    if bad is not None:  # written as computed, but never silently: NaN/Inf logits are no usable output
        print(f"qwen4exp logits: warning: the logits at position {bad[0]} are not finite (found {bad[1]}); the "
              f"checkpoint's weights or the backend give NaN/Inf (exit {EXIT_INCONCLUSIVE})", file=sys.stderr)
        rc = EXIT_INCONCLUSIVE
    if out is None:  # --out -: the .npy bytes on stdout (e.g. piped into another tool)
        import numpy as np
        buf = io.BytesIO()
        np.save(buf, logits)
        sys.stdout.flush()
        sys.stdout.buffer.write(buf.getvalue())
        sys.stdout.buffer.flush()
        print(f"wrote stdout: float32 {list(logits.shape)} ({sp})", file=sys.stderr)
        return rc
    atomic_save_npy(out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} ({sp})")
    return rc
