"""``qwen4exp taps list``, ``qwen4exp taps record`` and ``qwen4exp tap-diff``.

  qwen4exp taps list [--model MODEL] [--json]
  qwen4exp taps record MODEL [--backend NAME] --ids FILE --out DIR [--overwrite] [--taps GLOB ...]
                       [--layers SPEC] [--positions SPEC] [--dtype float32|float64] [--chunk-size N]
                       [--cap BYTES] [--scenario NAME]
      NAME: reference, reference-f64, engine, engine-cpu, engine-cuda or module:Class (parity.backends)
  qwen4exp taps check DIR [--model MODEL] [--json]      (validate an archive: docs/tap-archive.md)
  qwen4exp tap-diff A B [--profile fp32|bf16|FILE] [--json] [--all] [--force] [--replay MODEL]
                   [--taps GLOB ...] [--memory-mb N]

Exit codes: 0 agree / success, 1 diverged, 2 usage or input error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    """Add the ``taps`` subcommand (actions ``list`` and ``record``) and the ``tap-diff`` subcommand,
    with their options, to ``subparsers``."""
    p = subparsers.add_parser("taps", help="list the tap registry or record taps of a run")
    sub = p.add_subparsers(dest="taps_command", metavar="ACTION")
    sub.required = True
    pl = sub.add_parser("list", help="print the tap registry (name pattern, module, shape, dtype, kind, meaning)")
    pl.add_argument("--model", default=None, help="also list the concrete tap names of this model (dir or fixture)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=_cmd_list, command="taps list")   # command: the prefix of error messages

    pr = sub.add_parser("record", help="run a backend on token ids and record its taps into an archive")
    pr.add_argument("model", help="checkpoint directory or bundled fixture name")
    pr.add_argument("--backend", default="reference", metavar="NAME",
                    help="reference, reference-f64, engine, engine-cpu, engine-cuda or module:Class "
                         "(the names of 'qwen4exp parity')")
    pr.add_argument("--ids", required=True, help="token ids: a .npy file, a JSON list, or whitespace/comma separated")
    pr.add_argument("--out", required=True, help="archive directory to create (must not exist)")
    pr.add_argument("--taps", action="append", default=None, metavar="GLOB", help="tap name glob (repeatable)")
    pr.add_argument("--layers", default=None, metavar="SPEC", help="layer filter, e.g. '0:4,7'")
    pr.add_argument("--positions", default=None, metavar="SPEC", help="positions to keep, e.g. '0:64,100'")
    pr.add_argument("--dtype", choices=["float32", "float64"], default=None,
                    help="reference compute dtype (default float32; reference-f64: float64)")
    pr.add_argument("--precision", choices=["float32", "bf16"], default=None,
                    help="engine precision (default float32); the reference's is --dtype")
    pr.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="engine device for --backend engine (engine-cpu / engine-cuda name it)")
    pr.add_argument("--chunk-size", type=int, default=None, metavar="N",
                    help="prefill chunk size, N >= 1 (default: one chunk)")
    pr.add_argument("--cap", type=int, default=8 << 30, metavar="BYTES",
                    help="maximum archive size, BYTES >= 1 (default 8 GiB)")
    pr.add_argument("--scenario", default=None, help="scenario label stored in the manifest")
    pr.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    pr.set_defaults(func=_cmd_record, command="taps record")

    pc = sub.add_parser("check", help="validate a tap archive against its format (docs/tap-archive.md)")
    pc.add_argument("dir", help="tap archive directory")
    pc.add_argument("--model", default=None, help="also check shapes, layers and identity against this model")
    pc.add_argument("--json", action="store_true", help="machine-readable output")
    pc.set_defaults(func=_cmd_check, command="taps check")

    pd = subparsers.add_parser("tap-diff", help="diff two tap archives: first divergence, flips, replay bisect")
    pd.add_argument("a", help="archive A (the reference side)")
    pd.add_argument("b", help="archive B (the side under test)")
    pd.add_argument("--profile", default="fp32", help="tolerance profile: fp32, bf16 or a TOML file")
    pd.add_argument("--json", action="store_true", help="print the report as JSON")
    pd.add_argument("--all", action="store_true", help="list every tap, not only the ones that disagree")
    pd.add_argument("--force", action="store_true", help="diff archives of different models or tokens")
    pd.add_argument("--replay", default=None, metavar="MODEL",
                    help="re-run the first diverging block in the reference on B's recorded input (bisect)")
    pd.add_argument("--taps", action="append", default=None, metavar="GLOB", help="only taps matching (repeatable)")
    pd.add_argument("--memory-mb", type=int, default=256, help="approximate memory per tap chunk (MB)")
    pd.set_defaults(func=_cmd_diff)


# ---------------------------------------------------------------- check
def _cmd_check(args) -> int:
    """``taps check DIR``: 0 the archive conforms (warnings printed), 1 it does not (every problem listed),
    2 DIR is not a directory / a bad --model."""
    from taps.check import check_archive
    config = None
    if args.model:
        from reference.config import load_config
        from reference.paths import resolve_model
        config = load_config(resolve_model(args.model))
    rep = check_archive(args.dir, config)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        for w in rep.warnings:
            print(f"warning: {w}")
        for e in rep.problems:
            print(f"problem: {e}")
        print(f"{args.dir}: {'valid' if rep.ok else 'INVALID'} tap archive ({rep.taps} taps, {rep.rows} rows, "
              f"{len(rep.problems)} problems, {len(rep.warnings)} warnings)")
    return 0 if rep.ok else 1


# ---------------------------------------------------------------- list
def _cmd_list(args) -> int:
    from taps import registry
    specs = registry.specs()
    concrete = None
    if args.model:
        from reference.config import load_config
        from reference.paths import resolve_model
        concrete = registry.tap_names(load_config(resolve_model(args.model)))
    if args.json:
        d = {"registry_version": registry.REGISTRY_VERSION,
             "taps": [{"pattern": s.pattern, "module": s.module, "shape": s.shape, "dtype": s.dtype, "kind": s.kind,
                       "meaning": s.meaning, "layer_type": s.layer_type, "companion": s.companion,
                       "replay_input": s.replay_input} for s in specs]}
        if concrete is not None:
            d["names"] = concrete
        print(json.dumps(d, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table
    import io
    tty = sys.stdout.isatty()
    # rendered into a buffer, then written: rich's own stdout writer turns a closed pipe (`| head`) into
    # exit status 1; a plain write raises BrokenPipeError, which the CLI treats as the reader going away
    buf = io.StringIO()
    import shutil
    con = Console(file=buf, color_system="auto" if tty else None,
                  width=shutil.get_terminal_size().columns if tty else 250, highlight=False,
                  force_terminal=tty)
    con.print(f"tap registry version {registry.REGISTRY_VERSION} (shapes are positions first: [T, ...])")
    t = Table(box=None, pad_edge=False, show_edge=False)
    for c in ("pattern", "module", "shape", "dtype", "kind", "layers", "meaning"):
        t.add_column(c, no_wrap=c != "meaning")
    for s in specs:
        meaning = s.meaning + (f" [scores: {s.companion}]" if s.companion else "")
        t.add_row(s.pattern, s.module, s.shape, s.dtype, s.kind, s.layer_type or "all", meaning)
    con.print(t)
    if concrete is not None:
        con.print(f"\n{len(concrete)} concrete taps for {args.model}:")
        for n in concrete:
            con.print("  " + n)
    sys.stdout.write(buf.getvalue())
    return 0


# ---------------------------------------------------------------- record
def read_ids(path: str) -> list[int]:
    """Token ids from ``path``: ``.npy``, a JSON list (or {"ids": [...]}) or whitespace/comma separated ints.

    Raises:
        InputError: unreadable file, non-integer or negative ids, or no ids.
    """
    import numpy as np
    from reference.errors import InputError
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--ids {path!r}: expected a file of token ids, found no file")
    try:
        if p.suffix == ".npy":
            ids = np.load(p).reshape(-1).tolist()
        else:
            text = p.read_text().strip()
            if text.startswith("[") or text.startswith("{"):
                v = json.loads(text)
                ids = v.get("ids", v.get("token_ids")) if isinstance(v, dict) else v
            else:
                ids = [int(x) for x in text.replace(",", " ").split()]
    except (ValueError, OSError) as e:
        raise InputError(f"--ids {path!r}: expected integer token ids, found unreadable content ({e})") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                         for x in ids):
        raise InputError(f"--ids {path!r}: expected a non-empty list of non-negative integers, found "
                         f"{str(ids)[:80]!r}")
    return ids


def resolve_backend(backend: str, dtype: str | None = None, device: str = "auto") -> str:
    """The ``qwen4exp parity`` backend name that ``taps record --backend/--dtype/--device`` select.

    ``reference`` + ``--dtype float64`` is ``reference-f64``; ``engine`` + ``--device cpu|cuda`` is
    ``engine-cpu|engine-cuda``. Names are checked by :func:`parity.backends.backend_class` (so a
    ``module:Class`` plugin must be importable, e.g. on ``PYTHONPATH``).

    Raises:
        InputError: an unknown name, or ``--dtype`` / ``--device`` contradicting the name.
        BackendError: a ``module:Class`` that cannot be imported.
    """
    from parity.backends import backend_class
    from reference.errors import InputError
    spec = str(backend)
    if spec in ("reference", "reference-f64"):
        if dtype == "float64":
            spec = "reference-f64"
        elif dtype == "float32" and spec == "reference-f64":
            raise InputError(f"--dtype float32: expected float64 (or no --dtype) with --backend reference-f64, "
                             f"found float32")
        if device != "auto":
            raise InputError(f"--device {device}: expected only with an engine backend, found --backend {backend}")
    else:
        if dtype is not None:
            raise InputError(f"--dtype {dtype}: expected only with --backend reference / reference-f64 (the "
                             f"engine's is --precision), found --backend {backend}")
        if spec == "engine" and device != "auto":
            spec = f"engine-{device}"
        elif spec in ("engine-cpu", "engine-cuda") and device not in ("auto", spec.split("-")[1]):
            raise InputError(f"--device {device}: expected {spec.split('-')[1]} (or no --device) with --backend "
                             f"{spec}, found {device}")
        elif ":" in spec and device != "auto":
            raise InputError(f"--device {device}: expected only with an engine backend, found --backend {backend}")
    backend_class(spec)   # unknown name -> InputError naming --backend; plugin import -> BackendError
    return spec


def record(model_path, ids: list[int], out, backend: str = "reference", include=None, layers=None, positions=None,
           dtype: str | None = None, precision: str = "float32", chunk_size: int | None = None,
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
    spec = resolve_backend(backend, dtype, device)
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
    from parity.cli.logits import check_length
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
    ref_dtype = "float64" if spec == "reference-f64" else "float32"
    est = Recorder.estimate(cfg, n_pos, include=include, layers=layers,
                            dtype_bytes=8 if spec == "reference-f64" else 4)
    if cap_bytes is not None and est > cap_bytes:
        raise TapCapError(f"tap recording: estimated {est} bytes exceeds the cap of {cap_bytes} bytes; narrow "
                          f"--taps/--layers/--positions or raise --cap")
    be = None
    if spec.startswith("reference"):
        name, run_dtype = spec, ref_dtype
    else:
        from parity.backends import open_backend
        if spec.startswith("engine"):
            be = open_backend(spec, where if where is not None else ".", weights=ck, precision=precision,
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
                except Exception as e:   # noqa: BLE001 - the backend under test failed: one line, nothing written
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


def _cmd_record(args) -> int:
    from parity.cli.logits import check_precision
    spec = resolve_backend(args.backend, args.dtype, args.device)
    if spec.startswith("reference"):  # bf16 is refused as by logits/generate (the reference computes in f32/f64)
        check_precision("reference", args.precision)
    ids = read_ids(args.ids)
    arc = record(args.model, ids, args.out, backend=args.backend, include=args.taps, layers=args.layers,
                 positions=args.positions, dtype=args.dtype, precision=args.precision or "float32",
                 chunk_size=args.chunk_size,
                 cap_bytes=args.cap, scenario=args.scenario, overwrite=args.overwrite, device=args.device)
    n = len(arc.names())
    n_pos = sum(int(b) - int(a) for a, b in (arc.manifest.get("positions") or []))
    print(f"recorded {n} taps over {n_pos} positions ({arc.manifest.get('bytes', 0)} bytes) to {args.out}")
    return 0


# ---------------------------------------------------------------- diff
def _cmd_diff(args) -> int:
    from taps.diff import diff_archives, render_table, replay_check
    from reference.errors import InputError
    if args.memory_mb < 1:
        raise InputError(f"--memory-mb {args.memory_mb}: expected a memory budget >= 1 (MB), found {args.memory_mb}")
    replay_ck = None
    if args.replay:   # validated up front, whether or not the archives end up diverging
        from reference.checkpoint import Checkpoint
        from reference.paths import resolve_model
        from reference.errors import UserError
        try:
            replay_ck = Checkpoint.open(resolve_model(args.replay))
        except UserError as e:
            raise InputError(f"--replay {args.replay!r}: expected a model to replay in, found: {e}") from None
    rep = diff_archives(args.a, args.b, profile=args.profile, force=args.force, taps=args.taps,
                        memory_budget=args.memory_mb << 20, progress=sys.stderr.isatty() and not args.json)
    if args.replay and rep.first_divergence:
        import numpy as np
        from reference.model import ReferenceModel
        from taps.archive import Archive
        ck = replay_ck
        B = Archive.open(args.b)
        want = B.model.get("config_hash")
        if want is not None and want != ck.config.config_hash() and not args.force:
            raise InputError(f"--replay {args.replay!r}: expected the model the archives were recorded from "
                             f"(config hash {want}), found config hash {ck.config.config_hash()}")
        dt = np.float64 if (Archive.open(args.a).dtype == "float64") else np.float32
        from reference.errors import UserError
        try:
            rep.replay = replay_check(ReferenceModel(ck, dtype=dt), B, rep.first_divergence, args.profile, A=args.a)
        except UserError as e:   # e.g. B did not record the block's input: still report the diff
            rep.replay = {"tap": rep.first_divergence, "verdict": "unavailable", "message": f"replay unavailable: {e}"}
    if args.json:
        print(rep.to_json())
    else:
        render_table(rep, show_all=args.all)
    return rep.exit_code
