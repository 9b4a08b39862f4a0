"""Engine MTP drafting on the CPU path (NumPy twins; the CUDA path runs the same code on the CUDA kernels,
tests/engine/test_engine_mtp.py::test_gpu_*): draft logits against the reference head's goldens, greedy
speculative generation equal to plain greedy, every acceptance count with rollback of trunk and head, the
head's state through fork and snapshot/restore."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fixture_helpers import fixture_dir
from engine.engine import Engine
from reference.checkpoint import Checkpoint
from reference.errors import InputError
from reference.model import ReferenceModel

MTP_FIXTURES = ("tiny-mtp", "tiny-hc3-mtp")


def _golden(name):
    with np.load(fixture_dir(name) / "golden_mtp.npz") as z:
        return {k: z[k] for k in z.files}


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def _plain_greedy(eng, prompt, n):
    s = eng.add_sequence()
    lg = eng.prefill(s, prompt, last_only=True)
    out = [int(np.argmax(lg))]
    while len(out) < n:
        out.append(int(eng.decode_greedy([s], [out[-1]])[0]))
    eng.free(s)
    return out


# Tolerance 1e-4 relative to the largest logit: float32 engine (BF16 weights read exactly in both precisions:
# the fixtures store BF16) vs the float32 reference over the trunk prefix and the head; observed <= 4e-7.
TOL = 1e-4


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_engine_draft_logits_match_the_reference_head(name, precision):
    ck = Checkpoint.open(fixture_dir(name))
    g = _golden(name)
    for opt in ("fresh", "reuse_step0"):
        eng = Engine(ck, precision=precision, device="cpu", mtp_draft_selection=opt)
        assert eng.has_mtp
        for p in ("qsa", "chat"):
            ids, n = g[f"{p}/ids"], int(g[f"draft/{p}/n"])
            s = eng.add_sequence()
            eng.prefill(s, ids[:n])
            np.testing.assert_allclose(eng.last_residual, g[f"{p}/residual"][:n], atol=1e-4, rtol=0)
            d, dl = eng.mtp_draft_next(s, ids[n], 3, return_logits=True)
            assert _rel(dl, g[f"draft/{p}/{opt}/logits"]) < TOL, (p, opt)
            assert np.array_equal(d, g[f"draft/{p}/{opt}/ids"]), (p, opt)
            assert s.mtp_len == n - 1  # neither the next token's pair nor the draft steps stay in the head
            d2, dl2 = eng.mtp_draft_next(s, ids[n], 3, return_logits=True)  # repeatable
            assert np.array_equal(d2, d) and np.array_equal(dl2, dl)
            eng.free(s)
    # negative control: per-stream hnorm (llama.cpp's grouping) is caught at > 10x the tolerance
    eng = Engine(ck, precision=precision, device="cpu", mtp_hnorm="per_stream")
    ids, n = g["chat/ids"], int(g["draft/chat/n"])
    s = eng.add_sequence()
    eng.prefill(s, ids[:n])
    _, dl = eng.mtp_draft_next(s, ids[n], 3, return_logits=True)
    assert _rel(dl, g["draft/chat/fresh/logits"]) > 10 * TOL


def test_engine_mtp_chunked_catch_up_equals_one_shot():
    """The head follows the prompt chunk by chunk (one position behind the trunk): same drafts as one chunk."""
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    g = _golden("tiny-mtp")
    eng = Engine(ck, precision="float32", device="cpu")
    ids = g["chat/ids"]
    outs = []
    n = int(g["draft/chat/n"])
    for cs in (None, 5, 1):
        s = eng.add_sequence()
        eng.prefill(s, ids[:n], chunk_size=cs)
        assert s.mtp_len == n - 1  # one position behind the trunk after every chunk
        outs.append(eng.mtp_draft_next(s, ids[n], 3, return_logits=True)[1])
        eng.free(s)
    for o in outs:
        assert _rel(o, g["draft/chat/fresh/logits"]) < TOL


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_speculative_equals_plain_greedy_64(name):
    eng = Engine(Checkpoint.open(fixture_dir(name)), precision="float32", device="cpu")
    prompt = _golden(name)["qsa/ids"]
    s = eng.add_sequence()
    assert eng.generate_speculative(s, prompt, 64, 3) == _plain_greedy(eng, prompt, 64)


@pytest.mark.slow
@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_speculative_equals_plain_greedy_512(name):
    """The greedy identity over 512 tokens, k = 1 and 4, on the CPU engine and the reference."""
    from reference.session import speculative_greedy
    ck = Checkpoint.open(fixture_dir(name))
    eng = Engine(ck, precision="float32", device="cpu")
    prompt = _golden(name)["chat/ids"]
    plain = _plain_greedy(eng, prompt, 512)
    for k in (1, 4):
        s = eng.add_sequence()
        assert eng.generate_speculative(s, prompt, 512, k) == plain, k
        eng.free(s)
    assert speculative_greedy(ReferenceModel(ck), prompt, 512, 4) == plain


@pytest.mark.parametrize("tail_rows", [256, 0])
def test_every_acceptance_count_rolls_back_trunk_and_head(tail_rows, monkeypatch):
    """Forced drafts (the trunk's true continuation, first wrong at position j) give every acceptance count
    0..k; after each round the trunk is at position + accepted + 1 and the head's next drafts equal the reference
    head fed the same accepted history (its state was rolled back and caught up). ``tail_rows=0``: the head
    catches up after every prefill/decode step (never over a verify's positions)."""
    monkeypatch.setattr(Engine, "MTP_TAIL_ROWS", tail_rows)
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    g = _golden("tiny-mtp")
    prompt = g["qsa/ids"]
    k = 3
    eng = Engine(ck, precision="float32", device="cpu")
    truth = _plain_greedy(eng, prompt, 40)
    plan = [0, 1, 2, 3, 3, 0, 2, 1]  # acceptance count per round
    V = ck.config.vocab_size

    def propose(rnd, n, drafts):
        j = plan[rnd % len(plan)]
        base = n - len(prompt) + 1  # index in `truth` of the first draft's token
        d = [truth[base + i] for i in range(k)]
        if j < k:
            d[j] = (d[j] + 1) % V
        return d

    trace, seen = [], []
    s = eng.add_sequence()
    orig = eng.mtp_draft

    def checked_draft(seq, R, nxt, kk, **kw):  # compare the head's real drafts with the reference head
        out = orig(seq, R, nxt, kk, return_logits=True)
        seen.append((seq.length, out[1]))
        return out[0]
    eng.mtp_draft = checked_draft
    out = eng.generate_speculative(s, prompt, 30, k, trace=trace, propose=propose)
    assert out == truth[:30]
    assert sorted({t["accepted"] for t in trace}) == [0, 1, 2, 3]
    for a, b in zip(trace, trace[1:]):
        assert b["position"] == a["position"] + a["accepted"] + 1
    m = ReferenceModel(ck)
    sess = m.new_session()
    sess.residual_log = []
    hist = np.concatenate([prompt, truth[:30]])
    sess.prefill(hist)
    R = np.concatenate(sess.residual_log)
    for L, dl in seen[1:]:
        ms = m.new_mtp_session()
        _, ref = ms.draft(R[:L], hist[1:L + 1], dl.shape[0])
        assert _rel(dl, ref) < TOL, L  # the head's drafts depend only on the accepted history


def test_head_state_survives_fork_and_snapshot_restore():
    """Pages holding the head's caches are copied on write: a fork and a snapshot keep their head state while
    the parent goes on (its catch-up writes head caches in shared pages); an imported snapshot file holds no
    trunk residuals, so drafting from it is refused with the reason."""
    ck = Checkpoint.open(fixture_dir("tiny-hc3-mtp"))
    g = _golden("tiny-hc3-mtp")
    eng = Engine(ck, precision="float32", device="cpu", page_size=4)
    ids, n = g["chat/ids"], int(g["draft/chat/n"])
    ref = g["draft/chat/fresh/logits"]
    s = eng.add_sequence()
    eng.prefill(s, ids[:n])
    snap = eng.snapshot(s)
    child = eng.fork(s)
    assert _rel(eng.mtp_draft_next(s, ids[n], 3, return_logits=True)[1], ref) < TOL
    for t in (5, 6, 7, 8, 9):  # the parent moves on: head catch-up over positions in pages shared with both
        eng.decode([s], [t])
    eng.mtp_draft_next(s, 11, 3)
    assert _rel(eng.mtp_draft_next(child, ids[n], 3, return_logits=True)[1], ref) < TOL
    eng.restore(s, snap)
    assert s.mtp_len == n - 1
    assert _rel(eng.mtp_draft_next(s, ids[n], 3, return_logits=True)[1], ref) < TOL
    t = eng.add_sequence()
    eng.import_snapshot(t, eng.export_snapshot(snap))
    with pytest.raises(InputError, match="residuals"):
        eng.mtp_draft_next(t, ids[n], 3)


def test_engine_without_head_refuses_drafting():
    ck = Checkpoint.open(fixture_dir("tiny"))
    eng = Engine(ck, precision="float32", device="cpu")
    assert not eng.has_mtp
    s = eng.add_sequence()
    eng.prefill(s, [1, 2, 3])
    with pytest.raises(InputError, match="MTP head"):
        eng.mtp_draft_next(s, 4, 2)
    with pytest.raises(InputError, match="MTP head"):
        Engine(ck, precision="float32", device="cpu", mtp=True)
    with pytest.raises(InputError, match="hnorm"):
        Engine(Checkpoint.open(fixture_dir("tiny-mtp")), device="cpu", mtp_hnorm="rms")


@pytest.mark.gpu
@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_gpu_draft_logits_and_greedy_identity(name):
    """The CUDA path (same layer code on the CUDA kernels): draft logits vs the reference head, and the greedy
    identity over 128 tokens."""
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("needs cupy and a CUDA GPU")
    ck = Checkpoint.open(fixture_dir(name))
    g = _golden(name)
    for prec in ("float32", "bf16"):
        # both draft selections: reuse_step0 hands the attention a selection row wider than the complete
        # blocks fill (the CUDA kernel once read its -1 padding as block -1: NaN / 4e-2 drafts)
        for opt in ("fresh", "reuse_step0"):
            eng = Engine(ck, precision=prec, device="cuda", mtp_draft_selection=opt)
            for p in ("qsa", "chat"):
                ids, n = g[f"{p}/ids"], int(g[f"draft/{p}/n"])
                s = eng.add_sequence()
                eng.prefill(s, ids[:n])
                d, dl = eng.mtp_draft_next(s, ids[n], 3, return_logits=True)
                assert _rel(dl, g[f"draft/{p}/{opt}/logits"]) < TOL, (prec, opt, p)
                eng.free(s)
        ids = g["chat/ids"]
        s2 = eng.add_sequence()
        assert eng.generate_speculative(s2, ids, 128, 3) == _plain_greedy(eng, ids, 128)


def _fork_divergence_error(eng, m, ids):
    """Parent and child share the page holding the head's position n-1 (its last slot), then diverge; each
    head commits its own pair at n-1; the parent's next drafts vs the from-scratch reference head."""
    from reference.session import mtp_draft_from_history
    n = 4 * (len(ids) // 8)  # position n-1 is the last slot of a 4-token page
    s = eng.add_sequence()
    eng.prefill(s, ids[:n])
    c = eng.fork(s)
    eng.decode([s], [5])
    eng.decode([c], [6])
    eng.mtp_draft_next(s, 7, 2)   # the parent's head commits (R_{n-1}, 5) at position n-1
    eng.mtp_draft_next(c, 8, 2)   # the child's commits (R_{n-1}, 6) at the same position
    _, dl = eng.mtp_draft_next(s, 7, 2, return_logits=True)
    _, ref = mtp_draft_from_history(m, list(ids[:n]) + [5], 7, 2)
    eng.free(s)
    eng.free(c)
    return _rel(dl, ref)


def test_head_caches_are_copied_on_write_when_a_fork_diverges(monkeypatch):
    """The head writes below the trunk's length (its catch-up): its pages are made private first
    (StatePool.reserve_range). Negative control: reserving only from the trunk's length lets the child's head
    overwrite the parent's, caught at > 10x the tolerance."""
    from engine.state import StatePool
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    m = ReferenceModel(ck)
    ids = _golden("tiny-mtp")["chat/ids"]
    eng = Engine(ck, precision="float32", device="cpu", page_size=4)
    assert _fork_divergence_error(eng, m, ids) < TOL
    orig = StatePool.reserve_range
    monkeypatch.setattr(StatePool, "reserve_range", lambda self, seq, start, end: orig(self, seq, seq.length, end))
    assert _fork_divergence_error(eng, m, ids) > 10 * TOL


def test_negative_control_rollback_keeps_the_rejected_residuals(monkeypatch):
    """If rollback left the rejected positions' trunk residuals in the head's pending rows, the head would
    catch up on them: the engine refuses (the rows no longer match the trunk's positions) and the
    acceptance-loop test fails."""
    from engine.state import StatePool
    orig = StatePool.truncate

    def keep_tail(self, seq, new_length):
        tail = list(seq.mtp_tail)
        orig(self, seq, new_length)
        seq.mtp_tail = tail
    monkeypatch.setattr(StatePool, "truncate", keep_tail)
    with pytest.raises((AssertionError, InputError)):
        test_every_acceptance_count_rolls_back_trunk_and_head(256, monkeypatch)


def test_selfcheck_mtp_figures_cpu():
    """The MTP figures ci/gpu prints (engine.selfcheck.mtp_figures), on the CPU path; every MTP fixture is
    listed. On the GPU: tests/engine/test_engine_mtp.py::test_gpu_* and ci/gpu's selfcheck."""
    from engine import selfcheck
    assert selfcheck.mtp_fixtures() == sorted(MTP_FIXTURES)
    f = selfcheck.mtp_figures("tiny-hc3-mtp", "cpu")
    assert f["fail"] == [] and f["mtp_f32"] < TOL and f["mtp_greedy64"] == 64, f
