"""LIVE comparison with the official implementation (torch + transformers) on freshly drawn weights and
prompts: logits and every decoder layer's output, float32 and float64 reference, QSA tie-aware; the PLE
hash bit for bit against the official NGramEmbedding (largest ids, EOS at every position, context across
calls through the official cache). Negative controls: perturbed weight, wrong EOS reset, off-by-one RoPE."""
from __future__ import annotations
from reference import taphook

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: the live oracle tests need the `oracle` extra")
pytest.importorskip("transformers.models.qwen4_exp", reason="transformers with qwen4_exp not installed")

import reference.model as refmodel  # noqa: E402
from reference.config import ModelConfig  # noqa: E402
from reference.model import ReferenceModel, _Capture  # noqa: E402
from reference.numba_kernels import ngram_hash_rows  # noqa: E402
from reference_helpers import EOS, official_model, tiny_config_dict  # noqa: E402
from taps import recorder as recmod  # noqa: E402

pytestmark = pytest.mark.oracle
REL = 1e-4  # the reference's acceptance bound (official float32 vs reference; observed ~1e-6, see test_reference_goldens)
TIE_TOL = 1e-5  # relative gap under which two block scores count as tied (float32 score rounding ~1e-7)


def _prompt(seed, T, vocab=256):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, T)
    ids[ids == EOS] = 0
    ids[rng.choice(T, 2, replace=False)] = EOS
    return ids


def run_official(m, ids):
    """Official logits, decoder-layer outputs and per-QSA-layer token selection masks ``[T, T]``."""
    hidden, masks, hooks = {}, {}, []
    for i, layer in enumerate(m.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda mod, a, out, i=i: hidden.__setitem__(i, out[0].detach().numpy().copy())))
        if hasattr(layer, "self_attn"):
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, a, out, i=i: masks.__setitem__(i, out[0, 0].numpy().copy())))
    try:
        with torch.no_grad():
            logits = m(torch.as_tensor(ids)[None], use_cache=False).logits[0].numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, [hidden[i] for i in range(len(hidden))], masks


def official_blocks(mask, cfg):
    """Block selection ``[T, block_topk]`` read off an official token mask (a block is selected when its
    first token is; the incomplete tail is always visible and not a block)."""
    r, k = cfg.indexer_compress_ratio, cfg.block_topk
    T = mask.shape[0]
    out = np.full((T, k), -1, dtype=np.int64)
    for t in range(T):
        nc = (t + 1) // r
        b = [j for j in range(nc) if mask[t, j * r]]
        out[t, :len(b)] = b
    return out


def _captured(m, ids, hook=None):
    cap = _Capture()
    tok = taphook.set_current(cap)
    try:
        m.selection_hook = hook
        m.forward(ids)
    finally:
        m.selection_hook = None
        taphook.reset_current(tok)
    return cap.result()


def tie_aware_compare(m, tm, ids):
    """Compare the reference with the official model, explaining every selection difference by a tie.

    1. the reference's own (canonical) block selection must equal the official one wherever the cut-off is
       not tied (within ``TIE_TOL``), and differ only among tied blocks otherwise;
    2. the numbers are then compared with the reference following the official choice at those ties.
    Returns:
        (logits rel error, per-layer rel errors, number of tied cut-offs, number of differing selections).
    """
    cfg = m.config
    logits_o, hidden_o, masks = run_official(tm, ids)
    off_sel = {i: official_blocks(mk, cfg) for i, mk in masks.items()}
    own = _captured(m, ids)
    ties = differ = 0
    for i in off_sel:
        scores = own[f"layers.{i}.self_attn.indexer.block_scores"]
        sel = own[f"layers.{i}.self_attn.indexer.selected_blocks"]
        for t in range(len(ids)):
            nc = (t + 1) // cfg.indexer_compress_ratio
            k = min(cfg.block_topk, nc)
            if k == 0:
                continue
            s = scores[t, :nc]
            a, b = set(sel[t, :k].tolist()), set(off_sel[i][t, :k].tolist())
            if k == nc:
                assert a == b == set(range(nc)), (i, t, a, b)
                continue
            cut = np.sort(s)[::-1][k - 1]
            tol = TIE_TOL * max(1.0, abs(cut))
            tied_at_cut = np.sum(np.abs(s - cut) <= tol) > 1 and abs(np.sort(s)[::-1][k] - cut) <= tol
            ties += int(tied_at_cut)
            if a != b:
                differ += 1
                assert tied_at_cut and all(abs(s[j] - cut) <= tol for j in a ^ b), \
                    f"layer {i} position {t}: selection {sorted(a)} vs official {sorted(b)} not explained by a " \
                    f"tie (scores {s})"
    r = _captured(m, ids, hook=lambda i, pos, scores, sel: off_sel[i][pos])
    layers = [float(np.abs(r[f"layers.{i}.mlp_hyper_connection.combine"] - hidden_o[i]).max()
                    / np.abs(hidden_o[i]).max()) for i in range(cfg.num_hidden_layers)]
    lr = float(np.abs(r["logits"] - logits_o).max() / np.abs(logits_o).max())
    return lr, layers, ties, differ


@pytest.fixture(scope="module")
def live():
    d = tiny_config_dict()
    tm, w = official_model(d, seed=21)
    return d, tm, w


@pytest.mark.parametrize("seed,T", [(1, 30), (2, 45)])
def test_live_logits_and_layers_tie_aware(live, seed, T):
    d, tm, w = live
    ids = _prompt(seed, T)
    total_ties = 0
    for dtype in (np.float32, np.float64):
        m = ReferenceModel(w, dtype=dtype)
        lr, layers, ties, differ = tie_aware_compare(m, tm, ids)
        total_ties += ties
        assert lr <= REL and max(layers) <= REL, (dtype, lr, layers, ties, differ)
        if differ == 0:  # no selection difference: the plain forward must agree on its own
            logits_o = run_official(tm, ids)[0]
            assert np.abs(m.forward(ids) - logits_o).max() <= REL * np.abs(logits_o).max()
    print(f"seed {seed}: {total_ties} tied QSA cut-offs (counted over float32+float64 runs)")


def test_live_fresh_weights_second_config():
    """Other widths: 3 streams, more experts, GQA 4:1, silu output gate, PLE on two layers, no QSA tail."""
    d = tiny_config_dict(hc_count=3, num_experts=6, num_experts_per_tok=3, num_attention_heads=4,
                         num_key_value_heads=1, output_gate_type="silu", norm_topk_prob=False,
                         indexer_budget=6, indexer_compress_ratio=3, ple_layer_ids=[1, 2], attention_bias=True,
                         tie_word_embeddings=True)
    tm, w = official_model(d, seed=5)
    m = ReferenceModel(w)
    lr, layers, ties, differ = tie_aware_compare(m, tm, _prompt(9, 33))
    assert lr <= REL and max(layers) <= REL, (lr, layers)


def test_live_tie_is_detected_and_resolved():
    """Weights/prompt with a known exact tie at the QSA cut-off (zero relu-sums) where the official topk
    picks differently from the canonical order: detected, counted and compared tie-aware."""
    tm, w = official_model(tiny_config_dict(), seed=0)
    ids = np.random.default_rng(0).integers(0, 256, 40)
    ids[[5, 17]] = EOS
    m = ReferenceModel(w)
    lr, layers, ties, differ = tie_aware_compare(m, tm, ids)
    assert ties >= 1 and differ >= 1, (ties, differ)
    assert lr <= REL and max(layers) <= REL, (lr, layers)
    # the plain forward differs at the tie (why the comparison must be tie-aware)
    logits_o = run_official(tm, ids)[0]
    assert np.abs(m.forward(ids) - logits_o).max() > REL * np.abs(logits_o).max()


def test_live_negative_control_wrong_selection(live, monkeypatch):
    """A selection that is not explained by ties (lowest-scored blocks) fails the tie-aware comparison."""
    d, tm, w = live
    orig = refmodel.indexer_select

    def worst(q, bk, pos, cfg):
        scores, sel, nc = orig(q, bk, pos, cfg)
        _, sel2, _ = orig(q, bk, pos, cfg)
        flipped = np.where(np.isfinite(scores), -scores, -np.inf)
        from reference.blocks.qsa import canonical_topk
        k = sel.shape[1]
        alt = canonical_topk(flipped, min(k, flipped.shape[1]))
        keep = sel >= 0
        sel2[:, :alt.shape[1]] = np.where(keep[:, :alt.shape[1]], alt, -1)
        return scores, sel2, nc

    monkeypatch.setattr(refmodel, "indexer_select", worst)
    with pytest.raises(AssertionError, match="not explained by a tie"):
        tie_aware_compare(ReferenceModel(w), tm, _prompt(1, 30))


def test_live_negative_controls(live, monkeypatch):
    d, tm, w = live
    ids = _prompt(3, 30)
    logits_o, hidden_o, _ = run_official(tm, ids)
    # perturbed weight: a single GDN decay bias
    name = "layers.1.linear_attn.A_log"
    bad = ReferenceModel(w.with_override(name, w.get(name) + 0.3))
    assert np.abs(bad.forward(ids) - logits_o).max() > REL * np.abs(logits_o).max()
    # wrong EOS reset
    orig = refmodel.ngram_hash_rows
    monkeypatch.setattr(refmodel, "ngram_hash_rows", lambda c, i, eos, *a: orig(c, i, -1, *a))
    assert np.abs(ReferenceModel(w).forward(ids) - logits_o).max() > REL * np.abs(logits_o).max()
    monkeypatch.setattr(refmodel, "ngram_hash_rows", orig)
    # off-by-one RoPE: block keys rotated at their block's second token instead of its first
    orig_pool = refmodel.pool_block_keys
    monkeypatch.setattr(refmodel, "pool_block_keys", lambda keys, a, b, kw, cos_fn, cfg: orig_pool(
        keys, a, b, kw, lambda p: cos_fn(p + 1), cfg))
    m = ReferenceModel(w)
    cap = _Capture({"layers.3.self_attn.indexer.block_scores"})
    tok = taphook.set_current(cap)
    try:
        m.forward(ids)
    finally:
        taphook.reset_current(tok)
    monkeypatch.setattr(refmodel, "pool_block_keys", orig_pool)
    good = _Capture({"layers.3.self_attn.indexer.block_scores"})
    tok = taphook.set_current(good)
    try:
        ReferenceModel(w).forward(ids)
    finally:
        taphook.reset_current(tok)
    a, b = cap.result()["layers.3.self_attn.indexer.block_scores"], good.result()[
        "layers.3.self_attn.indexer.block_scores"]
    fin = np.isfinite(b)
    assert np.abs(a[fin] - b[fin]).max() > 1e-3


# ---------------------------------------------------------------- hashing, bit for bit
def _official_embedding(ple_layer_index, layer_idx=2, vocab=248320, eos=248044):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding
    d = tiny_config_dict(vocab_size=vocab, eos_token_id=eos, ngram_vocab_size_base=1009, ple_layer_ids=[1, 3])
    d.pop("model_type")
    tcfg = Qwen4ExpTextConfig(**d)
    emb = Qwen4ExpTextNGramEmbedding(tcfg, tcfg.ple_embed_dim, layer_idx, ple_layer_index)
    with torch.no_grad():  # row r holds r in column 0 (exact in float32 below 2**24)
        emb.ngram_embedding.weight.zero_()
        emb.ngram_embedding.weight[:, 0] = torch.arange(emb.ngram_embedding.weight.shape[0]).float()
    cfg = ModelConfig.from_dict(tiny_config_dict(vocab_size=vocab, eos_token_id=eos, ngram_vocab_size_base=1009,
                                                 ple_layer_ids=[1, 3]))
    return tcfg, emb, cfg


def _official_rows(emb, ids, cache=None):
    with torch.no_grad():
        out = emb(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], cache)
    heads = emb.ngram_heads
    return out[0].reshape(len(ids), heads, -1)[..., 0].numpy().astype(np.int64)


def _mine(cfg, layer, ctx, ids):
    lay = cfg.ple_layout(layer)
    return ngram_hash_rows(ctx, ids, cfg.ple_eos_token_id, lay.multipliers, lay.head_vocab_sizes,
                           lay.head_offsets, cfg.heads_per_ngram)


@pytest.mark.parametrize("pli,layer", [(0, 0), (1, 2)])
def test_hash_bit_exact_vs_official(pli, layer):
    tcfg, emb, cfg = _official_embedding(pli, layer)
    lay = cfg.ple_layout(layer)
    assert list(lay.head_vocab_sizes) == emb.head_vocab_sizes and list(lay.head_offsets) == emb.head_offsets
    assert list(lay.multipliers) == emb.layer_multipliers.tolist()
    eos = cfg.ple_eos_token_id
    ctx0 = np.full(2, eos)
    V = cfg.vocab_size
    largest = np.array([V - 1, V - 2, V - 1, V - 1, V - 3, 0, V - 1])
    assert np.array_equal(_mine(cfg, layer, ctx0, largest), _official_rows(emb, largest))
    rng = np.random.default_rng(pli)
    base = rng.integers(0, V, 9)
    base[base == eos] = 1
    for p in range(len(base)):  # EOS at every position
        ids = base.copy()
        ids[p] = eos
        assert np.array_equal(_mine(cfg, layer, ctx0, ids), _official_rows(emb, ids)), p
    # two EOS in a row and EOS at both ends
    ids = np.array([eos, 5, eos, eos, 9, 10, eos])
    assert np.array_equal(_mine(cfg, layer, ctx0, ids), _official_rows(emb, ids))


def test_hash_context_across_calls_vs_official_cache():
    from transformers.cache_utils import DynamicCache
    tcfg, emb, cfg = _official_embedding(1, 2)
    eos = cfg.ple_eos_token_id
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, 14)
    ids[ids == eos] = 3
    ids[6] = eos
    for cuts in ([1], [2, 3], [5, 6, 7], [1, 2, 3, 4, 13]):
        cache = DynamicCache(config=tcfg)
        ctx = np.full(2, eos)
        bounds = [0, *cuts, len(ids)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            off = _official_rows(emb, ids[a:b], cache)
            mine = _mine(cfg, 2, ctx, ids[a:b])
            assert np.array_equal(mine, off), (cuts, a, b)
            ctx = np.concatenate([ctx, ids[a:b]])[-2:]
        # negative control: a call that forgets the carried context disagrees with the official cache
    cache = DynamicCache(config=tcfg)
    _official_rows(emb, ids[:5], cache)
    off = _official_rows(emb, ids[5:], cache)
    assert not np.array_equal(_mine(cfg, 2, np.full(2, eos), ids[5:]), off)


def test_hash_negative_control_wrong_eos_vs_official():
    tcfg, emb, cfg = _official_embedding(0, 0)
    lay = cfg.ple_layout(0)
    ids = np.array([11, 12, cfg.ple_eos_token_id, 13, 14])
    wrong = ngram_hash_rows(np.full(2, cfg.ple_eos_token_id), ids, -1, lay.multipliers, lay.head_vocab_sizes,
                            lay.head_offsets, cfg.heads_per_ngram)
    assert not np.array_equal(wrong, _official_rows(emb, ids))


def test_live_incremental_vs_official_cache(live):
    """Official cached prefill + decode (its own recurrent/conv/indexer caches) vs a reference session."""
    from transformers.cache_utils import DynamicCache
    d, tm, w = live
    ids = _prompt(6, 22)
    cache = DynamicCache(config=tm.config)
    outs = []
    with torch.no_grad():
        outs.append(tm(torch.as_tensor(ids[:9])[None], cache=cache, use_cache=True).logits[0].numpy())
        for t in ids[9:]:
            outs.append(tm(torch.as_tensor([[int(t)]]), cache=cache, use_cache=True).logits[0].numpy())
    off = np.concatenate(outs)
    s = ReferenceModel(w).new_session()
    mine = np.concatenate([s.prefill(ids[:9]), np.stack([s.decode(t) for t in ids[9:]])])
    # a QSA tie would make the official choice arbitrary: the full-forward tie-aware test covers that case;
    # this prompt/seed has none at the cut-off (asserted through the full-forward comparison below)
    lr, _, _, differ = tie_aware_compare(ReferenceModel(w), tm, ids)
    assert differ == 0 and lr <= REL
    assert np.abs(mine - off).max() <= REL * np.abs(off).max()
