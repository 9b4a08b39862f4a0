"""``qwen4exp kl``: per-position logit KL between two backends, with the three controls in the same run.

    qwen4exp kl [MODEL] --a reference --b engine:device=cpu [--prompts FILE] [--format text|json]
                [--out FILE.json] [--plot FILE.png]

Exit codes (``qwen4exp -h``): 0 b agrees with a and every control passed; 1 b disagrees, a control failed, a
backend raised while running (an ERROR verdict) or an outside engine refused the checkpoint (a REFUSED verdict,
as ``parity``'s); 2 bad input; 4 environment failure.
"""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    """Add the ``kl`` subcommand and its options to ``subparsers``."""
    from parity.cli.common import add_backend, add_format, add_model, add_traceback
    p = subparsers.add_parser(
        "kl", help="logit-KL harness: backend b against backend a, with determinism/precision/negative controls",
        description="Per-position KL(P_a||P_b) and KL(P_b||P_a) over a prompt set (mean, median, p90, p99, p99.9, "
                    "max), top-1 agreement, top-5 overlap, RMS/max probability difference of a's top token and "
                    "greedy continuation agreement. Controls computed in the same run: determinism (b twice, "
                    "bitwise), precision floor (reference float32 vs float64), negative control (b with one weight "
                    "perturbed must be flagged). A failed control makes the exit code 1.")
    from reference.paths import install_command
    add_model(p)
    add_backend(p, "reference", flag="--a", what="backend a (the side trusted)")
    add_backend(p, "engine", flag="--b", what="backend b (the side under test)")
    # kl compares two backends: `kl --backend X` is refused with the spelling it takes (parity.cli.SubcommandParser)
    p.option_hints = {"--backend": "kl takes two backends, --a SPEC (the side trusted) and --b SPEC (the side under "
                                   "test)"}
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="JSON list of texts or token-id lists (default: the bundled set; '-' reads stdin)")
    p.add_argument("--greedy-tokens", type=int, default=8, metavar="N",
                   help="greedy continuation length compared (default 8; 0 disables)")
    p.add_argument("--perturb", metavar="TENSOR", default=None,
                   help="tensor perturbed for the negative control (default: layer 0's attention output projection)")
    add_format(p, default_help="text")
    p.add_argument("--out", metavar="FILE.json", default=None,
                   help="also write the JSON report here ('-' = stdout); an existing file needs --overwrite")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a KL histogram and per-position KL plot (needs matplotlib, the `plot` extra: "
                        f"{install_command('plot').replace('%', '%%')})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out / --plot file (only when the run completes)")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr (default: a bar on a "
                   "terminal, else a plain line per prompt and every 10 s)")
    add_traceback(p, failures="the JSON report holds it either way")
    p.set_defaults(func=run)


def render_kl(rep) -> str:
    """Human-readable KL report."""
    s = rep.comparison.summary()
    lines = [f"qwen4exp kl: b={rep.b} vs a={rep.a} ({rep.model}), {s['positions']} positions"]
    for key, label in (("kl_ab", "KL(a||b)"), ("kl_ba", "KL(b||a)")):
        st = s[key]
        lines.append(f"  {label:9s} mean {st['mean']:.3g}  median {st['median']:.3g}  p90 {st['p90']:.3g}  "
                     f"p99 {st['p99']:.3g}  p99.9 {st['p99.9']:.3g}  max {st['max']:.3g}")
    lines.append(f"  top-1 agreement {s['top1_agreement']:.4f}   top-5 overlap {s['top5_overlap']:.4f}   "
                 f"top-token prob diff rms {s['top_prob_diff_rms']:.3g} max {s['top_prob_diff_max']:.3g}   "
                 f"max logit err {s['max_logit_err']:.3g}")
    # the logit error is judged with each row's common offset removed (softmax ignores it): the offset is a figure
    lines.append(f"  per-row logit offset removed: max {s['max_removed_offset']:.3g} "
                 f"({s['max_removed_offset_rel']:.3g} of the logit scale; not an error)")
    if rep.greedy:
        n = len(rep.greedy[0]["a"])
        lines.append(f"  greedy agreement (tokens alike before the first difference, of {n} greedy tokens): "
                     + ", ".join(f"prompt {g['prompt']}: {g['agree']}" for g in rep.greedy))
    gen = getattr(rep, "generation", None)
    if gen:   # the generation path (parity.harness.kl.generation_paths)
        lines.append(f"  generation path: prefill_last {gen['prefill_last_rows']} rows; decode_greedy "
                     f"{gen['decode_greedy_as_decode']} tokens equal to decode()'s argmax, "
                     f"{gen['decode_greedy_tokens']} judged against a: "
                     + ("agree" if gen["ok"] else f"{len(gen['faults'])} fault(s)"))
    # the comparison's own verdict; a failure within the run-to-run noise of a backend not claiming determinism
    # is judged neither way (the run's status, on the exit line, is then INCONCLUSIVE)
    cmp_verdict = rep.status if rep.status == "INCONCLUSIVE" and not rep.passed else ("PASS" if rep.passed else "FAIL")
    reason = rep.reason
    if cmp_verdict == "PASS" and not rep.controls_ok:   # a pass the controls cannot vouch for is no PASS
        cmp_verdict, reason = "INCONCLUSIVE", f"the comparison alone passes, but a control failed (below): {reason}"
    lines.append(f"  verdict b: {cmp_verdict} ({reason})")
    lines.append("  controls:")
    for k, c in rep.controls.items():
        lines.append(f"    {k:17s} {'ok  ' if c.get('ok') else 'FAIL'}  {c.get('detail', '')}")
    if not rep.controls_ok:
        lines.append("  CONTROLS FAILED: this report cannot be trusted")
    lines.append(f"  exit {rep.exit_code}  ({rep.seconds:.1f}s)")
    return "\n".join(lines)


def _matplotlib_missing() -> Exception:
    """The error of ``--plot`` without matplotlib (the ``plot`` extra), naming the install command."""
    from reference.errors import InputError
    from reference.paths import install_command
    return InputError(f"--plot: expected matplotlib installed (the `plot` extra), found it missing; install it: "
                      f"{install_command('plot')}")


def plot_png(rep) -> bytes:
    """The KL plot as PNG bytes: a histogram of log10 KL(a||b) over positions (integer counts) and the
    per-position KL(a||b) with the pass threshold drawn as a line (matplotlib).

    Raises:
        InputError: matplotlib is missing.
    """
    import io

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise _matplotlib_missing() from None
    import numpy as np
    kl = np.asarray(rep.comparison.kl_ab)
    fig, (h, line) = plt.subplots(1, 2, figsize=(11, 3.5))
    try:
        pos = np.maximum(kl, 1e-30)
        h.hist(np.log10(pos), bins=40)
        h.yaxis.set_major_locator(MaxNLocator(integer=True))  # position counts are whole numbers
        h.set_xlabel("log10 KL(a||b)")
        h.set_ylabel("positions")
        limit = rep.thresholds.max_kl
        h.axvline(np.log10(limit), color="red", ls="--", lw=1, label=f"limit {limit:.0e}")
        h.legend(loc="upper left", fontsize=8)
        line.plot(pos, lw=0.8)  # floored at 1e-30 so exact agreement still plots on the log axis
        line.axhline(limit, color="red", ls="--", lw=1, label=f"pass limit: max KL <= {limit:.0e}")
        line.set_yscale("log")
        line.xaxis.set_major_locator(MaxNLocator(integer=True))
        line.set_xlabel("position (prompts concatenated)")
        line.set_ylabel("KL(a||b) (floor 1e-30)")
        line.legend(loc="upper right", fontsize=8)
        fig.suptitle(f"{rep.b} vs {rep.a}")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def run(args) -> int:
    """Run ``qwen4exp kl``: the logit-KL harness of backend b against a over the prompt set, printed
    as text or JSON (optionally written to ``--out`` and plotted to ``--plot``, both swapped in together when
    the run completes). A backend raising (or calling sys.exit) while the harness runs is an ERROR verdict,
    exit 1, with its stack trace in the JSON and behind ``--traceback``.

    Returns: the report's exit code (0 pass, 1 fail, a failed control, or a backend error).
    Raises:
        InputError: a bad backend spec, ``--greedy-tokens < 0``, a bad output path, or ``--plot`` without matplotlib.
    """
    import json
    import traceback

    from parity.backends import backend_class
    from parity.backends.refusal import EngineRefused
    from parity.cli.common import backend_spec, check_distinct_outputs, check_out, output_format, publish_files
    from parity.harness.kl import dumps
    from parity.prompts import load_prompts
    from reference.config import load_config
    from reference.errors import EXIT_DIVERGENCE, InputError, UserError
    from reference.paths import resolve_model

    model = resolve_model(args.model)
    a, b = str(backend_spec(args, "--a")), str(backend_spec(args, "--b"))
    backend_class(a, "--a")  # an unknown name / unimportable plugin is reported against the option that gave it
    backend_class(b, "--b")
    fmt = output_format(args)
    if args.greedy_tokens < 0:
        raise InputError(f"--greedy-tokens: expected an integer >= 0 (0 disables), found {args.greedy_tokens}")
    out = check_out(args.out, kind="file", overwrite=args.overwrite, stdout_ok=True)
    to_stdout = args.out == "-"
    plot = check_out(args.plot, kind="file", overwrite=args.overwrite, flag="--plot")
    check_distinct_outputs(("--out", args.out), ("--plot", args.plot))
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise _matplotlib_missing() from None
    cfg = load_config(model)
    if args.perturb is not None:  # named against the option, before anything runs
        from reference.checkpoint import Checkpoint
        if not Checkpoint.open(model).has(args.perturb):
            raise InputError(f"--perturb {args.perturb!r}: expected a tensor name of the checkpoint (e.g. "
                             f"layers.0.self_attn.o_proj.weight; `qwen4exp info {args.model or 'tiny'}` describes "
                             f"it), found no tensor of that name")
    prompts = load_prompts(args.prompts, model, cfg.vocab_size, cfg.max_position_embeddings)
    from parity.harness.progress import progress_mode
    from parity.harness.run import run_kl_command
    try:
        rep = run_kl_command(model, a, b, prompts, greedy_tokens=args.greedy_tokens,
                             perturb_name=args.perturb, progress=progress_mode(args.no_progress))
    except (KeyboardInterrupt, UserError):
        raise
    except EngineRefused as e:  # the engine's defect on a valid checkpoint: verdict REFUSED, as parity's open row
        doc = {"a": a, "b": b, "model": str(model), "verdict": "refused", "exit_code": EXIT_DIVERGENCE,
               "refused": e.to_json()}
        if out is not None:
            publish_files({out: (json.dumps(doc, indent=1) + "\n").encode()})
        if fmt == "json" or to_stdout:
            print(json.dumps(doc, indent=1))
        else:
            print(f"qwen4exp kl: b={b} vs a={a} ({model})\n  verdict: {e.verdict()}")
        return EXIT_DIVERGENCE
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a backend crashed mid-run: an ERROR verdict, never its code
        what = f"SystemExit({e.code!r}) (sys.exit called)" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        doc = {"a": a, "b": b, "model": str(model), "verdict": "error", "exit_code": EXIT_DIVERGENCE,
               "error": f"a backend raised while the KL harness ran: {what}", "traceback": tb}
        files = {out: (json.dumps(doc, indent=1) + "\n").encode()} if out is not None else {}
        if files:
            publish_files(files)
        if fmt == "json" or to_stdout:
            print(json.dumps(doc, indent=1))
        else:
            print(f"qwen4exp kl: b={b} vs a={a} ({model})\n  verdict: ERROR -- {doc['error']}")
        if getattr(args, "traceback", False):
            print(tb, file=sys.stderr, end="")
        else:
            print("qwen4exp kl: --traceback prints the backend's stack trace", file=sys.stderr)
        return EXIT_DIVERGENCE
    from parity.harness.run import _current_spelling
    rep.a, rep.b = _current_spelling(rep.a), _current_spelling(rep.b)  # a deprecated alias's name: the current one
    text = dumps(rep)
    files = {}
    if out is not None:
        files[out] = (text + "\n").encode()
    if plot is not None:
        files[plot] = plot_png(rep)
    if files:
        publish_files(files)
    if to_stdout or fmt == "json":
        print(text)
    else:
        print(render_kl(rep))
    return rep.exit_code
