"""The sparse MoE block: softmax router, canonical top-k, SwiGLU experts, gated shared expert.

Sources (modeling_qwen4_exp.py): ``Qwen4ExpTextTopKRouter.forward``, ``Qwen4ExpTextExperts.forward``,
``Qwen4ExpTextMLP.forward`` (shared expert) and ``Qwen4ExpTextSparseMoeBlock.forward``.
"""
from __future__ import annotations

import numpy as np

from reference.blocks.linear import linear
from reference.blocks.norms import sigmoid, silu
from reference.blocks.qsa import canonical_topk

__all__ = ["router_topk", "route", "swiglu", "moe_block"]


def router_topk(logits: np.ndarray, top_k: int, norm_topk_prob: bool):
    """Router selection from logits: ``softmax`` then the canonical top-k (probability descending, lower
    expert id first).

    Args:
        logits: ``[T, E]`` router logits (the softmax runs in their dtype).
    Returns:
        ``(topk_ids [T, k] int64, topk_weights [T, k])``; weights renormalised to sum 1 when ``norm_topk_prob``.
    Source: ``Qwen4ExpTextTopKRouter.forward`` (softmax in float32 there; in the compute dtype here).
    """
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    ids = canonical_topk(probs, top_k)
    wts = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return ids, wts


def route(x: np.ndarray, gate_w: np.ndarray, top_k: int, norm_topk_prob: bool):
    """Router: ``logits = x W^T``, then :func:`router_topk`.

    Args:
        x: ``[T, H]``; gate_w: ``[E, H]``.
    Returns:
        ``(router_logits [T, E], topk_ids [T, k] int64, topk_weights [T, k])``; weights renormalised to sum
        1 when ``norm_topk_prob``.
    Source: ``Qwen4ExpTextTopKRouter.forward``.
    """
    logits = linear(x, gate_w)
    ids, wts = router_topk(logits, top_k, norm_topk_prob)
    return logits, ids, wts


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``down(silu(gate x) * up x)``: x ``[N, H]``, gate/up ``[I, H]``, down ``[H, I]`` -> ``[N, H]``.

    The weights are arrays or :class:`reference.blocks.linear.BF16Matrix` (stored BF16 bits).

    Source: ``Qwen4ExpTextMLP.forward`` and the per-expert body of ``Qwen4ExpTextExperts.forward``.
    """
    return linear(silu(linear(x, gate)) * linear(x, up), down)


def moe_block(x: np.ndarray, w: dict, expert_fn, cfg):
    """Routed experts + sigmoid-gated shared expert.

    Args:
        x: ``[T, H]``.
        w: ``gate [E, H]``, ``shared_gate``/``shared_up [I_s, H]``, ``shared_down [H, I_s]``, ``shared_expert_gate [1, H]``.
        expert_fn: ``e -> (gate [I, H], up [I, H], down [H, I])`` in the compute dtype (or as
            ``BF16Matrix`` stored bits); called once per call and only for experts some token uses (so only
            those are read), with all the rows routed to that expert at once.
    Returns:
        ``(out [T, H], router_logits [T, E], topk_ids [T, k], topk_weights [T, k])``.
    Source: ``Qwen4ExpTextSparseMoeBlock.forward``.
    """
    logits, ids, wts = route(x, w["gate"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        g, u, d = expert_fn(int(e))
        y = swiglu(x[tok], g, u, d) * wts[tok, slot][:, None]
        out[tok] += y  # a token routes to an expert at most once: tok has no repeats
    shared = swiglu(x, w["shared_gate"], w["shared_up"], w["shared_down"])
    out = out + sigmoid(linear(x, w["shared_expert_gate"])) * shared
    return out, logits, ids, wts
