"""A synthetic tap producer: emits every registry tap of a config, in forward order, chunk by chunk,
through ``taps.recorder.current()`` exactly as a model would -- without computing a model.

Used by the taps tests (recorder/archive/diff on known streams) and by the diff benchmark. Values
are deterministic functions of (seed, tap name, position), so two runs agree bit for bit; a
``fault`` perturbs one tap from one position on and, to mimic propagation, every later activation
tap in forward order at the same or later positions.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from taps import registry
from taps.recorder import current, tap_row_shape

__all__ = ["tiny_config", "fake_forward"]


def tiny_config(num_hidden_layers: int = 4, **over):
    """A small valid :class:`reference.config.ModelConfig` (hidden 16, 4 layers: GDN x3 + QSA, PLE on layer 1)."""
    from reference.config import ModelConfig
    d = dict(vocab_size=64, hidden_size=16, num_hidden_layers=num_hidden_layers, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, linear_key_head_dim=4, linear_value_head_dim=4,
             linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=8,
             shared_expert_intermediate_size=8, num_experts=8, num_experts_per_tok=2, hc_count=2, hc_lowrank=4,
             ple_layer_ids=[2], ple_embed_dim=16, heads_per_ngram=2, ngram_vocab_size_base=100,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2,
             eos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    d.update(over)
    return ModelConfig.from_dict(d)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _canonical_topk(scores: np.ndarray, k: int, tie_break_high: bool = False) -> np.ndarray:
    """Top-k per row: score descending, then lower index (higher index with ``tie_break_high``); -1 pads
    when fewer than k finite candidates."""
    T, n = scores.shape
    out = np.full((T, k), -1, dtype=np.int64)
    idx = np.arange(n)
    for t in range(T):
        sec = -idx if tie_break_high else idx
        order = np.lexsort((sec, -scores[t]))
        order = [int(i) for i in order if np.isfinite(scores[t, i])][:k]
        out[t, :len(order)] = order
    return out


def fake_forward(config, token_ids, seed: int = 0, chunk_size: int | None = None, fault: dict | None = None,
                 dtype=np.float32, ties: bool = False) -> None:
    """Emit every tap of ``config`` for ``token_ids`` into the active recorder (no-op without one).

    Args:
        chunk_size: emit in chunks of this many positions (like chunked prefill); None: one chunk.
        fault: ``{"tap": name, "position": p, "scale": s}`` perturbs ``name`` at positions >= p by
            ``s`` (relative to its values) and every later activation tap likewise; ``{"tie_break": name}``
            makes that index tap break ties towards the higher index; ``{"near_tie": name, "position": p,
            "swap": bool}`` moves the k-th and (k+1)-th scores of ``name``'s companion at p to within 1e-6
            (relative) of each other, in their original order or swapped (combine with ``tap`` to
            perturb what follows).
        ties: quantise score taps so that exact ties occur.
    """
    rec = current()
    if rec is None:
        return
    T = len(token_ids)
    names = registry.tap_names(config)
    rank = {n: k for k, n in enumerate(names)}
    chunk = chunk_size or T
    fault = fault or {}
    f_tap, f_pos, f_scale = fault.get("tap"), int(fault.get("position", 0)), float(fault.get("scale", 1e-2))
    full: dict[str, np.ndarray] = {}
    for n in names:
        spec = registry.spec_for(n)
        shape = tap_row_shape(spec, config, T)
        if spec.kind == registry.INDEX:
            continue
        v = _rng(seed, n).standard_normal((T, *shape)).astype(np.float64)
        if "n_blocks" in spec.shape:  # block b (size r) is visible to query t once complete: (b+1)*r <= t+1
            r = config.indexer_compress_ratio
            vis = (np.arange(shape[-1])[None, :] + 1) * r <= (np.arange(T)[:, None] + 1)
            v = np.where(vis, np.abs(v), -np.inf)
        if ties and spec.kind != registry.INDEX and (n.endswith("block_scores") or n.endswith("router_logits")):
            v = np.round(v * 2) / 2
        if f_tap is not None and rank[n] >= rank.get(f_tap, 10 ** 9) and spec.kind != registry.INDEX:
            if n == f_tap or not (n.endswith("block_scores") or n.endswith("router_logits")):
                pert = f_scale * _rng(seed + 1, n).standard_normal(v[f_pos:].shape) * np.abs(v[f_pos:]).mean() \
                    if np.isfinite(v).any() else 0
                v[f_pos:] = np.where(np.isfinite(v[f_pos:]), v[f_pos:] + pert, v[f_pos:])
        full[n] = v.astype(dtype)
    if "near_tie" in fault:
        idx_name = fault["near_tie"]
        comp = registry.companion_of(idx_name)
        p = int(fault.get("position", 0))
        sc = full[comp][p].astype(np.float64)
        k = tap_row_shape(registry.spec_for(idx_name), config, T)[-1]
        order = np.lexsort((np.arange(len(sc)), -sc))
        a, b = int(order[k - 1]), int(order[k])
        mid = (sc[a] + sc[b]) / 2
        eps = 1e-6 * max(1.0, abs(mid)) * (-1 if fault.get("swap") else 1)
        sc[a], sc[b] = mid + eps, mid - eps
        full[comp][p] = sc.astype(dtype)
    for n in names:
        spec = registry.spec_for(n)
        if spec.kind != registry.INDEX:
            continue
        shape = tap_row_shape(spec, config, T)
        if spec.companion is None:  # n-gram ids: a hash of the token ids
            ids = np.asarray(token_ids, dtype=np.int64)
            v = (ids[:, None] * 7919 + np.arange(shape[-1])[None, :] * 104729 + seed) % 1000
            if f_tap == n:
                v = v.copy()
                v[f_pos] += 1
            full[n] = v
        else:
            comp = registry.companion_of(n)
            full[n] = _canonical_topk(full[comp].astype(np.float64), shape[-1],
                                      tie_break_high=fault.get("tie_break") == n)
    for s in range(0, T, chunk):
        pos = np.arange(s, min(T, s + chunk), dtype=np.int64)
        for n in names:
            v = full[n][pos]
            if "n_blocks" in registry.spec_for(n).shape:  # ragged: width = blocks complete by this chunk's end
                w = max(1, math.floor((pos[-1] + 1) / config.indexer_compress_ratio))
                v = v[:, :w]
            rec.emit(n, v, positions=pos)
