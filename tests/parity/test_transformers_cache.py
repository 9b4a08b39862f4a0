"""The ``transformers`` backend's own state paths against the official model's full forward: a cached decode,
a snapshot restored (into the same and into a fresh handle) and a rollback within a verify each give the logits
of one full forward over the history they stand for; a perturbed cache (live, in a snapshot, in the pre-verify
copy a rollback restores) is caught by the same comparison (the negative controls). Also: the ``threads``
option is parsed, applied and a bad value refused with exit code 2; the backend declares exactly the taps its
hooks emit; llama.cpp declares the taps of its node map.

Tolerance ``REL`` (1e-4 of the largest |logit| compared): the cached and the full forward of the official
float32 model differ in evaluation order only -- the GDN layers' chunked delta rule (a prefill) against its
one-token recurrent step (a decode), attention over cached keys against one causal matrix -- each a float32
rounding (2^-24 relative) summed over a few hundred terms per op and six layers: measured on tiny at most
3.5e-6 of the largest logit (4 prompts of 40 tokens, decode and verify + rollback), so REL leaves a margin of
~30. The perturbation of the negative controls (5% of the state's RMS,
:data:`parity.backends.transformers.PERTURB_REL`) must move the next logits by more than 10 x REL (asserted:
a control that moved nothing would make the positive checks vacuous)."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

from reference.errors import InputError

REL = 1e-4
FIXTURE = "tiny"   # GDN + indexed-attention layers: rollback is the limited, pre-verify-copy path


def _rel(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def be():
    pytest.importorskip("torch", reason="the transformers backend needs the `oracle` extra (torch)")
    pytest.importorskip("transformers.models.qwen4_exp", reason="transformers with qwen4_exp not installed")
    from parity.backends import open_backend
    from reference.paths import bundled_model
    b = open_backend("transformers", bundled_model(FIXTURE))
    yield b
    b.close()


def _ids(be, n, seed=5):
    from parity.harness.scenarios.common import token_stream
    return [int(t) for t in token_stream(be.config, n, seed=seed, eos_every=7)]


def _perturb(be, cache, kind="recurrent"):
    """Add PERTURB_REL x its RMS to one state tensor of ``cache`` (a GDN layer's recurrent state, or an
    attention layer's keys), in place; returns the tensor's name."""
    import torch
    from parity.backends.transformers import PERTURB_REL
    for i, layer in enumerate(cache.layers):
        if kind == "recurrent":
            for k, t in (getattr(layer, "recurrent_states", None) or {}).items():
                if t is not None and t.numel():
                    with torch.inference_mode():   # the cache's tensors were made under inference_mode
                        t.add_(PERTURB_REL * torch.sqrt(torch.mean(t.float() ** 2)).to(t.dtype))
                    return f"layers.{i}.recurrent_states.{k}"
        else:
            t = getattr(layer, "keys", None)
            if t is not None and hasattr(t, "numel") and t.numel():
                with torch.inference_mode():
                    t.add_(PERTURB_REL * torch.sqrt(torch.mean(t.float() ** 2)).to(t.dtype))
                return f"layers.{i}.keys"
    raise AssertionError(f"no {kind} state in the cache")


@pytest.mark.oracle
def test_cached_decode_equals_a_full_forward_over_the_history(be):
    ids = _ids(be, 24)
    full = be.logits(ids)
    h = be.new_sequence()
    try:
        rows = [be.prefill(h, ids[:9])]
        rows += [be.decode([h], [t]) for t in ids[9:]]
        got = np.concatenate(rows)
        errs = [_rel(got[p], full[p]) for p in range(len(ids))]
        assert max(errs) < REL, ("cached decode vs full forward", max(errs), int(np.argmax(errs)))
    finally:
        be.free(h)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["recurrent", "keys"])
def test_a_perturbed_cache_is_caught_by_the_decode_comparison(be, kind):
    """Negative control: the same comparison on a sequence whose cache was perturbed after the prefill."""
    ids = _ids(be, 16)
    full = be.logits(ids)
    h = be.new_sequence()
    try:
        be.prefill(h, ids[:12])
        what = _perturb(be, be._seq(h).cache, kind)
        err = max(_rel(be.decode([h], [t])[0], full[12 + j]) for j, t in enumerate(ids[12:]))
        assert err > 10 * REL, (what, err)
    finally:
        be.free(h)


@pytest.mark.oracle
def test_snapshot_restore_equals_a_full_forward_and_a_perturbed_snapshot_is_caught(be):
    ids = _ids(be, 12)
    x, y = _ids(be, 5, seed=11), _ids(be, 5, seed=12)
    full_x, full_y = be.logits(ids + x), be.logits(ids + y)
    h, g = be.new_sequence(), be.new_sequence()
    try:
        be.prefill(h, ids)
        snap = be.snapshot(h)
        assert _rel(be.prefill(h, x), full_x[12:]) < REL
        be.restore(h, snap)                      # the same handle, after it moved on
        assert be.position(h) == 12
        assert _rel(be.prefill(h, y), full_y[12:]) < REL
        be.restore(g, snap)                      # a fresh handle (fork); the snapshot stays usable
        got = np.stack([be.decode([g], [t])[0] for t in x])
        assert _rel(got, full_x[12:]) < REL
        # negative control: a snapshot whose state is not the history's is caught by the same comparison
        _perturb(be, snap[2])
        be.restore(g, snap)
        assert _rel(be.prefill(g, x), full_x[12:]) > 10 * REL
    finally:
        be.free(h)
        be.free(g)


@pytest.mark.oracle
@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_rollback_within_a_verify_equals_a_full_forward(be, n):
    ids = _ids(be, 10)
    drafts, nxt = [7, 11, 13, 17], 19
    keep = drafts[:len(drafts) - n]
    full_v, full_after = be.logits(ids + drafts), be.logits(ids + keep + [nxt])
    h = be.new_sequence()
    try:
        be.prefill(h, ids)
        assert _rel(be.forward_tokens(h, drafts), full_v[10:]) < REL
        be.rollback(h, n)
        assert be.position(h) == 10 + len(keep)
        assert _rel(be.decode([h], [nxt])[0], full_after[-1]) < REL
    finally:
        be.free(h)


@pytest.mark.oracle
def test_a_perturbed_pre_verify_copy_is_caught_after_the_rollback(be):
    """Negative control: the rollback restores the copy taken before the verify; a wrong copy shows."""
    ids = _ids(be, 10)
    drafts = [7, 11, 13, 17]
    full_after = be.logits(ids + drafts[:2] + [19])
    h = be.new_sequence()
    try:
        be.prefill(h, ids)
        be.forward_tokens(h, drafts)
        _perturb(be, be._seq(h).pre_verify[0])
        be.rollback(h, 2)
        assert _rel(be.decode([h], [19])[0], full_after[-1]) > 10 * REL
    finally:
        be.free(h)


# ----------------------------------------------------------------------------------------------- threads
@pytest.mark.oracle
def test_threads_option_is_parsed_and_applied():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen4_exp")
    from parity.backends import open_backend
    from parity.backends.registry import parse_backend_spec
    from reference.paths import bundled_model
    assert parse_backend_spec("transformers:threads=2").options == {"threads": "2"}
    assert parse_backend_spec("transformers:threads=auto").options == {"threads": "auto"}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        open_backend("transformers:threads=2", bundled_model(FIXTURE)).close()
        assert torch.get_num_threads() == 2
        torch.set_num_threads(3)
        open_backend("transformers", bundled_model(FIXTURE)).close()   # auto: hidden 64 <= SMALL_HIDDEN -> 1
        assert torch.get_num_threads() == 1
        for bad in ("0", "-1", "x", "1.5"):
            with pytest.raises(InputError, match=f"threads: expected a positive integer or auto, found '{re.escape(bad)}'"):
                open_backend(f"transformers:threads={bad}", bundled_model(FIXTURE))
    finally:
        torch.set_num_threads(before)


@pytest.mark.oracle
def test_a_bad_threads_value_exits_with_the_usage_code(capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen4_exp")
    from parity.cli import main
    from reference.errors import EXIT_USAGE
    before = torch.get_num_threads()
    try:
        rc = main(["parity", FIXTURE, "--backend", "transformers:threads=many", "--scenario", "budget",
                   "--no-progress"])
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE == 2, err
    assert "threads: expected a positive integer or auto, found 'many'" in err


# ----------------------------------------------------------------------------------------------- taps declared
@pytest.mark.oracle
def test_the_declared_taps_are_exactly_the_ones_the_hooks_emit(be):
    from parity.backends.base import declares_tap
    from parity.backends.transformers import NO_COUNTERPART, NOT_YET_MAPPED
    from taps.registry import tap_names
    ids = _ids(be, 20)
    with be.taps(None, meta={"token_ids": ids}) as rec:
        be.logits(ids)
    emitted = set(rec.archive().names())
    registry = set(tap_names(be.config))
    assert emitted and emitted <= registry
    assert all(declares_tap(be, n) for n in emitted), sorted(n for n in emitted if not declares_tap(be, n))
    undeclared_missing = sorted(n for n in registry - emitted if declares_tap(be, n))
    assert not undeclared_missing, undeclared_missing      # declared but never emitted: would be listed wrongly
    spelled = [t.replace("{i}", "0") for t in NO_COUNTERPART + NOT_YET_MAPPED]
    assert not any(declares_tap(be, n) for n in spelled)


def test_llamacpp_declares_the_taps_of_its_node_map():
    from parity.backends.base import declares_tap
    from parity.backends.llamacpp import NO_COUNTERPART, TAP_MAP, LlamaCppBackend
    mapped = {t for v in TAP_MAP.values() if v is not None for t in (v if isinstance(v, list) else [v])}
    assert set(LlamaCppBackend.produces_taps) == mapped
    one = lambda t: t.replace("{i}", "3").replace("{p}", "3")  # noqa: E731
    assert all(declares_tap(LlamaCppBackend, one(t)) for t in mapped)
    assert not any(declares_tap(LlamaCppBackend, one(t)) for t in NO_COUNTERPART), \
        [t for t in NO_COUNTERPART if declares_tap(LlamaCppBackend, one(t))]


# ----------------------------------------------------------------------------------------------- progress
class _Pipe(io.StringIO):
    def isatty(self):
        return False


def test_progress_lines_on_a_non_tty_stream():
    from parity.harness.progress import LineProgress, progress_bar, progress_mode
    assert progress_mode(False, _Pipe()) == "lines" and progress_mode(True, _Pipe()) is None
    now = [100.0]
    out = _Pipe()
    p = LineProgress(3, "parity", file=out, every=0, clock=lambda: now[0])
    for label, dt in (("budget/a", 2.0), ("budget/b", 61.0), ("kl", 1.0)):
        p.set_postfix_str(label)
        now[0] += dt
        p.update(1)
    p.close()
    assert out.getvalue().splitlines() == ["parity: [1/3] finished budget/a, elapsed 2s",
                                           "parity: [2/3] finished budget/b, elapsed 1m03s",
                                           "parity: [3/3] finished kl, elapsed 1m04s"]
    assert isinstance(progress_bar(1, "parity", "lines", file=_Pipe()), LineProgress)


def test_progress_heartbeat_while_a_case_runs_long():
    import time
    from parity.harness.progress import LineProgress
    out = _Pipe()
    with LineProgress(2, "parity", file=out, every=0.05) as p:
        p.set_postfix_str("self_consistency/long")
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert lines and all(re.fullmatch(r"parity: \[0/2\] still running self_consistency/long, elapsed \d+s", ln)
                         for ln in lines), lines


def test_parity_prints_a_line_per_case_when_stderr_is_not_a_terminal(capsys, tmp_path):
    """Progress lines on a pipe; each row's elapsed seconds in the table and in report.json."""
    import json
    from parity.cli import main
    rc = main(["parity", FIXTURE, "--backend", "reference", "--scenario", "budget", "--level", "ci",
               "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    err = cap.err    # pytest's capture is not a terminal
    rows = json.loads((tmp_path / "o" / "report.json").read_text())["scenarios"]
    assert rows and all(r["seconds"] > 0 for r in rows), rows
    assert re.search(r"^budget .* \d+\.\ds +PASS$", cap.out, re.M), cap.out
    done = [m.groups() for m in re.finditer(r"^parity: \[(\d+)/(\d+)\] finished (\S+), elapsed (\d+m)?\d+s$",
                                            err, re.M)]
    assert rc == 0 and done, err
    total = int(done[0][1])
    assert [int(d[0]) for d in done] == list(range(1, total + 1))
    assert all(d[2].startswith("budget/") for d in done), done
