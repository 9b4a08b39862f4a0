"""``qwen4exp bench``: reference (CPU) and engine (GPU) speed, against the official implementation
measured in the same run; JSON results and a closing table. Numbers are reported, never asserted."""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    """Add the ``bench`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser(
        "bench", help="speed of the reference and the engine against the official implementation",
        description="Benchmark the reference (CPU) and/or the engine (GPU, or its CPU path) on a checkpoint or "
                    "on synthetic real-width weights, with the official transformers implementation (eager) "
                    "timed in the same run as the peer. Warm-up excluded; medians of repeated runs with their "
                    "spread; results as JSON; a table printed last.")
    from parity.cli.common import model_help
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help=model_help() + " (same as --model; default: tiny)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="deprecated: the positional MODEL (default: tiny)")
    src.add_argument("--synthetic", choices=["real-widths"], default=None,
                     help="random BF16 weights at the real model's widths (cached; PLE table rows scaled down)")
    p.add_argument("--backend", default=None, metavar="SPEC",
                   help="what to time: reference, engine[:device=cpu|cuda,precision=float32|bf16] or both "
                        "(default: both when a GPU is usable, else reference)")
    p.add_argument("--layers", type=int, default=None,
                   help="synthetic layers (default: engine 4 = one period 3 GDN + 1 QSA with PLE on layer 1; "
                        "reference 1 real-width layer)")
    p.add_argument("--vocab", type=int, default=None,
                   help="synthetic vocabulary (default: engine 248320 (real), reference 32768 (reduced))")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="engine device (or --backend engine:device=...)")
    p.add_argument("--precision", default=None,
                   help="engine precision: bf16 (GPU default) or float32 (CPU default) (or --backend "
                        "engine:precision=...)")
    p.add_argument("--prompt-lens", type=_ints_arg, default=None, help="prefill lengths: the engine times each (GPU default 512,4096), the reference the first "
                        "(default 64)")
    p.add_argument("--batches", type=_ints_arg, default=None, help="engine decode batch sizes (GPU default 1,4,16)")
    p.add_argument("--contexts", type=_ints_arg, default=None,
                   help="engine decode contexts (default: below and above the QSA bound)")
    p.add_argument("--weights", choices=["bf16", "fp8", "nvfp4"], default=None,
                   help="with --synthetic --backend engine: random weights of this format built in memory (experts "
                        "directly on the device, no files; PLE table at its real size in host memory); a depth "
                        "that does not fit is measured at 4 and 8 layers and projected")
    p.add_argument("--decode-tokens", type=int, default=None, help="timed decode steps per setting")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed warm-up runs, >= 0 (default 1: the first run compiles the kernels; 0 times it)")
    p.add_argument("--no-peer", action="store_true", help="skip the official implementation")
    p.add_argument("--no-extras", action="store_true", help="skip the n-gram gather and tap-diff figures")
    p.add_argument("--budget-s", type=float, default=None, help="time budget per measurement (later settings skipped)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="hard limit per measurement process, load included (default: 3 x budget + 240 s, or none); "
                        "what was measured before it is kept")
    from parity.cli.common import add_format
    add_format(p)
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the result JSON to this file ('-' = stdout); its folder must exist, an existing file "
                        "needs --overwrite (replaced only when the run completes)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    from parity.cli.common import add_traceback
    add_traceback(p)
    p.set_defaults(func=run)


def _ints_arg(s: str) -> list[int]:
    from parity.bench.plan import ints as _ints
    try:
        return _ints(s)
    except Exception as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec_to_flags(args) -> None:
    """``--backend engine:device=cpu,precision=bf16`` read into ``args.device`` / ``args.precision`` (the
    one grammar, :func:`parity.backends.parse_backend_spec`); ``both`` stays as typed.

    Raises:
        InputError: a malformed spec, an option bench does not take, or a spec contradicting --device /
            --precision.
    """
    from reference.errors import InputError
    if args.backend in (None, "both"):
        return
    legacy = {"--device": None if args.device == "auto" else args.device, "--precision": args.precision}
    from parity.backends import parse_backend_spec
    name = parse_backend_spec(args.backend).name
    if name not in ("reference", "engine"):
        raise InputError(f"--backend {args.backend!r}: expected reference, engine[:key=value,...] or both, found "
                         f"{name!r}")
    sp = parse_backend_spec(args.backend)
    if name == "engine":  # bench's --device / --precision are its own options, not deprecated spellings
        sp = sp.with_options(legacy)
    if name == "reference" and sp.options:
        raise InputError(f"--backend {args.backend!r}: bench times the reference at float32, expected no options, "
                         f"found {sp.options}")
    if name == "engine" and "device" in parse_backend_spec(args.backend).options:
        args.device_flag = f"--backend {args.backend!r}"   # what the user typed, for the device error's name
    args.backend = name
    if name == "engine":
        args.device = sp.options.get("device", "auto")
        args.precision = sp.options.get("precision")


def run(args: argparse.Namespace) -> int:
    """Run ``qwen4exp bench``: each planned job in a worker process, then the results as JSON and/or
    a table. Returns :func:`exit_of_runs` (0; 4 a job failed; 3 a job timed out); InputError/DeviceUnavailableError from
    :func:`plan` for bad options."""
    from parity.bench import runner

    from parity.bench.plan import plan
    from parity.cli.common import check_out
    if args.model is not None and args.model_pos is None:
        print("note: bench --model is deprecated; write: qwen4exp bench MODEL", file=sys.stderr)
    _spec_to_flags(args)
    from parity.cli.common import output_format
    output_format(args)  # --json with another --format: said before anything runs
    check_out(args.out, kind="file", overwrite=args.overwrite, stdout_ok=True)
    jobs, settings, checkpoints = plan(args)
    if settings.get("note"):
        print(f"note: {settings['note']}", file=sys.stderr)
    if args.prompt_lens and len(args.prompt_lens) > 1 and settings.get("reference_prompt_len"):
        print(f"note: the reference is timed at prefill {settings['reference_prompt_len']} (the first --prompt-lens); "
              f"the engine at each of them", file=sys.stderr)
    with runner.terminate_on_signals():  # SIGTERM: stop the worker, remove its temp dir, exit 143
        return _run_jobs(args, runner, jobs, settings, checkpoints)


def _run_jobs(args, runner, jobs, settings, checkpoints) -> int:
    runs = {}
    timeout = args.timeout_s
    if timeout is None and args.budget_s is not None:
        timeout = 3 * args.budget_s + 240  # loads + the setting in flight
    for i, (key, spec) in enumerate(jobs, 1):
        print(f"[bench] {i}/{len(jobs)}: {key}", file=sys.stderr, flush=True)
        runs[key] = runner.run_worker(spec, timeout_s=timeout)
        r = runs[key]
        if "unavailable" in r:
            print(f"[bench] {key}: peer unavailable: {r['unavailable']}", file=sys.stderr)
        elif "error" in r:
            print(f"[bench] {key}: error: {r['error']}", file=sys.stderr)
    results = runner.assemble(runs, settings, checkpoints)
    from parity.cli.common import output_format
    fmt = "json" if args.out == "-" else output_format(args)
    if args.out and args.out != "-":
        runner.write_json_atomic(args.out, results)
    if fmt == "json":
        print(json.dumps(results, default=float))
    else:
        runner.print_table(results, fmt=fmt)
    return exit_of_runs(runs)


def exit_of_runs(runs: dict) -> int:
    """The exit code of a bench run (reference.errors.EXIT_CODES): 0 every job measured; 4 a job failed (its
    worker crashed or raised: an environment / internal failure, not a divergence: bench judges no backend); 3
    otherwise when a job hit its time limit (no figure: the run is inconclusive, what it measured is kept)."""
    from reference.errors import EXIT_ENVIRONMENT, EXIT_INCONCLUSIVE, EXIT_OK
    bad = [r for r in runs.values() if "error" in r]
    if any(not r.get("timed_out") for r in bad):
        return EXIT_ENVIRONMENT
    return EXIT_INCONCLUSIVE if bad else EXIT_OK
