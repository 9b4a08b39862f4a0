"""One-shot logits of a backend (``qwen4exp logits``) and the precision rules every verb shares."""
from __future__ import annotations

import numpy as np


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


def compute_logits(model_path, ids, backend: str = "reference", dtype: str = "float32", chunk_size=None,
                   last_only: bool = False, precision: str = "float32", device: str = "auto") -> np.ndarray:
    """Logits ``[T, V]`` (or ``[1, V]`` with ``last_only``) as float32 for ``ids`` on ``backend`` ('reference'
    with ``dtype`` float32/float64, or 'engine' with ``precision`` / ``device``), opened through the one
    opener (:func:`parity.backends.open_backend`).

    Raises:
        InputError: bad ids (empty, out of range, more than max_position_embeddings), bad chunk size, an
            unknown backend. BackendError: the engine is not available.
    """
    from parity.backends import open_backend
    from reference.checkpoint import Checkpoint
    from reference.errors import InputError
    from reference.paths import resolve_model
    from reference.session import check_ids, check_length
    path = resolve_model(model_path)
    ck = Checkpoint.open(path)
    ids = check_ids(ids, ck.config.vocab_size)
    check_length(len(ids), ck.config.max_position_embeddings, what="ids")
    if chunk_size is not None and chunk_size < 1:
        raise InputError(f"--chunk-size: expected a positive integer, found {chunk_size}")
    if backend == "reference":
        be = open_backend("reference", path, weights=ck, dtype=np.float64 if dtype == "float64" else np.float32)
    elif backend == "engine":
        spec = "engine" if device in (None, "auto") else f"engine:device={device}"
        be = open_backend(spec, path, weights=ck, precision=precision, max_seqs=1, kv_tokens=len(ids))
    else:  # any other spec (module:Class, NAME:key=value): the backend as the opener gives it
        be = open_backend(backend, path)
    try:
        h = be.new_sequence()
        out = np.asarray(be.prefill(h, [int(x) for x in ids], chunk_size=chunk_size))
        be.free(h)
        want = (len(ids), ck.config.vocab_size)
        if out.shape != want:  # else a [T, V-1] (or transposed) array would be written as if it were the logits
            from parity.backends.base import BackendOutputError
            raise BackendOutputError(f"backend {str(getattr(be, 'name', backend))!r}: prefill of {len(ids)} ids: "
                                     f"expected logits of shape {list(want)} ([T, vocab_size]), found "
                                     f"{list(out.shape)}; nothing was written")
    finally:
        close = getattr(be, "close", None)
        if close is not None:
            close()
    if last_only:
        out = out[-1]
    out = np.asarray(out, dtype=np.float32)
    return out.reshape(1, -1) if out.ndim == 1 else out
