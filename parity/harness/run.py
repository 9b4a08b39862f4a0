"""The jobs behind ``qwen4exp parity`` and ``qwen4exp kl``: the KL harness with its three controls
(:func:`run_kl_command`), the KL harness as one verdict-table row (:func:`kl_row`) and the whole parity run
(:func:`run_parity`: KL harness + scenario suites -> :class:`parity.harness.report.ParityReport`)."""
from __future__ import annotations

import contextlib
import sys
import time
import traceback


#: greedy tokens of the KL harness (parity.harness.kl.run_kl's default, the continuation ``qwen4exp parity`` judges)
KL_GREEDY_TOKENS = 8


def default_perturb_target(config) -> str:
    """The tensor the negative control perturbs by default: layer 0's mixer output projection."""
    return ("layers.0.linear_attn.out_proj.weight" if config.layer_types[0] == "linear_attention"
            else "layers.0.self_attn.o_proj.weight")


def perturbation(seed: int = 0, scale: float = 1.0):
    """``w -> w + scale * rms(w) * N(0, 1)`` (seeded): a wrong tensor of the right shape; ``scale`` sizes it
    (the harness sizes the negative control from the floor, parity.harness.kl.negative_control)."""
    import numpy as np

    def fn(w):
        rng = np.random.default_rng(seed)
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) or 1.0
        return (w + scale * rms * rng.standard_normal(w.shape)).astype(np.float32)
    return fn


def run_kl_command(model_path, a_spec: str, b_spec: str, prompts, *, greedy_tokens=KL_GREEDY_TOKENS, perturb_name=None,
                   progress=True, flags=("--a", "--b"), floor=None, thresholds=None, shared=None):
    """Open the backends, run :func:`parity.harness.kl.run_kl` with all three controls. Returns the KLReport.

    The negative control perturbs b itself when b supports ``perturb`` (see Backend.capabilities) and exposes its
    reference model (so its selections can be forced to the truth's picks: the control's effect is then
    continuous, never a selection flip), else the reference (noted in the report: it then proves the harness,
    not b's loader, flags a bad weight); it is sized from the floor (parity.harness.kl.negative_control). ``flags``: the options of a and b named in error
    messages; ``floor`` / ``thresholds``: the run's measured floor and thresholds (None: measured by the
    harness on the prompts). ``shared``: the :class:`SharedTruth` of a run judging several backends (its truth
    backend is a, ``a_spec`` must be "reference"; the truth's forwards and a control perturbing the reference are
    shared through its :class:`parity.harness.kl.KLTruth`); None: a opened here.
    """
    from parity.backends import capabilities_of, open_backend
    from parity.harness.kl import run_kl

    if shared is not None:
        a = shared.kl_reference()
        b = open_backend(b_spec, model_path, flag=flags[1])
        r32, r64 = a, None
    else:
        a = open_backend(a_spec, model_path, flag=flags[0])
        b = a if b_spec == a_spec else open_backend(b_spec, model_path, flag=flags[1])
        r32 = a if a_spec == "reference" else open_backend("reference", model_path)
        r64 = open_backend("reference:dtype=float64", model_path)
    name = perturb_name or default_perturb_target(b.config)
    # the control's selections are forced to the truth's picks (a continuous effect, not a selection flip): that
    # needs the perturbed backend's reference model; b is perturbed itself only when it has one
    forceable = hasattr(getattr(b, "model", None), "selection_hook")
    target = b_spec if capabilities_of(b).get("perturb") and forceable else "reference"
    note = base_note = f"{target} with {name} perturbed (+ rms * N(0,1))"
    if target != b_spec and capabilities_of(b).get("perturb"):
        note += f" (not {b_spec}: its selections cannot be forced to the truth's)"

    def perturbed(scale=1.0):
        return open_backend(target, model_path, perturb=(name, perturbation(scale=scale)))
    if floor is None and r64 is None:
        r64 = open_backend("reference:dtype=float64", model_path)
    rep = run_kl(a, b, prompts, model=str(model_path), greedy_tokens=greedy_tokens, floor_pair=(r32, r64),
                 perturbed_b=perturbed, perturbed_note=note, progress=progress, floor=floor, thresholds=thresholds,
                 control_weights=r32.model.weights if target == "reference" else None,
                 control_note=base_note, kl_truth=shared.kl_truth if shared is not None else None)
    rep.backend = b  # the instance that ran (and holds the history of) every prompt: locating replays on it
    return rep


def topk_report(report, be, model, prompts, scenarios=None, *, below_bound=False, progress=False):
    """``qwen4exp parity`` of an OpenAI-compatible server: one kl-topk row (see parity.backends.openai and
    parity.harness.topk) judged by the thresholds of the floor measured on this model and prompts
    (parity.harness.floor.thresholds_for_run, as every other row); the scenarios need sequences the API does
    not expose, so each one asked for is a skipped row with that reason (a skip never counts as a pass: the
    kl-topk row carries the verdict). A row that compared nothing, or whose top-k mass cannot resolve a useful
    fault, is INCONCLUSIVE with counts 0/0 (nothing vouched for).

    ``scenarios``: the names asked for (None: all); the kl-topk row runs when ``kl`` is among them.
    ``below_bound``: the prompts and the continuation confined below the QSA bound (:func:`confine_kl_prompts`,
    as the kl row of a sequence backend; the floor stays the one measured on the whole prompts).
    ``progress``: a line on stderr while the floor is measured (the run's first long step)."""
    from parity.backends import truth_model
    from parity.harness.floor import thresholds_for_run
    from parity.harness.report import ScenarioRow
    from parity.harness.scenarios import SCENARIOS
    from parity.harness.topk import GREEDY_TOKENS, run_topk
    from parity.prompts import load_prompts
    from parity.harness.kl import USEFUL_FAULT_REL
    names = ["kl", *SCENARIOS] if scenarios is None else [n.replace("-", "_") for n in scenarios]
    t0 = time.perf_counter()
    ps = load_prompts(prompts, model, be.config.vocab_size, be.config.max_position_embeddings)
    truth = truth_model(model)
    if progress:
        print("parity: measuring this model's precision floor (the limits every row is judged by)",
              file=sys.stderr, flush=True)
    th, floor, _ = thresholds_for_run(truth.weights, be, ps)
    if progress:
        print(f"parity: floor ready in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    report.meta.update(thresholds=th.to_json(), floor=floor.to_json(), smallest_fault_rel=th.tol_rel,
                       useful_fault_rel=USEFUL_FAULT_REL)
    limits = th.to_json()
    n_new, confined = GREEDY_TOKENS, None
    if below_bound:
        ps, n_new, confined = confine_kl_prompts(be.config, ps, n_new)
    if "kl" not in names:
        res = None
    else:
        try:
            res = run_topk(be, truth, ps, n_new=n_new, thresholds=th)
        except Exception as e:  # noqa: BLE001 - the server raised: an ERROR row, as for any backend
            report.rows.append(ScenarioRow("kl-topk", 1, 1, float("nan"), float("nan"), f"backend raised "
                                           f"{type(e).__name__}: {e}", time.perf_counter() - t0, "error", str(e),
                                           thresholds=limits, traceback=_format_tb(e)))
            res = None
    if res is not None:
        row = _topk_row(res, be, th, limits, t0)
        if confined:
            row.detail += "; " + confined
        report.rows.append(row)
    report.meta["openai"] = {"convention": be.convention, "requests": be.requests}
    for name in (n for n in SCENARIOS if n in names):
        report.rows.append(ScenarioRow(name.replace("_", "-"), 0, 0, float("nan"), float("nan"), None, 0.0, "skip",
                                       "skipped: needs sequences (snapshot/rollback/decode) an OpenAI server does "
                                       "not expose", skipped=1))
    return report



def _topk_row(res: dict, be, th, limits: dict, t0: float):
    """The kl-topk :class:`ScenarioRow` of a :func:`parity.harness.topk.run_topk` result ``res``."""
    from parity.harness.report import ScenarioRow
    status = res["status"]
    f = res["first"]
    if f is not None and f.get("echo"):   # an echo record has no KL bound: the server's rows cannot be attributed
        first = (f"prompt {f['prompt']} ({f['pattern']}): the server's echo drops or moves the token at position "
                 f"{f['position']}, so its rows from there cannot be attributed (a server defect)")
    elif f is not None:
        first = (f"prompt {f['prompt']} ({f['pattern']}): first divergent position {f['position']} "
                 f"({'greedy continuation' if f['greedy_region'] else 'prompt'}; KL on the top-{be.topk} "
                 f"{f['kl']:.3g} (limit {f['bound']:.3g}), top-1 {'same' if f['top1'] else 'differs'})")
    else:
        first = None
    if status == "inconclusive":
        first = res["inconclusive"]
    detail = (f"top-{be.topk} KL (+1 tail bucket: a lower bound of the full KL) <= (tol x scale + the server's "
              f"{getattr(be, 'precision', 'float32')} logprob rounding)^2 per position (tol {th.tol_rel:.3g}); worst KL / limit "
              f"{res['worst_kl_over_bound']:.3g}; smallest fault resolved at every position "
              f"{res['resolution_rel']:.3g} of the logit scale (least truth mass on the top-k "
              f"{res['min_mass_truth']:.3g}); "
              f"max server tail mass {res['max_tail_server']:.3g}; server row convention: {res['convention']}; "
              f"{res['requests']} requests ({', '.join(f'{k} x{v}' for k, v in res['patterns'].items())}); "
              f"{res['skipped_unsendable']} prompts not sendable"
              + (f"; echo misaligned in {len(res['echo_misaligned'])} request(s): "
                 + ", ".join(f"prompt {m['prompt']} at position {m['position']}" for m in res['echo_misaligned'])
                 if res["echo_misaligned"] else ""))
    prec = getattr(be, "precision", "float32")
    if status == "fail" and prec == "float32":   # one thing to rule out before blaming the graph
        detail += ("; the limit is float32's: if the server stores its KV cache or activations in f16/bf16 "
                   "(llama.cpp's default KV cache is f16), that rounding alone can exceed it -- rule it out with a "
                   "float32 cache (llama_cpp.server: --type_k 0 --type_v 0) or judge the server at its precision "
                   "(precision=fp16); a FAIL that stays with a float32 cache is not that rounding")
    elif prec != "float32":
        detail += f"; judged at precision {prec} (every activation store rounded to {prec} in the floor)"
    # one case per judged prompt, as the other kl paths count them (a prompt fails when any of its request
    # patterns does); an inconclusive row vouches for no prompt: 0/0
    cases = 0 if status == "inconclusive" else res["prompts"]
    n_bad = len(res["failed_prompts"]) if status == "fail" else 0
    fail = {**res, "label": f"kl-topk/prompt {f['prompt']}" if f is not None else "kl-topk",
            "advice": ("a server exposes no tensor taps: to locate the divergence, run the same engine in process "
                       "(e.g. --backend llama.cpp on the same GGUF) with --out DIR, then qwen4exp taps diff")}
    # no logit error: a server returns top-k logprobs, not logits ('-' in the table)
    return ScenarioRow("kl-topk", cases, n_bad, res["worst_kl"], None, first, time.perf_counter() - t0,
                       status, detail, failures=[fail] if status != "pass" else [], thresholds=limits)

class SharedTruth:
    """What every backend judged in one process on one model and prompt set shares: the truth model (the float32
    reference) and its :class:`parity.harness.scenarios.common.TruthCache` (the suites' truth forwards), the KL
    harness's truth backend over that same model and its :class:`parity.harness.kl.KLTruth` (the truth's
    forwards per prompt + continuation, its greedy continuations, the negative control when it perturbs the
    reference). Nothing in it depends on a backend under test: a backend's own results (its logits, tokens,
    verdicts) are never kept here, only the truth's, keyed by the token lists they were computed over.

    Built lazily: a run that needs no truth (self-consistency alone) never loads the reference.
    """

    def __init__(self, model):
        self.model = model
        self._truth = None
        self._a = None
        self._kl = None

    def truth(self):
        """The :class:`parity.harness.scenarios.common.TruthCache` of the float32 reference (built once)."""
        if self._truth is None:
            from parity.backends import truth_model
            from parity.harness.scenarios.common import TruthCache
            self._truth = TruthCache(truth_model(self.model))
        return self._truth

    def kl_reference(self):
        """The KL harness's truth backend: a :class:`parity.backends.ReferenceBackend` named ``reference`` over
        :meth:`truth`'s model (one set of weights and weight caches for both)."""
        if self._a is None:
            from parity.backends import ReferenceBackend
            self._a = ReferenceBackend(self.truth().model, "reference", self.model)
        return self._a

    @property
    def kl_truth(self):
        """The :class:`parity.harness.kl.KLTruth` of :meth:`kl_reference` (built once)."""
        if self._kl is None:
            from parity.harness.kl import KLTruth
            self._kl = KLTruth(self.kl_reference())
        return self._kl


def run_parity(model, backend_spec: str, scenarios: list[str], *, level="full", page_sizes=None, prompts=None,
               out_dir=None, progress=True, known=None, below_bound=False):
    """Run the KL harness and the scenarios; returns a :class:`parity.harness.report.ParityReport`.

    Every verdict uses thresholds from the floor measured once on this model (the KL prompts -- read whatever
    ``scenarios`` selects, so the thresholds do not depend on the selection -- plus a stream past the QSA bound,
    parity.harness.floor.thresholds_for_run); a tolerance too coarse for a useful fault makes passing rows
    'inconclusive'. ``known``: the ``--known`` baseline (:class:`parity.harness.causes.KnownCauses`, identity
    already checked); ``below_bound``: confine the scenarios and the kl row below the QSA bound
    (:func:`confine_kl_prompts`; parity.harness.causes). ``progress``: ``"bar"`` / True, ``"lines"`` (a plain line
    per finished case and every 10 s, for a stderr that is not a terminal) or a false value
    (:func:`parity.harness.progress.progress_bar`).

    An exception raised by the backend under test inside a case or the KL harness does not escape: it
    becomes an 'error' row / case (a failed case; the report's exit code is 1).

    Raises:
        BackendError / InputError: the backend cannot be opened, bad options or prompts (before anything runs).
    """
    return run_parity_many(model, [backend_spec], scenarios, level=level, page_sizes=page_sizes, prompts=prompts,
                           out_dirs=[out_dir], progress=progress, known=known, below_bound=below_bound)[0]


def run_parity_many(model, backend_specs: list[str], scenarios: list[str], *, level="full", page_sizes=None,
                    prompts=None, out_dirs=None, progress=True, known=None, below_bound=False, share=True):
    """:func:`run_parity` of several backends on one model and prompt set, in one process: one report per backend,
    in the order of ``backend_specs``, each exactly what :func:`run_parity` of that backend alone gives -- its own
    rows, thresholds (the floor of its own stores and precision), controls and failures -- while everything that
    depends on the truth alone is computed once (:class:`SharedTruth`): the truth model and the suites' truth
    forwards, the floors' float64 and float32-order forwards (parity.harness.floor.thresholds_for_runs: one rounded
    forward per distinct store set), the KL truth's forward per prompt + continuation (a backend with another
    continuation gets its own), the truth's greedy continuations and a negative control perturbing the reference.

    Args:
        backend_specs: ``--backend`` specs (at least one). Every backend is opened (probed) before anything runs.
        out_dirs: per backend, the folder of its tap archives (``taps/`` under it), or None.
        known: a ``--known`` baseline, for a single backend only.
        share: False judges each backend with truths of its own (as separate runs would; the forward-count tests'
            control).
    Returns:
        ``[ParityReport]``.
    Raises:
        BackendError / InputError: a backend cannot be opened, bad options or prompts; a top-k server backend
            (``topk_only``) among several (it shares nothing: judge it in a run of its own); ``known`` with
            several backends. Nothing runs then.
    """
    from parity.backends import capabilities_of, opener
    from parity.backends.base import capability_table
    from parity.backends.refusal import EngineRefused
    from parity.harness.report import ParityReport, ScenarioRow
    from reference.errors import InputError

    specs = [str(sp) for sp in backend_specs]
    if not specs:
        raise InputError("--backend: expected at least one backend, found none")
    if known is not None and len(specs) > 1:
        raise InputError("--known: a baseline is of one backend; expected one --backend with it, found "
                         f"{len(specs)}")
    out_dirs = list(out_dirs) if out_dirs is not None else [None] * len(specs)
    jobs = []   # per backend: (spec, opener, probe or None, report)
    for spec in specs:
        op = opener(spec, model)
        t_open = time.perf_counter()
        try:
            probe = op()  # fails here, clearly, when the backend cannot be opened
        except EngineRefused as e:  # the engine's defect on a valid checkpoint: verdict REFUSED, exit 1
            report = ParityReport(backend=backend_label(spec), model=str(model), meta={"refused": e.to_json()})
            # nothing was compared: no KL, no error figure ('-'); the offered re-parameterisation is in the cell
            report.rows.append(ScenarioRow("open", 1, 1, None, None, e.verdict(),
                                           time.perf_counter() - t_open, "refused", e.offer))
            jobs.append((spec, op, None, report))
            continue
        caps = capabilities_of(probe)
        cfg = probe.config
        report = ParityReport(backend=backend_label(spec), model=str(model),
                              meta={"config_hash": cfg.config_hash(), "precision": probe.precision, "level": level,
                                    # each operation's declaration (supported / limited with its limit / unsupported)
                                    "capabilities": {**{k: v for k, v in caps.items()}, **capability_table(probe)},
                                    **({"load": probe.load_note} if getattr(probe, "load_note", None) else {}),
                                    **({"conversion": probe.conversion} if hasattr(probe, "conversion") else {}),
                                    # what an outside engine leaves out of the checkpoint, located (never a silent
                                    # skip)
                                    **({"engine_findings": probe.findings} if getattr(probe, "findings", None)
                                       else {})})
        if caps.get("topk_only") and len(specs) > 1:
            raise InputError(f"--backend {spec}: a top-k server (OpenAI-compatible API) shares no truth with other "
                             f"backends (it is judged on top-k logprobs of text requests); expected it alone, found "
                             f"it among {len(specs)} --backend options: judge it in a run of its own")
        jobs.append((spec, op, probe, report))
    if len(jobs) == 1 and jobs[0][2] is not None and capabilities_of(jobs[0][2]).get("topk_only"):
        # an OpenAI-compatible server: top-k logprobs only, no sequences
        spec, op, probe, report = jobs[0]
        return [topk_report(report, probe, model, prompts, scenarios, below_bound=below_bound, progress=progress)]
    live = [j for j in jobs if j[2] is not None]
    for _, _, probe, _ in live:
        if hasattr(probe, "close"):
            probe.close()
    if not live:
        return [j[3] for j in jobs]
    cfg = live[0][2].config
    kl_prompts = None
    from parity.harness.scenarios import TRUTHLESS
    # the self-consistency suite needs no reference: a run of it alone never loads the truth
    needs_truth = any(s not in TRUTHLESS for s in scenarios)
    if "kl" in scenarios or needs_truth:
        # the KL prompt set is read whatever --scenario selects: the floor is measured on it (below), so the
        # thresholds are a function of the model, the backend's stores and the prompt set only, never of which
        # scenarios run. A bad --prompts file is an input error (exit 2), found before anything runs.
        from parity.prompts import load_prompts
        kl_prompts = load_prompts(prompts, model, cfg.vocab_size, cfg.max_position_embeddings)
    groups = [live] if share else [[j] for j in live]
    judged = {}
    for group in groups:
        shared = SharedTruth(model)
        truth = shared.truth() if needs_truth else None
        from parity.harness.scenarios.common import NonFiniteTruth, token_stream
        invalid = None
        if truth is not None:  # the truth must be finite before anything is judged against it (a NaN checkpoint is no
            try:               # verdict)
                truth.logits(kl_prompts[0] if kl_prompts else token_stream(cfg, min(8, cfg.max_position_embeddings),
                                                                           seed=0))
            except NonFiniteTruth as e:
                invalid = e
        ths = [(None, None, None)] * len(group)
        if truth is not None and invalid is None:
            from parity.harness.floor import thresholds_for_runs   # thresholds from the floor measured on this model
            tf = time.perf_counter()
            if progress:   # the floor is the run's first long step: a quiet log must still say what runs
                print("parity: measuring this model's precision floor (the limits every row is judged by)",
                      file=sys.stderr, flush=True)
            ths = thresholds_for_runs(truth.model.weights, [j[2] for j in group], kl_prompts)
            if progress:
                srcs = sorted({fl.source for _, fl, _ in ths if fl.source != "measured"})
                src = f" ({'; '.join(srcs)})" if srcs else ""
                print(f"parity: floor ready in {time.perf_counter() - tf:.0f}s{src}", file=sys.stderr, flush=True)
        for (spec, op, probe, report), (th, floor, coarse) in zip(group, ths):
            k = next(i for i, j in enumerate(jobs) if j[3] is report)
            if len(specs) > 1 and progress:
                print(f"parity: backend {k + 1} of {len(specs)}: {backend_label(spec)}", file=sys.stderr, flush=True)
            _judge_backend(report, model, spec, op, probe, scenarios, shared, truth, invalid, th, floor, coarse,
                           kl_prompts, level=level, page_sizes=page_sizes,
                           out_dir=out_dirs[k], progress=progress, known=known, below_bound=below_bound)
            judged[k] = report
    return [judged.get(i, j[3]) for i, j in enumerate(jobs)]


def _judge_backend(report, model, backend_spec, op, probe, scenarios, shared, truth, invalid, th, floor, coarse,
                   kl_prompts, *, level, page_sizes, out_dir, progress, known, below_bound):
    """Fill ``report`` with the rows of one backend (:func:`run_parity_many`): the kl row and the suites, judged
    by its own thresholds ``th`` (None: the nominal ones of its precision, when no floor was measured) against
    ``shared``'s truth."""
    from pathlib import Path

    from parity.backends import capabilities_of
    from parity.harness.report import ScenarioRow
    from parity.harness.scenarios import page_sizes_unused, run_scenario, summarize_results
    from parity.harness.scenarios.common import NonFiniteTruth
    from reference.errors import UserError
    caps = capabilities_of(probe)
    cfg = probe.config
    if th is not None:
        from parity.harness.kl import USEFUL_FAULT_REL
        # the resolution: a fault moving some logit by more than the limit (relative to the logit scale) FAILs
        report.meta.update(thresholds=th.to_json(), floor=floor.to_json(), smallest_fault_rel=th.tol_rel,
                           useful_fault_rel=USEFUL_FAULT_REL)
    else:
        from parity.harness.kl import thresholds_for
        th = thresholds_for(report.meta["precision"])
    limits = th.to_json()   # what every row (and every scenario operation) is judged by
    archive_dir = Path(out_dir) / "taps" if out_dir else None
    from parity.harness.scenarios import count_run_cases
    # the verdict table's cases: the kl row one per prompt (its harness counts each on this bar)
    total = count_run_cases(scenarios, cfg, caps, page_sizes, level, kl_prompts=len(kl_prompts or ()))
    from parity.harness.progress import SubProgress, progress_bar
    bar = progress_bar(total, "parity", progress if invalid is None else None)
    try:
        for name in scenarios:
            t0 = time.perf_counter()
            if invalid is not None:
                report.rows.append(_inconclusive_row(name, invalid, limits))
                continue
            if name == "kl":
                bar.set_postfix_str("kl")
                sub = SubProgress(bar, "kl")
                try:
                    report.rows.append(kl_row(model, backend_spec, kl_prompts, sub, t0, truth=truth,
                                              archive_dir=archive_dir, floor=floor, known=known, thresholds=th,
                                              below_bound=below_bound, shared=shared))
                except (Exception, SystemExit, KeyboardInterrupt) as e:  # the backend raised (or exited) in the KL
                    # harness: an ERROR row (the backend was opened and the prompts read before this point: nothing
                    # here is bad input); only a KeyboardInterrupt behind which a signal was received stops the run
                    if _real_interrupt(e):
                        raise
                    from parity.backends.base import BackendOutputError
                    msg = str(e) if isinstance(e, BackendOutputError) else f"backend raised {_exc_name(e)}"
                    report.rows.append(ScenarioRow("kl", len(kl_prompts), len(kl_prompts), float("nan"),
                                                   float("nan"), f"KL harness: {msg}", time.perf_counter() - t0,
                                                   "error", msg, traceback=_format_tb(e), thresholds=limits))
                bar.update(len(kl_prompts) - sub.n)  # the prompts not counted when the harness raised
                continue
            try:
                res = run_scenario(name, op, truth, page_sizes=page_sizes, archive_dir=archive_dir, progress=bar,
                                   level=level, thresholds=th, below_bound=below_bound, known=known)
                report.rows.append(summarize_results(name, res, time.perf_counter() - t0, inconclusive=coarse))
                unused = page_sizes_unused(caps, page_sizes)
                if unused:  # said under the table, not silently dropped
                    report.rows[-1].skips.append({"case": "*", "narrowed": unused})
            except NonFiniteTruth as e:  # the truth went NaN/Inf at some history: nothing to judge against
                invalid = e
                report.rows.append(_inconclusive_row(name, e, limits))
            except UserError:
                raise  # a backend that cannot be opened (at a page size) / bad options: exit 2
            except (Exception, SystemExit, KeyboardInterrupt) as e:  # a scenario that cannot run at all is an ERROR
                # row, not a crash; a KeyboardInterrupt stops the run only when a signal was received
                if _real_interrupt(e):
                    raise
                report.rows.append(ScenarioRow(name.replace("_", "-"), 0, 0, float("nan"), float("nan"), None,
                                               time.perf_counter() - t0, "error", _exc_name(e),
                                               traceback=_format_tb(e)))
            row = report.rows[-1]
            if not row.thresholds:
                row.thresholds = limits
    finally:
        bar.close()
    return report


def confine_kl_prompts(config, prompts, greedy_tokens: int = KL_GREEDY_TOKENS):
    """The KL prompts and greedy length confined below the QSA bound (``--below-bound``), as the scenarios are.

    A prompt of T tokens with g greedy tokens is judged at positions 0..T+g-2 (its prefill rows, then g - 1
    decode() / decode_greedy rows), i.e. the last one sees T + g - 1 tokens; confined, that is at most
    ``bound = indexer_budget + indexer_compress_ratio - 1`` visible tokens
    (:func:`parity.harness.scenarios.common.sizes`). The continuation keeps at most half the bound (rounded up)
    so the prompt keeps the other half: ``g' = min(g, ceil(bound / 2))``, each prompt cut to its first
    ``bound - g' + 1`` tokens (shorter prompts unchanged). A model without QSA has no bound: nothing changes.

    Args:
        config: the model's :class:`reference.config.ModelConfig`.
        prompts: token-id lists.
    Returns:
        ``(prompts, greedy_tokens, note)``: ``note`` says what was cut (None when nothing was).
    """
    from parity.harness.scenarios.common import sizes
    sz = sizes(config)
    if not sz.has_qsa:
        return [list(p) for p in prompts], greedy_tokens, None
    g = min(greedy_tokens, (sz.bound + 1) // 2)
    keep = sz.bound - max(g - 1, 0)
    out = [list(p)[:keep] for p in prompts]
    note = (f"confined below the QSA bound (--below-bound): prompts cut to at most {keep} tokens, {g} greedy "
            f"tokens: positions 0..{sz.bound - 1} at most ({sz.bound} visible tokens)")
    return out, g, note


def kl_row(model, backend_spec, prompts, progress, t0, truth=None, archive_dir=None, floor=None, known=None,
           thresholds=None, below_bound=False, shared=None):
    """The KL harness as one verdict-table row; a failing comparison is located: a decode failure through a
    replay of that prompt's prefill + greedy decode (:func:`parity.harness.kl.decode_case`: tap-diff and the
    search through the state), a prefill failure by tap-diff of the worst prompt's one-shot logits.

    ``prompts``: token-id lists (already loaded), or a prompt file / None (the bundled set). The row's
    failed cases are the report's ``failed_prompts`` (prefill or decode rows, or a pick outside a tie set).
    ``floor`` / ``thresholds``: the run's; ``known``: the ``--known`` baseline; ``below_bound``: judge only
    positions below the QSA bound (:func:`confine_kl_prompts`: the prompts and the continuation are cut; the floor
    and thresholds stay those measured on the whole prompts). ``shared``: the run's :class:`SharedTruth` (the
    truth's forwards and a control perturbing the reference shared with the other backends of the run; None: a
    run of its own).
    """
    import dataclasses

    import numpy as np

    from parity.backends import open_backend
    from parity.harness.causes import root_cause
    from parity.harness.kl import LogitComparison, verdict
    from parity.harness.report import ScenarioRow

    if prompts is None or isinstance(prompts, (str, bytes)) or hasattr(prompts, "__fspath__"):
        from parity.prompts import load_prompts
        from reference.config import load_config
        mc = load_config(model)
        prompts = load_prompts(prompts, model, mc.vocab_size, mc.max_position_embeddings)
    greedy_tokens, confined = KL_GREEDY_TOKENS, None
    if below_bound:
        from reference.config import load_config
        prompts, greedy_tokens, confined = confine_kl_prompts(load_config(model), prompts, greedy_tokens)
    rep = run_kl_command(model, "reference", backend_spec, prompts, greedy_tokens=greedy_tokens, progress=progress,
                         flags=("reference", "--backend"), floor=floor, thresholds=thresholds, shared=shared)
    failed_controls = [k for k, c in rep.controls.items() if not c.get("ok")]
    status = rep.status.lower()
    detail = rep.reason + (f"; controls failed: {failed_controls}" if failed_controls else "")
    if confined:
        detail += "; " + confined
    det = rep.controls.get("determinism", {})
    if det.get("ok") and det.get("claimed") is False and det.get("prompts_differing"):
        detail += "; " + det["detail"]   # the allowed run-to-run noise, measured: reported, never silent
    both = np.maximum(rep.comparison.kl_ab, rep.comparison.kl_ba)
    bounds = np.cumsum([0] + rep.per_prompt_positions)
    per_prompt = [float(np.max(both[bounds[i]:bounds[i + 1]])) for i in range(len(prompts))]
    cmp_fields = [f.name for f in dataclasses.fields(LogitComparison)]
    prompt_ok = [verdict(LogitComparison(*[getattr(rep.comparison, f)[bounds[i]:bounds[i + 1]] for f in cmp_fields]),
                         rep.thresholds)[0] for i in range(len(prompts))]
    n_bad = len(rep.failed_prompts) if rep.failed_prompts else sum(1 for ok in prompt_ok if not ok)
    first, archives = None, []
    if not rep.passed:
        # the worst prompt among those failing (KL, top-1, decode rows or a tie pick), else the worst KL overall
        cand = rep.failed_prompts or [i for i, ok in enumerate(prompt_ok) if not ok] or list(range(len(prompts)))
        worst = max(cand, key=lambda i: np.nan_to_num(per_prompt[i], nan=np.inf))
        gen_only = getattr(rep, "generation_failed", None) or []
        if worst in gen_only:   # its prefill and decode rows agree: located at the generation operation itself
            from parity.harness.kl import generation_fault_text
            f = next(f for f in rep.generation["faults"] if f["prompt"] == worst)
            first = generation_fault_text(f)
        elif truth is not None and worst in rep.decode_failed and rep.greedy:   # located through the decode path
            from parity.harness.kl import decode_case
            from parity.harness.scenarios.runner import run_case
            res = run_case("kl", decode_case(prompts[worst], rep.greedy[worst]["b"]), open_backend(backend_spec, model),
                           truth, thresholds=rep.thresholds, archive_dir=archive_dir)
            first, archives = f"prompt {worst} (decode): {res.divergence or res.failure}", res.archives
        elif truth is not None:
            from parity.harness.scenarios.locate import locate_one_shot
            # the SAME instance, after the same call history: state that leaks between requests shows (a freshly
            # opened backend would pass and report "all taps agree")
            be = getattr(rep, "backend", None) or open_backend(backend_spec, model)
            where, archives = locate_one_shot(be, truth.model, prompts[worst], archive_dir=archive_dir,
                                              thresholds=rep.thresholds)
            first = f"prompt {worst}: {where}"
        else:
            first = f"prompt {worst}: worst KL {per_prompt[worst]:.3g}"
        if rep.status == "INCONCLUSIVE":   # failing rows judged neither way: why comes first, then where they fail
            first = f"judged neither way: {rep.reason}; failing rows: {first}"
    elif failed_controls:
        first = "controls failed: " + "; ".join(rep.controls[k]["detail"] for k in failed_controls)
    doc = rep.to_json()
    doc["archives"] = archives
    doc["root_cause"] = root_cause(rep.reason, first, getattr(getattr(truth, "model", None), "config", None))
    doc["label"] = "kl"
    doc["fault"] = _kl_fault(rep, prompts) if status == "fail" else None
    rel = np.asarray(rep.comparison.rel_err(), dtype=np.float64)
    worst_rel = (float(np.max(np.where(np.isfinite(rel), rel, np.inf))) if rel.size else None)
    # the judged figure covers every row the verdict judged: prefill, decode and the generation path's rows
    others = [g.get("decode_max_logit_err_rel") for g in (rep.greedy or [])]
    others.append((rep.generation or {}).get("prefill_last_max_rel"))
    others = [float(x) for x in others if x is not None]
    vals = ([worst_rel] if worst_rel is not None else []) + others
    worst_rel = max(vals) if vals else None
    doc["worst_logit_err_rel"] = worst_rel
    if status == "fail" and known is not None:   # the same cause at the same places, no larger, no new top-1 flip
        ok, why = known.judge(doc["root_cause"], doc["fault"], rep.thresholds.tol_rel)
        if ok:
            doc["known"], status = True, "pass"
            detail = f"failing only through a known root cause ({doc['root_cause']['id']}); " + detail
        else:
            doc["known_note"] = why
            detail += f" (not excused by --known: {why})"
    tie_eq = (rep.ties or {}).get("tie_equivalent_positions", 0)
    n_known = max(n_bad, 1) if doc.get("known") else 0   # the excused prompts (as a suite's excused cases)
    tie_at = [{"case": f"kl/prompt {t['prompt']}", "op": None, "seq": None, "positions": list(t["positions"])}
              for t in (rep.ties or {}).get("tie_equivalent", []) if t["positions"]]
    return ScenarioRow("kl", len(prompts), 0 if n_known else n_bad, rep.comparison.worst_kl(),
                       rep.comparison.summary()["max_logit_err"],
                       first, time.perf_counter() - t0, status, detail, worst_logit_err_rel=worst_rel,
                       failures=[doc] if (status != "pass" or doc.get("known")) else [],
                       known=n_known, tie_equivalent=tie_eq, tie_equivalent_at=tie_at,
                       thresholds=rep.thresholds.to_json(),
                       # a narrowing is never silent: listed under the table as the suites' are
                       skips=[{"case": "kl", "narrowed": confined}] if confined else [])


def backend_label(spec) -> str:
    """The backend as the report names it: the whole ``--backend`` spec, options included, in its current
    spelling (``llama.cpp:reparam=auto`` stays that, ``engine-cpu`` -> ``engine:device=cpu``), so that
    re-running with it reproduces the verdict; a spec the grammar does not parse is shown as given."""
    from parity.backends import parse_backend_spec
    try:
        return str(parse_backend_spec(spec))
    except Exception:  # noqa: BLE001 - shown as it is
        return str(spec)


def _kl_fault(rep, prompts) -> dict:
    """The KL row's fault (:func:`parity.harness.causes.fault_of`) over every prompt: prefill rows at
    ``"prompt I position P"``, decode rows at the position they predict from (``len(prompt) + step``)."""
    import numpy as np

    from parity.harness.causes import fault_of
    n = len(prompts)
    sizes = rep.per_prompt_positions
    bounds = np.cumsum([0] + list(sizes))
    # decode blocks follow the prefill blocks, one per prompt whose greedy run returned rows (kl.run_kl)
    with_decode = [g["prompt"] for g in rep.greedy if "decode_faults" in g]
    out = {}
    for k in range(len(sizes)):
        i, off = (k, 0) if k < n else (with_decode[k - n], len(prompts[with_decode[k - n]]))
        out.update(fault_of(rep.comparison.select(slice(int(bounds[k]), int(bounds[k + 1]))), rep.thresholds,
                            offset=off, prefix=f"prompt {i} "))
    return out


def _current_spelling(name: str) -> str:
    """A backend's name in the current --backend grammar (``engine-cpu`` -> ``engine:device=cpu``)."""
    from parity.backends import parse_backend_spec
    try:
        sp = parse_backend_spec(name)
    except Exception:  # noqa: BLE001 - an outside backend's free-form name is shown as it is
        return name
    return str(sp) if sp.alias else name


def _inconclusive_row(name: str, e, limits):
    """A verdict-table row for a scenario that could not be judged because the truth is not finite."""
    from parity.harness.report import ScenarioRow
    return ScenarioRow(name.replace("_", "-"), 0, 0, float("nan"), float("nan"),
                       f"reference (truth) logits not finite at position {e.position}", 0.0, "inconclusive", str(e),
                       thresholds=limits)


def _real_interrupt(e: BaseException) -> bool:
    """True for a KeyboardInterrupt (or the CLI's Terminated) behind which SIGINT / SIGTERM / SIGHUP was really
    received (:func:`reference.atomic.real_interrupt`): the run stops (exit 128 + N). A KeyboardInterrupt the
    backend's code raised with no signal behind it is the backend raising: an ERROR row, exit 1."""
    if not isinstance(e, KeyboardInterrupt):
        return False
    from reference.atomic import real_interrupt
    return getattr(e, "signum", None) is not None or real_interrupt()


def _exc_name(e: BaseException) -> str:
    """``Type: message`` of an exception; ``SystemExit(code)`` for a backend that called sys.exit(); a
    KeyboardInterrupt with no signal behind it says so."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) (the backend called sys.exit)"
    if isinstance(e, KeyboardInterrupt):
        from parity.backends.base import describe_exception
        return f"{describe_exception(e)} (raised by the backend, no signal was received)"
    return f"{type(e).__name__}: {e}"


def _format_tb(e: BaseException) -> str:
    """The full stack trace of ``e`` (kept in report.json, printed with ``--traceback``)."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def unwritten_archives(doc) -> list[str]:
    """The reasons recorded in a report document where failing cases' tap archives could not be written
    (``archives`` entries made by :func:`parity.harness.scenarios.locate.not_written`)."""
    from parity.harness.scenarios.locate import NOT_WRITTEN
    out = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "archives" and isinstance(v, list):
                    out.extend(a[len(NOT_WRITTEN):].removesuffix(")") for a in v
                               if isinstance(a, str) and a.startswith(NOT_WRITTEN))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return out


def remove_empty_dirs(root) -> None:
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
