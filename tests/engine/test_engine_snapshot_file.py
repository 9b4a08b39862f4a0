"""Engine snapshots to disk and back (Engine.export_snapshot / import_snapshot + parity/snapshot_file.py), the
refusals (another model, another format version, missing PLE / indexer state, checked by contents), the sequence
kernels' limits stated/refused at Engine load, and the reference's content check of partial snapshots.

Tolerances: an exported-then-imported state holds the same float32 bytes as the in-memory snapshot, so the
continuation is bitwise identical to an in-memory restore (exact compare). Against a straight (one-prefill) run
the histories were built by different op sequences (prefill chunks vs decode steps), so they agree to summation
order only: 1e-5 relative (the engine self-consistency figure of tests/engine/test_engine_forward.py; measured ~1e-6),
while a lost or zeroed state moves logits by > 1e-2 (the negative controls below show it).
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from parity.backends import snapshot_file as sf
from parity.backends import EngineBackend, open_backend
from parity.harness.scenarios.common import token_stream
from reference.errors import UserError

FIX = "fixtures/tiny"
TOL_SELF = 1e-5  # summation order only (module docstring)
P = 14           # snapshot position: past the QSA bound (11), inside a compress block (14 % 4 = 2)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module")
def be():
    return open_backend("engine-cpu", FIX, page_size=3, kv_tokens=600)


@pytest.fixture(scope="module")
def ids(be):
    return token_stream(be.config, P + 5, seed=11, eos_every=6)


@pytest.fixture(scope="module")
def straight(be, ids):
    """Logits of every position of ``ids`` from one straight prefill."""
    h = be.new_sequence()
    out = be.prefill(h, ids)
    be.free(h)
    return out


@pytest.fixture()
def snap(be, ids):
    h = be.new_sequence()
    be.prefill(h, ids[:P])
    s = be.snapshot(h)
    be.free(h)
    yield s
    s.release()


def continue_decode(be, h, ids):
    return np.stack([be.decode([h], [t])[0] for t in ids[P:]])


def test_export_names_every_state_like_the_reference(be, snap):
    data = be.eng.export_snapshot(snap)
    assert data["length"] == P and data["kinds"] == sf.required_kinds(be.config)
    flat = sf.flatten_state(snap)  # via Snapshot.to_portable
    assert flat and all(sf.kind_of(p) is not None for p in flat), [p for p in flat if sf.kind_of(p) is None]
    assert sf.state_kinds(snap) == sf.required_kinds(be.config)
    r = be.config.indexer_compress_ratio
    for i, q in data["qsa"].items():
        assert q["k"].shape[0] == P and q["index_keys"].shape[0] == P and q["block_keys"].shape[0] == P // r
    # exported KV equals what the adapter reads from the live pages (same gather, independent code path)
    h = be.new_sequence()
    be.restore(h, snap)
    live = be.state_arrays(h)
    be.free(h)
    for fam in ("qsa", "gdn", "ple"):
        for i, fields in data[fam].items():
            for f, a in fields.items():
                name = {"context": f"ple.{i}.context"}.get(f, f"{fam}.{i}.{f}")
                assert np.array_equal(a, live[name]), name


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_file_roundtrip_equals_straight_run(be, snap, ids, straight, tmp_path, page_size):
    f = sf.save_snapshot(tmp_path / "e.qsnap", snap, be, position=P)
    assert not list(tmp_path.glob("*.tmp-*"))
    meta = sf.read_meta(f)
    assert set(meta["kinds"]) == sf.required_kinds(be.config) and meta["position"] == P
    assert meta["model"]["weights_fingerprint"] == be.eng.ck.fingerprint()
    back = sf.load_snapshot(f, be)
    # another engine with another page size: the export is page-independent
    other = open_backend("engine-cpu", FIX, page_size=page_size, kv_tokens=600)
    h2 = other.new_sequence()
    other.prefill(h2, ids[:3])  # a non-empty target: its state must be replaced entirely
    other.restore(h2, back)
    assert other.position(h2) == P
    got = continue_decode(other, h2, ids)
    h = be.new_sequence()
    be.restore(h, snap)
    mem = continue_decode(be, h, ids)
    be.free(h)
    assert np.array_equal(got, mem)  # same state bytes -> bitwise identical continuation
    assert rel_err(got, straight[P:]) <= TOL_SELF


def test_negative_control_corrupted_indexer_keys_are_caught_by_the_roundtrip_check(be, snap, ids, straight):
    data = be.eng.export_snapshot(snap)
    for q in data["qsa"].values():  # shapes kept, contents lost: import accepts, the continuation must differ
        q["index_keys"][:] = 0
        q["block_keys"][:] = 0
    h = be.new_sequence()
    be.restore(h, data)
    got = continue_decode(be, h, ids)
    be.free(h)
    assert rel_err(got, straight[P:]) > 100 * TOL_SELF


def _edit_meta(path, fn):
    m = json.loads((path / "meta.json").read_text())
    fn(m)
    (path / "meta.json").write_text(json.dumps(m))


@pytest.mark.parametrize("field,value,match", [
    ("format_version", sf.FORMAT_VERSION + 1, "format_version"),
    ("config_hash", "0" * 16, "config_hash"),
    ("weights_fingerprint", "deadbeef", "weights_fingerprint"),
])
def test_file_of_another_model_or_version_is_refused(be, snap, tmp_path, field, value, match):
    f = sf.save_snapshot(tmp_path / "e.qsnap", snap, be, position=P)
    _edit_meta(f, lambda m: (m["model"] if field != "format_version" else m).__setitem__(field, value))
    with pytest.raises(sf.SnapshotError, match=match):
        sf.load_snapshot(f, be)


def test_file_of_perturbed_weights_or_other_fixture_is_refused(be, snap, tmp_path):
    f = sf.save_snapshot(tmp_path / "e.qsnap", snap, be, position=P)
    pert = open_backend("engine-cpu", FIX, page_size=3, kv_tokens=60,
                        perturb=("lm_head.weight", lambda w: w * 1.01))
    with pytest.raises(sf.SnapshotError, match="weights_fingerprint"):
        sf.load_snapshot(f, pert)
    hc2 = open_backend("engine-cpu", "fixtures/tiny-hc2", page_size=3, kv_tokens=60)
    with pytest.raises(sf.SnapshotError, match="another model"):
        sf.load_snapshot(f, hc2)


def test_import_of_another_model_is_refused_even_without_the_file_check(be, snap):
    hc2 = open_backend("engine-cpu", "fixtures/tiny-hc2", page_size=3, kv_tokens=60)
    h = hc2.new_sequence()
    with pytest.raises(UserError, match="config_hash"):
        hc2.restore(h, be.eng.export_snapshot(snap))


@pytest.mark.parametrize("kind", sf.KINDS)
def test_file_lacking_a_kind_is_refused_on_load_and_on_restore(be, snap, tmp_path, kind):
    bad = sf.strip_kind(snap, kind)
    assert kind not in sf.state_kinds(bad)
    f = sf.save_snapshot(tmp_path / "bad.qsnap", bad, be, position=P)
    with pytest.raises(sf.SnapshotError, match=kind.replace(".", r"\.")):
        sf.load_snapshot(f, be)
    h = be.new_sequence()
    try:
        with pytest.raises(UserError, match=kind.replace(".", r"\.")):
            be.restore(h, bad)
        assert be.position(h) == 0  # refused before anything changed
    finally:
        be.free(h)


@pytest.mark.parametrize("fam,field,kind", [("qsa", "index_keys", "qsa.indexer_keys"),
                                            ("qsa", "block_keys", "qsa.indexer_keys"),
                                            ("ple", "conv", "ple.conv"), ("ple", "context", "ple.ngram_context")])
def test_negative_control_export_dropping_one_layer_with_intact_label_is_refused(be, snap, fam, field, kind):
    """The ``kinds`` label still claims everything; only one layer's array is gone: the contents check must
    name it (a label-only check would accept this and serve a partial state)."""
    data = be.eng.export_snapshot(snap)
    assert kind in data["kinds"]
    layer = sorted(data[fam])[-1]
    del data[fam][layer][field]
    h = be.new_sequence()
    be.prefill(h, [1, 2])
    try:
        with pytest.raises(UserError, match=re.escape(f"{fam}.{layer}.{field} (state kind {kind})")):
            be.restore(h, data)
        assert be.position(h) == 2  # the target sequence is unchanged
    finally:
        be.free(h)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["qsa"][sorted(d["qsa"])[0]].__setitem__(
        "block_keys", d["qsa"][sorted(d["qsa"])[0]]["block_keys"][:-1]), "expected shape"),
    (lambda d: d["ple"][sorted(d["ple"])[0]].__setitem__(
        "context", d["ple"][sorted(d["ple"])[0]]["context"].astype(np.float32)), "integer token ids"),
    (lambda d: d.__setitem__("version", 99), "version"),
    (lambda d: d.__setitem__("length", -1), "length"),
])
def test_malformed_export_is_refused(be, snap, edit, match):
    data = be.eng.export_snapshot(snap)
    edit(data)
    h = be.new_sequence()
    try:
        with pytest.raises(UserError, match=match):
            be.restore(h, data)
    finally:
        be.free(h)


def test_import_out_of_pages_is_a_capacity_error_and_leaves_the_sequence(be, snap):
    from engine.state import CapacityError
    small = open_backend("engine-cpu", FIX, page_size=4, kv_tokens=8)  # 2 pages < ceil(14 / 4) = 4
    h = small.new_sequence()
    small.prefill(h, [3])
    with pytest.raises(CapacityError, match="KV pages"):
        small.restore(h, be.eng.export_snapshot(snap))
    assert small.position(h) == 1 and small.eng.pool.free_pages() == 1


def test_released_or_foreign_snapshot_export_is_refused(be, ids):
    from engine.state import StateError
    h = be.new_sequence()
    be.prefill(h, ids[:4])
    s = be.snapshot(h)
    be.free(h)
    other = open_backend("engine-cpu", FIX, page_size=3, kv_tokens=60)
    with pytest.raises(StateError, match="this engine"):
        other.eng.export_snapshot(s)
    s.release()
    with pytest.raises(StateError, match="released"):
        be.eng.export_snapshot(s)


def test_engine_adapter_declares_snapshot_file():
    assert EngineBackend.capabilities["snapshot_file"] is True


# ------------------------------------------------------------------------ reference: contents, not labels
def test_reference_refuses_snapshot_whose_label_claims_stripped_state():
    ref = open_backend("reference", FIX)
    h = ref.new_sequence()
    ref.prefill(h, token_stream(ref.config, P, seed=5))
    good = ref.snapshot(h)
    for kind in ("ple.conv", "qsa.indexer_keys", "gdn.recurrent"):
        stripped = sf.strip_kind(good, kind)
        # negative control: put the full label back, so only the contents betray the missing state
        liar = dataclasses.replace(stripped, kinds=good.kinds)
        assert kind in liar.kinds and kind not in sf.state_kinds(liar)
        with pytest.raises(UserError, match=re.escape(f"({kind})")):
            ref.restore(h, liar)
    ref.restore(h, good)  # the intact snapshot is still accepted
    assert ref.position(h) == P


# ------------------------------------------------------------------------ sequence-kernel limits at load
class _Ck:
    def __init__(self, config):
        self.config = config


@pytest.mark.parametrize("change,match", [({"linear_conv_kernel_dim": 18}, "linear_conv_kernel_dim"),
                                          ({"indexer_budget": 4 * 5000}, "block_topk")])
def test_engine_refuses_config_beyond_cuda_kernel_limits_at_load(change, match):
    from engine import Engine
    from reference.checkpoint import Checkpoint
    from reference.config import ConfigError
    bad = dataclasses.replace(Checkpoint.open(FIX).config, **change)
    # raised before the device is touched or a weight is read (the stand-in ck has no weights at all)
    with pytest.raises(ConfigError, match=match):
        Engine(_Ck(bad), precision="float32", device="cuda")


def test_negative_control_without_the_load_check_the_bad_config_is_not_refused_up_front(monkeypatch):
    import engine.engine as ee
    from reference.checkpoint import Checkpoint
    from reference.config import ConfigError
    monkeypatch.setattr(ee, "seq_kernel_limits", lambda config, gpu=True: {})
    bad = dataclasses.replace(Checkpoint.open(FIX).config, linear_conv_kernel_dim=18)
    with pytest.raises(Exception) as ei:
        ee.Engine(_Ck(bad), precision="float32", device="cuda")
    assert not isinstance(ei.value, ConfigError)  # no GPU / no weights fail later, not as the limit refusal


def test_cpu_engine_states_kernel_limits_at_load(be):
    lim = be.eng.limits["seq_kernels"]
    c = be.config
    assert lim["conv_state_rows"] == c.linear_conv_kernel_dim - 1 and lim["block_topk"] == c.block_topk
    text = be.eng.describe_limits()
    assert f"block top-k {c.block_topk} <= {lim['max_block_topk']}" in text and "conv state rows" in text


# ------------------------------------------------------------------------ the parity scenario cases
FILE_CASES = ("snapshot_file_roundtrip", "refuse_snapshot_lacking_ple_or_indexer")


@pytest.fixture(scope="module")
def truth():
    from parity.backends import truth_model
    from parity.harness.scenarios.common import TruthCache
    return TruthCache(truth_model(FIX))


def _file_case(name, config):
    from parity.harness.scenarios import cases_for
    return [c for c in cases_for("snapshot_restore", config, "ci") if c.name == name][0]


@pytest.mark.parametrize("name", FILE_CASES)
def test_engine_cpu_runs_and_passes_the_snapshot_file_cases(be, truth, name):
    from parity.harness.scenarios.runner import run_case
    r = run_case("snapshot_restore", _file_case(name, be.config), be, truth, locate_on_fail=False)
    assert r.status == "pass", (r.status, r.failure)  # not 'skip': the engine serialises its snapshots now
    assert r.checks > 0


class ImportZeroesPLEConv(EngineBackend):
    """Fault: a state read from disk comes back without its PLE conv history (zeros)."""

    def restore(self, h, snap):
        if isinstance(snap, dict):
            snap = {**snap, "ple": {i: {**d, "conv": np.zeros_like(d["conv"])} for i, d in snap["ple"].items()}}
        super().restore(h, snap)


class ImportAcceptsPartial(EngineBackend):
    """Fault: a partial state is silently accepted (the refusal swallowed, the old state kept)."""

    def restore(self, h, snap):
        try:
            super().restore(h, snap)
        except UserError:
            pass


@pytest.mark.parametrize("fault,name,expect", [(ImportZeroesPLEConv, FILE_CASES[0], "logit error"),
                                               (ImportAcceptsPartial, FILE_CASES[1], "silently accepted")])
def test_negative_control_faulty_engine_import_fails_the_scenario_case(truth, fault, name, expect):
    from parity.harness.scenarios.runner import run_case
    fb = fault.open(FIX, device="cpu", page_size=5, kv_tokens=600)
    r = run_case("snapshot_restore", _file_case(name, fb.config), fb, truth, locate_on_fail=False)
    assert r.status == "fail" and expect in (r.failure or ""), (r.status, r.failure)
