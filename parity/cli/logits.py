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


def read_ids_file(path: str, vocab_size: int | None = None) -> np.ndarray:
    """Token ids from ``path`` (:func:`reference.ids_file.read_ids_file`: ``.npy``, a JSON list or
    ``{"ids": [...]}``, or whitespace/comma separated integers).

    Returns:
        ``[T]`` int64.
    Raises:
        InputError: missing/unreadable file, non-integer content, an empty item, no ids, ids out of
            ``[0, vocab_size)`` (when given).
    """
    from reference.ids_file import read_ids_file as _read
    return _read(path, vocab_size=vocab_size)


BF16_NOTE = ("note: --precision bf16 rounds the weights to BF16 and accumulates in float32; this checkpoint's "
             "weights are stored in BF16 already, so the result equals --precision float32")


def weights_bf16_exact(ck) -> bool:
    """True when every floating-point tensor of checkpoint ``ck`` is stored as BF16 (so rounding the
    weights to BF16 changes nothing)."""
    from reference.checkpoint import _INT
    dts = {ck.dtype(n) for n in ck.names()}
    return bool(dts - set(_INT)) and all(d == "BF16" or d in _INT for d in dts)


def check_precision(backend: str, precision: str | None, ck=None, *, flag: str = "--precision") -> None:
    """``--precision`` against the backend: the reference computes in float32/float64 only, so bf16 is an
    error there; for the engine a one-line notice is printed (stderr) when bf16 equals float32 because
    the checkpoint's weights are BF16 already.

    Raises:
        InputError: bf16 asked of the reference backend.
    """
    import sys

    from reference.errors import InputError
    if precision is None:
        return
    if backend == "reference" and precision not in ("float32", "float64"):
        raise InputError(f"{flag} {precision}: the reference backend computes in float32 or float64 only "
                         f"(use --backend engine for BF16 weights)")
    if backend == "engine" and precision == "bf16" and ck is not None and weights_bf16_exact(ck):
        print(BF16_NOTE, file=sys.stderr)


DEVICES = ("auto", "cpu", "cuda")


def check_backend_options(backend: str, *, device: str | None = "auto", dtype: str | None = None) -> None:
    """``--device`` / ``--dtype`` against the backend: the reference runs on the CPU (``--device`` auto or
    cpu) and takes ``--dtype``; the engine takes ``--device`` auto/cpu/cuda and ``--precision``, not ``--dtype``.

    Raises:
        InputError: an unknown device, a device the backend cannot use, or ``--dtype`` with the engine.
    """
    from reference.errors import InputError
    if device is not None and device not in DEVICES:
        raise InputError(f"--device {device!r}: expected one of {', '.join(DEVICES)}, found {device!r}")
    if backend == "reference" and device not in (None, "auto", "cpu"):
        raise InputError(f"--device {device}: the reference backend runs on the CPU (expected auto or cpu), found "
                         f"{device!r} (use --backend engine for the GPU)")
    if backend == "engine" and dtype is not None:
        raise InputError(f"--dtype {dtype}: applies to the reference backend only, found it with --backend engine "
                         f"(the engine's is --precision float32|bf16)")


def check_length(n_ids: int, max_positions: int, flag: str = "--ids") -> None:
    """Refuse more token ids than the model has positions (every backend; the reference would otherwise
    run for minutes before failing or silently go past the trained range).

    Raises:
        InputError: ``n_ids > max_positions``.
    """
    from reference.errors import InputError
    if n_ids > max_positions:
        raise InputError(f"{flag}: expected at most max_position_embeddings={max_positions} token ids, found "
                         f"{n_ids}")


def compute_logits(model_path, ids, backend: str = "reference", dtype: str = "float32", chunk_size=None,
                   last_only: bool = False, precision: str = "float32", device: str = "auto") -> np.ndarray:
    """Logits ``[T, V]`` (or ``[1, V]`` with ``last_only``) as float32 for ``ids`` on ``backend``.

    Raises:
        InputError: bad ids (empty, out of range), bad chunk size, engine not available.
    """
    from reference.checkpoint import Checkpoint
    from reference.errors import InputError
    from reference.paths import resolve_model
    from reference.session import check_ids
    ck = Checkpoint.open(resolve_model(model_path))
    ids = check_ids(ids, ck.config.vocab_size)
    check_length(len(ids), ck.config.max_position_embeddings, flag="ids")
    if chunk_size is not None and chunk_size < 1:
        raise InputError(f"--chunk-size: expected a positive integer, found {chunk_size}")
    if backend == "reference":
        from reference.model import ReferenceModel
        model = ReferenceModel(ck, dtype=np.float64 if dtype == "float64" else np.float32)
        out = model.new_session().prefill(ids, chunk_size=chunk_size, last_only=last_only)
    elif backend == "engine":
        try:
            import engine
            Engine = engine.Engine
        except (ImportError, AttributeError) as e:
            raise InputError(f"--backend engine: the engine is not importable here ({e}); use --backend reference")
        eng = Engine(ck, precision=precision, device=device, max_seqs=1, kv_tokens=len(ids))
        seq = eng.add_sequence()
        out = np.asarray(eng.prefill(seq, ids, chunk_size=chunk_size))
        if last_only:
            out = out[-1]
    else:
        raise InputError(f"--backend: expected 'reference' or 'engine', found {backend!r}")
    out = np.asarray(out, dtype=np.float32)
    return out.reshape(1, -1) if out.ndim == 1 else out


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
    check_backend_options(args.backend, device=args.device, dtype=args.dtype)
    if args.backend == "reference":
        check_precision("reference", args.precision)
    dtype = args.dtype or "float32"
    ck = Checkpoint.open(resolve_model(args.model))
    ids = read_ids_file(args.ids, vocab_size=ck.config.vocab_size)
    check_length(len(ids), ck.config.max_position_embeddings)
    check_precision(args.backend, args.precision, ck)
    logits = compute_logits(args.model, ids, backend=args.backend, dtype=dtype, chunk_size=args.chunk_size,
                            last_only=args.last_only, precision=args.precision or "float32", device=args.device)
    atomic_save_npy(args.out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} ({args.backend}"
          f"{', ' + dtype if args.backend == 'reference' else ''})")
    return 0
