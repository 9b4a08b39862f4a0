"""``qwen4exp parity``: the main job -- is this engine the qwen4exp model?

    qwen4exp parity [MODEL] [--backend SPEC] [--scenario NAME...] [--format text|rich|json] [--out DIR]

Runs the logit-KL harness (backend against the reference's full forward, with its controls) and the
scenario suites (budget, chunk-boundary, snapshot-restore, speculative-rollback) at the page sizes
the backend supports; prints one verdict table with its legend; writes ``report.json`` and the failing
cases' tap archives under ``--out`` (staged, swapped in when the run completes). Exit codes: the one
contract of every verb (``qwen4exp -h``): 0 pass; 1 fail (a divergence, a failed control, or the backend
raising -- or calling sys.exit -- inside a case: an ERROR row, counted as failed); 2 usage/input error; 3
inconclusive; 4 environment failure (e.g. a disk that filled up while writing ``--out``: nothing is swapped
in, the old results stay).
"""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    """Add the ``parity`` subcommand and its options to ``subparsers``."""
    from parity.cli.common import add_format, add_model, add_out, add_traceback
    from parity.harness.scenarios import SUITES
    against_truth = [s.label for s in SUITES.values() if s.needs_truth]
    p = subparsers.add_parser(
        "parity", help="the main job: KL harness + all scenario suites of a backend against the reference",
        description="Judge a backend against the reference: logit-KL with controls, then the "
                    f"{', '.join(against_truth[:-1])} and {against_truth[-1]} scenarios (every one also with "
                    "concurrent sequences and several paged-cache page sizes) and the backend against itself "
                    f"({', '.join(s.label for s in SUITES.values() if not s.needs_truth)}). Failures are located "
                    "by tap-diff. "
                    "Exit 0 pass / 1 fail (a divergence, a failed control, or an exception raised by the backend "
                    "inside a case: an ERROR row) / 2 usage or input error / 3 inconclusive (the evidence supports "
                    "no verdict: the model cannot resolve a fault of useful size at this precision, a control could "
                    "not vouch for a pass, or the reference's own logits are NaN/Inf) / 4 environment failure (output "
                    "not written: the old results are kept) / 128+N interrupted by signal N (130 Ctrl-C, 143 "
                    "SIGTERM, 129 SIGHUP).")
    add_model(p)
    from parity.backends.registry import backend_help
    p.add_argument("--backend", dest="backend", action="append", default=None, metavar="SPEC",
                   help=f"the backend under test: {backend_help()} (default: engine). Repeatable: several backends "
                        "are judged in one process on one set of truth forwards (the floor, the truth's forwards, "
                        "the negative control computed once), each with its own thresholds, verdict table and "
                        "report (--out DIR/<i>/report.json, an index in DIR/index.json); the exit code is the "
                        "worst of theirs (4, then 1, then 3, then 0)")
    p.add_argument("--scenario", nargs="+", default=None, metavar="NAME",
                   help=f"scenarios to run: {', '.join(s.label for s in SUITES.values())}, kl (default: all)")
    p.add_argument("--level", choices=["full", "ci", "long"], default="full",
                   help="full: every combination (default); ci: the same situations, fewer combinations; long: "
                        "the real caps (bound crossing, chunks over 8192, positions past 32768) for a real-width model")
    p.add_argument("--page-sizes", default=None, metavar="N,N,...",
                   help="paged-cache page sizes (default: the compress ratio, twice it and ratio+1)")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="prompt set of the KL harness (a JSON list of texts or token-id lists; '-' or /dev/stdin "
                        "reads a pipe)")
    add_format(p)
    add_out(p, "write report.json and failing cases' tap archives (taps/) here; written aside and swapped in "
               "when the run completes (other files in DIR are left alone)", kind="dir")
    p.add_argument("--known", metavar="FILE", default=None,
                   help="baseline of known divergences (from --write-known, for this model and --backend only): a "
                        "case failing only through a known root cause, at the positions recorded, no larger than "
                        "recorded + one tolerance band and with no new top-1 flip, is excused (shown as known, the "
                        "verdict 'PASS (with N known divergences)', exit 0); anything else fails, naming what is new")
    p.add_argument("--write-known", metavar="FILE", default=None,
                   help="write this run's root causes (where, how large, top-1 flips; the model's identity and the "
                        "backend spec) as a --known baseline; FILE's folder must exist, an existing FILE needs "
                        "--overwrite")
    p.add_argument("--below-bound", action="store_true",
                   help="confine the scenarios and the kl row below the QSA bound (cases reaching past it are "
                        "skipped; the kl row's prompts and greedy continuation are cut to end at bound - 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr (default: a bar on a "
                   "terminal, else a plain line per finished case and every 10 s)")
    add_traceback(p, failures="report.json holds them either way")
    p.set_defaults(func=run)


def _parse_scenarios(names):
    from parity.harness.scenarios import SCENARIOS, SUITES, normalize_name
    if not names:
        return ["kl", *SCENARIOS]
    from reference.errors import InputError
    out = []
    for n in names:
        if n.strip().lower() == "kl":
            out.append("kl")
            continue
        try:
            out.append(normalize_name(n))
        except InputError:
            valid = ", ".join(["kl", *(s.label for s in SUITES.values())])
            raise InputError(f"scenario {n!r}: expected one of {valid}, found {n!r}") from None
    return list(dict.fromkeys(out))


def prepare_out_dir(out, overwrite: bool = False):
    """Validate ``--out DIR`` before anything runs (:func:`parity.cli.common.check_out`): a non-empty DIR
    needs ``overwrite``; a ``report.json`` that is not a regular file or a ``taps`` that is not a directory
    is refused (the job would only find out after running). Nothing is removed here: the old results are
    replaced when the new run completes.

    Raises:
        InputError: naming ``--out``.
    """
    from parity.cli.common import check_out
    from reference.errors import InputError
    p = check_out(out, kind="dir", overwrite=overwrite)
    rj, tp = p / "report.json", p / "taps"
    if (rj.exists() or rj.is_symlink()) and not rj.is_file():
        raise InputError(f"--out {str(out)!r}: expected {str(rj)!r} to be absent or a regular file (it is "
                         f"replaced by the new report), found a directory or special file")
    if tp.exists() and not tp.is_dir():
        raise InputError(f"--out {str(out)!r}: expected {str(tp)!r} to be absent or a directory (failing cases' "
                         f"tap archives go there), found a file")
    return p


def display_path(path) -> str:
    """``path`` relative to the current directory when inside it (as README shows), else as is. A relative
    path that would read as a bundled fixture's name (a folder ./tiny) keeps its ``./``."""
    from pathlib import Path

    from reference.paths import bundled_fixtures
    try:
        rel = str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)
    return f"./{rel}" if rel in bundled_fixtures() else rel


def _print_report(report, fmt: str, doc) -> None:
    import dataclasses
    import json

    from parity.harness.report import render_table
    from parity.harness.scenarios import meanings
    if fmt == "json":
        print(json.dumps(doc, indent=1))
        return
    shown = dataclasses.replace(report, model=display_path(report.model))
    if fmt == "rich":
        from rich.console import Console
        render_table(shown, Console(highlight=False), legend=True, meanings=meanings())
    else:
        print(render_table(shown, legend=True, meanings=meanings()))


def run(args) -> int:
    """Run ``qwen4exp parity``: the KL harness and the scenario suites of ``--backend`` against the
    reference, printed as a table (text or rich) or JSON, and written to ``--out/report.json``. Returns the
    report's exit code.

    Raises:
        InputError: bad ``--backend``, ``--page-sizes``, scenario names, ``--format``, ``--out`` directory or
            ``--write-known`` path; a ``--known`` baseline that is unreadable or of another model or backend.
    """
    from pathlib import Path

    from parity.cli.common import check_distinct_outputs, check_out, output_format, replace_paths, staged_dir
    from parity.harness.report import write_json_atomic
    from parity.harness.run import remove_empty_dirs, run_parity, unwritten_archives
    from reference.atomic import OutputWriteError
    from reference.paths import resolve_model

    model = resolve_model(args.model)
    specs = _backend_specs(args)
    fmt = output_format(args)
    scen = _parse_scenarios(args.scenario)
    if len(specs) > 1:
        return _run_many(args, model, specs, fmt, scen)
    spec = specs[0]
    if args.out is not None:
        prepare_out_dir(args.out, overwrite=args.overwrite)
    if args.write_known is not None:   # the one output rule (parity.cli.common.check_out), before anything runs
        check_out(args.write_known, kind="file", overwrite=args.overwrite, flag="--write-known")
        if args.out is not None:   # the baseline written last would replace the report
            check_distinct_outputs(("--out", Path(args.out) / "report.json"), ("--out", Path(args.out) / "taps", "dir"),
                                   ("--write-known", args.write_known))
    pages = None
    if args.page_sizes is not None:
        from parity.harness.scenarios import parse_page_sizes
        from reference.config import load_config
        pages = parse_page_sizes(args.page_sizes, load_config(model).max_position_embeddings)
    from parity.harness.progress import progress_mode
    progress = progress_mode(args.no_progress)  # a bar on a terminal, plain lines otherwise
    known, identity, prompts_id = None, None, None
    if args.known is not None or args.write_known is not None:
        from parity.harness.causes import model_identity, prompts_identity
        from parity.prompts import load_prompts
        from reference.config import load_config
        identity = model_identity(model)
        mc = load_config(model)
        prompts_id = prompts_identity(load_prompts(args.prompts, model, mc.vocab_size, mc.max_position_embeddings))
    if args.known is not None:   # a bad baseline, or one of another model, backend or prompts, is bad input (exit 2)
        from parity.harness.causes import read_known
        known = read_known(args.known)
        known.check_identity(identity, spec, model_path=str(model), prompts=prompts_id)
    extra = {"known": known, "below_bound": args.below_bound}
    unwritten = []
    unwritten_report = None
    if args.out is not None:
        try:
            with staged_dir(args.out, ("report.json", "taps", *_many_entries(args.out))) as stage:
                report = run_parity(model, spec, scen, level=args.level, page_sizes=pages, prompts=args.prompts,
                                    out_dir=stage, progress=progress, **extra)
                report.reproduce = _reproduce(args)
                doc = replace_paths(report.to_json(), str(stage), str(Path(args.out)))
                for r in report.rows:   # the table names the archives at their final place too (the next command)
                    r.failures = replace_paths(r.failures, str(stage), str(Path(args.out)))
                unwritten = unwritten_archives(doc)
                if unwritten:  # an incomplete result set is never swapped in: the old results stay
                    raise _Incomplete
                remove_empty_dirs(stage / "taps")
                try:
                    write_json_atomic(stage / "report.json", doc)
                except OutputWriteError as e:   # full or read-only disk: the verdict is still printed, exit 4
                    unwritten_report = str(e).replace(str(stage), str(Path(args.out)))
                    raise _Incomplete from None
        except _Incomplete:
            pass
        else:
            print(f"report: {Path(args.out) / 'report.json'}", file=sys.stderr)
    else:
        report = run_parity(model, spec, scen, level=args.level, page_sizes=pages, prompts=args.prompts,
                            progress=progress, **extra)
        report.reproduce = _reproduce(args)
        doc = report.to_json()
    if args.write_known:
        from parity.harness.causes import write_known
        write_known(args.write_known, doc["root_causes"],
                    {"model": {**identity, "path": str(model)}, "backend_spec": spec, "backend": report.backend,
                     "level": args.level, "scenarios": scen, "prompts": prompts_id,
                     "tol_rel": (report.meta.get("thresholds") or {}).get("tol_rel")})
    _print_report(report, fmt, doc)
    if getattr(args, "traceback", False):
        for r in report.rows:
            if r.traceback:
                print(f"--- {r.scenario}: the backend's stack trace\n{r.traceback}", file=sys.stderr, end="")
    elif any(r.traceback for r in report.rows):
        print("qwen4exp parity: the backend raised in some cases; --traceback prints the stack traces (report.json "
              "holds them)", file=sys.stderr)
    if unwritten_report:  # report.json could not be written (disk full): named at its place in --out, exit 4
        from reference.errors import EXIT_ENVIRONMENT
        print(f"qwen4exp parity: error: {unwritten_report}; nothing was replaced in {str(args.out)!r} (the verdict "
              f"above is {report.to_json()['verdict']}, exit {EXIT_ENVIRONMENT})", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if unwritten:  # the output is incomplete (disk full, read-only): the environment failed, exit 4
        from reference.errors import EXIT_ENVIRONMENT
        print(f"qwen4exp parity: error: {len(unwritten)} failing case(s)' tap archives could not be written under "
              f"{str(Path(args.out) / 'taps')!r}: {unwritten[0]}; nothing was replaced in {str(args.out)!r} (the "
              f"verdict above is {report.to_json()['verdict']}, exit {EXIT_ENVIRONMENT})", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return report.exit_code


def _backend_specs(args) -> list[str]:
    """The ``--backend`` options of ``args`` (repeatable; ``engine`` when none), each parsed and in its current
    spelling (:func:`parity.cli.common.backend_spec`).

    Raises:
        InputError: a malformed spec or an option the backend does not take, naming it.
    """
    import argparse

    from parity.cli.common import backend_spec
    given = args.backend if isinstance(args.backend, list) else [args.backend or "engine"]
    return [str(backend_spec(argparse.Namespace(backend=g))) for g in (given or ["engine"])]


def prepare_out_many(out, n: int, overwrite: bool = False):
    """Validate ``--out DIR`` of a run judging ``n`` backends before anything runs: the rule of
    :func:`prepare_out_dir`, and ``DIR/index.json`` absent or a regular file, each ``DIR/<i>`` (i < n) absent or a
    directory.

    Raises:
        InputError: naming ``--out``.
    """
    from reference.errors import InputError
    p = prepare_out_dir(out, overwrite=overwrite)
    ix = p / "index.json"
    if (ix.exists() or ix.is_symlink()) and not ix.is_file():
        raise InputError(f"--out {str(out)!r}: expected {str(ix)!r} to be absent or a regular file (it is replaced "
                         f"by the new index), found a directory or special file")
    for i in range(n):
        d = p / str(i)
        if d.exists() and not d.is_dir():
            raise InputError(f"--out {str(out)!r}: expected {str(d)!r} to be absent or a directory (backend {i}'s "
                             f"report goes there), found a file")
    return p


def _many_entries(out) -> list[str]:
    """The entries of ``--out DIR`` a run judging several backends wrote (``index.json``, each ``<i>/`` holding a
    ``report.json``): a new run's results replace them, so no old index sits beside new reports."""
    from pathlib import Path
    d = Path(out)
    if not d.is_dir():
        return []
    return ([e.name for e in d.iterdir() if e.is_dir() and e.name.isdigit() and (e / "report.json").exists()]
            + (["index.json"] if (d / "index.json").is_file() else []))


def _run_many(args, model, specs: list[str], fmt: str, scen: list[str]) -> int:
    """``qwen4exp parity`` with several ``--backend``: :func:`parity.harness.run.run_parity_many`; each backend's
    table printed in turn (text / rich: under a ``backend I of N: SPEC`` line, the legend once, after the last;
    json: ``{"backends": [report, ...], "exit_code", "verdict"}``), each report written to ``--out DIR/<i>/``
    (``report.json`` and ``taps/``) with ``DIR/index.json`` naming them; returns the worst exit code
    (:func:`parity.harness.report.worst_exit_code`).

    Raises:
        InputError: ``--known`` / ``--write-known`` (a baseline is of one backend), a bad ``--out`` or
            ``--page-sizes``; a backend that cannot be opened (nothing runs then).
    """
    import dataclasses
    import json
    from pathlib import Path

    from parity.cli.common import replace_paths, staged_dir
    from parity.harness.report import render_table, worst_exit_code, write_json_atomic
    from parity.harness.run import remove_empty_dirs, run_parity_many, unwritten_archives
    from parity.harness.scenarios import meanings
    from reference.atomic import OutputWriteError
    from reference.errors import EXIT_ENVIRONMENT, InputError
    for flag, v in (("--known", args.known), ("--write-known", args.write_known)):
        if v is not None:
            raise InputError(f"{flag}: a baseline is of one backend; expected one --backend with it, found "
                             f"{len(specs)}")
    if args.out is not None:
        prepare_out_many(args.out, len(specs), overwrite=args.overwrite)
    pages = None
    if args.page_sizes is not None:
        from parity.harness.scenarios import parse_page_sizes
        from reference.config import load_config
        pages = parse_page_sizes(args.page_sizes, load_config(model).max_position_embeddings)
    from parity.harness.progress import progress_mode
    progress = progress_mode(args.no_progress)
    kw = dict(level=args.level, page_sizes=pages, prompts=args.prompts, progress=progress,
              below_bound=args.below_bound)
    unwritten, docs = [], []
    unwritten_report = None

    def finish(reports, stage=None):
        for r in reports:
            r.reproduce = _reproduce(args)
        out = []
        for r in reports:
            d = r.to_json()
            if stage is not None:
                d = replace_paths(d, str(stage), str(Path(args.out)))
                for row in r.rows:   # the table names the archives at their final place too
                    row.failures = replace_paths(row.failures, str(stage), str(Path(args.out)))
            out.append(d)
        return out
    if args.out is not None:
        # entries this run owns: its index and backend folders; a single-backend report and archives (and folders of
        # a run of more backends) left from earlier runs are removed when the new results are swapped in
        entries = tuple(dict.fromkeys(["index.json", "report.json", "taps", *map(str, range(len(specs))),
                                       *_many_entries(args.out)]))
        try:
            with staged_dir(args.out, entries) as stage:
                reports = run_parity_many(model, specs, scen, out_dirs=[stage / str(i) for i in range(len(specs))],
                                          **kw)
                docs = finish(reports, stage)
                unwritten = [u for d in docs for u in unwritten_archives(d)]
                if unwritten:  # an incomplete result set is never swapped in: the old results stay
                    raise _Incomplete
                try:
                    for i, d in enumerate(docs):
                        (stage / str(i)).mkdir(exist_ok=True)
                        remove_empty_dirs(stage / str(i) / "taps")
                        write_json_atomic(stage / str(i) / "report.json", d)
                    write_json_atomic(stage / "index.json", _index(docs, reports))
                except OutputWriteError as e:   # full or read-only disk: the verdicts are still printed, exit 4
                    unwritten_report = str(e).replace(str(stage), str(Path(args.out)))
                    raise _Incomplete from None
        except _Incomplete:
            pass
        else:
            print(f"reports: {Path(args.out) / 'index.json'} ({len(specs)} backends: "
                  f"{', '.join(str(Path(args.out) / str(i) / 'report.json') for i in range(len(specs)))})",
                  file=sys.stderr)
    else:
        reports = run_parity_many(model, specs, scen, **kw)
        docs = finish(reports)
    code = worst_exit_code(r.exit_code for r in reports)
    if fmt == "json":
        print(json.dumps({**_index(docs, reports, written=bool(args.out)), "backends": docs}, indent=1))
    else:
        console = None
        if fmt == "rich":
            from rich.console import Console
            console = Console(highlight=False)
        for i, r in enumerate(reports):
            head = f"backend {i + 1} of {len(reports)}: {r.backend}"
            shown = dataclasses.replace(r, model=display_path(r.model))
            last = i == len(reports) - 1
            if console is not None:
                console.print(head)
                render_table(shown, console, legend=last, meanings=meanings())
            else:
                print(("" if i == 0 else "\n") + head)
                print(render_table(shown, legend=last, meanings=meanings()))
        line = (f"verdict over {len(reports)} backends: exit {code} ("
                + ", ".join(f"#{i + 1} {r.verdict_line.split(' (')[0]}" for i, r in enumerate(reports)) + ")")
        if console is not None:
            console.print(line)
        else:
            print(line)
    if getattr(args, "traceback", False):
        for r in reports:
            for row in r.rows:
                if row.traceback:
                    print(f"--- {r.backend} {row.scenario}: the backend's stack trace\n{row.traceback}",
                          file=sys.stderr, end="")
    elif any(row.traceback for r in reports for row in r.rows):
        print("qwen4exp parity: a backend raised in some cases; --traceback prints the stack traces (report.json "
              "holds them)", file=sys.stderr)
    if unwritten_report:  # a report / the index could not be written (disk full): named at its place in --out
        print(f"qwen4exp parity: error: {unwritten_report}; nothing was replaced in {str(args.out)!r} (the verdicts "
              f"above stand, exit {EXIT_ENVIRONMENT})", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if unwritten:
        print(f"qwen4exp parity: error: {len(unwritten)} failing case(s)' tap archives could not be written under "
              f"{str(args.out)!r}: {unwritten[0]}; nothing was replaced in {str(args.out)!r} (the verdicts above "
              f"stand, exit {EXIT_ENVIRONMENT})", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return code


def _index(docs: list, reports: list, written: bool = True) -> dict:
    """The index of a run judging several backends (``DIR/index.json``; the head of the json output): per backend
    its position, spec, verdict, exit code and report path (relative to DIR; None when ``written`` is false: no
    --out, nothing written), and the worst exit code."""
    from parity.harness.report import worst_exit_code
    code = worst_exit_code(r.exit_code for r in reports)
    worst = next((d["verdict"] for d in docs if d["exit_code"] == code), "pass")
    return {"exit_code": code, "verdict": worst, "reproduce": docs[0].get("reproduce") if docs else None,
            "reports": [{"index": i, "backend": d["backend"], "verdict": d["verdict"], "exit_code": d["exit_code"],
                         "verdict_line": d["verdict_line"], "report": f"{i}/report.json" if written else None}
                        for i, d in enumerate(docs)]}


def _reproduce(args) -> str | None:
    """The command line of this run, shell-quoted (``qwen4exp parity ...``, the argv as given, with
    ``--overwrite`` added when it writes an ``--out`` directory: that directory holds this run's results when the
    command is read, and a run refuses a non-empty one without it), or None when the CLI was driven without one."""
    import shlex
    argv = getattr(args, "argv", None)
    if argv is None:
        return None
    argv = list(argv)
    if getattr(args, "out", None) is not None and "--overwrite" not in argv:
        argv.append("--overwrite")
    return shlex.join(["qwen4exp", *argv])


class _Incomplete(Exception):
    """Raised inside the staged --out block when some output could not be written: the stage is discarded."""
