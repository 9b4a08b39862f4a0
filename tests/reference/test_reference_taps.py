"""Taps emitted by the reference: every registry tap appears with its registry shape and positions;
nothing is built without a recorder; replay of each module from its recorded input reproduces the
recorded taps, and a perturbed module is detected by replay (negative control)."""
from __future__ import annotations
from reference import taphook

import numpy as np
import pytest

import taps.recorder as recmod
from reference.model import ReferenceModel
from reference_helpers import EOS, random_weights, tiny_config
from taps import registry
from taps.recorder import Recorder, tap_row_shape

T = 18


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    m = ReferenceModel(random_weights(cfg, seed=7), dtype=np.float64)
    ids = np.random.default_rng(2).integers(0, 256, T)
    ids[ids == EOS] = 0
    ids[9] = EOS
    with Recorder() as rec:
        logits = m.forward(ids)
    return m, ids, rec.archive(), logits


def test_every_registry_tap_emitted(setup):
    m, ids, arc, logits = setup
    names = registry.tap_names(m.config)
    assert set(arc.names()) == set(names)
    for n in names:
        v = arc.get(n)
        spec = registry.spec_for(n)
        want = tap_row_shape(spec, m.config, T)
        if n.endswith("block_scores"):  # complete blocks only (the registry's estimate rounds up)
            want = (max(1, T // m.config.indexer_compress_ratio),)
        assert v.shape == (T, *want), n
        assert np.array_equal(arc.positions(n), np.arange(T)), n
        assert (v.dtype.kind == "i") == (spec.dtype == "int64"), n
    assert np.array_equal(arc.get("logits"), logits)
    sel = arc.get("layers.3.self_attn.indexer.selected_blocks")
    sc = arc.get("layers.3.self_attn.indexer.block_scores")
    # selections follow the canonical order on the recorded scores
    for t in range(T):
        k = min(m.config.block_topk, (t + 1) // m.config.indexer_compress_ratio)
        assert (sel[t, k:] == -1).all()
        chosen = sel[t, :k]
        assert np.all(np.diff(sc[t, chosen]) <= 0)


def test_taps_follow_sessions_positions(setup):
    m, ids, arc, _ = setup
    with Recorder() as rec:
        s = m.new_session()
        s.prefill(ids[:10], chunk_size=4)
        for t in ids[10:13]:
            s.decode(t)
    a = rec.archive()
    assert np.array_equal(a.positions("layers.0.linear_attn.out"), np.arange(13))
    assert np.allclose(a.get("layers.0.linear_attn.out"), arc.get("layers.0.linear_attn.out")[:13], rtol=0,
                       atol=1e-12)


def test_no_recorder_no_emit(setup, monkeypatch):
    m, ids, _, _ = setup
    assert recmod.current() is None

    class Boom:
        def emit(self, *a, **k):
            raise AssertionError("emit called")

    m.forward(ids[:3])  # no recorder: no emit possible
    tok = taphook.set_current(Boom())
    try:
        with pytest.raises(AssertionError, match="emit called"):  # control: an active recorder is called
            m.forward(ids[:3])
    finally:
        taphook.reset_current(tok)


def test_replay_every_module(setup):
    m, ids, arc, _ = setup
    checked = 0
    for n in registry.tap_names(m.config):
        need = m.replay_inputs(n)
        out = m.replay(n, {k: arc.get(k) for k in need}, ids)
        assert n in out, n
        # float64, same code and inputs: agreement to rounding (the recorded run saw identical inputs)
        assert np.allclose(out[n], arc.get(n), rtol=1e-12, atol=1e-12), n
        checked += 1
    assert checked == len(registry.tap_names(m.config))
    assert m.replay_inputs("layers.3.self_attn.out") == ["layers.3.attn_hyper_connection.out"]


def test_replay_negative_control(setup):
    """A model with a perturbed GDN weight replays ``linear_attn.out`` differently from the recording."""
    m, ids, arc, _ = setup
    name = "layers.1.linear_attn.dt_bias"
    bad = ReferenceModel(m.weights.with_override(name, m.weights.get(name) + 0.5), dtype=np.float64)
    n = "layers.1.linear_attn.out"
    out = bad.replay(n, {k: arc.get(k) for k in bad.replay_inputs(n)}, ids)
    assert np.abs(out[n] - arc.get(n)).max() > 1e-4
    # and a module it does not touch still replays exactly
    n2 = "layers.1.mlp.out"
    out2 = bad.replay(n2, {k: arc.get(k) for k in bad.replay_inputs(n2)}, ids)
    assert np.allclose(out2[n2], arc.get(n2), rtol=1e-12, atol=1e-12)


def test_replay_errors(setup):
    from reference.errors import InputError
    m, ids, arc, _ = setup
    with pytest.raises(InputError, match="unknown tap"):
        m.replay_inputs("layers.0.nope")
    with pytest.raises(InputError, match="layer 1 has no PLE"):
        m.replay_inputs("layers.1.ple.out")
    with pytest.raises(InputError, match="missing input"):
        m.replay("layers.0.linear_attn.out", {}, ids)
    with pytest.raises(InputError, match="positions"):
        m.replay("layers.0.linear_attn.out", {"layers.0.attn_hyper_connection.out":
                                              arc.get("layers.0.attn_hyper_connection.out")[:3]}, ids)
