"""Selection taps (registry ``as_set``) whose padded width differs between the two recordings: compared as sets
of valid ids position by position (``registry.selection_ids``), never as "shape differs" at the first common
position. Before: a recording padded to another width (llama.cpp's selection taps, a dense-attention backend)
was reported diverged at position 0 whatever its ids."""
from __future__ import annotations

import numpy as np
import pytest

from taps import registry
from taps.archive import MemoryArchive
from taps.diff import compare_tap, diff_archives, load_profile

FP32 = load_profile("fp32")
SEL = "layers.2.self_attn.indexer.selected_blocks"
TOK = "layers.2.self_attn.indexer.selected_tokens"
SCORES = registry.companion_of(SEL)


def mem(taps: dict) -> MemoryArchive:
    """An in-memory archive of ``{name: (rows, kind)}`` at positions 0..T-1."""
    manifest, data = {"order": [], "taps": {}}, {}
    for n, (v, k) in taps.items():
        v = np.asarray(v)
        manifest["order"].append(n)
        manifest["taps"][n] = {"dtype": str(v.dtype), "tail": list(v.shape[1:]), "rows": len(v), "kind": k}
        data[n] = [(np.arange(len(v)), v)]
    return MemoryArchive(manifest, data)


def selections(T=16, k=2, seed=0):
    """``(scores [T, n], canonical top-k [T, k])``: block p//2 - 1 is the latest complete at position p (ratio
    2); distinct scores (no near ties: a changed pick is an error, not a flip)."""
    rng = np.random.default_rng(seed)
    n = T // 2
    scores = np.full((T, n), -np.inf)
    sel = np.full((T, k), -1, np.int64)
    for p in range(T):
        m = (p + 1) // 2
        s = rng.permutation(m).astype(np.float64) * 1.0
        scores[p, :m] = s
        top = np.argsort(-s, kind="stable")[:k]
        sel[p, :len(top)] = top
    return scores, sel


def pad(rows, width):
    out = np.full((len(rows), width), -1, np.int64)
    out[:, :rows.shape[1]] = rows
    return out


def test_same_ids_padded_to_another_width_agree():
    scores, sel = selections()
    A = mem({SCORES: (scores, "activation"), SEL: (sel, "index")})
    wide = pad(sel[:, ::-1], 5)[:, [2, 0, 3, 1, 4]]   # another width, another order, -1 between the ids
    B = mem({SCORES: (scores, "activation"), SEL: (wide, "index")})
    r = compare_tap(A, B, SEL, FP32)
    assert r.status == "agree" and r.first_position is None, r.note
    assert r.metrics["exact_match"] == 1.0 and r.metrics["set_overlap"] == 1.0
    rep = diff_archives(A, B, force=True)
    assert rep.agree and rep.exit_code == 0
    # the other direction (the truth padded wider) agrees too
    assert compare_tap(B, A, SEL, FP32).status == "agree"


@pytest.mark.parametrize("P", [5, 9, 15])
@pytest.mark.parametrize("width", [2, 4])
def test_one_changed_id_is_located_at_its_position(P, width):
    """Negative control: one id of position P replaced by an unpicked lower-scored block, B padded wider or not:
    diverged at P (an error: the dropped block beats the taken one far beyond the score tolerance)."""
    scores, sel = selections()
    bad = sel.copy()
    m = (P + 1) // 2
    unpicked = [x for x in range(m) if x not in set(bad[P])]
    bad[P, 1] = unpicked[0]
    A = mem({SCORES: (scores, "activation"), SEL: (sel, "index")})
    B = mem({SCORES: (scores, "activation"), SEL: (pad(bad, width), "index")})
    rep = diff_archives(A, B, force=True)
    assert rep.first_divergence == SEL and rep.last_agreeing == SCORES
    r = rep.result(SEL)
    assert r.status == "diverged" and r.first_position == P and r.metrics["errors"] == 1, r.note
    assert f"first at position {P}" in r.note


def test_an_extra_pick_is_located_where_it_first_appears():
    """Padded wider AND holding more ids from position 11 on (a backend attending every block): located at 11."""
    T = 14
    A_rows = np.full((T, 2), -1, np.int64)
    B_rows = np.full((T, 3), -1, np.int64)
    for p in range(T):
        n = (p + 1) // 4                       # complete blocks (ratio 4)
        A_rows[p, :min(n, 2)] = np.arange(min(n, 2))
        B_rows[p, :n] = np.arange(n)           # every block: 3 from position 11
    tok_a = pad(np.arange(8)[None, :].repeat(T, 0), 9)
    tok_b = pad(np.arange(8)[None, :].repeat(T, 0), 12)
    A = mem({SEL: (A_rows, "index"), TOK: (tok_a, "index")})
    B = mem({SEL: (B_rows, "index"), TOK: (tok_b, "index")})
    rep = diff_archives(A, B, force=True)
    r = rep.result(SEL)
    assert rep.first_divergence == SEL and r.first_position == 11, r.note
    assert "A picked 2 items, B 3" in r.note
    assert rep.result(TOK).status == "agree"    # same tokens, other pads


def test_width_mismatch_of_other_taps_is_still_a_divergence():
    """Only selections are sets: an activation tap or a positional index tap (ngram_ids: one id per head) of
    another width is a shape mismatch, as before."""
    act = "layers.2.mlp.out"
    r = compare_tap(mem({act: (np.zeros((4, 3), np.float32), "activation")}),
                    mem({act: (np.zeros((4, 5), np.float32), "activation")}), act, FP32)
    assert r.status == "diverged" and "shape differs" in r.note and r.first_position == 0
    ng = "layers.1.ple.ple_embedding.ngram_ids"
    assert not registry.is_selection(ng) and registry.is_selection(SEL) and registry.is_selection(TOK)
    r = compare_tap(mem({ng: (np.array([[0, 5], [1, 6]]), "index")}),
                    mem({ng: (np.array([[0, 5, -1], [1, 6, -1]]), "index")}), ng, FP32)
    assert r.status == "diverged" and "shape differs" in r.note
    # and a positional tap's ids in other places still differ (the old order rule kept for it)
    r = compare_tap(mem({ng: (np.array([[0, 5], [1, 6]]), "index")}),
                    mem({ng: (np.array([[0, 5], [6, 1]]), "index")}), ng, FP32)
    assert r.status == "diverged" and r.first_position == 1


def test_selection_ids_rule():
    assert registry.selection_ids([[3, -1, 1], [-1, -1, 0]]) == (0, 1, 3)
    assert registry.same_selection([1, 3], [3, -1, 1, -1])
    assert not registry.same_selection([1, 3], [1, 3, 3])     # an id picked twice is another selection
    assert not registry.same_selection([1, 3], [1, 2, -1])
    assert registry.index_rows_agree(SEL, [1, 3], [3, 1, -1])
    assert not registry.index_rows_agree("layers.1.ple.ple_embedding.ngram_ids", [1, 3], [3, 1])
