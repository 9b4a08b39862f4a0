"""``qwen4exp parity``: the main job -- is this engine the qwen4exp model?

    qwen4exp parity [MODEL] [--backend engine] [--scenario NAME...] [--json] [--out DIR]

Runs the logit-KL harness (backend against the reference's full forward, with its controls) and the
scenario suites (budget, chunk-boundary, snapshot-restore, speculative-rollback) at the page sizes
the backend supports; prints one verdict table (scenario, cases, worst KL, worst logit error, first
divergence, time); writes ``report.json`` and the failing cases' tap archives under ``--out``.
Exit codes: 0 pass; 1 fail (a divergence, a failed control, or the backend under test raising inside a
case or the KL harness -- such a case is shown as ERROR and counted as failed); 2 usage/input error (bad
arguments, model or prompts, an --out that cannot be written, a backend that cannot be opened).
"""
from __future__ import annotations

import contextlib
import sys
import time


def register(subparsers) -> None:
    """Add the ``parity`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser(
        "parity", help="the main job: KL harness + all scenario suites of a backend against the reference",
        description="Judge a backend against the reference: logit-KL with controls, then the budget, "
                    "chunk-boundary, snapshot-restore and speculative-rollback scenarios (every one also with "
                    "concurrent sequences and several paged-cache page sizes). Failures are located by tap-diff. "
                    "Exit 0 pass / 1 fail (a divergence, a failed control, or an exception raised by the backend inside a "
                    "case: an ERROR row) / 2 usage or input error (bad arguments, model, a backend that cannot be "
                    "opened).")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory or bundled fixture (default: tiny)")
    p.add_argument("--backend", default="engine",
                   help="reference, reference-f64, engine (cuda when a GPU is present, else cpu), engine-cpu, "
                        "engine-cuda, or module:Class (default: engine)")
    p.add_argument("--scenario", nargs="+", default=None, metavar="NAME",
                   help="scenarios to run: budget, chunk-boundary, snapshot-restore, speculative-rollback, kl "
                        "(default: all)")
    p.add_argument("--level", choices=["full", "ci"], default="full",
                   help="full: every combination (default); ci: the same situations, fewer combinations")
    p.add_argument("--page-sizes", default=None, metavar="N,N,...",
                   help="paged-cache page sizes (default: the compress ratio, twice it and ratio+1)")
    p.add_argument("--prompts", metavar="FILE", default=None, help="prompt set of the KL harness")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write report.json and failing cases' tap archives (truth.taps / backend.taps) here")
    p.add_argument("--overwrite", action="store_true",
                   help="reuse a non-empty --out DIR: its old report.json and taps/ are removed first")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _parse_scenarios(names):
    from parity.harness.scenarios import SCENARIOS, normalize_name
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
            valid = ", ".join(["kl", *(s.replace("_", "-") for s in SCENARIOS)])
            raise InputError(f"scenario {n!r}: expected one of {valid}, found {n!r}") from None
    return list(dict.fromkeys(out))


from parity.harness.scenarios import MAX_PAGE_SIZES, parse_page_sizes  # noqa: E402,F401


def prepare_out_dir(out, overwrite: bool = False):
    """Validate ``--out DIR`` before anything runs. A non-empty DIR needs ``overwrite``; then its old
    ``report.json`` and ``taps/`` (failing-case archives of an earlier run) are removed, so a new
    report never sits next to stale archives. Other files in DIR are left alone.

    Raises:
        InputError: DIR is a file, is not writable, is non-empty without ``overwrite``, or holds a
            ``report.json`` that is not a regular file / a ``taps`` that is not a directory (the job would
            only find out after running).
    """
    import shutil

    from reference.atomic import check_output_path
    from reference.errors import InputError
    p = check_output_path(out, "dir", overwrite=overwrite)
    rj, tp = p / "report.json", p / "taps"
    if (rj.exists() or rj.is_symlink()) and not rj.is_file():
        raise InputError(f"--out {str(out)!r}: expected {str(rj)!r} to be absent or a regular file (it is "
                         f"replaced by the new report), found a directory or special file")
    if tp.exists() and not tp.is_dir():
        raise InputError(f"--out {str(out)!r}: expected {str(tp)!r} to be absent or a directory (failing cases' "
                         f"tap archives go there), found a file")
    if overwrite and p.is_dir():
        if (p / "taps").is_dir():
            shutil.rmtree(p / "taps")
        if (p / "report.json").is_file():
            (p / "report.json").unlink()
    return p


def display_path(path) -> str:
    """``path`` relative to the current directory when inside it (as README shows), else as is."""
    from pathlib import Path
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def run(args) -> int:
    """Run ``qwen4exp parity``: the KL harness and the scenario suites of ``--backend`` against the
    reference, printed as a table or JSON (and written to ``--out/report.json``). Returns the report's exit code.

    Raises:
        InputError: bad ``--page-sizes``, scenario names or ``--out`` directory.
    """
    from pathlib import Path

    from parity.harness.report import render_table, write_json_atomic
    from reference.paths import resolve_model

    model = resolve_model(args.model)
    scen = _parse_scenarios(args.scenario)
    existed = bool(args.out) and Path(args.out).exists()
    if args.out:
        prepare_out_dir(args.out, overwrite=args.overwrite)
    pages = None
    if args.page_sizes is not None:
        from reference.config import load_config
        pages = parse_page_sizes(args.page_sizes, load_config(model).max_position_embeddings)
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        from parity.harness.run import run_parity
        report = run_parity(model, args.backend, scen, level=args.level, page_sizes=pages, prompts=args.prompts,
                            out_dir=args.out, progress=progress)
    except BaseException:
        if args.out:  # interrupted or failed: no taps/ without its report.json (prepare_out_dir left none)
            import shutil
            shutil.rmtree(Path(args.out) / "taps", ignore_errors=True)
            if not existed:
                with contextlib.suppress(OSError):
                    Path(args.out).rmdir()  # only if empty
        raise
    doc = report.to_json()
    from parity.harness.run import remove_empty_dirs, unwritten_archives
    unwritten = unwritten_archives(doc) if args.out else []
    if args.out:
        remove_empty_dirs(Path(args.out) / "taps")
        path = write_json_atomic(Path(args.out) / "report.json", doc)
        print(f"report: {path}", file=sys.stderr)
    if args.json:
        import json
        print(json.dumps(doc, indent=1))
    else:
        console = None
        if sys.stdout.isatty():
            try:
                from rich.console import Console
                console = Console()
            except ImportError:
                console = None
        import dataclasses
        text = render_table(dataclasses.replace(report, model=display_path(model)), console)
        if console is None:
            print(text)
    if unwritten:  # the verdict stands, but the archives it points to are missing: say so, never silently
        print(f"qwen4exp parity: error: {len(unwritten)} failing case(s)' tap archives could not be written under "
              f"{str(Path(args.out) / 'taps')!r}: {unwritten[0]}", file=sys.stderr)
        return max(1, report.exit_code)
    return report.exit_code


