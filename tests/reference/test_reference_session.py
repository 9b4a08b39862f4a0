"""Session tests (no torch): every path -- chunked prefill at every chunk size, decode, forward_tokens +
rollback, snapshot/restore -- equals one full forward; float64 to 1e-12 relative. Negative controls:
dropped state, off-by-one position, a snapshot missing a state kind, an interrupted step."""
from __future__ import annotations
from reference import taphook

import numpy as np
import pytest

from reference.errors import InputError
from reference.model import ReferenceModel
from reference.session import Snapshot, required_kinds
from reference_helpers import EOS, random_weights, tiny_config

# 26 tokens: past the QSA bound (budget 8 + ratio 4 - 1 = 11) so block selection is active, with EOS
# resets in the middle for the PLE history.
T = 26
REL64 = 1e-12  # float64: paths differ only in summation order / chunk boundaries (~1e-15 observed)


@pytest.fixture(scope="module")
def model64():
    return ReferenceModel(random_weights(tiny_config(), seed=3), dtype=np.float64)


@pytest.fixture(scope="module")
def ids():
    rng = np.random.default_rng(11)
    x = rng.integers(0, 256, T)
    x[x == EOS] = 1
    x[[6, 15]] = EOS
    return x


@pytest.fixture(scope="module")
def full(model64, ids):
    return model64.forward(ids)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_chunked_prefill_every_chunk_size(model64, ids, full):
    for cs in range(1, T + 1):
        out = model64.new_session().prefill(ids, chunk_size=cs)
        assert out.shape == full.shape and out.dtype == np.float64
        assert rel(out, full) <= REL64, cs


def test_last_only_and_decode(model64, ids, full):
    s = model64.new_session()
    last = s.prefill(ids[:10], last_only=True)
    assert last.shape == (256,) and rel(last, full[9]) <= REL64
    steps = np.stack([s.decode(t) for t in ids[10:]])
    assert s.position == T
    assert rel(steps, full[10:]) <= REL64
    s2 = model64.new_session()
    last2 = s2.prefill(ids, chunk_size=7, last_only=True)
    assert rel(last2, full[-1]) <= REL64


def test_forward_tokens_and_rollback_every_n(model64, ids, full):
    k0 = 12
    for n in range(0, 9):
        s = model64.new_session()
        s.prefill(ids[:k0])
        v = s.forward_tokens(ids[k0:k0 + 8])
        assert v.shape == (8, 256) and rel(v, full[k0:k0 + 8]) <= REL64
        s.rollback(n)
        assert s.position == k0 + 8 - n
        rest = s.prefill(ids[s.position:])
        assert rel(rest, full[k0 + 8 - n:]) <= REL64, n


def test_rollback_to_rejected_draft_then_continue(model64, ids, full):
    """Verify a wrong draft, roll back past it, continue with the true tokens: exact."""
    s = model64.new_session()
    s.prefill(ids[:14])
    draft = ids[14:18].copy()
    draft[1:] = (draft[1:] + 5) % 256
    s.forward_tokens(draft)
    s.rollback(3)  # keep the first (correct) draft token
    out = s.prefill(ids[15:])
    assert rel(out, full[15:]) <= REL64
    with pytest.raises(InputError, match="no checkpoint"):
        s.rollback(5)
    with pytest.raises(InputError):
        s.rollback(T + 1)


def test_snapshot_restore_independent(model64, ids, full):
    s = model64.new_session()
    s.prefill(ids[:13], chunk_size=5)
    snap = s.snapshot()
    assert snap.kinds == required_kinds(model64.config) and snap.position == 13
    s.prefill(ids[13:20])  # advance past the snapshot: must not alter it
    s.restore(snap)
    assert s.position == 13
    out = s.prefill(ids[13:])
    assert rel(out, full[13:]) <= REL64
    s.restore(snap)  # the snapshot is reusable (restore copies)
    out2 = np.stack([s.decode(t) for t in ids[13:]])
    assert rel(out2, full[13:]) <= REL64


def test_restore_refuses_missing_kind(model64, ids):
    s = model64.new_session()
    s.prefill(ids[:5])
    snap = s.snapshot()
    for kind in sorted(snap.kinds):
        bad = Snapshot(snap.position, snap.state, snap.kinds - {kind}, snap.config_hash, snap.dtype)
        with pytest.raises(InputError, match=kind.replace(".", r"\.")):
            s.restore(bad)
    with pytest.raises(InputError):
        s.restore(Snapshot(snap.position, snap.state, snap.kinds, "other", snap.dtype))


@pytest.mark.parametrize("drop", ["gdn.recurrent", "gdn.conv", "ple.conv", "ple.ngram_context", "qsa.kv"])
def test_negative_control_dropped_state(model64, ids, full, drop):
    """Each state kind matters: dropping it between chunks is caught by the chunked-prefill comparison."""
    s = model64.new_session()
    s.prefill(ids[:18])  # context ids[16:18] holds no EOS, so the n-gram context matters
    st = s.state
    layer_kind, what = drop.split(".")
    for layer_state in getattr(st, layer_kind).values():
        if drop == "gdn.recurrent":
            layer_state.recurrent[:] = 0
        elif drop == "gdn.conv":
            layer_state.conv[:] = 0
        elif drop == "ple.conv":
            layer_state.conv[:] = 0
        elif drop == "ple.ngram_context":
            layer_state.context[:] = EOS
        else:
            layer_state.v._a[:layer_state.v.n] = 0
    out = s.prefill(ids[18:])
    assert rel(out, full[18:]) > 1e-6, drop


def test_negative_control_off_by_one_position(model64, ids, full):
    s = model64.new_session()
    s.prefill(ids[:16])
    s.state.position += 1  # every later RoPE angle / QSA visibility shifted by one
    out = s.prefill(ids[16:])
    assert rel(out, full[16:]) > 1e-6


def test_interrupted_step_leaves_session_unchanged(model64, ids, full, monkeypatch):
    s = model64.new_session()
    s.prefill(ids[:9])
    before = s.snapshot()
    orig = ReferenceModel._moe_step

    def boom(self, i, *a, **k):
        if i == 3:
            raise KeyboardInterrupt
        return orig(self, i, *a, **k)

    monkeypatch.setattr(ReferenceModel, "_moe_step", boom)
    with pytest.raises(KeyboardInterrupt):
        s.prefill(ids[9:14])
    monkeypatch.setattr(ReferenceModel, "_moe_step", orig)
    assert s.position == 9
    for i, q in s.state.qsa.items():
        assert q.k.n == before.state.qsa[i].k.n == 9
    out = s.prefill(ids[9:])
    assert rel(out, full[9:]) <= REL64


def test_float32_same_path(ids, full):
    m32 = ReferenceModel(random_weights(tiny_config(), seed=3), dtype=np.float32)
    out = m32.forward(ids)
    assert out.dtype == np.float32
    # float32 vs float64 on the same weights: float32 rounding through 4 layers (observed ~1e-6)
    assert rel(out.astype(np.float64), full) <= 1e-4
    s = m32.new_session()
    inc = np.concatenate([s.prefill(ids[:11], chunk_size=3), np.stack([s.decode(t) for t in ids[11:]])])
    assert rel(inc, out) <= 1e-4


def test_bad_ids_are_input_errors(model64):
    s = model64.new_session()
    for bad, msg in (([], "at least one"), ([1, 256], "vocab_size=256"), ([-1], "vocab_size"),
                     ([1.5], "integers"), ([[1, 2]], "1-D")):
        with pytest.raises(InputError, match=msg):
            s.prefill(bad)
    with pytest.raises(InputError, match="chunk_size"):
        s.prefill([1, 2], chunk_size=0)
    with pytest.raises(InputError, match="one token"):
        s.decode([1, 2])
    with pytest.raises(InputError, match="dtype"):
        ReferenceModel(model64.weights, dtype=np.float16)
    assert s.position == 0


def test_only_routed_experts_are_read(ids):
    """Experts are requested from the weights object one by one, and only those some token routes to."""
    import taps.recorder as recmod
    from reference.model import _Capture
    w = random_weights(tiny_config(), seed=3)
    asked = []

    class Spy:
        def __init__(self, inner):
            self._inner = inner
            self.config = inner.config

        def expert(self, layer, e, dtype=np.float32):
            asked.append((layer, e))
            return self._inner.expert(layer, e, dtype)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    m = ReferenceModel(Spy(w), dtype=np.float64, cache_weights=False)
    cap = _Capture()
    tok = taphook.set_current(cap)
    try:
        m.forward(ids[:5])
    finally:
        taphook.reset_current(tok)
    r = cap.result()
    used = {(i, int(e)) for i in range(4) for e in np.unique(r[f"layers.{i}.mlp.gate.topk_ids"])}
    assert set(asked) == used and len(asked) == len(used)
    assert len(used) < 4 * 8  # some experts unused, so the check has teeth


def test_long_prompt_crosses_delta_rule_chunks(model64):
    """80 tokens: the chunked delta rule runs two 64-token chunks in one call; other splits agree."""
    rng = np.random.default_rng(8)
    x = rng.integers(0, 256, 80)
    x[x == EOS] = 2
    x[[30, 70]] = EOS
    whole = model64.forward(x)
    for cs in (1, 7, 63, 64, 65):
        assert rel(model64.new_session().prefill(x, chunk_size=cs), whole) <= REL64, cs


def test_check_ids_is_the_one_token_id_check():
    """``reference.session.check_ids``: every caller (sessions, backends, id files, prompts) gets the same
    rule and message; ids beyond int64 are reported (not wrapped); ``check_length`` bounds the count."""
    from reference.session import check_ids, check_length
    assert check_ids([0, 9], 10).tolist() == [0, 9] and check_ids(np.int32(3), 10).tolist() == [3]
    assert check_ids([2 ** 62], None).tolist() == [2 ** 62]
    for bad, msg in (([1, 10, 11], r"x: expected token ids in \[0, vocab_size=10\), found 10 at index 1 \(2 out"),
                     ([1, -1], r"found -1 at index 1"), ([], "at least one"), ([[1]], "1-D"), ([1.0], "integers"),
                     ([True], "integers")):
        with pytest.raises(InputError, match=msg):
            check_ids(bad, 10, "x")
    with pytest.raises(InputError, match=r"\[0, 2\^63\), found 9223372036854775808 at index 0"):
        check_ids([2 ** 63], None, "x")
    check_length(8, 8)  # negative control: exactly max_position_embeddings ids pass
    with pytest.raises(InputError, match="at most max_position_embeddings=8 token ids, found 9"):
        check_length(9, 8)
