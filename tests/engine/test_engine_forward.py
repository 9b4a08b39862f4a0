"""Engine (CPU path: NumPy twins) against the official implementation's goldens and against itself.

Goldens: fixtures/<name>/golden.npz hold transformers' float32 logits for each prompt (prefill) and for
incremental decode (``decode/<p>/*``). Tolerance: 1e-4 relative (max |diff| / max |ref|), the issue's
float32 acceptance figure; the engine's float32 path differs from torch only in summation order
(measured ~3e-6 on these fixtures), so 1e-4 leaves 30x headroom while any real fault (one perturbed
weight, a position off by one, a wrong tie order, lost state) moves logits by > 1e-2.

Engine-vs-engine checks (batching, fork, snapshot/restore, verify/rollback, reuse of freed slots) must be
*identical up to summation order* of the same kernels, so they use 1e-5 relative.

Every check carries a negative control: the same comparison with an injected fault must fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reference.paths import FIXTURES

pytestmark = []

FIXTURE_NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/golden.npz"))
TOL_GOLDEN = 1e-4   # the float32 acceptance bound (see module docstring)
TOL_SELF = 1e-5     # same kernels, different batching/chunking: summation order only


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


_CK = {}


def ckpt(name):
    from reference.checkpoint import Checkpoint
    if name not in _CK:
        _CK[name] = Checkpoint.open(FIXTURES / name)
    return _CK[name]


def golden(name):
    return np.load(FIXTURES / name / "golden.npz")


def make_engine(name="tiny", weights=None, **kw):
    from engine import Engine
    kw.setdefault("precision", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("page_size", 3)
    kw.setdefault("kv_tokens", 600)
    return Engine(weights if weights is not None else ckpt(name), **kw)


def prompts(name):
    g = golden(name)
    return sorted({k.split("/")[0] for k in g.files if k.endswith("/ids")})


needs_fixtures = pytest.mark.skipif(not FIXTURE_NAMES, reason="no fixtures built (fixtures/*/golden.npz missing)")


# ------------------------------------------------------------------------------------------ vs goldens
@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_prefill_matches_official_logits(name):
    g = golden(name)
    eng = make_engine(name)
    for p in prompts(name):
        s = eng.add_sequence()
        lg = eng.prefill(s, g[f"{p}/ids"])
        assert lg.shape == g[f"{p}/logits"].shape
        err = rel_err(lg, g[f"{p}/logits"])
        assert err < TOL_GOLDEN, f"{name}/{p}: max rel err {err:.2e}"
        eng.free(s)


@needs_fixtures
@pytest.mark.parametrize("page_size,chunk", [(1, None), (3, 5), (16, 1), (64, 7)])
def test_page_sizes_and_prefill_chunks(page_size, chunk):
    name = FIXTURE_NAMES[0]
    g = golden(name)
    eng = make_engine(name, page_size=page_size, kv_tokens=256)
    ids = g["chat/ids"] if "chat/ids" in g.files else g[f"{prompts(name)[-1]}/ids"]
    ref = g["chat/logits"] if "chat/ids" in g.files else g[f"{prompts(name)[-1]}/logits"]
    s = eng.add_sequence()
    lg = eng.prefill(s, ids, chunk_size=chunk)
    assert rel_err(lg, ref) < TOL_GOLDEN


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_incremental_decode_matches_official(name):
    g = golden(name)
    decs = sorted({k.split("/")[1] for k in g.files if k.startswith("decode/")})
    assert decs, "fixture has no decode goldens"
    eng = make_engine(name)
    for d in decs:
        n0 = int(g[f"decode/{d}/prefix_len"])
        ids = g[f"{d}/ids"]
        ref = g[f"decode/{d}/logits"]
        s = eng.add_sequence()
        pl = eng.prefill(s, ids[:n0])
        assert rel_err(pl, g[f"decode/{d}/prefill_logits"]) < TOL_GOLDEN
        rows = [eng.decode([s], [int(t)])[0] for t in ids[n0:n0 + len(ref)]]
        err = rel_err(np.stack(rows), ref)
        assert err < TOL_GOLDEN, f"{name}/decode {d}: {err:.2e}"
        eng.free(s)


@needs_fixtures
def test_negative_control_perturbed_weight_is_detected():
    """Control: one weight scaled by 1.05 must break the golden comparison (the harness can fail)."""
    name = FIXTURE_NAMES[0]
    g = golden(name)
    ck = ckpt(name)
    victim = "layers.1.linear_attn.out_proj.weight"
    bad = ck.with_override(victim, ck.get(victim) * 1.05)
    eng = make_engine(name, weights=bad)
    s = eng.add_sequence()
    assert rel_err(eng.prefill(s, g["short/ids"]), g["short/logits"]) > 100 * TOL_GOLDEN


@needs_fixtures
def test_negative_control_position_off_by_one_is_detected(monkeypatch):
    """Control: every token placed one position later (rope/QSA/paging) must break the comparison."""
    from engine import model as M
    name = FIXTURE_NAMES[0]
    g = golden(name)
    orig = M.Segment.__init__

    def shifted(self, seq, ids):
        orig(self, seq, ids)
        self.start = seq.length + 1
    eng = make_engine(name)
    s = eng.add_sequence()
    eng.pool.reserve(s, 1)  # room for the shifted positions
    monkeypatch.setattr(M.Segment, "__init__", shifted)
    assert rel_err(eng.prefill(s, g["qsa/ids"]), g["qsa/logits"]) > 100 * TOL_GOLDEN


# ------------------------------------------------------------------------------------------ serving state
def _long_ids(name, n=40, seed=None):
    rng = np.random.default_rng(seed)
    V = ckpt(name).config.vocab_size
    ids = rng.integers(0, V, n)
    eos = ckpt(name).config.ple_eos_token_id
    if eos is not None:
        ids[n // 3] = eos  # exercise the PLE n-gram reset
    return ids


@needs_fixtures
def test_batched_decode_of_different_lengths_equals_single_runs():
    name = FIXTURE_NAMES[0]
    eng = make_engine(name, max_seqs=8, kv_tokens=900)
    lens = [1, 5, 14, 23]
    data = [_long_ids(name, L + 4) for L in lens]
    # singles
    singles = []
    for ids, L in zip(data, lens):
        s = eng.add_sequence()
        eng.prefill(s, ids[:L])
        singles.append(np.stack([eng.decode([s], [int(t)])[0] for t in ids[L:]]))
        eng.free(s)
    seqs = []
    for ids, L in zip(data, lens):
        s = eng.add_sequence()
        eng.prefill(s, ids[:L])
        seqs.append(s)
    batched = [eng.decode(seqs, [int(d[L + j]) for d, L in zip(data, lens)]) for j in range(4)]
    for b, single in enumerate(singles):
        got = np.stack([batched[j][b] for j in range(4)])
        assert rel_err(got, single) < TOL_SELF, f"sequence {b}"
    assert [s.length for s in seqs] == [L + 4 for L in lens]


@needs_fixtures
def test_fork_continues_independently():
    name = FIXTURE_NAMES[0]
    eng = make_engine(name, max_seqs=4)
    ids = _long_ids(name, 30)
    a = eng.add_sequence()
    eng.prefill(a, ids[:17])  # partial page at 17 with page_size 3
    b = eng.fork(a)
    la = eng.prefill(a, ids[17:24])
    lb = eng.prefill(b, ids[20:30])  # a different continuation
    ra, rb = eng.add_sequence(), eng.add_sequence()
    ref_a = eng.prefill(ra, ids[:24])[17:]
    ref_b = eng.prefill(rb, np.concatenate([ids[:17], ids[20:30]]))[17:]
    assert rel_err(la, ref_a) < TOL_SELF and rel_err(lb, ref_b) < TOL_SELF


@needs_fixtures
def test_snapshot_restore_equals_straight_run():
    name = FIXTURE_NAMES[0]
    eng = make_engine(name)
    ids = _long_ids(name, 36)
    s = eng.add_sequence()
    eng.prefill(s, ids[:19])
    snap = eng.snapshot(s)
    eng.prefill(s, _long_ids(name, 9))  # wander off (writes into the snapshot's shared partial page)
    eng.restore(s, snap)
    got = eng.prefill(s, ids[19:])
    r = eng.add_sequence()
    ref = eng.prefill(r, ids)[19:]
    assert rel_err(got, ref) < TOL_SELF


@needs_fixtures
def test_negative_control_cow_dropping_indexer_keys_is_detected():
    """Control: a copy-on-write that skips the indexer-key pools changes the diverged branch's logits."""
    name = FIXTURE_NAMES[0]
    eng = make_engine(name)
    ids = _long_ids(name, 36)
    ref_s = eng.add_sequence()
    ref = eng.prefill(ref_s, ids)[20:]
    s = eng.add_sequence()
    eng.prefill(s, ids[:20])
    snap = eng.snapshot(s)  # noqa: F841  (shares the partial page -> the next write copies it)
    pool = eng.pool
    orig = pool.page_arrays
    pool.page_arrays = lambda: ((k, a) for k, a in orig() if not k.startswith(("idx_k", "blk_k")))
    got = eng.prefill(s, ids[20:])
    assert rel_err(got, ref) > 100 * TOL_SELF


@needs_fixtures
@pytest.mark.parametrize("k,reject", [(5, 2), (4, 4), (3, 0)])
def test_verify_rollback_equals_straight_run(k, reject):
    name = FIXTURE_NAMES[0]
    eng = make_engine(name)
    ids = _long_ids(name, 32)
    draft = _long_ids(name, k)
    n0 = 15
    s = eng.add_sequence()
    eng.prefill(s, ids[:n0])
    vl = eng.verify(s, draft)
    eng.rollback(s, reject)
    keep = k - reject
    assert s.length == n0 + keep
    got = eng.prefill(s, ids[n0:])
    r = eng.add_sequence()
    straight = eng.prefill(r, np.concatenate([ids[:n0], draft[:keep], ids[n0:]]))
    assert rel_err(vl, straight[n0:n0 + k] if reject == 0 else eng_prefill_ref(eng, ids[:n0], draft)) < TOL_SELF
    assert rel_err(got, straight[n0 + keep:]) < TOL_SELF


def eng_prefill_ref(eng, prefix, draft):
    r = eng.add_sequence()
    out = eng.prefill(r, np.concatenate([prefix, draft]))[len(prefix):]
    eng.free(r)
    return out


@needs_fixtures
def test_negative_control_rollback_without_recurrent_restore_is_detected(monkeypatch):
    """Control: a rollback that only truncates the KV length (keeps the drafted tokens' GDN/PLE state)."""
    name = FIXTURE_NAMES[0]
    eng = make_engine(name)
    ids = _long_ids(name, 26)
    draft = _long_ids(name, 4)
    s = eng.add_sequence()
    eng.prefill(s, ids[:15])
    eng.verify(s, draft)
    monkeypatch.setattr(eng.pool, "slab_arrays", lambda: iter(()))
    eng.rollback(s, 4)
    got = eng.prefill(s, ids[15:])
    r = eng.add_sequence()
    ref = eng.prefill(r, ids)[15:]
    assert rel_err(got, ref) > 100 * TOL_SELF


@needs_fixtures
def test_freed_poisoned_sequence_does_not_leak():
    """A sequence whose whole state is poisoned with NaN is freed; the next sequence, which reuses its slab
    row and pages, computes exactly what a fresh engine computes."""
    name = FIXTURE_NAMES[0]
    eng = make_engine(name, max_seqs=1, kv_tokens=60)
    ids = _long_ids(name, 25)
    a = eng.add_sequence()
    eng.prefill(a, ids[:20])
    pool = eng.pool
    for _, arr in pool.page_arrays():
        arr[pool.slots(a, 0, a.length)] = np.nan
    for key, arr in pool.slab_arrays():
        arr[a.slab] = -1 if key.startswith("ple_ctx") else np.nan
    pages = set(a.pages)
    eng.free(a)
    b = eng.add_sequence()
    got = eng.prefill(b, ids)
    assert set(b.pages) & pages, "the test must reuse the freed pages"
    fresh = make_engine(name, max_seqs=1, kv_tokens=60)
    ref = fresh.prefill(fresh.add_sequence(), ids)
    assert np.isfinite(got).all() and rel_err(got, ref) < TOL_SELF


@needs_fixtures
def test_negative_control_unscrubbed_slab_leaks(monkeypatch):
    """Control: with slab scrubbing disabled the poison reaches the next sequence."""
    name = FIXTURE_NAMES[0]
    eng = make_engine(name, max_seqs=1, kv_tokens=60)
    ids = _long_ids(name, 12)
    a = eng.add_sequence()
    eng.prefill(a, ids)
    for key, arr in eng.pool.slab_arrays():
        if key.startswith("gdn_rec"):
            arr[a.slab] = np.nan
    monkeypatch.setattr(eng.pool, "_scrub_slab", lambda slab: None)
    eng.free(a)
    b = eng.add_sequence()
    assert not np.isfinite(eng.prefill(b, ids)).all()


# ------------------------------------------------------------------------------------------ limits, taps
@needs_fixtures
def test_limits_are_stated_and_enforced():
    from engine import CapacityError
    name = FIXTURE_NAMES[0]
    eng = make_engine(name, page_size=4, kv_tokens=16, max_seqs=2)
    assert eng.limits["kv_token_capacity"] == 16 and "16 KV tokens" in eng.describe_limits()
    s = eng.add_sequence()
    with pytest.raises(CapacityError, match="KV pages"):
        eng.prefill(s, _long_ids(name, 17))
    assert s.length == 0  # nothing silently truncated
    with pytest.raises(CapacityError, match="needs 5 free pages"):
        eng.prefill(s, _long_ids(name, 17), chunk_size=4)  # checked for the whole prompt before any chunk runs
    assert s.length == 0 and s.pages == []
    lg = eng.prefill(s, _long_ids(name, 16))
    assert lg.shape[0] == 16
    with pytest.raises(CapacityError, match="max_position_embeddings"):
        eng.prefill(eng.add_sequence(), np.zeros(ckpt(name).config.max_position_embeddings + 1, np.int64))


@needs_fixtures
def test_taps_only_with_recorder_and_registry_names():
    from taps.recorder import Recorder
    from taps.registry import tap_names
    name = FIXTURE_NAMES[0]
    g = golden(name)
    eng = make_engine(name)
    s = eng.add_sequence()
    calls = []
    real = eng.model.syncs.host
    eng.model.syncs.host = lambda a: (calls.append(1), real(a))[1]  # spy on every host copy
    eng.prefill(s, g["short/ids"])
    assert len(calls) == 1  # only the logits copy: no tap work without a recorder
    r = eng.add_sequence()
    with Recorder() as rec:
        eng.prefill(r, g["short/ids"])
    assert len(calls) > 2
    arch = rec.archive()
    names = set(arch.names()) if hasattr(arch, "names") else set(arch.manifest["order"])
    expected = set(tap_names(ckpt(name).config))
    assert names == expected, sorted(names ^ expected)[:10]


@needs_fixtures
def test_interrupted_step_marks_sequence_broken_until_restore(monkeypatch):
    """A step interrupted between layers leaves the sequence unusable (clear error) until restore()."""
    from engine import StateError
    from engine import model as M
    name = FIXTURE_NAMES[0]
    eng = make_engine(name)
    ids = _long_ids(name, 20)
    s = eng.add_sequence()
    eng.prefill(s, ids[:10])
    snap = eng.snapshot(s)
    real = M.EngineModel._moe
    calls = []

    def boom(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(M.EngineModel, "_moe", boom)
    with pytest.raises(KeyboardInterrupt):
        eng.prefill(s, ids[10:])
    monkeypatch.setattr(M.EngineModel, "_moe", real)
    with pytest.raises(StateError, match="interrupted"):
        eng.decode([s], [1])
    eng.restore(s, snap)
    got = eng.prefill(s, ids[10:])
    r = eng.add_sequence()
    assert rel_err(got, eng.prefill(r, ids)[10:]) < TOL_SELF
