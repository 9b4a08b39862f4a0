"""Greedy decoding on the engine's device and the host half of a decode step (CPU checks; ``row_argmax`` itself:
tests/engine/test_sampling.py).

* ``Engine.decode_greedy`` returns the argmax of what ``Engine.decode`` returns, step after step;
* the memory-mapped PLE row gather (``PLETable.gather_host``, also into a caller's buffer) equals the
  checkpoint's own ``ngram_rows`` on BF16 and FP8 fixtures, and a wrong row id is caught.
All exact comparisons: integer ids, and float32 rows decoded by the same bit patterns.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference.checkpoint import Checkpoint
from reference.errors import InputError
from reference.paths import FIXTURES


def _engine(name="tiny", **kw):
    from engine import Engine
    return Engine(Checkpoint.open(FIXTURES / name), precision="float32", device="cpu", max_seqs=4, **kw)


def _twin_engines(seed, lengths):
    """Two identical CPU engines with the same prompts prefilled: ``(a, seqs_a, b, seqs_b, rng, V)``."""
    a, b = _engine(), _engine()
    V = a.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, V, n) for n in lengths]
    sa = [a.add_sequence() for _ in prompts]
    sb = [b.add_sequence() for _ in prompts]
    for x, y, p in zip(sa, sb, prompts):
        a.prefill(x, p)
        b.prefill(y, p)
    return a, sa, b, sb, rng, V


def test_decode_greedy_is_argmax_of_decode():
    a, sa, b, sb, rng, V = _twin_engines(2, (4, 9))
    tok = rng.integers(0, V, 2)
    tb = tok.copy()
    for _ in range(6):
        logits = a.decode(sa, tok)
        tok = np.argmax(logits, axis=-1)
        tb = b.decode_greedy(sb, tb)
        assert tb.tolist() == tok.tolist()
        np.testing.assert_array_equal(np.asarray(b.last_logits), logits)  # same path, same order: exact


@pytest.mark.parametrize("name", ["tiny", "tiny-fp8"])
def test_gather_host_equals_checkpoint_rows(name):
    from engine.ple_table import PLETable
    ck = Checkpoint.open(FIXTURES / name)
    layer = ck.config.ple_layers[0]
    t = PLETable(ck, layer, np)
    assert t.mode == "numpy"
    rng = np.random.default_rng(4)
    rows = rng.integers(0, t.rows_total, (5, 3))
    rows[0, 0], rows[-1, -1] = 0, t.rows_total - 1  # both ends of the table (first and last shard)
    want = np.asarray(ck.ngram_rows(layer, rows)).reshape(5, -1)
    np.testing.assert_array_equal(t.gather_host(rows), want)
    out = np.empty_like(want)
    assert t.gather_host(rows, out=out) is out
    np.testing.assert_array_equal(out, want)
    shifted = rows.copy()
    shifted[2, 1] = (shifted[2, 1] + 1) % t.rows_total  # negative control: one row id off by one
    diff = np.nonzero((t.gather_host(shifted) != want).any(axis=1))[0]
    assert diff.tolist() == [2]
    with pytest.raises(InputError, match="out"):
        t.gather_host(rows, out=np.empty((5, 3), np.float32))
    with pytest.raises(InputError, match="expected ids"):
        t.gather_host(np.array([[t.rows_total]]))


def test_gather_single_shard_path_equals_checkpoint_rows():
    """gather_twin on the tiny table merged into one shard (a table of one shard, scaled and not)."""
    from engine.ple_table import TableShards, gather_twin, table_shards
    ck = Checkpoint.open(FIXTURES / "tiny")
    layer = ck.config.ple_layers[0]
    sh = table_shards(ck, layer)
    assert len(set(sh.codes.tolist())) == 1
    one = TableShards((np.concatenate(sh.arrays),), np.array([0, sh.starts[-1]], np.int64), sh.codes[:1],
                      sh.scales[:1], sh.head_dim)
    rows = np.random.default_rng(5).integers(0, int(sh.starts[-1]), (6, 2))
    want = np.asarray(ck.ngram_rows(layer, rows)).reshape(6, -1)
    np.testing.assert_array_equal(gather_twin(one, rows), want)
    scaled = TableShards(one.arrays, one.starts, one.codes, np.array([2.0], np.float32), one.head_dim)
    np.testing.assert_array_equal(gather_twin(scaled, rows), 2 * want)  # the scale is applied


def test_generation_greedy_uses_device_argmax_and_matches_logits_path():
    """Greedy generation through ``BackendLM.step_greedy`` (``EngineBackend.decode_greedy``: argmax on the
    engine's device) emits what the logits path emits; a step_greedy that picks the wrong token (second best) is caught."""
    from parity import generate as G
    lm = G.open_lm(FIXTURES / "tiny", backend="engine", device="cpu", max_seqs=4)
    tok = G.load_tokenizer(FIXTURES / "tiny")
    prompts = [tok.encode("hello world").ids, tok.encode("a b c d").ids]
    params = G.SamplingParams(do_sample=False, max_new_tokens=8)
    calls = []
    orig = lm.step_greedy

    def counted(h, t):
        calls.append(len(h))
        return orig(h, t)
    lm.step_greedy = counted
    fast = G.Generator(lm, tok).generate_batch(prompts, params)
    assert calls, "greedy generation did not take the device-argmax path"
    lm.step_greedy = None  # the logits path: host sampler on copied logits
    slow = G.Generator(lm, tok).generate_batch(prompts, params)
    assert [r.token_ids for r in fast] == [r.token_ids for r in slow]

    def second_best(h, t):
        lg = lm.step(h, t)
        return np.argsort(lg, axis=-1)[:, -2]
    lm.step_greedy = second_best
    wrong = G.Generator(lm, tok).generate_batch(prompts, params)
    assert [r.token_ids for r in wrong] != [r.token_ids for r in slow]


def test_decode_greedy_steps_equals_repeated_decode_greedy():
    a, sa, b, sb, rng, V = _twin_engines(6, (3, 8))
    first = rng.integers(0, V, 2)
    times = []
    got = a.decode_greedy_steps(sa, first, 5, step_times=times)
    want, t = [], first
    for _ in range(5):
        t = b.decode_greedy(sb, t)
        want.append(t)
    assert got.shape == (5, 2) and got.tolist() == np.stack(want).tolist()
    assert len(times) == 5 and all(x > 0 for x in times)
    assert [s.length for s in sa] == [s.length for s in sb]
    with pytest.raises(InputError, match="steps"):
        a.decode_greedy_steps(sa, first, 0)


def test_make_resident_copies_small_tables_only_and_rows_are_unchanged():
    from engine.ple_table import PLETable
    ck = Checkpoint.open(FIXTURES / "tiny")
    layer = ck.config.ple_layers[0]
    t = PLETable(ck, layer, np)
    rows = np.random.default_rng(12).integers(0, t.rows_total, (4, 3))
    before = t.gather_host(rows)
    assert t.make_resident(limit_bytes=0) is False  # over the limit: stays mapped
    assert t.make_resident() is True
    assert len(t._shards.arrays) == 1 and not isinstance(t._shards.arrays[0].base, np.memmap)  # merged, in RAM
    np.testing.assert_array_equal(t.gather_host(rows), before)
