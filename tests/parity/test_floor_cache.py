"""$QWEN4EXP_FLOOR_CACHE: a floor measured once is read back bitwise, and only for the same weights, prompts,
stores and code (each changed alone is a miss); a partial or foreign entry is never read."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fixture_helpers import fixture_dir

FIX = fixture_dir("tiny")


class _Be:
    """A backend as thresholds_for_run reads it: a precision and its declared stores."""

    def __init__(self, precision="float32", stores=None):
        self.precision = precision
        self.capabilities = {"stores": {} if stores is None else stores}


@pytest.fixture(scope="module")
def weights():
    from parity.backends import load_weights
    return load_weights(FIX)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The cache in a fresh folder; counts the floor measurements actually run (measure_floors: the one pass behind
    measure_floor and thresholds_for_run[s])."""
    from parity.harness import floor as F
    monkeypatch.setenv("QWEN4EXP_FLOOR_CACHE", str(tmp_path / "floors"))
    n = {"floor": 0, "taps": 0}
    real_floor, real_taps = F.measure_floors, F.tap_floors

    def mf(*a, **k):
        n["floor"] += 1
        return real_floor(*a, **k)

    def tf(*a, **k):
        n["taps"] += 1
        return real_taps(*a, **k)
    monkeypatch.setattr(F, "measure_floors", mf)
    monkeypatch.setattr(F, "tap_floors", tf)
    return n, tmp_path / "floors"


def _prompts(cfg, seed=0):
    from parity.harness.sizes import token_stream
    return [token_stream(cfg, 9, seed=seed), token_stream(cfg, 17, seed=seed + 1)]


def _same(a, b):
    """Two thresholds_for_run results judge alike: thresholds, the floor (but where it came from) and the tap
    profile's every override."""
    (tha, fla, ca), (thb, flb, cb) = a, b
    ja, jb = fla.to_json(), flb.to_json()
    ja.pop("source"), jb.pop("source")
    assert ja == jb and fla.ties.cuts == flb.ties.cuts and ca == cb
    assert {k: v for k, v in tha.to_json().items() if k != "tap_profile"} == \
        {k: v for k, v in thb.to_json().items() if k != "tap_profile"}
    assert tha.tap_profile.overrides == thb.tap_profile.overrides
    assert tha.tap_profile.floors == thb.tap_profile.floors


def test_a_second_run_reads_the_floor_bitwise_and_measures_nothing(weights, counted):
    from parity.harness.floor import thresholds_for_run
    n, root = counted
    ps = _prompts(weights.config)
    first = thresholds_for_run(weights, _Be(), ps)
    assert n == {"floor": 1, "taps": 0} and first[1].source.startswith("measured, kept in")  # taps: from the floor's forwards
    assert len(list(root.glob("floor-*.json"))) == 1
    second = thresholds_for_run(weights, _Be(), ps)
    assert n == {"floor": 1, "taps": 0}                     # nothing measured again
    assert second[1].source.startswith("read from")
    _same(first, second)
    # a backend of another precision with the same stores shares the measurement (its multiple is its own)
    other = thresholds_for_run(weights, _Be("bf16", {}), ps)
    assert n == {"floor": 1, "taps": 0}
    assert other[0].precision == "bf16" and other[1].f32_logit_rel == first[1].f32_logit_rel


def test_uncached_and_cached_runs_give_the_same_thresholds(weights, monkeypatch, tmp_path):
    from parity.harness.floor import thresholds_for_run
    ps = _prompts(weights.config)
    monkeypatch.delenv("QWEN4EXP_FLOOR_CACHE", raising=False)
    plain = thresholds_for_run(weights, _Be(), ps)
    assert plain[1].source == "measured"
    monkeypatch.setenv("QWEN4EXP_FLOOR_CACHE", str(tmp_path))
    thresholds_for_run(weights, _Be(), ps)
    _same(plain, thresholds_for_run(weights, _Be(), ps))


def test_unset_writes_nothing(weights, monkeypatch, tmp_path):
    from parity.harness import floor_cache
    monkeypatch.delenv("QWEN4EXP_FLOOR_CACHE", raising=False)
    assert floor_cache.cache_dir() is None and floor_cache.entry_path({"x": 1}) is None
    assert floor_cache.store({"x": 1}, {}) is None


@pytest.mark.parametrize("change", ["prompts", "stores", "weights", "code", "orders"])
def test_each_input_of_the_floor_is_in_the_key_negative_controls(weights, counted, monkeypatch, change):
    from parity.harness import floor as F
    from parity.harness import floor_cache
    n, root = counted
    ps = _prompts(weights.config)
    F.thresholds_for_run(weights, _Be(), ps)
    w, be = weights, _Be()
    if change == "prompts":
        ps = [list(ps[0]), list(ps[1][:-1]) + [int(ps[1][-1]) ^ 1]]   # one token of one prompt
    elif change == "stores":
        be = _Be("bf16", {"kv": "bf16"})
    elif change == "weights":
        name = "layers.0.mlp.gate.weight" if weights.has("layers.0.mlp.gate.weight") else sorted(weights.names())[-1]
        a = np.array(weights.get(name), dtype=np.float32)
        a.flat[a.size // 3] += 1e-3                                    # one element, away from the sampled bytes
        w = weights.with_override(name, a)
    elif change == "code":
        monkeypatch.setattr(floor_cache, "code_version", lambda: "another version of the reference")
    elif change == "orders":
        from reference.order import EvalOrder
        monkeypatch.setattr(F, "FLOOR_ORDERS", F.FLOOR_ORDERS[:1] + (EvalOrder("split-k8", linear_block=8),))
    got = F.thresholds_for_run(w, be, ps)
    assert n["floor"] == 2, f"a changed {change} read the other floor's entry"
    assert got[1].source.startswith("measured")
    assert len(list(root.glob("floor-*.json"))) == 2


def test_a_partial_or_foreign_entry_is_never_read(weights, counted):
    from parity.harness import floor_cache
    from parity.harness.floor import FLOOR_ORDERS, _cached_floor, floor_prompts, stores_of, thresholds_for_run
    n, root = counted
    ps = _prompts(weights.config)
    thresholds_for_run(weights, _Be(), ps)
    mat = floor_cache.key_material(weights, floor_prompts(weights.config, ps), stores_of(_Be()),
                                   floor_prompts(weights.config, None)[-1], FLOOR_ORDERS)
    path = floor_cache.entry_path(mat)
    good = path.read_text()
    assert _cached_floor(mat) is not None
    path.write_text(good[: len(good) // 2])                           # a truncated file (not written atomically)
    assert floor_cache.load(mat) is None and _cached_floor(mat) is None
    doc = json.loads(good)
    doc["material"]["prompts"] = "0" * 64                              # an entry of other inputs under this name
    path.write_text(json.dumps(doc))
    assert _cached_floor(mat) is None
    doc = json.loads(good)
    del doc["payload"]["floor"]["by_order"]                            # an entry missing a field
    path.write_text(json.dumps(doc))
    assert _cached_floor(mat) is None
    got = thresholds_for_run(weights, _Be(), ps)                       # measured again and the entry repaired
    assert n["floor"] == 2 and got[1].source.startswith("measured")
    assert _cached_floor(mat) is not None


def test_the_floors_own_forwards_give_the_tap_floors_of_a_separate_measurement(weights):
    # the float32 floor's forwards over the stream are tap_floors' forwards: recording their taps gives the same
    # per-tap floors as measuring them apart (with stores the floor's float32 forwards are unrounded: measured apart)
    from parity.harness.floor import floor_prompts, measure_floor, tap_floors
    ps = floor_prompts(weights.config, _prompts(weights.config))
    stream = ps[-1]
    fl = measure_floor(weights, ps, {}, tap_ids=stream)
    apart = tap_floors(weights, stream, {})
    assert fl.tap_floors is not None and set(fl.tap_floors) == set(apart) and len(apart) > 10
    # bitwise for every tap but the logits: a fresh float32 model's first lm_head product of <= 64 rows runs the
    # fused BF16 kernel, a model whose weight cache holds the upcast lm_head (the floor's, after its first prompt)
    # runs BLAS on it -- two float32 orders of the same sum, so that tap's floor agrees to its own size only
    assert {k: v for k, v in fl.tap_floors.items() if k != "logits"} == {k: v for k, v in apart.items() if k != "logits"}
    (r1, a1), (r2, a2) = fl.tap_floors["logits"], apart["logits"]
    assert 0.5 < r1 / r2 < 2 and 0.5 < a1 / a2 < 2
    assert measure_floor(weights, ps, {"kv": "bf16"}, tap_ids=stream).tap_floors is None
    assert measure_floor(weights, ps[:-1], {}, tap_ids=stream).tap_floors is None   # not among the prompts


# ------------------------------------------------------------------------------------------ negative control
def _kl(weights, ps, th=None, note="reference with layers.0 perturbed", cw=True):
    from parity.backends import open_backend
    from parity.harness.floor import thresholds_for_run
    from parity.harness.kl import run_kl
    from parity.harness.run import default_perturb_target, perturbation
    a, b = open_backend("reference", FIX), open_backend("reference", FIX)
    if th is None:
        th, fl, _ = thresholds_for_run(a.model.weights, b, ps)
    else:
        fl = thresholds_for_run(a.model.weights, b, ps)[1]
    name = default_perturb_target(a.config)

    def pb(scale=1.0):
        return open_backend("reference", FIX, perturb=(name, perturbation(scale=scale)))
    return run_kl(a, b, ps, greedy_tokens=2, perturbed_b=pb, perturbed_note=note, progress=False, floor=fl,
                  thresholds=th, control_weights=a.model.weights if cw else None)


@pytest.fixture
def nc_counted(monkeypatch, tmp_path):
    from parity.harness import kl as K
    monkeypatch.setenv("QWEN4EXP_FLOOR_CACHE", str(tmp_path / "c"))
    n = [0]
    real = K.negative_control

    def nc(*a, **k):
        n[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(K, "negative_control", nc)
    return n


def test_a_reference_control_is_read_back_by_the_next_run(weights, nc_counted):
    ps = _prompts(weights.config)
    first = _kl(weights, ps)
    second = _kl(weights, ps)
    assert nc_counted[0] == 1
    c1, c2 = first.controls["negative_control"], second.controls["negative_control"]
    assert c1["source"].startswith("measured, kept in") and c2["source"].startswith("read from")
    assert {k: v for k, v in c1.items() if k != "source"} == {k: v for k, v in c2.items() if k != "source"}
    assert c1["ok"] and first.status == second.status


@pytest.mark.parametrize("change", ["thresholds", "note", "prompts", "not the reference"])
def test_the_control_key_negative_controls(weights, nc_counted, change):
    import dataclasses
    ps = _prompts(weights.config)
    first = _kl(weights, ps)
    kw = {}
    if change == "thresholds":
        kw["th"] = dataclasses.replace(first.thresholds, tol_rel=first.thresholds.tol_rel * 2)
    elif change == "note":
        kw["note"] = "reference with layers.1 perturbed"
    elif change == "prompts":
        ps = [ps[0][:-1], ps[1]]
    else:
        kw["cw"] = False        # the control perturbs the backend under test: never shared
    rep = _kl(weights, ps, **kw)
    assert nc_counted[0] == 2, change
    assert "read from" not in rep.controls["negative_control"].get("source", "")


def test_floors_of_several_store_sets_in_one_pass_equal_each_measured_alone(weights, monkeypatch):
    # measure_floors runs the float64 and float32-order forwards once for every store set (one rounded forward per
    # distinct set): each floor bitwise what measure_floor of that set alone gives
    from parity.harness import floor as F
    from reference.model import ReferenceModel
    ps = _prompts(weights.config)
    stream = F.floor_prompts(weights.config, None)[-1]
    ps = ps + [stream]
    sets = [{}, {"kv": "bf16"}, "bf16", {}]
    passes = []
    real = ReferenceModel._run

    def counted(self, state, ids, logits="all", residual_out=None):
        passes.append(np.dtype(self.dtype).name + ("+stores" if self.store_round is not None else ""))
        return real(self, state, ids, logits, residual_out)
    monkeypatch.setattr(ReferenceModel, "_run", counted)
    together = F.measure_floors(weights, ps, sets, tap_ids=stream)
    n_orders = len(F.FLOOR_ORDERS)
    # per prompt: one float64, one float32 per order, one rounded per distinct store set (two)
    assert passes.count("float64") == len(ps) and passes.count("float32") == n_orders * len(ps)
    assert passes.count("float32+stores") == 2 * len(ps)
    passes.clear()
    alone = [F.measure_floor(weights, ps, st, tap_ids=stream) for st in sets]
    assert len(passes) > (1 + n_orders) * len(ps) * 2          # measured alone, the shared forwards repeat
    for a, b in zip(together, alone):
        assert a.to_json() == b.to_json() and a.ties.cuts == b.ties.cuts
        assert (a.tap_floors is None) == (b.tap_floors is None)
        assert a.tap_floors is None or a.tap_floors == b.tap_floors
    assert together[0] is not together[3]
