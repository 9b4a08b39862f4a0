"""Snapshot files (parity/snapshot_file.py): round trip, identity/version refusals, state-kind checks."""
from __future__ import annotations

import json

import numpy as np
import pytest

from parity.backends import snapshot_file as sf
from parity.backends import open_backend
from parity.harness.scenarios.common import token_stream

FIX = "fixtures/tiny"


@pytest.fixture(scope="module")
def be():
    return open_backend("reference", FIX)


@pytest.fixture(scope="module")
def snap_and_ids(be):
    ids = token_stream(be.config, 20, seed=3, eos_every=6)
    h = be.new_sequence()
    be.prefill(h, ids[:16])
    snap = be.snapshot(h)
    be.free(h)
    return snap, ids


def test_every_reference_state_array_has_a_kind(be, snap_and_ids):
    snap, _ = snap_and_ids
    flat = sf.flatten_state(snap)
    unknown = [p for p in flat if sf.kind_of(p) is None]
    assert not unknown, f"state arrays without a kind: {unknown}"
    assert sf.state_kinds(snap) == sf.required_kinds(be.config)


def test_roundtrip_continues_like_the_original(be, snap_and_ids, tmp_path):
    snap, ids = snap_and_ids
    f = sf.save_snapshot(tmp_path / "s.qsnap", snap, be, position=16)
    assert not list(tmp_path.glob("*.tmp-*"))  # written via temp + rename
    back = sf.load_snapshot(f, be)
    h1, h2 = be.new_sequence(), be.new_sequence()
    be.restore(h1, snap)
    be.restore(h2, back)
    a, b = be.prefill(h1, ids[16:]), be.prefill(h2, ids[16:])
    assert np.array_equal(a, b)  # same float32 state bytes -> bitwise identical continuation
    meta = sf.read_meta(f)
    assert meta["format_version"] == sf.FORMAT_VERSION and meta["position"] == 16
    assert set(meta["kinds"]) == sf.required_kinds(be.config)


def _edit_meta(path, fn):
    m = json.loads((path / "meta.json").read_text())
    fn(m)
    (path / "meta.json").write_text(json.dumps(m))


@pytest.mark.parametrize("field,value,match", [
    ("format_version", sf.FORMAT_VERSION + 1, "format_version"),
    ("config_hash", "0" * 16, "config_hash"),
    ("weights_fingerprint", "deadbeef", "weights_fingerprint"),
    ("format", "something-else", "format"),
])
def test_refuses_other_model_or_version(be, snap_and_ids, tmp_path, field, value, match):
    snap, _ = snap_and_ids
    f = sf.save_snapshot(tmp_path / "s.qsnap", snap, be, position=16)

    def edit(m):
        if field in ("config_hash", "weights_fingerprint"):
            m["model"][field] = value
        else:
            m[field] = value
    _edit_meta(f, edit)
    with pytest.raises(sf.SnapshotError, match=match):
        sf.load_snapshot(f, be)


def test_refuses_snapshot_of_another_fixture(be, snap_and_ids, tmp_path):
    snap, _ = snap_and_ids
    f = sf.save_snapshot(tmp_path / "s.qsnap", snap, be, position=16)
    other = open_backend("reference", "fixtures/tiny-hc2")
    with pytest.raises(sf.SnapshotError, match="another model"):
        sf.load_snapshot(f, other)


@pytest.mark.parametrize("kind", sf.KINDS)
def test_stripped_kind_is_refused_on_load_and_on_restore(be, snap_and_ids, tmp_path, kind):
    from reference.errors import UserError
    snap, _ = snap_and_ids
    bad = sf.strip_kind(snap, kind)
    assert kind not in sf.state_kinds(bad)
    f = sf.save_snapshot(tmp_path / "bad.qsnap", bad, be, position=16)
    with pytest.raises(sf.SnapshotError, match=kind.replace(".", r"\.")):
        sf.load_snapshot(f, be)
    h = be.new_sequence()
    with pytest.raises(UserError):
        be.restore(h, bad)  # the reference refuses, it does not serve a partial state
    be.free(h)


def test_strip_kind_rejects_unknown_kind(snap_and_ids):
    with pytest.raises(sf.SnapshotError, match="kind"):
        sf.strip_kind(snap_and_ids[0], "kv")


def test_unencodable_object_is_a_clear_error(be, tmp_path):
    with pytest.raises(sf.SnapshotError, match="cannot encode"):
        sf.save_snapshot(tmp_path / "x.qsnap", {"f": object()}, be)
