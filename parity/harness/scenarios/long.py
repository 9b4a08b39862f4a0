"""``--level long``: the caps real engines have, reached at the model's real sizes.

Meant for a real-width model (``qwen4exp`` real widths, e.g. one period -- 3 GDN + 1 QSA, PLE on layer 1 --
written by :func:`parity.bench.synthetic.cached_synthetic`) with the real ``indexer_budget`` 2048 /
``indexer_compress_ratio`` 4, so the QSA bound is 2051 visible tokens (position p sees p + 1). Every case reads
prefixes of ONE deterministic token stream, so the truth is one reference forward over the longest prefix
(primed first; the truth cache answers every shorter prefix from it). Cases per scenario:

* budget: a prompt crossing the bound (``bound + 2 * ratio + 1`` tokens) then decoded; a decode walking
  across the bound, its QSA block selection compared with the truth's (:func:`check_selection`);
* chunk-boundary: chunked prefill with chunks larger than :data:`PLE_CHUNK_CAP` (8192, a PLE buffer cap seen in
  public ports) over a prompt holding two of them; positions past :data:`QSA_POSITION_CAP` (32768): a prefill
  in such chunks up to just below it, then decode and verify/rollback across it;
* snapshot-restore: snapshot past the bound, the sequence runs on, restore (same and fresh handle), continue;
* speculative-rollback: verify 4 wrong drafts that cross the bound, roll back 3, decode, state compared;
* self-consistency: its usual cases (their sizes already follow the config's bound).

``max_tokens`` (``QWEN4EXP_LONG_MAX_TOKENS``, default none) drops the cases whose history would exceed it -- the
CPU path's slow test keeps the bound-crossing cases only; the H200 run (``ci/gpu``) keeps them all.
"""
from __future__ import annotations

import os

import numpy as np

from parity.harness.scenarios.common import Case, Run, sizes, token_stream

PLE_CHUNK_CAP = 8192      # R28: a PLE buffer shorter than the prefill chunk
QSA_POSITION_CAP = 32768  # R28: a QSA position cap
STREAM_SEED = 9100


def max_tokens() -> int | None:
    """The longest history the long cases may build: ``$QWEN4EXP_LONG_MAX_TOKENS`` or None (no limit).

    Raises:
        InputError: the variable is set to something other than a positive integer.
    """
    from reference.errors import InputError
    v = os.environ.get("QWEN4EXP_LONG_MAX_TOKENS")
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n <= 0:
        raise InputError(f"QWEN4EXP_LONG_MAX_TOKENS: expected a positive integer, found {v!r}")
    return n


def _plan(config) -> dict:
    """Lengths of the long cases (all from the config) and the stream length the kept ones need."""
    s = sizes(config)
    big_chunk = PLE_CHUNK_CAP + s.ratio + 1
    need = {"cross": s.bound + 2 * s.ratio + 1 + 3, "across": s.bound + 4, "snap": s.bound + 3 + 12,
            "spec": s.bound + 4, "chunk": 2 * big_chunk + 3, "past": QSA_POSITION_CAP + 8}
    cap = max_tokens()
    if config.max_position_embeddings:
        cap = min(cap or config.max_position_embeddings, config.max_position_embeddings)
    keep = {k: v for k, v in need.items() if cap is None or v <= cap}
    return {"keep": keep, "stream": max(keep.values()) if keep else 0, "big_chunk": big_chunk}


_SELECTION: dict = {}  # (config hash, stream length) -> the truth's selection taps around the bound


def _stream(run: Run, n: int) -> list[int]:
    plan = _plan(run.config)
    ids = token_stream(run.config, plan["stream"], seed=STREAM_SEED, eos_every=997)
    key = (run.config.config_hash(), len(ids))
    if key not in _SELECTION and run.sizes.has_qsa:
        from taps.recorder import Recorder
        with Recorder(None, include=["*indexer.selected_blocks"], positions=_around_bound(run)) as rec:
            # the one truth forward (cached), logged (every selection: the tie judge of a near tie at a cut reads
            # it instead of a forward of its own), its selection taps recorded near the bound
            if hasattr(run.truth, "logged"):
                run.truth.logged(ids)
            else:
                run.truth.logits(ids)
        arc = rec.archive()
        if not arc.names():  # the truth had it cached already: record its selection once more
            with Recorder(None, include=["*indexer.selected_blocks"], positions=_around_bound(run)) as rec:
                run.truth.model.forward(ids)
            arc = rec.archive()
        _SELECTION[key] = arc
    run.plan(ids)  # one truth forward over the longest history every case reads a prefix of
    return ids[:n]


def _around_bound(run: Run) -> list[int]:
    s = run.sizes
    return list(range(max(0, s.bound - 3), s.bound + 2 * s.ratio + 4))


def check_selection(run: Run, s, token: int, desc: str) -> None:
    """Decode ``token`` on ``s`` with the backend's ``indexer.selected_blocks`` taps recorded and require them to
    equal the truth's at that position (flips within the score tolerance excepted; an exact tie must follow
    the lower-index rule). Logits may not see a one-block selection error near the real bound on random weights
    (4 of ~2052 attended tokens move them little); the selection does. When both the selection and the logits of
    this decode fail, the selection is named: it comes first in the dataflow (the logits' error follows from it;
    the logits' failure is kept in the message). Backends emitting no taps are checked on logits only."""
    from parity.harness.scenarios.case import CaseFailure
    p = len(s.hist)
    from parity.harness.ties import SELECTION_TAPS
    keep, run.keep_selections = run.keep_selections, False  # one tap recording at a time: this one, kept below
    logits_failed = None
    try:
        with run.be.taps(None, include=list(SELECTION_TAPS), positions=[p]) as rec:
            try:
                run.decode([s], [token], desc=desc)
            except CaseFailure as f:  # judged below, after the selection this decode took
                logits_failed = f
    finally:
        run.keep_selections = keep
    got = rec.archive()
    if keep:
        for name in got.names():
            s.sel.setdefault(name, {})[p] = np.asarray(got.get(name)).astype(np.int64).reshape(-1)
    key = (run.config.config_hash(), _plan(run.config)["stream"])
    truth = _SELECTION.get(key)
    if truth is None or not got.names() or p not in set(int(x) for x in _around_bound(run)):
        if logits_failed is not None:
            raise logits_failed
        return
    from taps.diff import diff_archives
    op = logits_failed.op if logits_failed is not None else run.ops - 1
    run.checks += 1
    prof = "bf16" if getattr(run.be, "precision", "float32") in ("bf16", "fp8") else "fp32"
    rep = diff_archives(truth, got, prof, force=True, taps=[n for n in got.names() if truth.has(n)])
    if rep.first_divergence is not None:
        r = rep.result(rep.first_divergence)
        also = ""
        if logits_failed is not None:
            lw = logits_failed.what
            also = f"; its logits fail too: {lw[len(desc) + 2:] if lw.startswith(desc + ': ') else lw}"
        run.fail(op, f"{desc}: QSA block selection differs from the truth's at position {p}{also}",
                 f"op {op}, seq {s.label}, position {p}: first divergence {rep.first_divergence}"
                 + (f" ({r.note})" if r is not None and r.note else ""), seq=s.label)
    if logits_failed is not None:
        raise logits_failed


def _setup(config):
    plan = _plan(config)
    return sizes(config), plan["keep"], plan["big_chunk"]


def budget_cases(config) -> list[Case]:
    """The long budget cases for ``config``: a prompt crossing the bound, then decoded; a decode walking
    across it, its selections checked."""
    s, keep, _ = _setup(config)
    out = []
    if "cross" in keep:
        def cross(run: Run):
            run.keep_selections = True  # near ties judged on the selections these ops took
            L = s.bound + 2 * s.ratio + 1
            ids = _stream(run, L + 3)
            a = run.new("long-cross")
            run.prefill(a, ids[:L], desc=f"prefill {L} tokens ({L} visible tokens at position {L - 1}, bound "
                                          f"{s.bound} visible tokens)")
            for t in ids[L:]:
                run.decode([a], [t])
        out.append(Case(f"long_prompt_crossing_bound_{s.bound + 2 * s.ratio + 1}", cross))
    if "across" in keep:
        def across(run: Run):
            run.keep_selections = True  # near ties judged on the selections these ops took
            ids = _stream(run, s.bound + 4)
            a = run.new("long-across")
            run.prefill(a, ids[:s.bound - 2])
            for t in ids[s.bound - 2:]:
                check_selection(run, a, t, f"decode at position {len(a.hist)} ({len(a.hist) + 1} visible tokens, "
                                              f"bound {s.bound} visible tokens)")
        out.append(Case("long_decode_across_bound", across))
    return out


def chunk_boundary_cases(config) -> list[Case]:
    """The long chunk-boundary cases for ``config``: chunks larger than the PLE chunk cap; positions past the QSA position cap."""
    s, keep, big = _setup(config)
    out = []
    if "chunk" in keep:
        def chunked(run: Run):
            run.keep_selections = True  # near ties judged on the selections these ops took
            n = 2 * big + 1
            ids = _stream(run, n + 2)
            a = run.new(f"chunks-of-{big}")
            run.prefill(a, ids[:n], chunk_size=big, desc=f"prefill {n} tokens in chunks of {big} (> {PLE_CHUNK_CAP})")
            for t in ids[n:]:
                run.decode([a], [t])
        out.append(Case(f"long_chunks_of_{big}_over_{PLE_CHUNK_CAP}", chunked))
    if "past" in keep:
        def past(run: Run):
            run.keep_selections = True  # near ties judged on the selections these ops took
            P = QSA_POSITION_CAP - 2
            ids = _stream(run, QSA_POSITION_CAP + 8)
            a = run.new("past-32768")
            run.prefill(a, ids[:P], chunk_size=big, desc=f"prefill {P} tokens in chunks of {big}")
            for t in ids[P:P + 4]:
                run.decode([a], [t], desc=f"decode at position {len(a.hist)} (cap {QSA_POSITION_CAP})")
            run.verify(a, ids[P + 4:P + 8], desc=f"verify 4 tokens at position {len(a.hist)}")
            run.rollback(a, 2, desc="roll back 2 past the position cap")
            run.decode([a], [ids[P + 6]])
        out.append(Case(f"long_positions_past_{QSA_POSITION_CAP}", past))
    return out


def snapshot_restore_cases(config) -> list[Case]:
    """The long snapshot-restore cases for ``config``: a snapshot past the bound restored, continued, and
    restored into a fresh handle."""
    s, keep, _ = _setup(config)
    out = []
    if "snap" in keep:
        def snap(run: Run):
            run.keep_selections = True  # near ties judged on the selections these ops took
            p = s.bound + 3
            ids = _stream(run, p + 12)
            a = run.new("long-snap")
            run.prefill(a, ids[:p])
            sn = run.snapshot(a)
            run.prefill(a, ids[p:p + 6], desc="the sequence runs on past the snapshot")
            run.restore(a, sn, desc=f"restore the snapshot of {p} tokens ({p} visible tokens, past the bound "
                                     f"{s.bound} visible tokens)")
            for t in ids[p:p + 3]:
                run.decode([a], [t])
            c = run.new("long-fresh")
            run.restore(c, sn, desc="restore into a fresh handle")
            run.prefill(c, ids[p:p + 12], desc="prefill after restore")
        out.append(Case("long_snapshot_restore_past_bound", snap))
    return out


def speculative_rollback_cases(config) -> list[Case]:
    """The long speculative-rollback cases for ``config``: a verify and a rollback across the bound, then the
    state against a straight run."""
    s, keep, _ = _setup(config)
    out = []
    if "spec" in keep:
        def spec(run: Run):
            run.keep_selections = True  # near ties judged on the selections these ops took
            L = s.bound - 1
            ids = _stream(run, L)
            a = run.new("long-spec")
            run.prefill(a, ids)
            drafts = token_stream(run.config, 4, seed=9200)  # any tokens off the stream: one truth forward
            run.verify(a, drafts, desc=f"verify 4 wrong drafts at positions {L}..{L + 3} ({L + 1}..{L + 4} visible "
                                       f"tokens, across the bound {s.bound} visible tokens)")
            run.rollback(a, 3, desc=f"accept 1/4: roll back 3, from {L + 4} to {L + 1} visible tokens (across the "
                                    f"bound {s.bound} visible tokens)")
            run.decode([a], token_stream(run.config, 1, seed=9201))
            straight = run.new("long-straight")
            run.prefill(straight, a.hist)
            run.compare_state(a, straight, "state after a rollback past the bound")
        out.append(Case("long_rollback_past_bound", spec))
    return out
