"""Recorder + archive: roundtrip (in memory and on disk), incremental flushes, filters, size estimate,
cap, atomicity (exception and kill -9 mid-write), newer-format refusal, lazy reading."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from taps import registry
from taps.archive import Archive, ArchiveError, FORMAT_VERSION
from taps.recorder import Recorder, TapCapError, TapError, current, parse_positions
from taps.synthetic import fake_forward, tiny_config

REPO = Path(__file__).resolve().parents[2]
CFG = tiny_config()
IDS = list(range(2, 14))


def _record(out=None, **kw):
    fkw = {k: kw.pop(k) for k in ("chunk_size", "fault", "seed") if k in kw}
    with Recorder(out, meta={"backend": "synthetic", "token_ids": IDS}, **kw) as rec:
        fake_forward(CFG, IDS, **fkw)
    return rec.archive()


def test_no_recorder_means_none():
    assert current() is None
    with Recorder() as rec:
        assert current() is rec
    assert current() is None


@pytest.mark.parametrize("disk", [False, True])
def test_roundtrip_matches_chunked_emits(tmp_path, disk):
    # chunked emission (3 chunks) with tiny flushes: many segments and files must read back as one array
    out = tmp_path / "a.taps" if disk else None
    arc = _record(out, chunk_size=5, flush_bytes=2000)
    ref = _record(None, chunk_size=None)   # one chunk, in memory
    assert arc.names() == registry.tap_names(CFG)
    for n in arc.names():
        np.testing.assert_array_equal(arc.positions(n), np.arange(len(IDS)))
        np.testing.assert_array_equal(arc.get(n), ref.get(n))
    if disk:
        files = sorted(p.name for p in out.iterdir())
        assert len([f for f in files if f.endswith(".safetensors")]) > 3  # really written incrementally
        m = json.loads((out / "manifest.json").read_text())
        assert m["format_version"] == FORMAT_VERSION and m["token_ids"] == IDS and m["backend"] == "synthetic"
        assert m["registry_version"] == registry.REGISTRY_VERSION
        assert m["positions"] == [[0, len(IDS)]]
        # lazy chunked iteration equals the whole
        name = "layers.1.attn_hyper_connection.in"
        parts = list(arc.iter_chunks(name, chunk_rows=5))
        assert [len(p) for p, _ in parts] == [5, 5, 2]
        np.testing.assert_array_equal(np.concatenate([r for _, r in parts]), ref.get(name))


def test_ragged_block_scores_padded_with_neg_inf():
    arc = _record(None, chunk_size=5)
    v = arc.get("layers.3.self_attn.indexer.block_scores")
    # 12 tokens, blocks of 2: 6 blocks; positions 0..4 were emitted while only 2 blocks existed
    assert v.shape == (12, 6)
    assert np.isneginf(v[:5, 2:]).all()
    assert np.isfinite(v[11]).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(splits=st.lists(st.integers(1, 6), min_size=1, max_size=6), width=st.integers(1, 5),
       flush=st.integers(1, 400), dtype=st.sampled_from(["float32", "float64", "int64"]))
def test_property_roundtrip_any_emit_pattern(tmp_path_factory, splits, width, flush, dtype):
    rng = np.random.default_rng(len(splits) * 31 + width)
    d = tmp_path_factory.mktemp("arc") / "x"
    parts, pos0 = [], 0
    with Recorder(d, flush_bytes=flush) as rec:
        for n in splits:
            v = (rng.standard_normal((n, width)) * 100).astype(dtype)
            p = np.arange(pos0, pos0 + n)
            rec.emit("layers.0.mlp.out", v, positions=p)
            parts.append(v)
            pos0 += n
    arc = Archive.open(d)
    np.testing.assert_array_equal(arc.get("layers.0.mlp.out"), np.concatenate(parts))
    np.testing.assert_array_equal(arc.positions("layers.0.mlp.out"), np.arange(pos0))
    assert arc.info("layers.0.mlp.out").dtype == dtype


def test_filters_include_layers_positions_and_companion():
    arc = _record(None, include=["layers.*.mlp.gate.topk_ids", "logits"], layers="1:3", positions="2:5,9")
    names = set(arc.names())
    # companion score taps ride along with their index taps; layer filter keeps 1 and 2 only
    assert names == {"layers.1.mlp.gate.topk_ids", "layers.1.mlp.gate.router_logits",
                     "layers.2.mlp.gate.topk_ids", "layers.2.mlp.gate.router_logits", "logits"}
    np.testing.assert_array_equal(arc.positions("logits"), [2, 3, 4, 9])
    assert arc.manifest["positions"] == [[2, 5], [9, 10]]
    full = _record(None)
    np.testing.assert_array_equal(arc.get("logits"), full.get("logits")[[2, 3, 4, 9]])


def test_scores_kwarg_records_companion():
    with Recorder() as rec:
        rec.emit("layers.0.mlp.gate.topk_ids", np.array([[1, 0]]), positions=[0], scores=np.array([[3.0, 2.0, 1.0]]))
    arc = rec.archive()
    np.testing.assert_array_equal(arc.get("layers.0.mlp.gate.router_logits"), [[3.0, 2.0, 1.0]])


def test_positions_spec_parsing_and_errors():
    np.testing.assert_array_equal(parse_positions("0:3, 7, 10:16:3"), [0, 1, 2, 7, 10, 13])
    assert parse_positions(None) is None and parse_positions("all") is None
    for bad in ("5:", "x", "-3"):
        with pytest.raises(TapError, match="positions"):
            parse_positions(bad)


def test_emit_errors_are_clear():
    with Recorder() as rec:
        with pytest.raises(TapError, match="expected 3 positions"):
            rec.emit("logits", np.zeros((3, 4)), positions=[0, 1])
        rec.emit("logits", np.zeros((1, 4)), positions=[0])
        with pytest.raises(TapError, match="like its earlier emits"):
            rec.emit("logits", np.zeros((1, 5)), positions=[1])


def test_estimate_equals_recorded_bytes():
    # float32 elements (4 bytes), int64 index taps (8), 8 bytes of position per row: exact for a run
    # whose block_scores reach their full width, which the one-chunk synthetic run does.
    for include, layers in ((None, None), (["layers.*.linear_attn.*"], "0:2"), (["logits"], None)):
        with Recorder(include=include, layers=layers) as rec:
            fake_forward(CFG, IDS)
        est = Recorder.estimate(CFG, len(IDS), include=include, layers=layers)
        assert est == rec.bytes_recorded, (include, layers)
        assert est > 0


def test_cap_exceeded_leaves_no_archive(tmp_path):
    out = tmp_path / "capped"
    with pytest.raises(TapCapError, match="cap of 5000 bytes"):
        _record(out, cap_bytes=5000)
    assert not out.exists()
    assert not list(tmp_path.glob("capped.tmp-*"))


def test_exception_mid_run_leaves_no_archive(tmp_path):
    out = tmp_path / "boom"
    with pytest.raises(RuntimeError):
        with Recorder(out, flush_bytes=100) as rec:
            rec.emit("logits", np.ones((4, 8), np.float32), positions=range(4))
            rec.emit("logits", np.ones((4, 8), np.float32), positions=range(4, 8))
            raise RuntimeError("producer crashed")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_existing_output_refused(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ArchiveError, match="expected a new path"):
        with Recorder(tmp_path / "x"):
            pass


def test_kill_mid_write_leaves_no_archive(tmp_path):
    out = tmp_path / "killed"
    code = textwrap.dedent(f"""
        import sys, time, numpy as np
        sys.path.insert(0, {str(REPO)!r})
        from taps.recorder import Recorder
        with Recorder({str(out)!r}, flush_bytes=1) as rec:
            for t in range(100000):
                rec.emit("logits", np.ones((1, 64), np.float32), positions=[t])
                if t == 3:
                    print("flushing", flush=True)
                time.sleep(0.001)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "flushing"
    deadline = time.time() + 20
    while time.time() < deadline and not any(tmp_path.glob("killed.tmp-*/chunk-00003.safetensors")):
        time.sleep(0.01)
    assert any(tmp_path.glob("killed.tmp-*/chunk-*.safetensors"))   # it really was mid-write
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists()
    with pytest.raises(ArchiveError, match="interrupted recording"):
        Archive.open(out)


def test_newer_format_version_refused(tmp_path):
    out = tmp_path / "new"
    _record(out, include=["logits"])
    m = json.loads((out / "manifest.json").read_text())
    m["format_version"] = FORMAT_VERSION + 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArchiveError, match=rf"format version {FORMAT_VERSION + 1} is newer .*up to {FORMAT_VERSION}"):
        Archive.open(out)


def test_missing_tap_and_missing_file_errors(tmp_path):
    out = tmp_path / "a"
    arc = _record(out, include=["logits"])
    with pytest.raises(ArchiveError, match="'layers.0.mlp.out': not recorded"):
        arc.get("layers.0.mlp.out")
    for f in out.glob("chunk-*.safetensors"):
        f.unlink()
    with pytest.raises(ArchiveError, match="missing"):
        Archive.open(out).get("logits")
