"""The qwen4exp checkpoint's tensor names and shapes, from the config: the canonical names (prefixes
stripped), every tensor the model needs with its expected shape (the official module tree,
``Qwen4ExpTextModel.__init__`` and the classes it builds), the MTP head's, and the messages naming what is
missing."""
from __future__ import annotations

import re
from typing import Iterable

from reference.config import ModelConfig, defaulted_note as _defaulted_note  # noqa: F401 - re-exported

_PREFIXES = ("model.language_model.", "model.")
_NGRAM_SHARD_RE = re.compile(r"^(layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding)\.shard_(\d+)\.weight$")
_NGRAM_FULL = "layers.{i}.ple.ple_embedding.ngram_embedding.weight"


def canonical_name(stored: str) -> str:
    """Strip the checkpoint prefix: ``model.language_model.X`` / ``model.X`` -> ``X``;
    ``model.visual.X`` -> ``visual.X``; ``lm_head.*`` and ``mtp.*`` are kept."""
    for p in _PREFIXES:
        if stored.startswith(p):
            return stored[len(p):]
    return stored


# --------------------------------------------------------------------------- expected shapes
def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> expected shape of every tensor the text model can hold.

    The fused expert layout (``mlp.experts.gate_up_proj`` / ``down_proj``) and both n-gram-table forms are
    listed (a checkpoint holds one of each); the per-expert names
    (``layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``) are not enumerated - that would cost
    O(layers x num_experts) at every open - and :func:`expected_shape` answers for any one name of either
    layout. MTP, vision and quantisation scales are not listed. Source: the ``__init__`` of each module in
    modeling_qwen4_exp.py (``Qwen4ExpTextGatedResidual``, ``Qwen4ExpTextGatedDeltaNet``,
    ``Qwen4ExpTextAttention``, ``Qwen4ExpTextQSAIndexer``, ``Qwen4ExpTextSparseMoeBlock``,
    ``Qwen4ExpTextExperts``, ``Qwen4ExpTextPLELayer``, ``Qwen4ExpTextNGramEmbedding``).
    """
    H, V, hc, R = cfg.hidden_size, cfg.vocab_size, cfg.hc_count, cfg.hc_lowrank
    hcH = hc * H
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H),
                                       "hyper_connection_mixer.hc_norm.weight": (hcH,),
                                       "hyper_connection_mixer.input_mix_weight_down.weight": (R, hcH),
                                       "hyper_connection_mixer.input_mix_weight_up.weight": (hcH, R)}
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    for i, lt in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        for hcn in ("attn_hyper_connection", "mlp_hyper_connection"):
            out[p + hcn + ".hc_norm.weight"] = (hcH,)
            out[p + hcn + ".input_mix_weight_down.weight"] = (R, hcH)
            out[p + hcn + ".input_mix_weight_up.weight"] = (hcH, R)
            out[p + hcn + ".block_inject_weight.weight"] = (hc, hcH)
        if lt == "linear_attention":
            q = p + "linear_attn."
            nv, conv = cfg.linear_num_value_heads, cfg.linear_conv_dim
            out.update({q + "dt_bias": (nv,), q + "A_log": (nv,), q + "conv1d.weight": (conv, 1, cfg.linear_conv_kernel_dim),
                        q + "norm.weight": (cfg.linear_value_head_dim,), q + "out_proj.weight": (H, cfg.linear_value_dim),
                        q + "in_proj_qkv.weight": (conv, H), q + "in_proj_z.weight": (cfg.linear_value_dim, H),
                        q + "in_proj_b.weight": (nv, H), q + "in_proj_a.weight": (nv, H)})
        else:
            q = p + "self_attn."
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            out.update({q + "q_proj.weight": (2 * nh * hd, H), q + "k_proj.weight": (nkv * hd, H),
                        q + "v_proj.weight": (nkv * hd, H), q + "o_proj.weight": (H, nh * hd),
                        q + "q_norm.weight": (hd,), q + "k_norm.weight": (hd,)})
            if cfg.attention_bias:
                out.update({q + "q_proj.bias": (2 * nh * hd,), q + "k_proj.bias": (nkv * hd,),
                            q + "v_proj.bias": (nkv * hd,), q + "o_proj.bias": (H,)})
            if cfg.qsa_enabled:
                ihd = cfg.indexer_head_dim
                out.update({q + "indexer.index_qk_proj.weight": ((cfg.indexer_n_heads + cfg.indexer_kv_heads) * ihd, H),
                            q + "indexer.q_layernorm.weight": (ihd,), q + "indexer.k_layernorm.weight": (ihd,)})
        m = p + "mlp."
        out.update({m + "gate.weight": (E, H), m + "experts.gate_up_proj": (E, 2 * I, H),
                    m + "experts.down_proj": (E, H, I), m + "shared_expert.gate_proj.weight": (S, H),
                    m + "shared_expert.up_proj.weight": (S, H), m + "shared_expert.down_proj.weight": (H, S),
                    m + "shared_expert_gate.weight": (1, H)})
        if i in cfg.ple_layers:
            lay = cfg.ple_layout(i)
            q, P = p + "ple.", cfg.ple_embed_dim
            out.update({q + "key_proj.weight": (hcH, P), q + "value_proj.weight": (H, P),
                        q + "norm_key.weight": (hcH,), q + "norm_query.weight": (hcH,), q + "norm_conv.weight": (hcH,),
                        q + "conv1d.weight": (hcH, 1, cfg.ple_conv_kernel_size),
                        q + "ple_embedding.layer_multipliers": (cfg.ngram_size,),
                        q + "ple_embedding.ngram_heads_vocab_sizes": (cfg.ngram_heads,),
                        q + "ple_embedding.ngram_heads_offsets": (cfg.ngram_heads,),
                        _NGRAM_FULL.format(i=i): (lay.padded_rows, lay.head_dim)})
    return out


_PER_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MTP_PER_EXPERT_RE = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

#: the ``layer`` argument of :meth:`_WeightsBase.expert` that names the MTP head's MoE (``mtp.layers.0.mlp``)
MTP_LAYER = "mtp"


def mtp_expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> expected shape of the MTP head's tensors (``mtp.*``; fused expert layout listed, the
    per-expert names answered by :func:`expected_shape`). They are optional: a checkpoint without them is
    complete (:func:`required_names` never lists them). Source: model-facts.md section 3 (the tensor census
    and the vLLM/SGLang loaders; no official module exists): ``pre_fc_norm_embedding [H]``,
    ``pre_fc_norm_hidden [hc*H]``, ``fc_embedding``/``fc_hidden [H, H]``, one full-attention (QSA) decoder
    layer ``mtp.layers.0.*`` shaped like the trunk's, and ``mtp.hyper_connection_mixer.*``."""
    H, hc, R = cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank
    hcH = hc * H
    # the layer is the trunk's full-attention layer: reuse the trunk's shape rules on a one-layer config
    import dataclasses
    one = expected_shapes(dataclasses.replace(cfg, layer_types=("indexed_attention",), num_hidden_layers=1,
                                              ple_layer_ids=()))
    out = {"mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (hcH,),
           "mtp.fc_embedding.weight": (H, H), "mtp.fc_hidden.weight": (H, H),
           "mtp.hyper_connection_mixer.hc_norm.weight": (hcH,),
           "mtp.hyper_connection_mixer.input_mix_weight_down.weight": (R, hcH),
           "mtp.hyper_connection_mixer.input_mix_weight_up.weight": (hcH, R)}
    out.update({"mtp." + n: s for n, s in one.items() if n.startswith("layers.0.")})
    return out


def expected_shape(cfg: ModelConfig, name: str, shapes: dict | None = None) -> tuple[int, ...] | None:
    """Expected shape of one canonical tensor ``name`` (either expert layout), or None when the text model
    has no such tensor. ``shapes``: a precomputed :func:`expected_shapes` of ``cfg`` (saves recomputing)."""
    if shapes is None:
        shapes = expected_shapes(cfg)
    exp = shapes.get(name)
    if exp is not None:
        return exp
    m = _PER_EXPERT_RE.match(name)
    if m and int(m.group(1)) < cfg.num_hidden_layers and int(m.group(2)) < cfg.num_experts:
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        return (H, I) if m.group(3) == "down" else (I, H)
    m = _MTP_PER_EXPERT_RE.match(name)
    if m and int(m.group(1)) < cfg.num_experts:
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        return (H, I) if m.group(2) == "down" else (I, H)
    return None


def required_names(cfg: ModelConfig, names: Iterable[str] = ()) -> list[str]:
    """Canonical names a complete text checkpoint must hold. Experts count in either layout and the
    n-gram table in either form (sharded or whole), judged from ``names`` (the stored canonical names).
    ``lm_head.weight`` is not required when ``tie_word_embeddings`` is set. The PLE buffers
    (``layer_multipliers`` ...) are derived from the config and not required."""
    return list(_iter_required(cfg, names))


def _iter_required(cfg: ModelConfig, names: Iterable[str] = ()):
    """:func:`required_names` as a generator (a check can stop at the first missing name without listing
    layers x num_experts per-expert names first)."""
    names = set(names)
    for n in expected_shapes(cfg):
        if n == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".ple_embedding.layer_multipliers" in n or ".ngram_heads_" in n or n.endswith("ngram_embedding.weight"):
            continue
        if ".mlp.experts." in n:
            continue
        yield n
    for i in range(cfg.num_hidden_layers):
        m = f"layers.{i}.mlp.experts."
        if (m + "gate_up_proj") in names or (m + "down_proj") in names:
            yield m + "gate_up_proj"
            yield m + "down_proj"
        else:
            for e in range(cfg.num_experts):
                yield f"{m}{e}.gate_proj.weight"
                yield f"{m}{e}.up_proj.weight"
                yield f"{m}{e}.down_proj.weight"


def _near(name: str, names: Iterable[str], k: int = 5) -> list[str]:
    """Up to ``k`` stored names close to ``name`` (same layer first; bounded work on 150k-tensor checkpoints)."""
    import difflib
    names = list(names)
    parts = name.split(".")
    scope = ".".join(parts[:2]) + "." if parts[0] == "layers" and len(parts) > 2 else parts[0]
    pool = [n for n in names if n.startswith(scope)] or names
    if len(pool) > 4000:
        stem = name.rsplit(".", 1)[-1]
        pool = [n for n in pool if n.endswith(stem)][:4000] or pool[:4000]
    return difflib.get_close_matches(name, pool, n=k, cutoff=0.5)
