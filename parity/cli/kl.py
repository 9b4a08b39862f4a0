"""``qwen4exp kl``: per-position logit KL between two backends, with the three controls in the same run.

    qwen4exp kl [MODEL] --a reference --b engine-cpu [--prompts FILE] [--json] [--plot FILE.png]

Exit codes: 0 b agrees with a and every control passed; 1 b disagrees or a control failed; 2 bad input.
"""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    """Add the ``kl`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser(
        "kl", help="logit-KL harness: backend b against backend a, with determinism/precision/negative controls",
        description="Per-position KL(P_a||P_b) and KL(P_b||P_a) over a prompt set (mean, median, p90, p99, p99.9, "
                    "max), top-1 agreement, top-5 overlap, RMS/max probability difference of a's top token and "
                    "greedy continuation agreement. Controls computed in the same run: determinism (b twice, "
                    "bitwise), precision floor (reference float32 vs float64), negative control (b with one weight "
                    "perturbed must be flagged). A failed control makes the exit code 1.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory or bundled fixture (default: tiny)")
    p.add_argument("--a", default="reference", metavar="BACKEND", help="backend a (default: reference)")
    p.add_argument("--b", default="engine", metavar="BACKEND",
                   help="backend b: reference, reference-f64, engine, engine-cpu, engine-cuda or module:Class "
                        "(default: engine)")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="JSON list of texts or token-id lists (default: the bundled set)")
    p.add_argument("--greedy-tokens", type=int, default=8, metavar="N",
                   help="greedy continuation length compared (default 8; 0 disables)")
    p.add_argument("--perturb", metavar="TENSOR", default=None,
                   help="tensor perturbed for the negative control (default: layer 0's attention output projection)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a KL histogram and per-position KL plot (needs matplotlib: pip install -e '.[plot]')")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def default_perturb_target(config) -> str:
    """The tensor the negative control perturbs by default: layer 0's mixer output projection."""
    return ("layers.0.linear_attn.out_proj.weight" if config.layer_types[0] == "linear_attention"
            else "layers.0.self_attn.o_proj.weight")


def perturbation(seed: int = 0):
    """``w -> w + rms(w) * N(0, 1)`` (seeded): a clearly wrong tensor of the right shape and scale."""
    import numpy as np

    def fn(w):
        rng = np.random.default_rng(seed)
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) or 1.0
        return (w + rms * rng.standard_normal(w.shape)).astype(np.float32)
    return fn


def run_kl_command(model_path, a_spec: str, b_spec: str, prompts, *, greedy_tokens=8, perturb_name=None,
                   progress=True, flags=("--a", "--b")):
    """Open the backends, run :func:`parity.harness.kl.run_kl` with all three controls. Returns the KLReport.

    The negative control perturbs b itself when b supports ``perturb`` (see Backend.capabilities), else
    the reference (noted in the report: it then proves the harness, not b's loader, flags a bad weight).
    ``flags``: the options of a and b named in error messages.
    """
    from parity.backends import capabilities_of, open_backend
    from parity.harness.kl import run_kl

    a = open_backend(a_spec, model_path, flag=flags[0])
    b = a if b_spec == a_spec else open_backend(b_spec, model_path, flag=flags[1])
    r32 = a if a_spec == "reference" else open_backend("reference", model_path)
    r64 = open_backend("reference-f64", model_path)
    name = perturb_name or default_perturb_target(b.config)
    target = b_spec if capabilities_of(b).get("perturb") else "reference"
    note = f"{target} with {name} perturbed (+ rms * N(0,1))"

    def perturbed():
        return open_backend(target, model_path, perturb=(name, perturbation()))
    rep = run_kl(a, b, prompts, model=str(model_path), greedy_tokens=greedy_tokens, floor_pair=(r32, r64),
                 perturbed_b=perturbed, perturbed_note=note, progress=progress)
    rep.backend = b  # the instance that ran (and holds the history of) every prompt: locating replays on it
    return rep


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
    if rep.greedy:
        ag = [g["agree"] for g in rep.greedy]
        n = len(rep.greedy[0]["a"])
        lines.append(f"  greedy agreement (of {n}): " + " ".join(str(x) for x in ag))
    lines.append(f"  verdict b: {'PASS' if rep.passed else 'FAIL'} ({rep.reason})")
    lines.append("  controls:")
    for k, c in rep.controls.items():
        lines.append(f"    {k:17s} {'ok  ' if c.get('ok') else 'FAIL'}  {c.get('detail', '')}")
    if not rep.controls_ok:
        lines.append("  CONTROLS FAILED: this report cannot be trusted")
    lines.append(f"  exit {rep.exit_code}  ({rep.seconds:.1f}s)")
    return "\n".join(lines)


def write_plot(rep, path) -> None:
    """KL histogram + per-position KL (matplotlib). Raises InputError when matplotlib is missing."""
    from reference.errors import InputError
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot: expected matplotlib to be installed (pip install -e '.[plot]'), found it missing")
    import numpy as np
    kl = np.asarray(rep.comparison.kl_ab)
    fig, (h, line) = plt.subplots(1, 2, figsize=(11, 3.5))
    pos = np.maximum(kl, 1e-30)
    h.hist(np.log10(pos), bins=40)
    h.set_xlabel("log10 KL(a||b)")
    h.set_ylabel("positions")
    line.plot(pos, lw=0.8)  # floored at 1e-30 so exact agreement still plots on the log axis
    line.set_yscale("log")
    line.set_xlabel("position (prompts concatenated)")
    line.set_ylabel("KL(a||b) (floor 1e-30)")
    fig.suptitle(f"{rep.b} vs {rep.a}")
    fig.tight_layout()
    from reference.atomic import atomic_open
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)


def run(args) -> int:
    """Run ``qwen4exp kl``: the logit-KL harness of backend b against a over the prompt set, printed
    as a table or JSON (optionally plotted). Returns the report's exit code (0 pass, 1 fail or a failed control).

    Raises:
        InputError: an unknown backend, ``--greedy-tokens < 0``, or ``--plot`` without matplotlib.
    """
    from parity.harness.kl import dumps
    from parity.prompts import load_prompts
    from reference.config import load_config
    from reference.paths import resolve_model

    from reference.errors import InputError
    model = resolve_model(args.model)
    from parity.backends import backend_class
    backend_class(args.a, "--a")  # an unknown name is reported against the option that gave it
    backend_class(args.b, "--b")
    if args.greedy_tokens < 0:
        raise InputError(f"--greedy-tokens: expected an integer >= 0 (0 disables), found {args.greedy_tokens}")
    if args.plot:
        from reference.atomic import check_output_path
        check_output_path(args.plot, "file", overwrite=True, flag="--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from reference.errors import InputError
            raise InputError("--plot: expected matplotlib to be installed (pip install -e '.[plot]'), found it missing")
    cfg = load_config(model)
    prompts = load_prompts(args.prompts, model, cfg.vocab_size)
    rep = run_kl_command(model, args.a, args.b, prompts, greedy_tokens=args.greedy_tokens,
                         perturb_name=args.perturb, progress=not args.no_progress and sys.stderr.isatty())
    if args.plot:
        write_plot(rep, args.plot)
    print(dumps(rep) if args.json else render_kl(rep))
    return rep.exit_code
