"""The PLE layer composed from the engine's ops exactly as ``engine.model.Engine._ple`` composes them
(key/value projections -> ``ple_gate`` -> ``ple_conv``), for the kernel tests that check the whole layer.
Not a test module; the engine itself has no separate whole-layer function (its taps sit between the ops)."""
from __future__ import annotations

from engine.kernels.linear import linear
from engine.kernels.ple import ple_conv, ple_gate


def ple_layer(hidden, emb, key_proj_w, value_proj_w, norm_key_w, norm_query_w, norm_conv_w, conv_w, conv_slab,
              slots, *, hc_count: int, eps: float, dilation: int):
    """``(out [B, T, hc*H], gate [B, T, hc])`` of one PLE layer; ``conv_slab[slots]`` is advanced in place.

    Shapes: hidden ``[B, T, hc*H]``, emb ``[B, T, ple_embed_dim]``, key_proj_w ``[hc*H, E]``, value_proj_w
    ``[H, E]``, the norm weights ``[hc*H]``, conv_w ``[hc*H, K]``, conv_slab ``[n_slots, (K-1)*dilation, hc*H]``.
    """
    B, T, W = hidden.shape
    e2 = emb.reshape(B * T, emb.shape[2])
    pg = ple_gate(linear(e2, key_proj_w), linear(e2, value_proj_w), hidden.reshape(B * T, W), norm_key_w,
                  norm_query_w, norm_conv_w, hc_count=hc_count, eps=eps)
    conv = ple_conv(pg.gated_normed.reshape(B, T, W), conv_slab, slots, conv_w, dilation=dilation)
    return pg.gated.reshape(B, T, W) + conv, pg.gate.reshape(B, T, hc_count)
