"""Plan, run (one worker process per measurement), compare against the peer, check the goals, and
write/print the results.

Result JSON (``SCHEMA`` 1)::

    {"schema": 1, "created": ISO-8601, "host": {...}, "settings": {...},
     "checkpoints": {"reference": {...}, "engine": {...}},
     "runs": {"reference": {...}, "peer_cpu": {...}, "engine": {...}, "peer_gpu": {...}, "extras": {...}},
     "ratios": {name: value or null}, "goals": [{"goal", "measured", "target", "met"}]}

Each run is the worker's JSON (see :mod:`parity.bench.measure`); rates are
``{"median", "min", "max", "spread", "n"}``. Ratios compare measurements of the same run only.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA = 1

# the official eager GPU forward over one period of real-width layers, batch 1
GOALS = {"engine_b1_hbm_fraction": 0.40, "engine_b1_vs_peer": 5.0, "engine_b16_vs_b1": 6.0,
         "engine_host_syncs_in_step": 0, "reference_vs_peer_cpu": 1.0,
         # at full depth in each weight format: decode b1 / b16 bytes/s against the measured copy
         # bandwidth, prefill 4096 FLOP/s against the measured dense BF16 matmul rate
         "engine_full_b1_copy_fraction": 0.70, "engine_full_b16_copy_fraction": 0.75,
         "engine_full_prefill4096_matmul_fraction": 0.35}


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM (inside :func:`terminate_on_signals`): unwinds like Ctrl-C,
    so running workers are stopped and temp directories removed. ``signum`` gives the exit code 128+N."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def terminate_on_signals():
    """Turn SIGTERM (and SIGHUP) into :class:`Terminated` while the block runs (main thread only);
    SIGINT already raises KeyboardInterrupt. Previous handlers are restored afterwards."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from reference.atomic import note_signal, tracking_signals
    old = {}

    def handler(signum, frame):
        note_signal(signum)
        raise Terminated(signum)

    def on_sigint(signum, frame):  # as Python's default, but recorded: a raised KeyboardInterrupt is not Ctrl-C
        note_signal(signum)
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        old[signal.SIGINT] = signal.signal(signal.SIGINT, on_sigint)
    old_hook = sys.unraisablehook
    hook = _redeliver_swallowed(old_hook)
    sys.unraisablehook = hook
    try:
        with tracking_signals():
            yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if sys.unraisablehook is hook:
            sys.unraisablehook = old_hook


def _redeliver_swallowed(previous):
    """An unraisable hook for :func:`terminate_on_signals`: a signal's exception raised where it cannot propagate
    -- a ctypes callback (llvmlite's object-cache notify while Numba compiles) or a ``__del__`` -- is dropped
    there with an "Exception ignored" traceback and the command would run on (or fail later on the state the
    callback left). Instead the signal is sent to the main thread again once it has left this hook, so its
    handler raises in ordinary code; a later landing in such a place repeats this. Anything else goes to
    ``previous``."""
    import threading
    from reference.atomic import signal_delivered

    def hook(unraisable) -> None:
        e = unraisable.exc_value
        signum = getattr(e, "signum", None)
        if signum is None and isinstance(e, KeyboardInterrupt) and signal_delivered():
            signum = signal.SIGINT
        if signum is None:
            previous(unraisable)
            return
        threading.Thread(target=_send_when_left, args=(sys._getframe(), signum), daemon=True,
                         name="qwen4exp-redeliver-signal").start()
    return hook


def _send_when_left(frame, signum: int) -> None:
    """Wait until ``frame`` is off the main thread's stack, then send ``signum`` to the main thread (a thread-
    directed signal: held like any other while :func:`reference.atomic.signals_deferred` blocks it)."""
    import threading
    import time
    main = threading.main_thread().ident
    while True:
        f = sys._current_frames().get(main)
        if f is None:  # the main thread has ended
            return
        while f is not None and f is not frame:
            f = f.f_back
        if f is None:
            break
        time.sleep(0.001)
    del frame, f
    signal.pthread_kill(main, signum)


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after ``grace_s``) and reap it."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except (ProcessLookupError, KeyboardInterrupt):
        proc.kill()
        proc.wait()


def run_worker(spec: dict, timeout_s: float | None = None, quiet: bool = False) -> dict:
    """Run one measurement in a fresh ``python -m parity.bench.measure`` process; its last stdout line
    is the result. A crash, a non-JSON answer or a timeout becomes ``{"error": ...}``. An interrupt
    (Ctrl-C, or SIGTERM under :func:`terminate_on_signals`) stops the worker, removes its temp
    directory and propagates."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="qwen4exp-bench-") as td:
        partial = os.path.join(td, "partial.json")
        cmd = [sys.executable, "-m", "parity.bench.measure", json.dumps(dict(spec, partial_path=partial))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if quiet else None,
                                text=True, env=env, cwd=root)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            res = {"kind": spec.get("kind")}
            if os.path.exists(partial):  # keep what was measured before the limit
                with open(partial) as f:
                    res = json.load(f)
            res.update(error=f"timed out after {timeout_s:.0f} s (measurements up to then kept)", timed_out=True,
                       spec=spec)
            return res
        except BaseException:
            _stop(proc)
            raise
        lines = [ln for ln in (out or "").splitlines() if ln.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            return {"kind": spec.get("kind"), "error": f"worker exited {proc.returncode} without a result",
                    "spec": spec}


def _median(r, *path):
    x = r
    for k in path:
        if not isinstance(x, dict) or k not in x:
            return None
        x = x[k]
    return x.get("median") if isinstance(x, dict) else x


def _find(rows, **kw):
    for r in rows or []:
        if all(r.get(k) == v for k, v in kw.items()) and "skipped" not in r:
            return r
    return None


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def compare(runs: dict) -> tuple[dict, list]:
    """Ratios against the peer measured in the same run, and the issue-7 goals (met / not met / n/a)."""
    ratios, goals = {}, []
    ref, pc, eng, pg = (runs.get(k) or {} for k in ("reference", "peer_cpu", "engine", "peer_gpu"))
    if ref and pc and "unavailable" not in pc and "prefill_tokens_per_s" in ref and pc.get("decode"):
        pdec = _find(pc.get("decode"), batch=1)
        ppre = _find(pc.get("prefill"))
        ratios["reference_prefill_vs_peer_cpu"] = _ratio(_median(ref, "prefill_tokens_per_s"),
                                                         _median(ppre, "tokens_per_s"))
        ratios["reference_decode_vs_peer_cpu"] = _ratio(_median(ref, "decode_tokens_per_s"),
                                                        _median(pdec, "tokens_per_s"))
        ratios["reference_peak_rss_vs_peer_cpu"] = _ratio(ref.get("peak_rss_bytes"), pc.get("peak_rss_bytes"))
        g = ratios["reference_decode_vs_peer_cpu"]
        goals.append({"goal": "reference decode at least as fast as the official CPU forward",
                      "measured": g, "target": GOALS["reference_vs_peer_cpu"],
                      "met": None if g is None else g >= GOALS["reference_vs_peer_cpu"]})
    if eng and eng.get("decode") is not None:  # also a run cut short: its finished settings count
        dec = [r for r in eng.get("decode", []) if "skipped" not in r]
        b1 = [r for r in dec if r["batch"] == 1]
        if b1:
            f = max((r.get("hbm_fraction") or 0) for r in b1) if any("hbm_fraction" in r for r in b1) else None
            goals.append({"goal": "engine decode batch 1 >= 40% of the measured HBM roofline",
                          "measured": f, "target": GOALS["engine_b1_hbm_fraction"],
                          "met": None if f is None else f >= GOALS["engine_b1_hbm_fraction"]})
        fmt = eng.get("weights_format")
        if fmt:  # the full-depth goals: in-memory weights at full depth (projected rows flagged as such)
            tag = f"{fmt}, {'projected' if eng.get('fits') is False else 'measured'} at full depth"
            for B, key in ((1, "engine_full_b1_copy_fraction"), (16, "engine_full_b16_copy_fraction")):
                rows = [r for r in dec if r["batch"] == B and r.get("hbm_fraction") is not None]
                if rows:
                    f = max(r["hbm_fraction"] for r in rows)
                    goals.append({"goal": f"engine decode batch {B} >= {GOALS[key]:.0%} of the copy bandwidth ({tag})",
                                  "measured": f, "target": GOALS[key], "met": f >= GOALS[key]})
            p = _find(eng.get("prefill"), prompt_len=4096)
            if p and p.get("matmul_fraction") is not None:
                key = "engine_full_prefill4096_matmul_fraction"
                goals.append({"goal": f"engine prefill 4096 >= {GOALS[key]:.0%} of the dense BF16 matmul rate ({tag})",
                              "measured": p["matmul_fraction"], "target": GOALS[key],
                              "met": p["matmul_fraction"] >= GOALS[key]})
        for C in sorted({r["context"] for r in dec}):
            r1, r16 = _find(dec, batch=1, context=C), _find(dec, batch=16, context=C)
            if r1 and r16:
                x = _ratio(_median(r16, "tokens_per_s"), _median(r1, "tokens_per_s"))
                ratios[f"engine_b16_vs_b1_ctx{C}"] = x
                goals.append({"goal": f"engine batch 16 >= 6x batch 1 (context {C})", "measured": x,
                              "target": GOALS["engine_b16_vs_b1"], "met": x >= GOALS["engine_b16_vs_b1"]})
        syn = [r["host_syncs_per_step"] for r in dec if r.get("host_syncs_per_step") is not None]
        if syn and eng.get("device") == "cuda":  # on the CPU path nothing crosses a device boundary
            # the counter includes the one copy of the returned logits, which ends the step
            inside = max(syn) - 1
            goals.append({"goal": "zero host synchronisations inside a decode step (counter minus the logits copy)",
                          "measured": inside, "target": 0, "met": inside <= 0})
        if pg and "unavailable" not in pg and pg.get("decode") is not None:
            for r in dec:
                p = _find(pg.get("decode"), batch=r["batch"], context=r["context"])
                if p:
                    x = _ratio(_median(r, "tokens_per_s"), _median(p, "tokens_per_s"))
                    ratios[f"engine_decode_vs_peer_gpu_b{r['batch']}_ctx{r['context']}"] = x
                    if r["batch"] == 1:
                        goals.append({"goal": f"engine decode batch 1 >= 5x the official eager GPU forward "
                                              f"(context {r['context']})", "measured": x,
                                      "target": GOALS["engine_b1_vs_peer"], "met": x >= GOALS["engine_b1_vs_peer"]})
            for r in eng.get("prefill", []):
                p = _find(pg.get("prefill"), prompt_len=r["prompt_len"])
                if p and "skipped" not in r:
                    ratios[f"engine_prefill_vs_peer_gpu_{r['prompt_len']}"] = _ratio(
                        _median(r, "tokens_per_s"), _median(p, "tokens_per_s"))
    return ratios, goals


def host_info() -> dict:
    """This host's platform string, Python version, CPU count and processor name."""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def write_json_atomic(path: str | os.PathLike, obj: dict) -> Path:
    """Write ``obj`` as JSON to ``path`` through a temp file in the same directory and a rename
    (:func:`reference.atomic.atomic_write_json`: mode per umask)."""
    from reference.atomic import atomic_write_json
    return atomic_write_json(path, obj, indent=1, default=float)


def _fmt_rate(x) -> str:
    m = x.get("median") if isinstance(x, dict) else None
    if m is None:
        return "-"
    if x.get("range"):   # a projection: its range from the measurements' spreads (measure.project_periods)
        lo, hi = x["range"]
        return f"{m:,.1f} ({lo:,.1f}..{'unbounded' if hi is None else f'{hi:,.1f}'})"
    s = x.get("spread")
    return f"{m:,.1f}" + (f" ±{100 * s / 2:.0f}%" if s else "")


def ratio_label(key: str) -> str:
    """A ratio key of the results JSON (``engine_b16_vs_b1_ctx64``) in plain words for the table
    (``engine decode batch 16 / batch 1 tok/s, context 64``); an unknown key is returned as is."""
    import re
    fixed = {"reference_prefill_vs_peer_cpu": "reference prefill tok/s / official CPU",
             "reference_decode_vs_peer_cpu": "reference decode tok/s / official CPU",
             "reference_peak_rss_vs_peer_cpu": "reference peak memory (RSS) / official CPU"}
    if key in fixed:
        return fixed[key]
    m = re.fullmatch(r"engine_b16_vs_b1_ctx(\d+)", key)
    if m:
        return f"engine decode tok/s, batch 16 / batch 1 (context {m.group(1)})"
    m = re.fullmatch(r"engine_decode_vs_peer_gpu_b(\d+)_ctx(\d+)", key)
    if m:
        return f"engine decode tok/s / official GPU (batch {m.group(1)}, context {m.group(2)})"
    m = re.fullmatch(r"engine_prefill_vs_peer_gpu_(\d+)", key)
    if m:
        return f"engine prefill tok/s / official GPU (prompt {m.group(1)} tokens)"
    return key


def table_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(what, setting, measured, note) rows for the closing table."""
    rows = []
    runs = results.get("runs", {})
    for key, label in (("reference", "reference CPU"), ("peer_cpu", "official CPU (eager)"),
                       ("engine", "engine"), ("peer_gpu", "official GPU (eager)")):
        r = runs.get(key)
        if not r:
            continue
        if "unavailable" in r:
            rows.append((label, "", "peer unavailable", r["unavailable"]))
            continue
        if "error" in r:
            rows.append((label, "", "error", r["error"]))
            if not any(k in r for k in ("prefill", "decode", "prefill_tokens_per_s")):
                continue
        dev = r.get("device", "")
        if key == "reference" and "prefill_tokens_per_s" in r:
            rows.append((label, f"prefill {r.get('prompt_len', '?')}", _fmt_rate(r.get("prefill_tokens_per_s")) + " tok/s",
                         f"peak RSS {r.get('peak_rss_bytes', 0) / 2**20:,.0f} MiB"))
            rows.append((label, "decode b1", _fmt_rate(r.get("decode_tokens_per_s")) + " tok/s", ""))
            continue
        if r.get("weights_format"):
            est = r.get("weights_estimate") or {}
            rows.append((label, f"weights {r['weights_format']} in memory", f"{est.get('total', 0) / 1e9:,.1f} GB",
                         "fits the device" if r.get("fits") else r.get("not_fitting", "")))
        if "hbm" in r and r["hbm"]:
            rows.append((label, "HBM d2d copy", f"{r['hbm']['bytes_per_s'] / 1e9:,.0f} GB/s", r.get("gpu", "")))
        if r.get("matmul"):
            rows.append((label, "dense BF16 matmul", f"{r['matmul']['flop_per_s'] / 1e12:,.0f} TFLOP/s",
                         r["matmul"].get("how", "")))
        for p in r.get("prefill", []):
            if "skipped" in p:
                rows.append((label, f"prefill {p['prompt_len']}", "skipped", p["skipped"]))
            else:
                note = []
                if p.get("projected"):
                    note.append(f"projected; marginal period {1e3 * p['period_marginal_s']:,.1f} ms")
                if p.get("flop_per_token"):
                    note.append(f"{p['flop_per_token'] / 1e9:,.1f} GFLOP/token")
                if p.get("matmul_fraction") is not None:
                    note.append(f"{100 * p['matmul_fraction']:.1f}% of matmul rate")
                rows.append((label, f"prefill {p['prompt_len']} ({dev})", _fmt_rate(p["tokens_per_s"]) + " tok/s",
                             ", ".join(note)))
        for d in r.get("decode", []):
            setting = f"decode b{d['batch']} ctx {d['context']} ({dev})"
            if "skipped" in d:
                rows.append((label, setting, "skipped", d["skipped"]))
                continue
            note = []
            if d.get("projected"):
                note.append(f"projected; marginal period {1e3 * d['period_marginal_s']:,.2f} ms"
                            + (f" at {100 * d['period_marginal_hbm_fraction']:.0f}% HBM"
                               if d.get("period_marginal_hbm_fraction") else ""))
            if d.get("bytes_per_token") is not None:
                note.append(f"{d['bytes_per_token'] / 2**20:,.1f} MiB/token")
            if d.get("hbm_fraction") is not None:
                note.append(f"{100 * d['hbm_fraction']:.1f}% HBM")
            if d.get("host_syncs_per_step") is not None:
                note.append(f"{d['host_syncs_per_step']:g} syncs/step")
            if d.get("flop_per_token"):
                note.append(f"{d['flop_per_token'] / 1e9:,.1f} GFLOP/token")
            rows.append((label, setting, _fmt_rate(d["tokens_per_s"]) + " tok/s", ", ".join(note)))
        if r.get("peak_rss_bytes"):
            rows.append((label, "peak RSS", f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB", ""))
    ex = runs.get("extras")
    if ex:
        g = ex.get("ngram_gather", {})
        rows.append(("checkpoint", "n-gram gather", f"{g['rows_per_s']:,.0f} rows/s" if "rows_per_s" in g else "-",
                     g.get("unavailable", "")))
        d = ex.get("tap_diff_mb_per_s")
        rows.append(("taps", "tap-diff", f"{d:,.0f} MB/s" if d else "-", ex.get("tap_diff_unavailable", "")))
    note = results.get("settings", {}).get("note")
    if note:
        rows.append(("note", "warm-up", "-", note))
    skipped = results.get("settings", {}).get("engine_skipped")
    if skipped:
        rows.append(("engine", "not measured", "-", skipped))
    for k, v in results.get("ratios", {}).items():
        rows.append(("ratio", ratio_label(k), "-" if v is None else f"{v:.2f}x", ""))
    for g in results.get("goals", []):
        m = g["measured"]
        rows.append(("goal", g["goal"], "-" if m is None else f"{m:.3g}",
                     {True: "met", False: "NOT met", None: "n/a"}[g["met"]] + f" (target {g['target']})"))
    return rows


def print_table(results: dict, file=None, fmt: str = "rich") -> None:
    """The closing table: ``fmt`` 'rich' (boxes; plain text when rich is missing) or 'text' (plain aligned
    columns, nothing wrapped or cut: for pipes and CI logs)."""
    rows = table_rows(results)
    out = file or sys.stdout
    if fmt == "text":
        cols = ("what", "setting", "measured", "note")
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        print("qwen4exp bench", file=out)
        for r in (cols, tuple("-" * w for w in widths), *rows):
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip(), file=out)
        return
    try:
        from rich.console import Console
        from rich.table import Table
        t = Table(title="qwen4exp bench")
        for c in ("what", "setting", "measured", "note"):
            t.add_column(c)
        for r in rows:
            t.add_row(*r)
        Console(file=file or sys.stdout).print(t)   # the terminal's width (COLUMNS; 80 for a file)
    except ImportError:
        for r in rows:
            print(" | ".join(r), file=file or sys.stdout)


def assemble(runs: dict, settings: dict, checkpoints: dict) -> dict:
    """The results document: schema, UTC creation time, host, settings, checkpoints, the raw ``runs``
    and the ratios and goals from :func:`compare`."""
    ratios, goals = compare(runs)
    return {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": host_info(), "settings": settings, "checkpoints": checkpoints, "runs": runs,
            "ratios": ratios, "goals": goals}
