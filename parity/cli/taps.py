"""``qwen4exp taps list``, ``qwen4exp taps record`` and ``qwen4exp taps diff`` (alias ``tap-diff``).

  qwen4exp taps list [MODEL] [--format text|rich|json]
  qwen4exp taps record MODEL [--backend SPEC] --ids FILE --out DIR [--overwrite] [--taps GLOB ...]
                       [--layers SPEC] [--positions SPEC] [--chunk-size N] [--cap BYTES] [--scenario NAME]
      SPEC: reference[:dtype=float64], engine[:device=cpu|cuda,precision=float32|bf16] or module:Class
  qwen4exp taps check DIR [--model MODEL] [--json]      (validate an archive: docs/tap-archive.md)
  qwen4exp taps diff A B [--profile fp32|bf16|FILE] [--format text|json] [--all] [--force] [--replay MODEL]
                   [--taps GLOB ...] [--memory-mb N] [--until-position P]

Exit codes (``qwen4exp -h``): 0 agree / success, 1 diverged, 2 usage or input error, 4 environment failure.
"""
from __future__ import annotations

import json
import sys


def _add_diff_args(pd) -> None:
    from parity.cli.common import add_format, add_traceback
    pd.add_argument("a", help="archive A (the reference side)")
    pd.add_argument("b", help="archive B (the side under test)")
    pd.add_argument("--profile", default="fp32", help="tolerance profile: fp32, bf16 or a TOML file")
    add_format(pd, default_help="text")
    pd.add_argument("--all", action="store_true", help="list every tap, not only the ones that disagree")
    pd.add_argument("--force", action="store_true",
                    help="diff archives A and B of different models or tokens (relaxes the A-vs-B identity check "
                         "only, never the --replay model check)")
    pd.add_argument("--replay", default=None, metavar="MODEL",
                    help="re-run the first diverging block in the reference on B's recorded input (bisect); MODEL "
                         "must be the checkpoint B was recorded from (same config and weights)")
    pd.add_argument("--replay-other-weights", action="store_true",
                    help="let --replay use a model with B's config but other weights (its verdict then judges "
                         "those weights, not B's)")
    pd.add_argument("--taps", action="append", default=None, metavar="GLOB", help="only taps matching (repeatable)")
    pd.add_argument("--memory-mb", type=int, default=256, help="approximate memory per tap chunk (MB)")
    pd.add_argument("--until-position", type=int, default=None, metavar="P",
                    help="count a tap as the first divergence only when it is first beyond tolerance at a position "
                         "<= P (what `qwen4exp parity` does when it locates a failure whose first failing logit "
                         "position is P: a cause lies at or before it)")
    add_traceback(pd)
    pd.set_defaults(func=_cmd_diff)


def register(subparsers) -> None:
    """Add the ``taps`` subcommand (actions ``list``, ``record`` and ``diff``) and the ``tap-diff`` alias of
    ``taps diff``, with their options, to ``subparsers``."""
    from parity.cli.common import add_backend, add_format, add_model, add_traceback
    from reference.ids_file import IDS_FILE_HELP
    p = subparsers.add_parser("taps", help="list the tap registry, record taps of a run, diff two tap archives")
    sub = p.add_subparsers(dest="taps_command", metavar="ACTION")
    sub.required = True
    pl = sub.add_parser("list", help="print the tap registry (name pattern, module, shape, dtype, kind, meaning)")
    add_model(pl)
    pl.add_argument("--model", dest="model_opt", default=None,
                    help="deprecated: the positional MODEL (also list the concrete tap names of this model)")
    add_format(pl, default_help="rich on a terminal, text otherwise")
    add_traceback(pl)
    pl.set_defaults(func=_cmd_list, command="taps list")   # command: the prefix of error messages

    pr = sub.add_parser("record", help="run a backend on token ids and record its taps into an archive")
    add_model(pr, required=True)
    add_backend(pr, "reference")
    pr.add_argument("--ids", required=True, help=IDS_FILE_HELP + " ('-' reads stdin)")
    pr.add_argument("--out", required=True, help="archive directory to create (written aside, renamed when complete)")
    pr.add_argument("--taps", action="append", default=None, metavar="GLOB", help="tap name glob (repeatable)")
    pr.add_argument("--layers", default=None, metavar="SPEC", help="layer filter, e.g. '0:4,7'")
    pr.add_argument("--positions", default=None, metavar="SPEC", help="positions to keep, e.g. '0:64,100'")
    pr.add_argument("--dtype", choices=["float32", "float64"], default=None,
                    help="deprecated: --backend reference:dtype=float64")
    pr.add_argument("--precision", choices=["float32", "bf16"], default=None,
                    help="deprecated: --backend engine:precision=bf16")
    pr.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None,
                    help="deprecated: --backend engine:device=cpu|cuda")
    pr.add_argument("--chunk-size", type=int, default=None, metavar="N",
                    help="prefill chunk size, N >= 1 (default: one chunk)")
    pr.add_argument("--cap", type=int, default=8 << 30, metavar="BYTES",
                    help="maximum archive size, BYTES >= 1 (default 8 GiB)")
    pr.add_argument("--scenario", default=None, help="scenario label stored in the manifest")
    pr.add_argument("--overwrite", action="store_true",
                    help="replace an existing --out (only when the new archive is complete)")
    add_traceback(pr)
    pr.set_defaults(func=_cmd_record, command="taps record")

    pc = sub.add_parser("check", help="validate a tap archive against its format (docs/tap-archive.md)",
                        description="Validate a tap archive against its format (docs/tap-archive.md). Exit 0: valid "
                                    "(warnings listed); 1: invalid, every problem listed; 2: DIR is no tap archive "
                                    "(not a directory, or no manifest.json) or --model is bad.")
    pc.add_argument("dir", help="tap archive directory")
    pc.add_argument("--model", default=None, help="also check shapes, layers and identity against this model")
    add_format(pc, default_help="text")
    add_traceback(pc)
    pc.set_defaults(func=_cmd_check, command="taps check")

    pd = sub.add_parser("diff", help="diff two tap archives: first divergence, flips, replay bisect")
    _add_diff_args(pd)
    pd.set_defaults(command="taps diff")
    pa = subparsers.add_parser("tap-diff", help="alias of 'taps diff'")
    _add_diff_args(pa)


# ---------------------------------------------------------------- list
_LIST_COLUMNS = ("pattern", "module", "shape", "dtype", "kind", "layers", "meaning")


def list_text(rows: list[list[str]], columns: int | None) -> list[str]:
    """The registry as plain-text lines: every column but the last at its full width (names are never cut
    or split), the meaning wrapped into what is left of ``columns`` (at least 30 characters; None: no
    wrapping, for pipes and CI logs)."""
    from parity.harness.report import _cell_lines
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_LIST_COLUMNS[:-1])]
    pad = sum(widths) + 2 * len(widths)
    room = None if columns is None else max(30, columns - pad)
    lines = ["  ".join(h.ljust(w) for h, w in zip(_LIST_COLUMNS, [*widths, 0])).rstrip()]
    for r in rows:
        cell = _cell_lines(r[-1], room)
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + cell[0])
        lines += [" " * pad + more for more in cell[1:]]
    return lines


def _cmd_list(args) -> int:
    import io
    import shutil

    from parity.cli.common import output_format
    from reference.errors import InputError
    from taps import registry
    if args.model is not None and args.model_opt is not None and args.model != args.model_opt:
        raise InputError(f"--model {args.model_opt!r}: expected either MODEL or --model, found both ({args.model!r})")
    model = args.model if args.model is not None else args.model_opt
    if args.model_opt is not None:
        print("note: taps list --model is deprecated; write: qwen4exp taps list MODEL", file=sys.stderr)
    fmt = output_format(args)
    specs = registry.specs()
    concrete = None
    if model:
        from reference.config import load_config
        from reference.paths import resolve_model
        concrete = registry.tap_names(load_config(resolve_model(model)))
    if fmt == "json":
        d = {"registry_version": registry.REGISTRY_VERSION,
             "taps": [{"pattern": s.pattern, "module": s.module, "shape": s.shape, "dtype": s.dtype, "kind": s.kind,
                       "meaning": s.meaning, "layer_type": s.layer_type, "companion": s.companion,
                       "replay_input": s.replay_input} for s in specs]}
        if concrete is not None:
            d["names"] = concrete
        print(json.dumps(d, indent=1))
        return 0
    rows = [[s.pattern, s.module, s.shape, s.dtype, s.kind, s.layer_type or "all",
             s.meaning + (f" [scores: {s.companion}]" if s.companion else "")] for s in specs]
    title = f"tap registry version {registry.REGISTRY_VERSION} (shapes are positions first: [T, ...])"
    tty = sys.stdout.isatty()
    if fmt == "text":
        lines = [title, *list_text(rows, shutil.get_terminal_size().columns if tty else None)]
        if concrete is not None:
            lines += ["", f"{len(concrete)} concrete taps for {model}:", *("  " + n for n in concrete)]
        sys.stdout.write("\n".join(lines) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table
    # rendered into a buffer, then written: rich's own stdout writer turns a closed pipe (`| head`) into
    # exit status 1; a plain write raises BrokenPipeError, which the CLI treats as the reader going away
    buf = io.StringIO()
    width = shutil.get_terminal_size().columns if tty else 250
    # names are never cut: the table is at least as wide as its fixed columns, the meaning wraps
    fixed = sum(max(len(c), *(len(r[i]) for r in rows)) + 1 for i, c in enumerate(_LIST_COLUMNS[:-1]))
    con = Console(file=buf, color_system="auto" if tty else None, width=max(width, fixed + 30), highlight=False,
                  force_terminal=tty)
    con.print(title)
    t = Table(box=None, pad_edge=False, show_edge=False)
    for c in _LIST_COLUMNS:
        t.add_column(c, no_wrap=c != "meaning", overflow="fold" if c == "meaning" else "ignore",
                     min_width=None if c == "meaning" else max(len(c), *(len(r[_LIST_COLUMNS.index(c)]) for r in rows)))
    for r in rows:
        t.add_row(*r)
    con.print(t)
    if concrete is not None:
        con.print(f"\n{len(concrete)} concrete taps for {model}:")
        for n in concrete:
            con.print("  " + n)
    sys.stdout.write(buf.getvalue())
    return 0


# ---------------------------------------------------------------- record
def _cmd_record(args) -> int:
    from parity.cli.common import backend_spec, check_out, legacy_device
    from parity.harness.logits import check_precision
    from parity.harness.record import record
    from reference.ids_file import read_ids_file
    if args.precision == "bf16" and args.dtype is None and str(args.backend).startswith("reference"):
        check_precision("reference", "bf16")  # bf16 is refused as by logits/generate (the reference computes in f32/f64)
    spec = backend_spec(args, legacy={"--dtype": args.dtype, "--device": legacy_device(args.device, args.backend),
                                      "--precision": args.precision})
    from parity.backends import backend_class
    backend_class(spec)  # an unknown name / unimportable plugin: said before reading the ids (maybe a pipe)
    check_out(args.out, kind="dir", overwrite=args.overwrite)
    from reference.config import load_config
    from reference.paths import resolve_model
    model_dir = resolve_model(str(args.model))  # once: a fixture-name note is said once
    from reference.paths import check_output_spares_model
    check_output_spares_model(args.out, model_dir, "--out")
    vocab = load_config(model_dir).vocab_size   # ids checked where they are read: --ids FILE named
    ids = [int(x) for x in read_ids_file(args.ids, vocab_size=vocab)]
    # the name as typed where it names model_dir alone (messages then repeat it); else the resolved folder, whose
    # second resolution repeats no fixture-beside-a-folder note
    typed = str(args.model)
    from pathlib import Path
    shown = typed if not Path(typed).exists() or Path(typed).resolve() == model_dir.resolve() else str(model_dir)
    arc = record(shown, ids, args.out, backend=spec, include=args.taps, layers=args.layers,
                 positions=args.positions, chunk_size=args.chunk_size,
                 cap_bytes=args.cap, scenario=args.scenario, overwrite=args.overwrite)
    n = len(arc.names())
    n_pos = sum(int(b) - int(a) for a, b in (arc.manifest.get("positions") or []))
    print(f"recorded {n} taps over {n_pos} positions ({arc.manifest.get('bytes', 0)} bytes) to {args.out}")
    return 0


# ---------------------------------------------------------------- diff
def _cmd_diff(args) -> int:
    from taps.diff import diff_archives, render_table
    from taps.replay import replay_check
    from reference.errors import InputError
    if args.memory_mb < 1:
        raise InputError(f"--memory-mb {args.memory_mb}: expected a memory budget >= 1 (MB), found {args.memory_mb}")
    if args.until_position is not None and args.until_position < 0:
        raise InputError(f"--until-position {args.until_position}: expected a token position >= 0, found "
                         f"{args.until_position}")
    replay_ck = None
    if args.replay:   # validated up front, whether or not the archives end up diverging
        from reference.checkpoint import Checkpoint
        from reference.paths import resolve_model
        from reference.errors import UserError
        try:
            replay_ck = Checkpoint.open(resolve_model(args.replay))
        except UserError as e:
            raise InputError(f"--replay {args.replay!r}: expected a model to replay in, found: {e}") from None
        _check_replay_model(args, replay_ck)
    rep = diff_archives(args.a, args.b, profile=args.profile, force=args.force, taps=args.taps,
                        memory_budget=args.memory_mb << 20, progress=sys.stderr.isatty() and not args.json,
                        until_position=args.until_position)
    if args.replay and rep.first_divergence:
        import numpy as np
        from reference.model import ReferenceModel
        from taps.archive import Archive
        ck = replay_ck
        B = Archive.open(args.b)
        dt = np.float64 if (Archive.open(args.a).dtype == "float64") else np.float32
        from reference.errors import UserError
        try:
            rep.replay = replay_check(ReferenceModel(ck, dtype=dt), B, rep.first_divergence, args.profile, A=args.a)
        except UserError as e:   # e.g. B did not record the block's input: still report the diff
            rep.replay = {"tap": rep.first_divergence, "verdict": "unavailable", "message": f"replay unavailable: {e}"}
    from parity.cli.common import output_format
    if output_format(args) == "json":
        print(rep.to_json())
    else:
        render_table(rep, show_all=args.all)
    return rep.exit_code


def _check_replay_model(args, ck) -> None:
    """``--replay MODEL`` must be the checkpoint archive B was recorded from: another config is always refused
    (``--force`` relaxes only the A-vs-B check); other weights are refused unless ``--replay-other-weights``.

    Raises:
        InputError: naming ``--replay``, the expected and the found config hash / weights fingerprint.
    """
    from reference.errors import InputError
    from taps.archive import Archive
    B = Archive.open(args.b)
    want = B.model.get("config_hash")
    if want is not None and want != ck.config.config_hash():
        raise InputError(f"--replay {args.replay!r}: expected the model archive B was recorded from (config hash "
                         f"{want}), found config hash {ck.config.config_hash()} (--force does not relax this)")
    want_w = B.model.get("weights_fingerprint")  # same config, other weights: the replay would judge other weights
    if want_w is not None and want_w != ck.fingerprint() and not args.replay_other_weights:
        raise InputError(f"--replay {args.replay!r}: expected the weights archive B was recorded with (weights "
                         f"fingerprint {want_w}), found fingerprint {ck.fingerprint()} (same config, other weights; "
                         f"--replay-other-weights replays anyway)")


# ---------------------------------------------------------------- check
def _cmd_check(args) -> int:
    """``taps check DIR``: 0 the archive conforms (warnings printed), 1 it does not (every problem listed),
    2 DIR is no tap archive at all (not a directory, or no manifest.json: the same error as ``taps diff``) / a
    bad --model."""
    from taps.check import check_archive
    config = None
    if args.model:
        from reference.config import load_config
        from reference.paths import resolve_model
        config = load_config(resolve_model(args.model))
    from parity.cli.common import output_format
    fmt = output_format(args)   # text and rich print the same lines (a list, no table)
    rep = check_archive(args.dir, config)
    if fmt == "json":
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        for w in rep.warnings:
            print(f"warning: {w}")
        for e in rep.problems:
            print(f"problem: {e}")
        print(f"{args.dir}: {'valid' if rep.ok else 'INVALID'} tap archive ({rep.taps} taps, {rep.rows} rows, "
              f"{len(rep.problems)} problems, {len(rep.warnings)} warnings)")
    return 0 if rep.ok else 1
