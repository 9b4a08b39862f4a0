"""``qwen4exp parity``: the main job -- is this engine the qwen4exp model?

    qwen4exp parity [MODEL] [--backend engine] [--scenario NAME...] [--json] [--out DIR]

Runs the logit-KL harness (backend against the reference's full forward, with its controls) and the
scenario suites (budget, chunk-boundary, snapshot-restore, speculative-rollback) at the page sizes
the backend supports; prints one verdict table (scenario, cases, worst KL, worst logit error, first
divergence, time); writes ``report.json`` and the failing cases' tap archives under ``--out``.
Exit codes: 0 pass; 3 inconclusive (every case skipped: the backend declares the operations they need
unsupported -- nothing was judged); 1 fail (a divergence, a failed control, or the backend under test raising inside a
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


def run_parity(model, backend_spec: str, scenarios: list[str], *, level="full", page_sizes=None, prompts=None,
               out_dir=None, progress=True):
    """Run the KL harness and the scenarios; returns a :class:`parity.harness.report.ParityReport`.

    An exception raised by the backend under test inside a case or the KL harness does not escape: it
    becomes an 'error' row / case (a failed case; the report's exit code is 1).

    Raises:
        BackendError / InputError: the backend cannot be opened, bad options or prompts (before anything runs).
    """
    from pathlib import Path

    from tqdm.auto import tqdm

    from parity.backends import opener, truth_model
    from parity.harness.report import ParityReport, ScenarioRow
    from parity.harness.scenarios import count_cases, run_scenario, summarize_results
    from parity.harness.scenarios.common import TruthCache
    from reference.errors import UserError

    op = opener(backend_spec, model)
    from parity.backends import capabilities_of
    from parity.backends.base import capability_table
    probe = op()  # fails here, clearly, when the backend cannot be opened
    caps = capabilities_of(probe)
    cfg = probe.config
    report = ParityReport(backend=probe.name, model=str(model),
                          meta={"config_hash": cfg.config_hash(), "precision": probe.precision, "level": level,
                                "capabilities": {**{k: v for k, v in caps.items()}, **capability_table(probe)},
                                **({"load": probe.load_note} if getattr(probe, "load_note", None) else {})})
    if hasattr(probe, "close"):
        probe.close()
    kl_prompts = None
    if "kl" in scenarios:  # a bad --prompts file is an input error (exit 2), found before anything runs
        from parity.prompts import load_prompts
        kl_prompts = load_prompts(prompts, model, cfg.vocab_size)
    truth = TruthCache(truth_model(model))
    archive_dir = Path(out_dir) / "taps" if out_dir else None
    total = sum(count_cases(s, cfg, caps, page_sizes, level) for s in scenarios if s != "kl") + ("kl" in scenarios)
    bar = tqdm(total=total, desc="parity", unit="case", disable=not progress, leave=False, file=sys.stderr)
    try:
        for name in scenarios:
            t0 = time.perf_counter()
            if name == "kl":
                try:
                    report.rows.append(_kl_row(model, backend_spec, kl_prompts, progress, t0, truth=truth,
                                               archive_dir=archive_dir))
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # the backend raised in the KL harness: a failed (ERROR) row, as in a case
                    msg = f"backend raised {type(e).__name__}: {e}"
                    report.rows.append(ScenarioRow("kl", len(kl_prompts), len(kl_prompts), float("nan"),
                                                   float("nan"), f"KL harness: {msg}", time.perf_counter() - t0,
                                                   "error", msg))
                bar.update(1)
                continue
            try:
                res = run_scenario(name, op, truth, page_sizes=page_sizes, archive_dir=archive_dir, progress=bar,
                                   level=level)
                report.rows.append(summarize_results(name, res, time.perf_counter() - t0))
            except (KeyboardInterrupt, UserError):
                raise  # a backend that cannot be opened (at a page size) / bad options: exit 2
            except Exception as e:  # a scenario that cannot run at all is an error row (a failure), not a crash
                report.rows.append(ScenarioRow(name.replace("_", "-"), 0, 0, float("nan"), float("nan"), None,
                                               time.perf_counter() - t0, "error", f"{type(e).__name__}: {e}"))
    finally:
        bar.close()
    return report


def _kl_row(model, backend_spec, prompts, progress, t0, truth=None, archive_dir=None):
    """The KL harness as one verdict-table row; a failing comparison is located by tap-diff on its worst
    prompt (the backend's one-shot logits against the truth's forward).

    ``prompts``: token-id lists (already loaded), or a prompt file / None (the bundled set). The row's
    failed cases are the prompts failing :func:`parity.harness.kl.verdict` on their own (KL or top-1).
    """
    import dataclasses

    import numpy as np

    from parity.backends import open_backend
    from parity.cli.kl import run_kl_command
    from parity.harness.kl import LogitComparison, verdict
    from parity.harness.report import ScenarioRow

    if prompts is None or isinstance(prompts, (str, bytes)) or hasattr(prompts, "__fspath__"):
        from parity.prompts import load_prompts
        from reference.config import load_config
        prompts = load_prompts(prompts, model, load_config(model).vocab_size)
    rep = run_kl_command(model, "reference", backend_spec, prompts, progress=False, flags=("reference", "--backend"))
    failed_controls = [k for k, c in rep.controls.items() if not c.get("ok")]
    status = "pass" if rep.exit_code == 0 else "fail"
    detail = rep.reason + (f"; controls failed: {failed_controls}" if failed_controls else "")
    both = np.maximum(rep.comparison.kl_ab, rep.comparison.kl_ba)
    bounds = np.cumsum([0] + rep.per_prompt_positions)
    per_prompt = [float(np.max(both[bounds[i]:bounds[i + 1]])) for i in range(len(prompts))]
    cmp_fields = [f.name for f in dataclasses.fields(LogitComparison)]
    prompt_ok = [verdict(LogitComparison(*[getattr(rep.comparison, f)[bounds[i]:bounds[i + 1]] for f in cmp_fields]),
                         rep.thresholds)[0] for i in range(len(prompts))]
    n_bad = sum(1 for ok in prompt_ok if not ok)
    first, archives = None, []
    if not rep.passed:
        # the worst prompt among those failing on their own (KL or top-1), else the worst KL overall
        cand = [i for i, ok in enumerate(prompt_ok) if not ok] or list(range(len(prompts)))
        worst = max(cand, key=lambda i: np.nan_to_num(per_prompt[i], nan=np.inf))
        if truth is not None:
            from parity.harness.scenarios.locate import locate_one_shot
            be = open_backend(backend_spec, model)
            where, archives = locate_one_shot(be, truth.model, prompts[worst], archive_dir=archive_dir)
            first = f"prompt {worst}: {where}"
        else:
            first = f"prompt {worst}: worst KL {per_prompt[worst]:.3g}"
    elif failed_controls:
        first = "controls failed: " + "; ".join(rep.controls[k]["detail"] for k in failed_controls)
    doc = rep.to_json()
    doc["archives"] = archives
    return ScenarioRow("kl", len(prompts), n_bad, rep.comparison.worst_kl(), rep.comparison.summary()["max_logit_err"],
                       first, time.perf_counter() - t0, status, detail, failures=[doc] if status != "pass" else [])


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
    unwritten = _unwritten_archives(doc) if args.out else []
    if args.out:
        _remove_empty_dirs(Path(args.out) / "taps")
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


def _unwritten_archives(doc) -> list[str]:
    """The reasons recorded in a report document where failing cases' tap archives could not be written
    (``archives`` entries made by :func:`parity.harness.scenarios.locate.not_written`)."""
    from parity.harness.scenarios.locate import NOT_WRITTEN
    out = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "archives" and isinstance(v, list):
                    out.extend(a[len(NOT_WRITTEN):].rstrip(")") for a in v
                               if isinstance(a, str) and a.startswith(NOT_WRITTEN))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return out


def _remove_empty_dirs(root) -> None:
    """Remove the empty folders under ``root`` (and ``root`` itself when it ends up empty): a case whose
    archives could not be written leaves no empty folder behind."""
    import os
    from pathlib import Path
    root = Path(root)
    if not root.is_dir():
        return
    for d, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            if not any(Path(d).iterdir()):
                Path(d).rmdir()
