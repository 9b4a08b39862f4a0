"""``qwen4exp logits``: write the float32 logits ``[T, vocab_size]`` of the token ids in a file.

  qwen4exp logits MODEL --ids FILE --out OUT.npy [--backend reference|engine] [--dtype float32|float64]
                        [--chunk-size N] [--last-only]

FILE holds a JSON list of integers (or ``{"ids": [...]}``) or whitespace/comma separated integers.
``--last-only`` writes ``[1, vocab_size]`` (the last position's logits). The file is written to a temp
name and renamed. Exit codes: 0 success, 2 usage or input error.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np


def register(subparsers) -> None:
    p = subparsers.add_parser("logits", help="write the float32 logits [T, vocab] of token ids (reference or engine)")
    p.add_argument("model", help="checkpoint directory or bundled fixture name")
    p.add_argument("--ids", required=True, help="token ids: a JSON list, or whitespace/comma separated integers")
    p.add_argument("--out", required=True, help="output .npy file (float32 [T, vocab_size])")
    p.add_argument("--backend", choices=["reference", "engine"], default="reference")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="reference compute dtype (the file is float32 either way)")
    p.add_argument("--precision", choices=["float32", "bf16"], default="float32", help="engine precision")
    p.add_argument("--device", default="auto", help="engine device: cuda, cpu or auto (cuda when a GPU is present)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one chunk)")
    p.add_argument("--last-only", action="store_true", help="only the last position's logits ([1, vocab_size])")
    p.set_defaults(func=run)


def read_ids_file(path: str) -> np.ndarray:
    """Token ids from ``path``: a JSON list (or ``{"ids": [...]}``) or whitespace/comma separated integers.

    Returns:
        ``[T]`` int64.
    Raises:
        InputError: missing/unreadable file, non-integer content or no ids.
    """
    from reference.errors import InputError
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--ids {path!r}: expected a file of token ids, found no such file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--ids {path!r}: expected a text file of token ids, found unreadable content ({e})") from None
    s = text.strip()
    if not s:
        raise InputError(f"--ids {path!r}: expected at least one token id, found an empty file")
    try:
        if s[0] in "[{":
            v = json.loads(s)
            ids = v.get("ids", v.get("token_ids")) if isinstance(v, dict) else v
        else:
            ids = [int(x) for x in s.replace(",", " ").split()]
    except (ValueError, json.JSONDecodeError) as e:
        raise InputError(f"--ids {path!r}: expected integer token ids, found unparsable content ({e})") from None
    if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise InputError(f"--ids {path!r}: expected a list of integers, found {str(ids)[:80]!r}")
    if not ids:
        raise InputError(f"--ids {path!r}: expected at least one token id, found an empty list")
    return np.asarray(ids, dtype=np.int64)


def _atomic_save(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
    ids = read_ids_file(args.ids)
    logits = compute_logits(args.model, ids, backend=args.backend, dtype=args.dtype, chunk_size=args.chunk_size,
                            last_only=args.last_only, precision=args.precision, device=args.device)
    _atomic_save(Path(args.out), logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} ({args.backend}"
          f"{', ' + args.dtype if args.backend == 'reference' else ''})")
    return 0
