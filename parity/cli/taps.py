"""``qwen4exp taps list``, ``qwen4exp taps record`` and ``qwen4exp tap-diff``.

  qwen4exp taps list [--model MODEL] [--json]
  qwen4exp taps record MODEL [--backend NAME] --ids FILE --out DIR [--overwrite] [--taps GLOB ...]
                       [--layers SPEC] [--positions SPEC] [--dtype float32|float64] [--chunk-size N]
                       [--cap BYTES] [--scenario NAME]
      NAME: reference, reference-f64, engine, engine-cpu, engine-cuda or module:Class (parity.backends)
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
def _cmd_record(args) -> int:
    from parity.harness.logits import check_precision
    from parity.harness.record import record, resolve_backend
    from reference.ids_file import read_ids_file
    spec = resolve_backend(args.backend, args.dtype, args.device)
    if spec.startswith("reference"):  # bf16 is refused as by logits/generate (the reference computes in f32/f64)
        check_precision("reference", args.precision)
    ids = [int(x) for x in read_ids_file(args.ids)]
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
