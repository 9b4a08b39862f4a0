"""Engine taps vs the reference's taps through tap-diff (CPU path).

The float32 engine's taps agree with the reference's under the ``fp32`` profile, the BF16 engine's under
the ``bf16`` profile (profiles in taps/profiles/ carry their own justified tolerances), for a chunked
prefill that crosses the QSA selection bound. Negative control: a perturbed weight is caught and
*located*: tap-diff's first divergence is the first tap downstream of that weight.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference.paths import FIXTURES

needs_tiny = pytest.mark.skipif(not (FIXTURES / "tiny" / "golden.npz").exists(), reason="fixtures/tiny not built")


def _record(fn):
    from taps.recorder import Recorder
    with Recorder() as rec:
        fn()
    return rec.archive()


def _setup():
    from reference.checkpoint import Checkpoint
    from reference.model import ReferenceModel
    ck = Checkpoint.open(FIXTURES / "tiny")
    ids = np.load(FIXTURES / "tiny" / "golden.npz")["qsa/ids"]
    ref = _record(lambda: ReferenceModel(ck).forward(ids))
    return ck, ids, ref


def _engine_taps(ck, ids, precision, chunk=None):
    from engine import Engine
    eng = Engine(ck, precision=precision, device="cpu", kv_tokens=128, page_size=3)
    return _record(lambda: eng.prefill(eng.add_sequence(), ids, chunk_size=chunk))


@needs_tiny
@pytest.mark.parametrize("precision,profile", [("float32", "fp32"), ("bf16", "bf16")])
def test_engine_taps_agree_with_reference(precision, profile):
    from taps.diff import diff_archives
    from taps.registry import tap_names
    ck, ids, ref = _setup()
    got = _engine_taps(ck, ids, precision, chunk=7)
    rep = diff_archives(ref, got, profile)
    assert rep.agree, rep.first_divergence
    compared = {r.name for r in rep.results if r.status in ("agree", "flip")}
    assert compared == set(tap_names(ck.config))  # every registry tap was produced and compared


@needs_tiny
def test_negative_control_perturbed_weight_is_located():
    from taps.diff import diff_archives
    ck, ids, ref = _setup()
    w = "layers.3.linear_attn.in_proj_z.weight"
    got = _engine_taps(ck.with_override(w, ck.get(w) * 1.05), ids, "float32")
    rep = diff_archives(ref, got, "fp32")
    assert not rep.agree
    assert rep.first_divergence == "layers.3.linear_attn.norm.out"  # z only enters the gated norm (its own tap)
