"""Greedy decoding on the GPU and the steady-state decode graph path (pinned staging, in-graph argmax); ``row_argmax``
itself: tests/engine/test_sampling.py.

* ``decode_greedy`` with CUDA graphs (steady-state replays from the pinned staging) produces the same
  tokens and logits as the eager engine (graphs off), step after step; a negative control corrupts one
  staged PLE row and the logits comparison catches it.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _gpu():
    cp = pytest.importorskip("cupy", reason="cupy not installed: GPU tests skipped")
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no usable CUDA GPU: GPU tests skipped")
    return cp


def _run(ck, graphs, prompts, first, steps, corrupt=False):
    from engine import Engine
    eng = Engine(ck, precision="float32", device="cuda", kv_tokens=2048, max_seqs=4, cuda_graphs=graphs)
    seqs = [eng.add_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        eng.prefill(s, p)
    toks, logits = [], []
    t = np.asarray(first)
    for j in range(steps):
        if corrupt and j == steps - 1:
            tab = next(iter(eng.model.ple.values()))
            orig = tab.gather_host

            def bad(rows, out=None, _o=orig):
                r = _o(rows, out=out)
                r[0, 0] += 1.0  # one staged value of the first sequence's PLE row
                return r
            tab.gather_host = bad
        t = eng.decode_greedy(seqs, t)
        toks.append(t.copy())
        logits.append(eng.last_logits.get())
    return eng, toks, logits


def test_decode_greedy_graphs_equal_eager_and_catch_a_corrupt_staged_row():
    _gpu()
    from engine import selfcheck
    from reference.checkpoint import Checkpoint
    from reference.paths import FIXTURES
    ck = Checkpoint.open(FIXTURES / "tiny")
    assert ck.config.ple_layers, "the tiny fixture has a PLE layer (the staged rows under test)"
    V = ck.config.vocab_size
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, V, n) for n in (5, 12, 30)]
    first = rng.integers(0, V, 3)
    _, te, le = _run(ck, False, prompts, first, 10)
    eng, tg, lg = _run(ck, True, prompts, first, 10)
    st = eng.graphs.stats
    assert st["replays"] >= 5 and st["failed"] == 0, (st, eng.graphs.failed)
    assert all(e["checks"] >= 2 for e in eng.graphs.entries.values())  # steady state (fast path) was reached
    for a, b in zip(te, tg):
        assert a.tolist() == b.tolist()
    for a, b in zip(le, lg):
        # same kernels and summation order; 1e-5 relative as the graphs' own replay check
        assert selfcheck.rel_err(b, a) < 1e-5
    # negative control: a corrupted staged PLE value on the last (fast-path) step is caught in its logits
    _, _, lb = _run(ck, True, prompts, first, 10, corrupt=True)
    assert selfcheck.rel_err(lb[-1][0], le[-1][0]) > 1e-5
    assert selfcheck.rel_err(lb[-2], le[-2]) < 1e-5  # the steps before are unaffected


def _pair(ck, prompts, bucket):
    from engine import Engine
    engs = []
    for graphs in (True, True):
        eng = Engine(ck, precision="float32", device="cuda", kv_tokens=4096, max_seqs=4, cuda_graphs=graphs)
        eng.graphs.bucket = bucket  # small score-width buckets: the graph key changes every few steps
        seqs = [eng.add_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):
            eng.prefill(s, p)
        engs.append((eng, seqs))
    return engs


@pytest.mark.parametrize("bucket", [512, 2])
def test_decode_greedy_steps_pipelined_equals_step_by_step(bucket):
    """The pipelined loop (head graph fed by the previous device argmax while the host gathers PLE rows)
    gives the tokens of step-by-step decode_greedy, across graph-key changes (bucket 2), and leaves the
    same state (the next step's logits agree). Negative control: feeding the head a wrong previous token
    (device argmax + 1) is caught."""
    _gpu()
    from engine import selfcheck
    from reference.checkpoint import Checkpoint
    from reference.paths import FIXTURES
    ck = Checkpoint.open(FIXTURES / "tiny")
    V = ck.config.vocab_size
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, V, n) for n in (6, 20)]
    first = rng.integers(0, V, 2)
    (ea, sa), (eb, sb) = _pair(ck, prompts, bucket)
    times = []
    got = ea.decode_greedy_steps(sa, first, 24, step_times=times)
    want, t = [], first
    for _ in range(24):
        t = eb.decode_greedy(sb, t)
        want.append(t)
    st = ea.graphs.stats
    assert st["failed"] == 0, ea.graphs.failed
    assert st["pipelined"] >= 8, st  # the pipelined path really ran (also across key changes)
    want = np.stack(want)
    bad_rows = np.nonzero((got != want).any(axis=1))[0]
    assert bad_rows.size == 0, (f"first differing step {bad_rows[:1]}", got.tolist(), want.tolist(), st)
    assert len(times) == 24
    la, lb = ea.decode(sa, got[-1]), eb.decode(sb, want[-1])
    assert selfcheck.rel_err(la, lb) < 1e-5  # same state afterwards (same kernels: rounding only)
    # negative control: a pipelined step whose head reads argmax + 1
    (ec, sc), _ = _pair(ck, prompts, bucket)
    g = ec.graphs
    orig = g.pipelined_step

    def wrong(pool, seqs, e, prev, known=None, _o=orig):
        with g.stream:
            e["tok"][...] = (e["tok"] + 1) % V
        return _o(pool, seqs, e, prev, known=None)
    g.pipelined_step = wrong
    bad = ec.decode_greedy_steps(sc, first, 24)
    assert g.stats["pipelined"] >= 8 and bad.tolist() != want.tolist()


def test_fused_projections_equal_separate_and_a_corrupt_stack_row_is_caught():
    """The engine stacks projections that share an input (GDN in_proj_*, QSA q/k/v/indexer, hyper-connection
    down+inject, shared expert gate+up). Decode logits with the stacks equal those with separate weights
    (1e-5: only the GEMV's K-split choice, i.e. float32 summation order, can differ); every group of the
    fixture was stacked; negative control: one corrupted row of a stack (GDN in_proj_b) is caught."""
    cp = _gpu()
    from engine import Engine, selfcheck
    from engine.model import EngineModel
    from reference.checkpoint import Checkpoint
    from reference.paths import FIXTURES
    ck = Checkpoint.open(FIXTURES / "tiny")
    c = ck.config
    V = c.vocab_size
    rng = np.random.default_rng(11)
    prompt, steps = rng.integers(0, V, 9), rng.integers(0, V, 4)

    def run(fuse=True, corrupt=False):
        orig = EngineModel._fuse_weights
        if not fuse:
            EngineModel._fuse_weights = lambda self: None
        try:
            eng = Engine(ck, precision="float32", device="cuda", kv_tokens=1024, max_seqs=2, cuda_graphs=False)
        finally:
            EngineModel._fuse_weights = orig
        if corrupt:
            i = c.layer_types.index("linear_attention")
            key = f"layers.{i}.linear_attn.fused_in_proj"
            _, a, _ = [sp for sp in eng.model.fused[key] if sp[0].endswith("in_proj_b.weight")][0]
            eng.model.w[key][a] += 0.5
        s = eng.add_sequence()
        out = [eng.prefill(s, prompt)]
        for t in steps:
            out.append(eng.decode([s], [int(t)]))
        return eng, out

    ef, lf = run(True)
    want = set()
    for i, lt in enumerate(c.layer_types):
        p = f"layers.{i}."
        want |= {p + "attn_hyper_connection.fused_down_inject", p + "mlp_hyper_connection.fused_down_inject",
                 p + ("linear_attn." if lt == "linear_attention" else "self_attn.") + "fused_in_proj"}
        if ef.model.w.get(p + "mlp.shared_expert.gate_proj.weight") is not None:
            want.add(p + "mlp.fused_shared_gate_up")
    assert set(ef.model.fused) == want
    _, ls = run(False)
    for a, b in zip(lf, ls):
        assert selfcheck.rel_err(a, b) < 1e-5
    _, lc = run(True, corrupt=True)
    assert max(selfcheck.rel_err(a, b) for a, b in zip(lc, ls)) > 1e-3
