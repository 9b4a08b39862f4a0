"""Recording a backend's taps on token ids into an archive (``qwen4exp taps record``; the profile
calibration, :mod:`parity.harness.calibrate`)."""
from __future__ import annotations

import sys
from pathlib import Path


def resolve_backend(backend, dtype: str | None = None, device: str | None = "auto", precision: str | None = None):
    """The :class:`parity.backends.BackendSpec` that ``taps record --backend SPEC`` (and the deprecated
    ``--dtype`` / ``--device`` / ``--precision``) select: ``reference`` + dtype float64 is
    ``reference:dtype=float64``; ``engine`` + device cpu is ``engine:device=cpu``. The class is resolved
    (:func:`parity.backends.backend_class`), so a ``module:Class`` plugin must be importable.

    Raises:
        InputError: an unknown name, or an option the backend does not take / contradicting the spec.
        BackendError: a ``module:Class`` that cannot be imported.
    """
    from parity.backends import backend_class, parse_backend_spec
    sp = parse_backend_spec(backend)
    extra = {"--dtype": dtype, "--device": None if device in (None, "auto") else device}
    if sp.name == "engine" or precision not in (None, "float32"):
        extra["--precision"] = precision
    sp = sp.with_options(extra)
    backend_class(sp)   # unknown name -> InputError naming --backend; plugin import -> BackendError
    return sp


def record(model_path, ids: list[int], out, backend: str = "reference", include=None, layers=None, positions=None,
           dtype: str | None = None, precision: str | None = None, chunk_size: int | None = None,
           cap_bytes: int | None = 8 << 30, scenario: str | None = None, overwrite: bool = False,
           device: str = "auto"):
    """Run ``backend`` on ``ids`` and record its taps into archive directory ``out`` (None: in memory).

    Args:
        backend: a ``qwen4exp parity`` backend name -- reference, reference-f64, engine (cuda when a GPU
            is present), engine-cpu, engine-cuda or module:Class (see :func:`resolve_backend`). The
            manifest's ``backend`` is the opened backend's name (``engine-cuda``, ``my_mod:MyBackend``).
        dtype: reference compute dtype ('float32' default, 'float64'); precision/device: the engine's.

    Returns: the finished archive (:class:`taps.archive.Archive` or ``MemoryArchive``).

    Raises:
        InputError / CheckpointError / ArchiveError / TapError / BackendError: bad inputs (``chunk_size``
        or ``cap_bytes`` < 1; ``out`` an existing file, an existing archive without ``overwrite``, under a
        missing or non-directory parent or on /proc; an unknown backend; a layer beyond the model; a
        selection -- ``include`` / ``layers`` / ``positions`` -- that would record nothing; errors name
        the CLI flag); TapCapError when the up-front estimate (or the recording) exceeds ``cap_bytes``;
        BackendError when a ``module:Class`` backend raises while running. Nothing is left at ``out``
        (nor a temporary directory beside it) on error.
    """
    import numpy as np
    from reference.atomic import check_output_path
    from reference.checkpoint import Checkpoint
    from reference.errors import InputError, UserError
    from reference.paths import resolve_model
    from taps import registry
    from taps.recorder import Recorder, TapCapError
    from taps.recorder import parse_layers, parse_positions
    if chunk_size is not None and (isinstance(chunk_size, bool) or int(chunk_size) < 1):
        raise InputError(f"--chunk-size {chunk_size}: expected a chunk size >= 1 (or no --chunk-size for one "
                         f"chunk), found {chunk_size}")
    if cap_bytes is not None and int(cap_bytes) < 1:
        raise InputError(f"--cap {cap_bytes}: expected a byte count >= 1, found {cap_bytes}")
    if out is not None:   # the shared output rules, checked before any work
        if Path(out).is_dir() and not overwrite:   # an empty directory too: an archive replaces it
            raise InputError(f"--out {str(out)!r}: expected a new path, found an existing directory "
                             f"(pass --overwrite)")
        check_output_path(out, kind="dir", overwrite=overwrite, flag="--out")
        parent = Path(out).absolute().parent
        if not parent.is_dir():
            raise InputError(f"--out {str(out)!r}: expected an existing parent directory, found "
                             f"{str(parent)!r} missing")
    sp = resolve_backend(backend, dtype, device, precision)
    spec = str(sp)
    is_ref = sp.name == "reference"
    ref_dtype = sp.options.get("dtype", "float32")
    lay = parse_layers(layers, "--layers")
    pos = parse_positions(positions, "--positions")
    if hasattr(model_path, "fingerprint"):
        ck = model_path
        where = getattr(ck, "root", None)
    else:
        where = resolve_model(str(model_path))
        ck = Checkpoint.open(where)
    cfg = ck.config
    if any(i >= cfg.vocab_size for i in ids):
        raise InputError(f"token ids: expected ids < vocab_size {cfg.vocab_size}, found {max(ids)}")
    from reference.session import check_length
    check_length(len(ids), cfg.max_position_embeddings)
    if lay is not None:
        bad = sorted(x for x in lay if x >= cfg.num_hidden_layers)
        if bad:
            raise InputError(f"--layers {layers!r}: expected layer indices in 0..{cfg.num_hidden_layers - 1} (the "
                             f"model has {cfg.num_hidden_layers} layers), found {', '.join(map(str, bad[:5]))}")
        if not lay:
            raise InputError(f"--layers {layers!r}: expected at least one layer, found an empty selection")
    names = registry.tap_names(cfg)
    if include:
        for g in include:
            if not any(registry.matches(n, [g]) for n in names):
                raise InputError(f"--taps {g!r}: expected a glob matching some tap of this model (see "
                                 f"'qwen4exp taps list --model ...'), found none")
    probe = Recorder(include=include, layers=lay)
    if not any(probe.wants(n) for n in names):
        raise InputError(f"--taps {include!r} with --layers {layers!r}: expected a selection holding some tap of "
                         f"this model, found none (the globs match no tap of the selected layers)")
    n_pos = len(ids)
    if pos is not None:
        n_pos = int(np.sum(pos < len(ids)))
        if n_pos == 0:
            raise InputError(f"--positions {positions!r}: expected positions within the {len(ids)} token ids "
                             f"(0..{len(ids) - 1}), found none there")
    est = Recorder.estimate(cfg, n_pos, include=include, layers=layers,
                            dtype_bytes=8 if is_ref and ref_dtype == "float64" else 4)
    if cap_bytes is not None and est > cap_bytes:
        raise TapCapError(f"tap recording: estimated {est} bytes exceeds the cap of {cap_bytes} bytes; narrow "
                          f"--taps/--layers/--positions or raise --cap")
    be = None
    if is_ref:
        name, run_dtype = ("reference-f64" if ref_dtype == "float64" else "reference"), ref_dtype
    else:
        from parity.backends import open_backend
        if sp.name == "engine":
            be = open_backend(spec, where if where is not None else ".", weights=ck,
                              precision=sp.options.get("precision", "float32"),
                              max_seqs=1, kv_tokens=len(ids) + 64)
        else:
            if where is None:
                raise InputError(f"--backend {spec!r}: expected a model directory to open the plugin on, found "
                                 f"an in-memory checkpoint")
            be = open_backend(spec, where)
        name, run_dtype = str(getattr(be, "name", spec)), str(getattr(be, "precision", "float32"))
    meta = {"backend": name, "dtype": run_dtype,
            "model": {"config_hash": cfg.config_hash(), "weights_fingerprint": ck.fingerprint(),
                      **({"path": str(where)} if where is not None else {})},
            "token_ids": list(ids), "scenario": scenario, "chunk_size": chunk_size, "estimated_bytes": est}
    try:
        with Recorder(out, include=include, layers=layers, positions=positions, cap_bytes=cap_bytes, meta=meta,
                      overwrite=overwrite) as rec:
            if be is None:
                from reference.model import ReferenceModel
                model = ReferenceModel(ck, dtype=np.float64 if ref_dtype == "float64" else np.float32)
                sess = model.new_session()
                step = chunk_size or len(ids)
                from tqdm import tqdm
                with tqdm(total=len(ids), desc="taps record", unit="tok", disable=not sys.stderr.isatty(),
                          file=sys.stderr) as bar:
                    for s in range(0, len(ids), step):   # consecutive prefills == one chunked prefill
                        sess.prefill(list(ids[s:s + step]))
                        bar.update(min(step, len(ids) - s))
            else:
                try:
                    h = be.new_sequence()
                    be.prefill(h, list(ids), chunk_size=chunk_size)
                    be.free(h)
                except UserError:
                    raise
                except (Exception, SystemExit) as e:   # noqa: BLE001 - the backend under test failed: one line, nothing written
                    from parity.backends import BackendError
                    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    raise BackendError(f"--backend {spec!r}: raised {type(e).__name__}{': ' + msg if msg else ''} "
                                       f"while prefilling the {len(ids)} token ids; nothing was written") from e
            if rec.n_emits == 0:   # raised inside the block: the writer discards the (empty) archive
                raise InputError(f"tap recording: the {name} run emitted no tap matching --taps {include!r} / "
                                 f"--layers {layers!r} / --positions {positions!r}; nothing was written")
    finally:
        if be is not None:
            close = getattr(be, "close", None)
            if close is not None:
                close()
    return rec.archive()


