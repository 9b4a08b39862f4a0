"""The qwen4exp model configuration: one definition shared by the reference and the engine.

Source: transformers >= 5.23, ``models/qwen4_exp/configuration_qwen4_exp.py``
(``Qwen4ExpTextConfig.__post_init__`` and ``validate_architecture``) and the derived PLE layout of
``modeling_qwen4_exp.py`` (``Qwen4ExpTextNGramEmbedding.__init__``, ``_build_layer_multipliers``,
``_find_nth_prime_after``). Every field and default below is the official class's; the checks
the official code leaves to crash later are added, each raising :class:`ConfigError` that names
the field, what was expected and what was found.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "ModelConfig", "PLELayout", "load_config", "splitmix64", "build_layer_multipliers",
           "find_nth_prime_after"]


from reference.errors import UserError


class ConfigError(UserError, ValueError):
    """A config.json that is malformed or describes an invalid qwen4exp model."""


_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_PRIME_1 = 10007


def splitmix64(value: int) -> int:
    """One splitmix64 step on a Python int, wrapping mod 2**64.

    Source: modeling_qwen4_exp.py ``_splitmix64``.
    """
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def build_layer_multipliers(unigram_vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """The ``ngram_size`` odd 63-bit hash multipliers of one PLE layer (Python ints, all < 2**63).

    Source: modeling_qwen4_exp.py ``_build_layer_multipliers``.
    """
    max_long = (1 << 63) - 1
    multiplier_max = max_long // max(unigram_vocab_size, 1)
    half_bound = max(1, multiplier_max // 2)
    base_seed = seed + _PRIME_1 * ple_layer_index
    out = []
    for index in range(ngram_size):
        value = (base_seed + _SPLITMIX_GAMMA * (index + 1)) & _MASK64
        out.append(2 * (splitmix64(value) % half_bound) + 1)
    return out


_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(value: int) -> bool:
    """Exact primality: trial division by the first primes, then the deterministic Miller-Rabin test with
    the first 12 prime bases, which has no pseudoprime below 3.3e24 (every value a valid config can
    produce: bases are < 2**31). Cheap for any size, unlike plain trial division (sqrt(n) steps)."""
    if value < 2:
        return False
    for p in _SMALL_PRIMES:
        if value % p == 0:
            return value == p
    if value < 41 * 41:
        return True
    d, r = value - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, value)
        if x in (1, value - 1):
            continue
        for _ in range(r - 1):
            x = x * x % value
            if x == value - 1:
                break
        else:
            return False
    return True


def find_nth_prime_after(start: int, count: int) -> int:
    """The ``count``-th prime strictly greater than ``start``.

    Source: modeling_qwen4_exp.py ``_find_nth_prime_after``.
    """
    prime = start
    for _ in range(count):
        prime += 1
        while not _is_prime(prime):
            prime += 1
    return prime


# keys of the text config that change no computation of this package (training, the cache switch, unused ids)
_NO_EFFECT_KEYS = ("initializer_range", "use_cache", "attention_dropout", "output_router_logits",
                   "router_aux_loss_coef", "pad_token_id", "bos_token_id")


def _text_source(cfg: "ModelConfig") -> dict:
    src = cfg.source or {}
    return src.get("text_config") if isinstance(src.get("text_config"), dict) else src


def _default_text(cfg: "ModelConfig", key: str) -> str:
    """``key=value`` as a defaulted key is reported; ``layer_types`` (a long list) by the rule that built it."""
    if key == "layer_types":
        text = _text_source(cfg)
        interval = text.get("full_attention_interval", 4)
        given = "full_attention_interval" in text
        return (f"layer_types=indexed_attention at 0-based layers {interval - 1}, {2 * interval - 1}, ..., the rest "
                f"linear_attention, from full_attention_interval={interval}"
                f"{'' if given else ' (also the official default)'}")
    return f"{key}={getattr(cfg, key)}"


def defaulted_keys(cfg: "ModelConfig", keys=None) -> list[str]:
    """Those of ``keys`` (default: every text-config key that changes the computation) the checkpoint's
    config.json leaves out, so that they hold the official default; [] for a config not read from a file.
    ``rope_parameters: null`` counts as left out (the official config builds the same default from it);
    ``rope_parameters`` built from the legacy ``rope_theta`` / ``partial_rotary_factor`` keys is not a default."""
    src = cfg.source or {}
    if not src:
        return []
    text = _text_source(cfg)
    if keys is None:
        keys = [k for k in _TEXT_DEFAULTS if k not in _NO_EFFECT_KEYS]
        if "rope_theta" in text or "partial_rotary_factor" in text:
            keys.remove("rope_parameters")
    return [k for k in keys if k not in text or (k == "rope_parameters" and text[k] is None)]


def rope_null_note(cfg: "ModelConfig") -> str | None:
    """For a config.json stating ``rope_parameters: null``: what was used instead, each value with where it comes
    from (the legacy ``rope_theta`` / ``partial_rotary_factor`` keys, else the official default); None otherwise."""
    text = _text_source(cfg)
    if not ("rope_parameters" in text and text["rope_parameters"] is None):
        return None

    def src(key: str, default: str) -> str:
        return f"config.json's {key}" if key in text else f"official default{default}"

    return (f"rope_parameters is null, so rope_parameters={cfg.rope_parameters} is used: "
            f"rope_theta={cfg.rope_theta} ({src('rope_theta', '')}), partial_rotary_factor="
            f"{cfg.partial_rotary_factor} ({src('partial_rotary_factor', ': every channel rotated')})")


def defaulted_note(cfg: "ModelConfig", keys) -> str:
    """`` (official default, not in config.json: vocab_size=248320)`` for those of ``keys`` the checkpoint's
    config.json leaves out; `` (from config.json)`` when it sets them all or was not read from a file."""
    missing = defaulted_keys(cfg, keys)
    if not missing:
        return " (from config.json)"
    return " (official default, not in config.json: " + ", ".join(_default_text(cfg, k) for k in missing) + ")"


def defaulted_summary(cfg: "ModelConfig") -> dict[str, str]:
    """``{key: 'key=value'}`` for every key that changes the computation and that config.json leaves to the
    official default (what ``qwen4exp info`` lists under ``official defaults``)."""
    return {k: _default_text(cfg, k) for k in defaulted_keys(cfg)}


@dataclass(frozen=True)
class PLELayout:
    """Derived layout of one PLE layer's n-gram table.

    Attributes:
        layer_idx: 0-based decoder layer index.
        ple_layer_index: position of this layer in ``ple_layer_ids`` (0 for the first PLE layer).
        multipliers: ``ngram_size`` int64 hash multipliers (``layer_multipliers`` in the checkpoint).
        head_vocab_sizes: per hash head, the prime vocabulary size (``ngram_heads_vocab_sizes``).
        head_offsets: per hash head, the first row of its slice (``ngram_heads_offsets``).
        total_rows: unpadded sum of head vocab sizes.
        padded_rows: ``total_rows`` rounded up to ``make_ngram_vocab_size_divisible_by``.
        head_dim: columns of the table (``ple_embed_dim // ngram_heads``).
    """

    layer_idx: int
    ple_layer_index: int
    multipliers: tuple[int, ...]
    head_vocab_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    total_rows: int
    padded_rows: int
    head_dim: int


_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
    tie_word_embeddings=False, rope_parameters=None, attention_bias=False, attention_dropout=0.0, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts_per_tok=10, num_experts=512, output_router_logits=False, router_aux_loss_coef=0.001,
    layer_types=None, pad_token_id=None, bos_token_id=None, eos_token_id=None, hc_count=4, hc_lowrank=320,
    ple_layer_ids=None, ple_embed_dim=None, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, seed=1234, split_ngram_parts=512,
    indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None,
    indexer_compress_ratio=None, norm_topk_prob=True, output_gate_type=None,
)

_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
               "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
               "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "hc_count", "hc_lowrank",
               "ple_conv_kernel_size", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
               "make_ngram_vocab_size_divisible_by", "seed", "split_ngram_parts")


# Field type table of every key ModelConfig reads (the official class's annotations); checked in from_dict
# before any rule, so a wrong JSON type is one ConfigError naming the key, never a TypeError later.
_FLOAT_FIELDS = ("initializer_range", "rms_norm_eps", "attention_dropout", "router_aux_loss_coef")
_BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "attention_bias", "output_router_logits", "norm_topk_prob")
_STR_FIELDS = ("hidden_act",)
_OPT_STR_FIELDS = ("output_gate_type",)
_OPT_INT_FIELDS = ("pad_token_id", "bos_token_id", "ple_embed_dim", "indexer_n_heads", "indexer_kv_heads",
                   "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")

# Upper bounds (sanity, far above the real model; see /work/shared/model-facts.md for its values):
# * every size / count / id field: <= 2**31 - 1. The engine indexes tokens, experts, heads and rows with
#   int32 (engine/kernels/moe.py routing tables, token-id buffers), so a larger value cannot run anyway.
# * num_hidden_layers <= 4096 (real: 48): config load and checkpoint checks enumerate ~40 tensor names
#   per layer, which must stay cheap (< 1 s) so a typo fails fast instead of hanging.
# * PLE n-gram heads over all PLE layers, len(ple_layer_ids) * (ngram_size - 1) * heads_per_ngram <= 4096
#   (real: 1 * 16): each head is one prime search when the table layout is derived at load.
_MAX_INT32 = 2**31 - 1
_MAX_LAYERS = 4096
_MAX_PLE_HEADS = 4096


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_types(vals: dict, where: str) -> None:
    """The JSON type of every field ModelConfig reads (table above); raises ConfigError naming the first bad key."""
    def bad(k, expected, v):
        raise ConfigError(f"{where}: {k}: expected {expected}, found {v!r} ({type(v).__name__})")

    for k in _INT_FIELDS:
        v = vals[k]
        if not _is_int(v):
            bad(k, "an integer", v)
        if k != "seed" and v > _MAX_INT32:
            raise ConfigError(f"{where}: {k}: expected at most {_MAX_INT32} (sizes and ids are int32 in the "
                              f"engine), found {v}")
    if vals["num_hidden_layers"] > _MAX_LAYERS:
        raise ConfigError(f"{where}: num_hidden_layers: expected at most {_MAX_LAYERS} (the real model has 48), "
                          f"found {vals['num_hidden_layers']}")
    for k in _OPT_INT_FIELDS:
        v = vals[k]
        if v is not None and not _is_int(v):
            bad(k, "an integer or null", v)
        if v is not None and v > _MAX_INT32:
            raise ConfigError(f"{where}: {k}: expected at most {_MAX_INT32} (int32 in the engine), found {v}")
    for k in _FLOAT_FIELDS:
        if not _is_number(vals[k]):
            bad(k, "a finite number", vals[k])
    for k in _BOOL_FIELDS:
        if not isinstance(vals[k], bool):
            bad(k, "a JSON boolean (true or false)", vals[k])
    for k in _STR_FIELDS:
        if not isinstance(vals[k], str):
            bad(k, "a string", vals[k])
    for k in _OPT_STR_FIELDS:
        if vals[k] is not None and not isinstance(vals[k], str):
            bad(k, "a string or null", vals[k])
    eos = vals["eos_token_id"]
    if eos is not None:
        items = eos if isinstance(eos, list) else [eos]
        if not all(_is_int(e) and e >= 0 for e in items):
            bad("eos_token_id", "an integer id >= 0 or a list of them", eos)
    lt = vals["layer_types"]
    if lt is not None and not (isinstance(lt, list) and all(isinstance(t, str) for t in lt)):
        bad("layer_types", "a list of strings", lt)


def _check_rope(rp: dict, where: str) -> None:
    """Types of the rope_parameters keys ModelConfig reads (rope_theta, partial_rotary_factor, rope_type)."""
    if "rope_theta" in rp and not (_is_number(rp["rope_theta"]) and rp["rope_theta"] > 0):
        v = rp["rope_theta"]
        raise ConfigError(f"{where}: rope_parameters.rope_theta: expected a positive number, found {v!r} "
                          f"({type(v).__name__})")
    if "partial_rotary_factor" in rp and not _is_number(rp["partial_rotary_factor"]):
        v = rp["partial_rotary_factor"]
        raise ConfigError(f"{where}: rope_parameters.partial_rotary_factor: expected a number in (0, 1], found "
                          f"{v!r} ({type(v).__name__})")
    if "rope_type" in rp and not isinstance(rp["rope_type"], str):
        raise ConfigError(f"{where}: rope_parameters.rope_type: expected 'default', found {rp['rope_type']!r}")


def qsa_visible_bound(budget: int, ratio: int) -> int:
    """Most tokens one QSA query attends, and the visible-token count at and below which the indexer keeps
    every token: ``budget`` tokens of complete blocks plus the ``ratio - 1`` tokens of the incomplete tail
    (official ``Qwen4ExpTextQSAIndexer``: the ``token_budget + compress_ratio - 1`` selection width)."""
    return budget + ratio - 1


@dataclass(frozen=True)
class ModelConfig:
    """The text model's configuration (``Qwen4ExpTextConfig``), validated, with derived layout.

    Field names and defaults are transformers' ``Qwen4ExpTextConfig``. Build with :func:`load_config`
    or :meth:`from_dict`. ``layer_types`` uses ``linear_attention`` / ``indexed_attention``
    (the checkpoint's ``full_attention`` is renamed as the official config does).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str
    max_position_embeddings: int
    initializer_range: float
    rms_norm_eps: float
    use_cache: bool
    tie_word_embeddings: bool
    rope_parameters: dict
    attention_bias: bool
    attention_dropout: float
    head_dim: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts_per_tok: int
    num_experts: int
    output_router_logits: bool
    router_aux_loss_coef: float
    layer_types: tuple[str, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int
    indexer_n_heads: int | None
    indexer_kv_heads: int | None
    indexer_head_dim: int | None
    indexer_budget: int | None
    indexer_compress_ratio: int | None
    norm_topk_prob: bool
    output_gate_type: str | None
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    source: dict = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: dict, *, where: str = "config") -> "ModelConfig":
        """Build from a config.json dict: flat ``qwen4_exp_text`` or the ``qwen4_exp`` wrapper.

        Raises:
            ConfigError: unknown model_type, wrong field types, or any failed validation rule.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(raw).__name__}")
        source = raw
        model_type = raw.get("model_type")
        if model_type == "qwen4_exp" or ("text_config" in raw and model_type in (None, "qwen4_exp")):
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{where}: model_type 'qwen4_exp' needs a 'text_config' object, "
                                  f"found {type(text).__name__}")
            raw = dict(text)
            model_type = raw.get("model_type", "qwen4_exp_text")
        if model_type not in ("qwen4_exp_text", None):
            raise ConfigError(f"{where}: model_type: expected 'qwen4_exp' or 'qwen4_exp_text', found {model_type!r}")
        vals = dict(_TEXT_DEFAULTS)
        extra = {}
        kwargs = dict(raw)
        kwargs.pop("model_type", None)
        interval = kwargs.pop("full_attention_interval", 4)
        for k, v in kwargs.items():
            if k in vals:
                vals[k] = v
            else:
                extra[k] = v
        _check_types(vals, where)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ConfigError(f"{where}: full_attention_interval: expected a positive integer, found {interval!r}")
        # __post_init__ of the official config
        ple_ids = vals["ple_layer_ids"]
        if ple_ids is None:
            ple_ids = []
        if not isinstance(ple_ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in ple_ids):
            raise ConfigError(f"{where}: ple_layer_ids: expected a list of integers, found {ple_ids!r}")
        vals["ple_layer_ids"] = tuple(sorted(set(ple_ids)))
        if vals["ple_embed_dim"] is None:
            vals["ple_embed_dim"] = vals["hidden_size"]
        lt = vals["layer_types"]
        if lt is None:
            lt = ["linear_attention" if (i + 1) % interval else "indexed_attention"
                  for i in range(vals["num_hidden_layers"])]
        else:
            if not isinstance(lt, (list, tuple)):
                raise ConfigError(f"{where}: layer_types: expected a list of strings, found {lt!r}")
            lt = ["indexed_attention" if t == "full_attention" else t for t in lt]
        vals["layer_types"] = tuple(lt)
        eos = vals["eos_token_id"]
        if isinstance(eos, list):
            vals["eos_token_id"] = tuple(eos)
        rp = vals["rope_parameters"]
        if rp is None:
            rp = {"rope_type": "default", "rope_theta": extra.get("rope_theta", 10000.0)}
            if "partial_rotary_factor" in extra:
                rp["partial_rotary_factor"] = extra["partial_rotary_factor"]
        if not isinstance(rp, dict):
            raise ConfigError(f"{where}: rope_parameters: expected an object, found {rp!r}")
        _check_rope(rp, where)
        vals["rope_parameters"] = dict(rp)
        cfg = cls(**vals, extra=extra, source=source)
        cfg.validate(where)
        return cfg

    def to_dict(self) -> dict:
        """The text config as a flat ``qwen4_exp_text`` dict (JSON-serialisable)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "source")}
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
        d["model_type"] = "qwen4_exp_text"
        return d

    def config_hash(self) -> str:
        """sha256 (hex, 16 chars) of the canonical text-config JSON: the model identity in archives."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ------------------------------------------------------------------ validation
    def validate(self, where: str = "config") -> None:
        """Apply the official ``validate_architecture`` rules plus the ones it leaves to crash later.

        Raises:
            ConfigError: naming the field, the expected and the found value.
        """
        def bad(msg: str):
            raise ConfigError(f"{where}: {msg}")

        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_num_key_heads", "linear_num_value_heads", "hc_lowrank", "max_position_embeddings",
                    "ple_conv_kernel_size", "heads_per_ngram", "make_ngram_vocab_size_divisible_by",
                    "split_ngram_parts")
        for k in positive:
            if getattr(self, k) <= 0:
                bad(f"{k}: expected > 0, found {getattr(self, k)}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            bad(f"rms_norm_eps: expected a positive number, found {self.rms_norm_eps!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            bad(f"layer_types: expected num_hidden_layers = {self.num_hidden_layers} entries"
                f"{defaulted_note(self, ('num_hidden_layers',))}, found {len(self.layer_types)}")
        unsupported = sorted(set(self.layer_types) - {"linear_attention", "indexed_attention"})
        if unsupported:
            bad(f"layer_types: unsupported Qwen4-Exp layer types {unsupported}; expected 'linear_attention' or "
                f"'indexed_attention' (or 'full_attention')")
        gate = self.output_gate_type or self.hidden_act
        if gate not in ("sigmoid", "silu"):
            bad(f"output_gate_type: expected 'sigmoid' or 'silu', found {gate!r}")
        if self.hidden_act != "silu":
            bad(f"hidden_act: expected 'silu' (the only activation of this architecture), found {self.hidden_act!r}")
        if self.hc_count <= 1:
            bad(f"hc_count: Qwen4-Exp requires hc_count > 1, found {self.hc_count}")
        if self.num_experts <= 0:
            bad(f"num_experts: expected > 0, found {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            bad(f"num_experts_per_tok: expected in [1, num_experts={self.num_experts}], found "
                f"{self.num_experts_per_tok}{defaulted_note(self, ('num_experts_per_tok', 'num_experts'))}")
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
            bad(f"moe_intermediate_size and shared_expert_intermediate_size: expected > 0, found "
                f"{self.moe_intermediate_size} and {self.shared_expert_intermediate_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads: expected a multiple of num_key_value_heads={self.num_key_value_heads}, "
                f"found {self.num_attention_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad(f"linear_num_value_heads: expected a multiple of linear_num_key_heads={self.linear_num_key_heads}, "
                f"found {self.linear_num_value_heads}")
        rp = self.rope_parameters
        if "rope_theta" not in rp:
            bad(f"rope_parameters.rope_theta: expected a number, found nothing in {rp!r}")
        if rp.get("rope_type", "default") != "default":
            bad(f"rope_parameters.rope_type: expected 'default', found {rp.get('rope_type')!r}")
        prf = rp.get("partial_rotary_factor", 1.0)
        if not (0 < prf <= 1):
            bad(f"rope_parameters.partial_rotary_factor: expected in (0, 1], found {prf}")
        rdim = self.rotary_dim
        if rdim % 2 or rdim <= 0:
            bad(f"rotary dim (head_dim * partial_rotary_factor): expected a positive even number, found {rdim}")
        # The official rotary (Qwen4ExpTextRotaryEmbedding.recomposition_frequencies) reads sections [1] and [2]
        # and never checks their sum (its default [11, 11, 10] with head_dim 256 is valid); text positions are
        # identical in T/H/W, so the sections do not change the numbers. Only the shape is checked.
        sec = self.rope_parameters.get("mrope_section", [11, 11, 10])
        if not (isinstance(sec, (list, tuple)) and len(sec) >= 3
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sec)):
            bad(f"rope_parameters.mrope_section: expected a list of 3 non-negative integers, found {sec!r}")
        qsa = {k: getattr(self, k) for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                                              "indexer_budget", "indexer_compress_ratio")}
        if any(v is not None for v in qsa.values()):
            missing = [k for k, v in qsa.items() if v is None]
            if missing:
                bad(f"QSA config is missing required fields {missing} (QSA fields are all-or-nothing), found {qsa}")
            if any(v <= 0 for v in qsa.values()):
                bad(f"QSA config values must be positive, found {qsa}")
            if self.indexer_kv_heads != 1:
                bad(f"indexer_kv_heads: Qwen4-Exp QSA requires 1, found {self.indexer_kv_heads}")
            if self.indexer_budget % self.indexer_compress_ratio:
                bad(f"indexer_budget: expected a multiple of indexer_compress_ratio={self.indexer_compress_ratio}, "
                    f"found {self.indexer_budget}")
            if rdim > self.indexer_head_dim:
                bad(f"rotary_dim={rdim} must fit the QSA index head: indexer_head_dim={self.indexer_head_dim}")
        elif "indexed_attention" in self.layer_types:
            bad("indexer_*: layers of type indexed_attention need the QSA fields (indexer_n_heads, "
                "indexer_kv_heads, indexer_head_dim, indexer_budget, indexer_compress_ratio), found none")
        if self.ple_layer_ids:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            if self.ngram_size < 2:
                bad(f"ngram_size: expected >= 2 when PLE is on, found {self.ngram_size}")
            if len(self.ple_layer_ids) * heads > _MAX_PLE_HEADS:
                bad(f"ple_layer_ids, ngram_size, heads_per_ngram: expected at most {_MAX_PLE_HEADS} n-gram heads "
                    f"over all PLE layers (len(ple_layer_ids) * (ngram_size-1) * heads_per_ngram; the real model "
                    f"has 16), found {len(self.ple_layer_ids)} * {heads}")
            if heads <= 0 or self.ple_embed_dim <= 0 or self.ple_embed_dim % heads:
                bad(f"ple_embed_dim: expected a positive multiple of the n-gram head count "
                    f"(ngram_size-1)*heads_per_ngram={heads}, found {self.ple_embed_dim}")
            bad_ids = [i for i in self.ple_layer_ids if i < 1 or i > self.num_hidden_layers]
            if bad_ids:
                bad(f"ple_layer_ids: expected one-indexed ids in [1, {self.num_hidden_layers}], found {bad_ids}")
            non_lin = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != "linear_attention"]
            if non_lin:
                bad(f"ple_layer_ids: PLE is only supported on linear_attention layers, found PLE on {non_lin}")
            if self.eos_token_id is None or (isinstance(self.eos_token_id, tuple) and not self.eos_token_id):
                bad("eos_token_id: must be set when PLE layers are enabled (it resets the n-gram history), "
                    "found None")
            if self.ngram_vocab_size_base <= 1:
                bad(f"ngram_vocab_size_base: expected > 1, found {self.ngram_vocab_size_base}")
        eos_ids = self.eos_token_ids
        out = [e for e in eos_ids if not (0 <= e < self.vocab_size)]
        if out:
            bad(f"eos_token_id: expected ids in [0, vocab_size={self.vocab_size}), found {out}")
        for k in ("bos_token_id", "pad_token_id"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, int) and 0 <= v < self.vocab_size):
                bad(f"{k}: expected an id in [0, vocab_size={self.vocab_size}), found {v!r}")

    # ------------------------------------------------------------------ derived
    @property
    def hc_hidden_size(self) -> int:
        """Width of the multi-stream residual: ``hc_count * hidden_size``."""
        return self.hc_count * self.hidden_size

    @property
    def partial_rotary_factor(self) -> float:
        """Fraction of each head's channels that are rotated: ``rope_parameters["partial_rotary_factor"]``,
        1.0 when unset (official ``Qwen4ExpTextRotaryEmbedding.compute_default_rope_parameters``)."""
        return float(self.rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def rope_theta(self) -> float:
        """RoPE base ``rope_parameters["rope_theta"]`` as a float (KeyError when absent; official
        ``Qwen4ExpTextRotaryEmbedding.compute_default_rope_parameters``)."""
        return float(self.rope_parameters["rope_theta"])

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head: ``int(head_dim * partial_rotary_factor)`` (official rotary init)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_section(self) -> list[int]:
        """mrope sections (T, H, W); the official default ``[11, 11, 10]`` when unset."""
        return list(self.rope_parameters.get("mrope_section", [11, 11, 10]))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All EOS ids as a tuple (empty when unset)."""
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, tuple) else (e,)

    @property
    def ple_eos_token_id(self) -> int | None:
        """The id that resets the PLE n-gram history: the first EOS id (official ``eos_token_id[0]``)."""
        ids = self.eos_token_ids
        return ids[0] if ids else None

    @property
    def output_gate(self) -> str:
        """GDN gated-norm activation: ``output_gate_type or hidden_act``."""
        return self.output_gate_type or self.hidden_act

    @property
    def qsa_enabled(self) -> bool:
        """True when the config defines the QSA indexer (``indexer_n_heads`` is not None)."""
        return self.indexer_n_heads is not None

    @property
    def block_topk(self) -> int:
        """Complete compressed blocks kept per query: ``indexer_budget // indexer_compress_ratio``."""
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def qsa_bound(self) -> int:
        """Visible-token count at and below which QSA selects everything:
        ``indexer_budget + indexer_compress_ratio - 1`` (:func:`qsa_visible_bound`)."""
        return qsa_visible_bound(self.indexer_budget, self.indexer_compress_ratio)

    @property
    def ngram_heads(self) -> int:
        """PLE n-gram embedding heads: ``(ngram_size - 1) * heads_per_ngram`` (official
        ``Qwen4ExpTextNGramEmbedding.__init__``)."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_conv_state_len(self) -> int:
        """Carried PLE conv history: ``(ple_conv_kernel_size - 1) * ngram_size`` (dilation = ngram_size)."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def linear_key_dim(self) -> int:
        """GDN key width: ``linear_num_key_heads * linear_key_head_dim`` (official
        ``Qwen4ExpTextGatedDeltaNet.__init__`` ``key_dim``)."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """GDN value width: ``linear_num_value_heads * linear_value_head_dim`` (official
        ``Qwen4ExpTextGatedDeltaNet.__init__`` ``value_dim``)."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN causal conv: ``2 * key_dim + value_dim``."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def ple_layer_index(self, layer_idx: int) -> int | None:
        """Index into ``ple_layer_ids`` of 0-based ``layer_idx``, or None when it has no PLE."""
        return self.ple_layer_ids.index(layer_idx + 1) if (layer_idx + 1) in self.ple_layer_ids else None

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """0-based indices of the PLE layers."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    def ple_layout(self, layer_idx: int) -> PLELayout:
        """The derived n-gram table layout of PLE layer ``layer_idx`` (0-based).

        Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.__init__``.
        Raises:
            ConfigError: the layer has no PLE.
        """
        pli = self.ple_layer_index(layer_idx)
        if pli is None:
            raise ConfigError(f"layer {layer_idx}: has no PLE (ple_layer_ids={list(self.ple_layer_ids)})")
        return _ple_layout_cached(self.ple_embed_dim, self.ngram_size, self.heads_per_ngram, self.vocab_size,
                                  self.ngram_vocab_size_base, self.make_ngram_vocab_size_divisible_by, self.seed,
                                  layer_idx, pli)


_LAYOUT_CACHE: dict = {}


def _ple_layout_cached(ple_embed_dim, ngram_size, heads_per_ngram, vocab, base, divisor, seed, layer_idx, pli):
    key = (ple_embed_dim, ngram_size, heads_per_ngram, vocab, base, divisor, seed, layer_idx, pli)
    if key in _LAYOUT_CACHE:
        return _LAYOUT_CACHE[key]
    heads = (ngram_size - 1) * heads_per_ngram
    sizes, offsets, total = [], [], 0
    # the n-th prime after base-1 for consecutive n: walk primes incrementally (same result as the official
    # per-head restart, without its quadratic cost)
    p = base - 1
    start_n = pli * heads
    for _ in range(start_n):
        p = find_nth_prime_after(p, 1)
    for _h in range(heads):
        p = find_nth_prime_after(p, 1)
        sizes.append(p)
        offsets.append(total)
        total += p
    padded = math.ceil(total / divisor) * divisor
    lay = PLELayout(layer_idx=layer_idx, ple_layer_index=pli,
                    multipliers=tuple(build_layer_multipliers(vocab, ngram_size, pli, seed)),
                    head_vocab_sizes=tuple(sizes), head_offsets=tuple(offsets), total_rows=total,
                    padded_rows=padded, head_dim=ple_embed_dim // heads)
    _LAYOUT_CACHE[key] = lay
    return lay


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate ``config.json`` from a checkpoint directory (or the file itself).

    A config.json must state its ``model_type`` (``qwen4_exp`` or ``qwen4_exp_text``): transformers'
    AutoConfig needs it to pick the configuration class. Every other key may be absent and takes the
    official ``Qwen4ExpTextConfig`` default (e.g. ``vocab_size`` 248320; a checkpoint whose tensors
    disagree is caught when they are checked, naming the key). ``rope_parameters: null`` is such a default too:
    one note on stderr (once per file and process) says which values it stands for.

    Raises:
        ConfigError: missing or unreadable file, bytes that are not UTF-8, invalid JSON, no
            ``model_type``, or an invalid configuration.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{p}: config.json not found (expected a checkpoint directory holding config.json)")
    from reference.textio import read_utf8
    text = read_utf8(p, str(p), "JSON file", ConfigError)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    if isinstance(raw, dict) and "model_type" not in raw:
        raise ConfigError(f"{p}: model_type: expected 'qwen4_exp' or 'qwen4_exp_text', found no model_type key")
    cfg = ModelConfig.from_dict(raw, where=str(p))
    rope = rope_null_note(cfg)
    if rope is not None:  # an explicit null reads as "set", yet it stands for a default: say which
        from reference.notes import note_once
        note_once(("rope_parameters null", str(p.resolve())), f"{p}: {rope}")
    return cfg
