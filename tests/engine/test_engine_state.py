"""State-pool tests (CPU, NumPy path): paging, fork, free/reuse scrubbing, snapshots, verify checkpoints.

These exercise engine/state.py directly on a tiny config; the engine-level equivalents (logits of a
restored/rolled-back sequence == a straight run) are in tests/engine/test_engine_forward.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.state import CapacityError, StateError, StatePool
from reference.config import ModelConfig


def tiny_config(**over):
    d = dict(vocab_size=64, hidden_size=8, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
             linear_value_head_dim=4, moe_intermediate_size=4, shared_expert_intermediate_size=4, num_experts=4,
             num_experts_per_tok=2, hc_count=2, hc_lowrank=4, ple_layer_ids=[2], ple_embed_dim=8, heads_per_ngram=2,
             ngram_vocab_size_base=50, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
             indexer_compress_ratio=4, eos_token_id=3, max_position_embeddings=40,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [1, 1, 0]})
    d.update(over)
    return ModelConfig.from_dict(d)


def write_tokens(pool, seq, n, rng, value=None):
    """Simulate a forward writing n tokens: reserve, fill K/V/indexer keys at the slots, bump state."""
    pool.reserve(seq, n)
    slots = pool.slots(seq, seq.length, seq.length + n)
    for key, arr in pool.page_arrays():
        arr[slots] = rng.standard_normal(arr[slots].shape) if value is None else value
    for key, arr in pool.slab_arrays():
        if not key.startswith("ple_ctx"):
            arr[seq.slab] = rng.standard_normal(arr[seq.slab].shape) if value is None else value
        else:
            arr[seq.slab] = rng.integers(0, 64, arr[seq.slab].shape)
    seq.length += n
    return slots


def read_state(pool, seq):
    slots = pool.slots(seq, 0, seq.length)
    pages = {k: a[slots].copy() for k, a in pool.page_arrays()}
    slab = {k: a[seq.slab].copy() for k, a in pool.slab_arrays()}
    return pages, slab


def same(a, b):
    return all(np.array_equal(a[0][k], b[0][k]) for k in a[0]) and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_slots_are_unique_and_block_table_mirrors_host(page_size):
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=page_size, num_pages=200 // page_size + 4, max_seqs=3)
    rng = np.random.default_rng()
    seqs = [pool.add() for _ in range(3)]
    lens = [7, 13, 1]
    for s, n in zip(seqs, lens):
        for _ in range(n):  # token by token, as decode does
            write_tokens(pool, s, 1, rng)
    all_slots = np.concatenate([pool.slots(s, 0, s.length) for s in seqs])
    assert len(np.unique(all_slots)) == sum(lens)  # no two tokens share a slot
    for s in seqs:
        row = pool.block_tables[s.slab]
        assert list(row[:len(s.pages)]) == s.pages and (row[len(s.pages):] == -1).all()
        assert len(s.pages) == -(-s.length // page_size)


def test_position_limit_is_max_position_embeddings_and_errors():
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=3, num_pages=100, max_seqs=2)
    s = pool.add()
    pool.reserve(s, 40)  # exactly max_position_embeddings: allowed, no hidden cap below it
    with pytest.raises(CapacityError, match="max_position_embeddings=40"):
        pool.reserve(s, 41)


def test_out_of_pages_is_a_clear_error_and_leaves_pool_intact():
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=4, num_pages=3, max_seqs=2)
    s = pool.add()
    with pytest.raises(CapacityError, match="KV pages"):
        pool.reserve(s, 13)  # needs 4 pages, pool has 3
    assert pool.free_pages() == 3 and s.pages == []
    with pytest.raises(CapacityError, match="sequences"):
        pool.add(); pool.add()
    assert "KV tokens" in pool.describe_limits()


def test_freed_sequence_leaves_nothing_behind():
    """A poisoned sequence is freed; the next owner of its slab row and pages sees only clean state."""
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=3, num_pages=6, max_seqs=1)
    a = pool.add()
    write_tokens(pool, a, 10, np.random.default_rng(), value=np.nan)
    a_pages = list(a.pages)
    pool.free(a)
    with pytest.raises(StateError, match="freed"):
        pool.reserve(a, 1)
    b = pool.add()
    assert b.slab == 0  # reused row
    pool.reserve(b, 10)
    assert sorted(b.pages) == sorted(a_pages)  # reused pages
    slots = pool.slots(b, 0, 10)
    for k, arr in pool.page_arrays():
        assert np.all(arr[slots] == 0), k
    for k, arr in pool.slab_arrays():
        expect = cfg.ple_eos_token_id if k.startswith("ple_ctx") else 0
        assert np.all(arr[b.slab] == expect), k


def test_negative_control_leaky_free_is_detected(monkeypatch):
    """Control: with page scrubbing disabled the same check must see the poison."""
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=3, num_pages=6, max_seqs=1)
    monkeypatch.setattr(pool, "_scrub_pages", lambda pages: None)
    a = pool.add()
    write_tokens(pool, a, 10, np.random.default_rng(), value=np.nan)
    pool.free(a)
    b = pool.add()
    pool.reserve(b, 10)
    slots = pool.slots(b, 0, 10)
    assert any(np.isnan(arr[slots]).any() for _, arr in pool.page_arrays())


def test_fork_is_copy_on_write():
    cfg = tiny_config()
    rng = np.random.default_rng()
    pool = StatePool(cfg, np, page_size=4, num_pages=20, max_seqs=3)
    p = pool.add()
    write_tokens(pool, p, 6, rng)  # page 1 half full -> shared partial page
    before = read_state(pool, p)
    c = pool.fork(p)
    assert c.pages == p.pages and all(pool.refcount[q] == 2 for q in p.pages)
    assert same(read_state(pool, c), before)
    write_tokens(pool, c, 3, rng)  # writes into the shared partial page -> copied first
    assert c.pages[0] == p.pages[0] and c.pages[1] != p.pages[1]
    assert same(read_state(pool, p), before)  # parent untouched (pages and slab)
    # the copied page keeps the parent's first tokens
    ck, _ = read_state(pool, c)
    for k in before[0]:
        assert np.array_equal(ck[k][:6], before[0][k])
    pool.free(p)
    assert pool.refcount[c.pages[0]] == 1


def test_snapshot_restore_round_trip_and_release():
    cfg = tiny_config()
    rng = np.random.default_rng()
    pool = StatePool(cfg, np, page_size=3, num_pages=20, max_seqs=2)
    s = pool.add()
    write_tokens(pool, s, 5, rng)
    ref = read_state(pool, s)
    snap = pool.snapshot(s)
    write_tokens(pool, s, 7, rng)
    assert not same(read_state(pool, s), ref)
    pool.restore(s, snap)
    assert s.length == 5 and same(read_state(pool, s), ref)
    write_tokens(pool, s, 2, rng)
    pool.restore(s, snap)  # restorable twice
    assert same(read_state(pool, s), ref)
    free_before = pool.free_pages()
    snap.release()
    pool.free(s)
    assert pool.free_pages() == pool.num_pages > free_before


def _branch_keeps_prefix(pool, rng, patch=None):
    """Snapshot a 5-token sequence, then write 2 more tokens into its shared partial page (copy on
    write) and restore: both the diverged branch and the restored sequence must hold the first 5 tokens'
    keys (K, V, indexer keys, block keys) exactly."""
    s = pool.add()
    write_tokens(pool, s, 5, rng)
    orig = pool.page_arrays
    ref = {k: a[pool.slots(s, 0, 5)].copy() for k, a in orig()}
    snap = pool.snapshot(s)
    if patch:
        patch(pool)
    write_tokens(pool, s, 2, rng)
    branch = {k: a[pool.slots(s, 0, 5)].copy() for k, a in orig()}
    pool.restore(s, snap)
    restored = {k: a[pool.slots(s, 0, 5)].copy() for k, a in orig()}
    return [k for k in ref if not (np.array_equal(branch[k], ref[k]) and np.array_equal(restored[k], ref[k]))]


def test_copy_on_write_carries_every_pool():
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=3, num_pages=20, max_seqs=2)
    assert _branch_keeps_prefix(pool, np.random.default_rng()) == []


def test_negative_control_cow_without_indexer_keys_is_detected():
    """Control: a copy-on-write that forgets the indexer-key pools is caught and located."""
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=3, num_pages=20, max_seqs=2)

    def drop_idx(p):
        orig = p.page_arrays
        p.page_arrays = lambda: ((k, a) for k, a in orig() if not k.startswith("idx_k"))
    bad = _branch_keeps_prefix(pool, np.random.default_rng(), patch=drop_idx)
    assert bad == ["idx_k.3"]


def test_verify_checkpoints_roll_back_to_any_prefix():
    cfg = tiny_config()
    rng = np.random.default_rng()
    pool = StatePool(cfg, np, page_size=3, num_pages=20, max_seqs=2)
    s = pool.add()
    write_tokens(pool, s, 4, rng)
    k = 5
    ck = pool.begin_checkpoints(s, k)
    states = [read_state(pool, s)]
    for j in range(k):
        write_tokens(pool, s, 1, rng)
        for key, arr in pool.slab_arrays():
            ck[key][j + 1] = arr[s.slab]
        states.append(read_state(pool, s))
    pool.rollback(s, 2)
    assert s.length == 4 + 3
    got = read_state(pool, s)
    assert same(got, (states[3][0], states[3][1]))
    pool.rollback(s, 3)  # further back, to the pre-verify state
    assert s.length == 4 and same(read_state(pool, s), states[0])
    with pytest.raises(StateError, match="rollback of 1 tokens"):
        pool.rollback(s, 1)


def test_negative_control_rollback_with_wrong_checkpoint_is_detected():
    """Control: restoring the checkpoint one position off must not look like the right state."""
    cfg = tiny_config()
    rng = np.random.default_rng()
    pool = StatePool(cfg, np, page_size=3, num_pages=20, max_seqs=2)
    s = pool.add()
    ck = pool.begin_checkpoints(s, 3)
    states = [read_state(pool, s)]
    for j in range(3):
        write_tokens(pool, s, 1, rng)
        for key, arr in pool.slab_arrays():
            ck[key][j + 1] = arr[s.slab]
        states.append(read_state(pool, s))
    # off-by-one: shift the checkpoints
    for key, _ in pool.slab_arrays():
        ck[key][1:] = ck[key][:-1].copy()
    pool.rollback(s, 1)
    assert not same(read_state(pool, s), states[2])


def test_pages_needed_counts_copy_on_write_and_matches_reserve():
    cfg = tiny_config()
    pool = StatePool(cfg, np, page_size=4, num_pages=20, max_seqs=3)
    p = pool.add()
    write_tokens(pool, p, 6, np.random.default_rng())
    c = pool.fork(p)  # shares the half-full page 1
    for n in (1, 2, 3, 7):
        need = pool.pages_needed(c, n)
        expect = 1 + (-(-(6 + n) // 4) - 2)  # one copy-on-write + the new pages
        assert need == expect
    free = pool.free_pages()
    pool.reserve(c, 7)
    assert free - pool.free_pages() == pool.pages_needed(p, 0) + 3  # reserve took exactly what was predicted
