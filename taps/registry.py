"""The tap registry: every tap's name, producing module, shape, dtype, kind and meaning.

Names follow the checkpoint's module paths (``layers.{i}.`` is a decoder layer, 0-based) plus a
suffix naming what the module produced. Shapes are positions first: ``[T, ...]`` where ``T`` is
the number of recorded positions. Index taps name their companion score tap, so comparisons can
tell a real selection error from a near-tie flip.

Forward order (the order tap-diff walks): ``embed_tokens.out``; then per layer ``i``: the PLE taps
(PLE layers only), the attention hyper-connection, the mixer block (``linear_attn`` or
``self_attn``), the attention combine, the MLP hyper-connection, the MoE, the MLP combine; then
``hyper_connection_mixer.hc_norm.out``, ``hyper_connection_mixer.out`` and ``logits``. Every RMSNorm has an
``<module>.out`` tap (``hc_norm``, ``ple.norm_key/norm_query/norm_conv``, ``linear_attn.norm``,
``self_attn.q_norm/k_norm``, ``self_attn.indexer.q_layernorm``; the indexer's ``k_layernorm`` is read through
the pooled ``indexer.block_keys``), so a norm fault is named at the norm, not at its first consumer.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import numpy as np

REGISTRY_VERSION = 2  # 2: norm outputs, pooled block keys, PLE conv output, GDN conv state

ACTIVATION, INDEX, SCALAR = "activation", "index", "scalar"


@dataclass(frozen=True)
class TapSpec:
    """One tap pattern. ``{i}`` in ``pattern`` stands for a layer index."""

    pattern: str
    module: str
    shape: str
    dtype: str
    kind: str
    meaning: str
    layer_type: str | None = None  # 'linear_attention' / 'indexed_attention' / 'ple' / None (every layer)
    companion: str | None = None  # for index taps: the tap holding the scores the selection was made on
    replay_input: str | None = None  # the tap that is this block's input (for --replay)
    # index taps only: each row is a selection, compared as the set of its valid ids (selection_ids: -1 padding,
    # the padded width and the ids' order do not count); False: the row is positional (e.g. one id per head)
    as_set: bool = False


_SPECS: list[TapSpec] = [
    TapSpec("embed_tokens.out", "embed_tokens", "[T, hidden_size]", "float", ACTIVATION,
            "token embeddings (before the hc_count-fold repeat)"),
    # --- PLE (layers in ple_layer_ids)
    TapSpec("layers.{i}.ple.ple_embedding.ngram_ids", "layers.{i}.ple.ple_embedding", "[T, ngram_heads]", "int64",
            INDEX, "hashed n-gram row ids (head offsets added) into the PLE table", "ple"),
    TapSpec("layers.{i}.ple.ple_embedding.out", "layers.{i}.ple.ple_embedding", "[T, ple_embed_dim]", "float",
            ACTIVATION, "gathered n-gram embeddings, heads concatenated", "ple"),
    TapSpec("layers.{i}.ple.norm_key.out", "layers.{i}.ple.norm_key", "[T, hc_count * hidden_size]", "float",
            ACTIVATION, "RMSNorm of key_proj(n-gram embeddings), grouped per stream", "ple"),
    TapSpec("layers.{i}.ple.norm_query.out", "layers.{i}.ple.norm_query", "[T, hc_count * hidden_size]", "float",
            ACTIVATION, "RMSNorm of the residual entering the PLE layer, grouped per stream", "ple"),
    TapSpec("layers.{i}.ple.gate", "layers.{i}.ple", "[T, hc_count]", "float", ACTIVATION,
            "signed-square-root PLE gate per stream (before the sigmoid)", "ple"),
    TapSpec("layers.{i}.ple.norm_conv.out", "layers.{i}.ple.norm_conv", "[T, hc_count * hidden_size]", "float",
            ACTIVATION, "RMSNorm of the sigmoid-gated value: the dilated conv's input", "ple"),
    TapSpec("layers.{i}.ple.conv_out", "layers.{i}.ple.conv1d", "[T, hc_count * hidden_size]", "float",
            ACTIVATION, "silu(dilated causal conv over the carried conv state and norm_conv.out): the term added "
            "to the gated value", "ple"),
    TapSpec("layers.{i}.ple.out", "layers.{i}.ple", "[T, hc_count * hidden_size]", "float", ACTIVATION,
            "PLE output added to the residual: gated value + silu(dilated conv)", "ple"),
    # --- attention half
    TapSpec("layers.{i}.attn_hyper_connection.in", "layers.{i}.attn_hyper_connection",
            "[T, hc_count * hidden_size]", "float", ACTIVATION, "multi-stream residual entering the layer's "
            "attention half (after PLE where present)"),
    TapSpec("layers.{i}.attn_hyper_connection.hc_norm.out", "layers.{i}.attn_hyper_connection.hc_norm",
            "[T, hc_count * hidden_size]", "float", ACTIVATION, "RMSNorm of the residual streams (grouped per "
            "stream) that the mix and the injection weights read"),
    TapSpec("layers.{i}.attn_hyper_connection.out", "layers.{i}.attn_hyper_connection", "[T, hidden_size]",
            "float", ACTIVATION, "mixed block input (mean over streams of sigmoid mix * normed streams)"),
    TapSpec("layers.{i}.attn_hyper_connection.injection_weights", "layers.{i}.attn_hyper_connection",
            "[T, hc_count]", "float", ACTIVATION, "block injection weights 2*sigmoid(W x / hc_count)"),
    TapSpec("layers.{i}.linear_attn.conv_state", "layers.{i}.linear_attn",
            "[T, linear_conv_kernel_dim - 1, 2*key_dim + value_dim]", "float", ACTIVATION,
            "the K-1 conv input rows (carried conv state, then this step's in_proj_qkv rows) the causal conv "
            "reads before each position", "linear_attention", replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.linear_attn.conv_out", "layers.{i}.linear_attn", "[T, 2*key_dim + value_dim]", "float",
            ACTIVATION, "q|k|v after the causal depthwise conv and silu", "linear_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.linear_attn.core_out", "layers.{i}.linear_attn",
            "[T, linear_num_value_heads, linear_value_head_dim]", "float", ACTIVATION,
            "gated delta rule output (before the gated RMSNorm)", "linear_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.linear_attn.norm.out", "layers.{i}.linear_attn.norm",
            "[T, linear_num_value_heads, linear_value_head_dim]", "float", ACTIVATION,
            "gated RMSNorm of the delta rule output (the out_proj input)", "linear_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.linear_attn.out", "layers.{i}.linear_attn", "[T, hidden_size]", "float", ACTIVATION,
            "Gated DeltaNet output (out_proj)", "linear_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.indexer.q_layernorm.out", "layers.{i}.self_attn.indexer.q_layernorm",
            "[T, indexer_n_heads, indexer_head_dim]", "float", ACTIVATION, "RMSNorm of the indexer queries "
            "(before RoPE)", "indexed_attention", replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.indexer.block_keys", "layers.{i}.self_attn.indexer.k_layernorm",
            "[T, indexer_head_dim]", "float", ACTIVATION, "pooled block key (mean of ratio raw keys, k_layernorm, "
            "RoPE at the block start) of the latest complete block visible to the query, block (p+1)//ratio - 1; "
            "zeros while none is complete", "indexed_attention", replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.indexer.block_scores", "layers.{i}.self_attn.indexer", "[T, n_blocks]",
            "float", ACTIVATION, "relu-summed indexer score of every complete compressed block visible to the "
            "query (-inf where the block is not complete/visible)", "indexed_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.indexer.selected_blocks", "layers.{i}.self_attn.indexer", "[T, block_topk]",
            "int64", INDEX, "selected block indices in canonical order (score descending, then lower block "
            "index), -1 padded", "indexed_attention", companion="layers.{i}.self_attn.indexer.block_scores",
            replay_input="layers.{i}.attn_hyper_connection.out", as_set=True),
    TapSpec("layers.{i}.self_attn.indexer.selected_tokens", "layers.{i}.self_attn.indexer",
            "[T, indexer_budget + indexer_compress_ratio - 1]", "int64", INDEX, "positions the query attends "
            "(selected blocks' tokens + the incomplete tail), ascending, -1 padded; compared as sets, so an "
            "engine selecting tokens rather than blocks is comparable", "indexed_attention",
            replay_input="layers.{i}.attn_hyper_connection.out", as_set=True),
    TapSpec("layers.{i}.self_attn.q_norm.out", "layers.{i}.self_attn.q_norm",
            "[T, num_attention_heads, head_dim]", "float", ACTIVATION, "RMSNorm of the attention queries (before "
            "RoPE)", "indexed_attention", replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.k_norm.out", "layers.{i}.self_attn.k_norm",
            "[T, num_key_value_heads, head_dim]", "float", ACTIVATION, "RMSNorm of the attention keys (before "
            "RoPE)", "indexed_attention", replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.core_out", "layers.{i}.self_attn", "[T, num_attention_heads * head_dim]",
            "float", ACTIVATION, "sparse attention output before the sigmoid output gate", "indexed_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.self_attn.out", "layers.{i}.self_attn", "[T, hidden_size]", "float", ACTIVATION,
            "gated sparse attention output (o_proj)", "indexed_attention",
            replay_input="layers.{i}.attn_hyper_connection.out"),
    TapSpec("layers.{i}.attn_hyper_connection.combine", "layers.{i}.attn_hyper_connection",
            "[T, hc_count * hidden_size]", "float", ACTIVATION, "residual after injecting the attention output"),
    # --- MLP half
    TapSpec("layers.{i}.mlp_hyper_connection.hc_norm.out", "layers.{i}.mlp_hyper_connection.hc_norm",
            "[T, hc_count * hidden_size]", "float", ACTIVATION, "RMSNorm of the residual streams entering the MoE "
            "half"),
    TapSpec("layers.{i}.mlp_hyper_connection.out", "layers.{i}.mlp_hyper_connection", "[T, hidden_size]",
            "float", ACTIVATION, "mixed MoE input"),
    TapSpec("layers.{i}.mlp_hyper_connection.injection_weights", "layers.{i}.mlp_hyper_connection",
            "[T, hc_count]", "float", ACTIVATION, "MoE injection weights"),
    TapSpec("layers.{i}.mlp.gate.router_logits", "layers.{i}.mlp.gate", "[T, num_experts]", "float",
            ACTIVATION, "router logits", replay_input="layers.{i}.mlp_hyper_connection.out"),
    TapSpec("layers.{i}.mlp.gate.topk_ids", "layers.{i}.mlp.gate", "[T, num_experts_per_tok]", "int64", INDEX,
            "routed experts, probability descending then lower id", companion="layers.{i}.mlp.gate.router_logits",
            replay_input="layers.{i}.mlp_hyper_connection.out", as_set=True),
    TapSpec("layers.{i}.mlp.gate.topk_weights", "layers.{i}.mlp.gate", "[T, num_experts_per_tok]", "float",
            ACTIVATION, "routing weights (renormalised when norm_topk_prob)",
            replay_input="layers.{i}.mlp_hyper_connection.out"),
    TapSpec("layers.{i}.mlp.out", "layers.{i}.mlp", "[T, hidden_size]", "float", ACTIVATION,
            "MoE output: routed experts + sigmoid-gated shared expert",
            replay_input="layers.{i}.mlp_hyper_connection.out"),
    TapSpec("layers.{i}.mlp_hyper_connection.combine", "layers.{i}.mlp_hyper_connection",
            "[T, hc_count * hidden_size]", "float", ACTIVATION, "decoder layer output (multi-stream residual)"),
    TapSpec("hyper_connection_mixer.hc_norm.out", "hyper_connection_mixer.hc_norm", "[T, hc_count * hidden_size]",
            "float", ACTIVATION, "RMSNorm of the final residual streams"),
    TapSpec("hyper_connection_mixer.out", "hyper_connection_mixer", "[T, hidden_size]", "float", ACTIVATION,
            "final mixer output (the last hidden state)"),
    TapSpec("logits", "lm_head", "[T, vocab_size]", "float", ACTIVATION, "LM head logits"),
]


def specs() -> list[TapSpec]:
    """All tap patterns of the trunk, in per-layer forward order (the MTP head's: :func:`mtp_specs`)."""
    return list(_SPECS)


# --- the MTP head (mtp.*; recorded while the head runs, see reference/blocks/mtp.py): its own fusion taps,
# then its one full-attention decoder layer under ``mtp.layers.0.`` (the trunk layer's taps, PLE off), its
# mixer and its draft logits (through the shared lm_head)
_MTP_SPECS: list[TapSpec] = [
    TapSpec("mtp.fc_embedding.out", "mtp.fc_embedding", "[T, hidden_size]", "float", ACTIVATION,
            "fc_embedding(RMSNorm(embed_tokens[x_{t+1}])): the embedding branch of the MTP head"),
    TapSpec("mtp.fc_hidden.out", "mtp.fc_hidden", "[T, hc_count * hidden_size]", "float", ACTIVATION,
            "fc_hidden applied per stream to RMSNorm(R) (R: the trunk's pre-final-mixer residual or the "
            "previous draft step's state)"),
] + [TapSpec("mtp." + s.pattern.replace("{i}", "0"), "mtp." + s.module.replace("{i}", "0"), s.shape, s.dtype,
             s.kind, "MTP head: " + s.meaning, None,
             None if s.companion is None else "mtp." + s.companion.replace("{i}", "0"),
             None if s.replay_input is None else "mtp." + s.replay_input.replace("{i}", "0"), s.as_set)
     for s in _SPECS if s.pattern.startswith("layers.{i}.") and s.layer_type in (None, "indexed_attention")] + [
    TapSpec("mtp.hyper_connection_mixer.hc_norm.out", "mtp.hyper_connection_mixer.hc_norm",
            "[T, hc_count * hidden_size]", "float", ACTIVATION, "RMSNorm of the MTP head's final residual streams"),
    TapSpec("mtp.hyper_connection_mixer.out", "mtp.hyper_connection_mixer", "[T, hidden_size]", "float",
            ACTIVATION, "the MTP head's mixer output (input of the shared lm_head)"),
    TapSpec("mtp.logits", "lm_head", "[T, vocab_size]", "float", ACTIVATION,
            "MTP draft logits (predict the token after x_{t+1})"),
]
_MTP_INDEX = {s.pattern: k for k, s in enumerate(_MTP_SPECS)}


def mtp_specs() -> list[TapSpec]:
    """The MTP head's taps (concrete names, ``mtp.*``), in its forward order."""
    return list(_MTP_SPECS)


def mtp_tap_names(config=None) -> list[str]:
    """Every MTP tap name, in forward order (the head is one full-attention layer for every config)."""
    return [s.pattern for s in _MTP_SPECS]


from reference.taphook import _LAYER_RE, layer_of  # noqa: E402,F401  (one layer-name rule)


def spec_for(name: str) -> TapSpec | None:
    """The spec of a concrete tap name (``layers.3.mlp.out``), or None when unknown."""
    if name in _MTP_INDEX:
        return _MTP_SPECS[_MTP_INDEX[name]]
    m = _LAYER_RE.match(name)
    key = f"layers.{{i}}.{m.group(2)}" if m else name
    for s in _SPECS:
        if s.pattern == key:
            return s
    return None




def tap_names(config) -> list[str]:
    """Every concrete tap name for a model config, in forward order."""
    out = ["embed_tokens.out"]
    ple_layers = set(config.ple_layers)
    for i, lt in enumerate(config.layer_types):
        for s in _SPECS:
            if not s.pattern.startswith("layers."):
                continue
            if s.layer_type == "ple" and i not in ple_layers:
                continue
            if s.layer_type in ("linear_attention", "indexed_attention") and s.layer_type != lt:
                continue
            out.append(s.pattern.replace("{i}", str(i)))
    out += ["hyper_connection_mixer.hc_norm.out", "hyper_connection_mixer.out", "logits"]
    return out


def forward_rank(config) -> dict[str, int]:
    """Map tap name -> its rank in forward order."""
    return {n: k for k, n in enumerate(tap_names(config))}


def matches(name: str, globs: list[str] | None) -> bool:
    """True when ``globs`` is empty/None or ``name`` matches any of them (``fnmatchcase``, case-sensitive)."""
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)


_SPEC_INDEX = {s.pattern: k for k, s in enumerate(_SPECS)}


def order_key(name: str) -> tuple:
    """Sort key putting concrete tap names in forward order without a config (the same order as
    :func:`forward_rank`): ``embed_tokens.out``, then layer by layer in registry order, then
    ``hyper_connection_mixer.out`` and ``logits``; names not in the registry sort last, by name."""
    if name == "embed_tokens.out":
        return (0, 0, 0, "")
    m = _LAYER_RE.match(name)
    if m:
        k = _SPEC_INDEX.get(f"layers.{{i}}.{m.group(2)}")
        if k is not None:
            return (1, int(m.group(1)), k, "")
    if name == "hyper_connection_mixer.hc_norm.out":
        return (2, 0, 0, "")
    if name == "hyper_connection_mixer.out":
        return (2, 0, 1, "")
    if name == "logits":
        return (2, 0, 2, "")
    if name in _MTP_INDEX:  # the MTP head runs after the trunk
        return (3, 0, _MTP_INDEX[name], "")
    return (4, 0, 0, name)


def companion_of(name: str) -> str | None:
    """The concrete companion score tap of a concrete index tap name, or None."""
    s = spec_for(name)
    if s is None or s.companion is None:
        return None
    layer = layer_of(name)
    return s.companion if layer is None else s.companion.replace("{i}", str(layer))


def replay_input_of(name: str) -> str | None:
    """The concrete tap recorded as the input of ``name``'s block (registry ``replay_input``), or None."""
    s = spec_for(name)
    if s is None or s.replay_input is None:
        return None
    layer = layer_of(name)
    return s.replay_input if layer is None else s.replay_input.replace("{i}", str(layer))


def selection_ids(row) -> tuple[int, ...]:
    """The valid ids of one row of a selection tap (kind :data:`INDEX`, ``as_set``), as a sorted tuple: entries ``< 0`` are
    padding and dropped, so the row's padded width and the order of its ids do not count (an engine padding its
    selection to another width, or emitting it in another order, selects the same thing); a repeated id is kept
    (picking an item twice is a different selection). ``row``: any int array-like (flattened).
    The one comparison rule of selection taps: tap-diff, the MTP locate and the tie judge compare rows with it."""
    v = np.asarray(row).reshape(-1)
    return tuple(sorted(int(x) for x in v[v >= 0]))


def same_selection(a, b) -> bool:
    """Do selection rows ``a`` and ``b`` (any widths) hold the same valid ids? (:func:`selection_ids`)"""
    return selection_ids(a) == selection_ids(b)


def is_selection(name: str) -> bool:
    """Is tap ``name`` an index tap whose rows are selections compared as sets (registry ``as_set``)?"""
    s = spec_for(name)
    return s is not None and s.kind == INDEX and s.as_set


def index_rows_agree(name: str, a, b) -> bool:
    """Do rows ``a`` and ``b`` of index tap ``name`` agree? A selection (:func:`is_selection`): same valid ids
    (:func:`same_selection`, any width); any other index tap: the same shape and the same ids in the same places."""
    if is_selection(name):
        return same_selection(a, b)
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))
