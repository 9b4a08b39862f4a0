"""Synthetic checkpoints with the real model's per-layer widths and random BF16 weights.

The writer streams every tensor to disk in chunks (a 5 GB expert tensor never sits in memory), one
safetensors shard per decoder layer plus one for the rest, with ``model.safetensors.index.json``,
written into a temp directory that is renamed into place once complete (an interrupted write leaves
nothing behind but the temp directory, which the next call removes). The layout is what
transformers' ``Qwen4ExpForCausalLM.save_pretrained`` produces for the BF16 release: names under
``model.``, ``lm_head.weight`` at the top, fused 3-D experts (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``), the n-gram table as
``split_ngram_parts`` row shards - so the official implementation loads it with ``from_pretrained``.

Scaled down against the real checkpoint (stated in every result): the PLE n-gram table rows
(``ngram_vocab_size_base`` 20,000 instead of 20,000,000: ~320k rows instead of 320M) and, where
asked, the vocabulary. Everything else is model-facts §1: hidden 2560, 512 experts top-10 of width
640, 24/2 attention heads of 256, GDN 16/48 heads of 128, hc_count 4 / hc_lowrank 320, indexer 4x128.

Values: a pool of N(0, 0.02) BF16 numbers (the official ``initializer_range``) tiled with
per-tensor offsets; RMSNorm weights near 0 (zero-centred norms), the GDN gated norm near 1,
``A_log = log(U(1, 16))``, ``dt_bias = 1`` - magnitudes that keep a random model finite.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from reference.checkpoint import _WeightsBase
from reference.config import ModelConfig
from reference.safetensors_file import StreamedTensor, write_streamed

BF16 = np.dtype(ml_dtypes.bfloat16)

# model-facts §1 (text_config of Qwen/Qwen3.8-Flash-Next)
REAL_TEXT_CONFIG = {
    "model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"],
    "vocab_size": 248320, "hidden_size": 2560, "num_attention_heads": 24, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
    "output_gate_type": "sigmoid", "hidden_act": "silu", "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640, "num_experts": 512, "num_experts_per_tok": 10,
    "hc_count": 4, "hc_lowrank": 320, "ple_embed_dim": 2560, "ple_conv_kernel_size": 4, "ngram_size": 3,
    "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
    "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "eos_token_id": 248044, "bos_token_id": 248044,
    "pad_token_id": None, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "attention_bias": False, "dtype": "bfloat16", "router_aux_loss_coef": 0.001, "initializer_range": 0.02,
    "full_attention_interval": 4,
}

DEFAULT_NGRAM_BASE = 20_000  # real: 20,000,000 -> the table has ~1/1000 of the real rows
REAL_NGRAM_BASE = REAL_TEXT_CONFIG["ngram_vocab_size_base"]  # in-memory weights: the real table size


def real_width_config(layers: int = 4, *, vocab_size: int | None = None,
                      ngram_vocab_size_base: int = DEFAULT_NGRAM_BASE, overrides: dict | None = None) -> dict:
    """A flat ``qwen4_exp_text`` config dict at real widths with ``layers`` decoder layers.

    Layer types follow the real period (3 ``linear_attention`` then 1 ``full_attention``); PLE sits
    on 0-based layer 1 as in the real model. ``layers == 1`` gives one QSA layer without PLE (the
    official implementation cannot run a cache without an attention layer). ``vocab_size`` and
    ``ngram_vocab_size_base`` scale the embedding/lm_head and the n-gram table down; ``overrides``
    replaces any field (tests use it for small widths).

    Raises:
        InputError: layers < 1.
    """
    from reference.errors import InputError
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise InputError(f"--layers: expected an integer >= 1, found {layers!r}")
    cfg = json.loads(json.dumps(REAL_TEXT_CONFIG))
    cfg["num_hidden_layers"] = layers
    if layers == 1:
        # a single layer is a QSA layer: the official implementation's cache cannot run a model that has
        # no attention layer (DynamicCache.get_seq_length raises), and PLE needs a GDN layer
        cfg["layer_types"], cfg["ple_layer_ids"] = ["full_attention"], []
    else:
        cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        cfg["ple_layer_ids"] = [2]
    cfg["ngram_vocab_size_base"] = int(ngram_vocab_size_base)
    if vocab_size is not None:
        cfg["vocab_size"] = int(vocab_size)
        cfg["eos_token_id"] = cfg["bos_token_id"] = min(cfg["eos_token_id"], int(vocab_size) - 1)
    cfg.update(overrides or {})
    return cfg


def _tensor_specs(cfg) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(stored name, shape, kind, shard) for every tensor; kind picks the value recipe."""
    from reference.checkpoint import expected_shapes
    out = []
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        if ".mlp.experts." in name and not name.endswith(("gate_up_proj", "down_proj")):
            continue  # per-expert layout: we write the fused one
        if ".ple_embedding." in name and not name.endswith("ngram_embedding.weight"):
            lay = cfg.ple_layout(int(name.split(".")[1]))  # I64 buffers, as save_pretrained writes them
            vals = {"layer_multipliers": lay.multipliers, "ngram_heads_vocab_sizes": lay.head_vocab_sizes,
                    "ngram_heads_offsets": lay.head_offsets}[name.rsplit(".", 1)[1]]
            out.append(("model." + name, shape, np.asarray(vals, dtype="<i8"), int(name.split(".")[1]) + 1))
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        shard = int(name.split(".")[1]) + 1 if name.startswith("layers.") else 0
        stored = name if name == "lm_head.weight" else "model." + name
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "hc_norm" in name:
            kind = "ones" if ".linear_attn.norm." in name else "small"
        elif name.endswith("A_log"):
            kind = "a_log"
        elif name.endswith("dt_bias"):
            kind = "ones"
        else:
            kind = "normal"
        if name.endswith("ngram_embedding.weight"):
            rows, dim = shape
            parts = cfg.split_ngram_parts
            if rows % parts:
                out.append((stored, shape, kind, shard))
                continue
            base = stored.rsplit(".weight", 1)[0]
            for k in range(parts):
                out.append((f"{base}.shard_{k}.weight", (rows // parts, dim), kind, shard))
            continue
        out.append((stored, shape, kind, shard))
    n_mtp = (cfg.extra or {}).get("mtp_num_hidden_layers") or 0
    if n_mtp:  # the MTP head (config mtp_num_hidden_layers >= 1): top-level mtp.*, fused experts, own shard
        from reference.checkpoint import mtp_expected_shapes
        for name, shape in mtp_expected_shapes(cfg).items():
            if name.endswith(".bias") and not cfg.attention_bias:
                continue
            kind = "small" if (name.endswith("norm.weight") or name.endswith("layernorm.weight")
                               or "hc_norm" in name or "pre_fc_norm" in name) else "normal"
            out.append((name, shape, kind, cfg.num_hidden_layers + 1))
    return out


class _Pool:
    """Tiled random BF16 values: cheap to produce at any size, different for every tensor.

    :meth:`pieces` yields read-only views into two pre-drawn pools (N(0, 0.02) and 0.1x that), so a
    multi-GB tensor is written without ever being built in memory.
    """

    def __init__(self, seed: int, size: int = 1 << 22, std: float = 0.02):
        rng = np.random.default_rng(seed)
        normal = rng.standard_normal(size * 2, dtype=np.float32) * std
        self.pools = {"normal": normal.astype(BF16), "small": (normal * np.float32(0.1)).astype(BF16),
                      "ones": np.ones(size * 2, BF16)}
        self.rng = rng
        self.size = size

    def pieces(self, kind: str, n: int, key: str):
        """Yield BF16 pieces totalling ``n`` values of pool ``kind`` ('normal', 'small', 'ones'), starting at
        an offset derived from ``key``; 'a_log' yields one freshly drawn array of ``log(U(1, 16))``."""
        if kind == "a_log":
            yield np.log(self.rng.uniform(1.0, 16.0, size=n)).astype(BF16)
            return
        pool = self.pools[kind]
        off = int(hashlib.blake2s(key.encode(), digest_size=4).hexdigest(), 16) % self.size
        done = 0
        while done < n:
            m = min(self.size, n - done)
            yield pool[off:off + m]
            done += m
            off = (off + 7919) % self.size  # a different phase for each repetition


def _nbytes(shape, kind) -> int:
    return int(np.prod(shape)) * (8 if isinstance(kind, np.ndarray) else 2)


def _write_shard(path: Path, specs, pool: _Pool, bar) -> None:
    # one safetensors writer (reference.safetensors_file); inside the checkpoint's atomic_dir
    out = []
    for name, shape, kind, _ in specs:
        dt = "I64" if isinstance(kind, np.ndarray) else "BF16"
        chunks = (kind,) if isinstance(kind, np.ndarray) else _pieces(pool, kind, shape, name, bar)
        out.append(StreamedTensor(name, dt, tuple(shape), _nbytes(shape, kind), chunks))
    write_streamed(path, out, atomic=False)


def _pieces(pool: _Pool, kind, shape, name: str, bar):
    for piece in pool.pieces(kind, int(np.prod(shape)), name):
        yield piece.view(np.uint16)
        if bar is not None:
            bar.update(piece.nbytes)


#: the real model's decoder layers (model-facts: num_hidden_layers 48); synthetic checkpoints stop there
MAX_LAYERS = 48


def checkpoint_bytes(cfg_dict: dict) -> int:
    """Bytes of weights the synthetic checkpoint for ``cfg_dict`` holds (BF16)."""
    from reference.config import ModelConfig
    cfg = ModelConfig.from_dict(cfg_dict)
    return sum(_nbytes(s, k) for _, s, k, _ in _tensor_specs(cfg))


def write_synthetic(out_dir: str | os.PathLike, cfg_dict: dict, *, seed: int = 0, progress: bool = True) -> Path:
    """Write a synthetic BF16 checkpoint for ``cfg_dict`` into ``out_dir`` (created atomically).

    Returns the directory. An existing complete ``out_dir`` is replaced.
    Raises:
        ConfigError: ``cfg_dict`` is not a valid qwen4exp text config.
        InputError: the checkpoint would not fit the free space of ``out_dir``'s filesystem (checked first).
    """
    from tqdm import tqdm

    from reference.config import ModelConfig
    cfg = ModelConfig.from_dict(cfg_dict, where="synthetic config")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    from reference.atomic import atomic_dir
    specs = _tensor_specs(cfg)
    total = sum(_nbytes(s, k) for _, s, k, _ in specs)
    free = shutil.disk_usage(out.parent).free
    if total + (1 << 30) > free:  # 1 GiB of headroom for the filesystem and the index
        from reference.errors import InputError
        raise InputError(f"synthetic checkpoint {out.name}: needs {total / 2**30:.1f} GiB on {out.parent}, found "
                         f"{free / 2**30:.1f} GiB free (set QWEN4EXP_CACHE to a larger disk, or use fewer --layers)")
    with atomic_dir(out, prefix=f".{out.name}.tmp") as tmp:
        shards = sorted({s for *_, s in specs})
        pool = _Pool(seed)
        wmap = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"synthetic {out.name}", disable=not progress,
                  leave=False) as bar:
            for k, sh in enumerate(shards):
                fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                part = [s for s in specs if s[3] == sh]
                _write_shard(tmp / fn, part, pool, bar)
                wmap.update({s[0]: fn for s in part})
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total, "synthetic": True}, "weight_map": wmap}, indent=1))
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=1))
        (tmp / "SYNTHETIC.json").write_text(json.dumps({"seed": seed, "bytes": total, "scaled_down": {
            "ngram_vocab_size_base": cfg_dict.get("ngram_vocab_size_base"),
            "vocab_size": cfg_dict.get("vocab_size")}}, indent=1))
    return out


def cache_dir() -> Path:
    """Where synthetic checkpoints are kept: ``$QWEN4EXP_CACHE`` or ``~/.cache/qwen4exp``."""
    return Path(os.environ.get("QWEN4EXP_CACHE") or Path.home() / ".cache" / "qwen4exp") / "synthetic"


def synthetic_dir(layers: int = 4, *, vocab_size: int | None = None,
                  ngram_vocab_size_base: int = DEFAULT_NGRAM_BASE, overrides: dict | None = None,
                  seed: int = 0, kind: str = "realwidth") -> Path:
    """The cache folder of the synthetic checkpoint for these settings (written or not):
    ``cache_dir() / f"{kind}-L{layers}-{hash}"``; ``hash``: the first 12 hex digits of the SHA-256 of the config
    and the seed, so other settings never share a folder. ``kind`` names what the checkpoint is ('realwidth':
    the real widths; parity.bench.long_model names its reduced-width model 'reducedwidth')."""
    cfg = real_width_config(layers, vocab_size=vocab_size, ngram_vocab_size_base=ngram_vocab_size_base,
                            overrides=overrides)
    key = hashlib.sha256(json.dumps([cfg, seed, 1], sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{kind}-L{layers}-{key}"


def cached_synthetic(layers: int = 4, *, vocab_size: int | None = None,
                     ngram_vocab_size_base: int = DEFAULT_NGRAM_BASE, overrides: dict | None = None,
                     seed: int = 0, progress: bool = True, kind: str = "realwidth") -> Path:
    """The synthetic checkpoint for these settings, written once into :func:`cache_dir` (its folder:
    :func:`synthetic_dir`, ``kind`` naming it)."""
    d = synthetic_dir(layers, vocab_size=vocab_size, ngram_vocab_size_base=ngram_vocab_size_base,
                      overrides=overrides, seed=seed, kind=kind)
    if (d / "model.safetensors.index.json").is_file() and (d / "config.json").is_file():
        return d
    cfg = real_width_config(layers, vocab_size=vocab_size, ngram_vocab_size_base=ngram_vocab_size_base,
                            overrides=overrides)
    return write_synthetic(d, cfg, seed=seed, progress=progress)


# ------------------------------------------------------------------------------------------ in memory
#: Formats :class:`SyntheticWeights` builds (model-facts section 4): 'bf16' (the BF16 release), 'fp8' (the
#: official FP8 release: experts and the big projections F8_E4M3 with 128x128 ``weight_scale_inv``, the PLE
#: table F8_E4M3 with one BF16 ``weight_scale``), 'nvfp4' (RadixArk / nvidia ModelOpt: routed experts NVFP4,
#: everything else BF16, the PLE table FP8).
WEIGHT_FORMATS = ("bf16", "fp8", "nvfp4")
#: Projections the official FP8 release stores as F8_E4M3 besides the routed experts (model-facts 4a; the
#: fixture builder uses the same list for tiny-fp8). Embeddings, lm_head, norms, router, hyper-connection
#: mixers, convs and the GDN b/a projections stay BF16.
FP8_RELEASE_QUANTISED = (".mlp.experts.", ".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.",
                         ".self_attn.o_proj.", ".linear_attn.in_proj_qkv.", ".linear_attn.in_proj_z.",
                         ".linear_attn.out_proj.", ".mlp.shared_expert.gate_proj.", ".mlp.shared_expert.up_proj.",
                         ".mlp.shared_expert.down_proj.", ".self_attn.indexer.index_qk_proj.")
_FP8_SCALE = np.float32(0.02 / 16)  # FP8 codes of N(0, 0.02) values at this scale stay well inside E4M3's range
_EXPERT_FP8_SCALE = 0.04  # device codes have |value| <= 1.875 (exponent field <= 7): ~N(0, 0.02) after scaling
_EXPERT_NVFP4_S2 = 0.006  # E2M1 magnitudes <= 6, E4M3 scale 1.0


def _hash32(i: np.ndarray, seed: int) -> np.ndarray:
    """NumPy twin of ``synthetic_fill.cu:hash32`` over uint64 indices ``i``."""
    i = i.astype(np.uint64)
    x = ((i ^ (i >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ np.uint32(seed)
    x = (x ^ (x >> np.uint32(16))) * np.uint32(0x7FEB352D)
    x = (x ^ (x >> np.uint32(15))) * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _fill_u8(xp, shape, seed: int, mask: int, bits: int):
    n = int(np.prod(shape))
    if xp is np:
        return ((_hash32(np.arange(n, dtype=np.uint64), seed) & np.uint32(mask)) | np.uint32(bits)).astype(
            np.uint8).reshape(shape)
    from engine.kernels.dense_common import kernel
    out = xp.empty(shape, dtype=xp.uint8)
    if n:
        kernel("synthetic_fill.cu", "fill_u8")((min(-(-n // 256), 65535 * 16),), (256,),
                                               (out, np.int64(n), np.uint32(seed), np.uint32(mask), np.uint32(bits)))
    return out


def _fill_bf16(xp, shape, seed: int, amp: float = 0.05):
    n = int(np.prod(shape))
    if xp is np:
        h = _hash32(np.arange(n, dtype=np.uint64), seed)
        v = ((h & np.uint32(0xFFFF)).astype(np.float32) / 65536 + (h >> np.uint32(16)).astype(np.float32) / 65536
             - np.float32(1)) * np.float32(amp)
        return (v.view(np.uint32) >> np.uint32(16)).astype(np.uint16).reshape(shape)
    from engine.kernels.dense_common import kernel
    out = xp.empty(shape, dtype=xp.uint16)
    if n:
        kernel("synthetic_fill.cu", "fill_bf16_normal")((min(-(-n // 256), 65535 * 16),), (256,),
                                                        (out, np.int64(n), np.uint32(seed), np.float32(amp)))
    return out


#: host memory the device machine has (KINDS.md: 128 GiB); the real BF16 n-gram table (102 GB) does not fit
#: beside the process, the FP8 one (51 GB) does
HOST_TABLE_LIMIT_BYTES = 64 * 10**9


def in_memory_ngram_base(fmt: str) -> tuple[int, str]:
    """``ngram_vocab_size_base`` for in-memory weights of format ``fmt`` and a note saying what was done: the
    real table (20M base, 320M rows x 160) when it fits :data:`HOST_TABLE_LIMIT_BYTES` in its format (FP8 for
    'fp8' / 'nvfp4', as both releases store it), else the scaled-down :data:`DEFAULT_NGRAM_BASE` (BF16)."""
    cfg = ModelConfig.from_dict(real_width_config(4, ngram_vocab_size_base=REAL_NGRAM_BASE))
    lay = cfg.ple_layout(cfg.ple_layers[0])
    nbytes = lay.padded_rows * lay.head_dim * (2 if fmt == "bf16" else 1)
    if nbytes <= HOST_TABLE_LIMIT_BYTES:
        return REAL_NGRAM_BASE, (f"real size in host memory: {lay.padded_rows:,} rows x {lay.head_dim}, "
                                 f"{'BF16' if fmt == 'bf16' else 'FP8'}, {nbytes / 1e9:.1f} GB")
    return DEFAULT_NGRAM_BASE, (f"scaled down to ngram_vocab_size_base {DEFAULT_NGRAM_BASE:,}: the real "
                                f"{'BF16' if fmt == 'bf16' else 'FP8'} table ({nbytes / 1e9:.0f} GB) does not fit "
                                f"the host's memory beside the process (limit {HOST_TABLE_LIMIT_BYTES / 1e9:.0f} GB)")


def weights_bytes_estimate(cfg, fmt: str) -> dict:
    """Bytes of the weights :class:`SyntheticWeights` puts on the device for ``cfg`` in format ``fmt``
    (``{'experts', 'dense', 'total'}``; the PLE table is host-resident and not counted)."""
    from reference.checkpoint import expected_shapes
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    per_expert = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "nvfp4": 0.5 + 1 / 16}[fmt] * 3 * I * H
    dense = 0
    for name, shape in expected_shapes(cfg).items():
        if ".mlp.experts." in name or "ngram_embedding" in name or ".ple_embedding." in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        n = int(np.prod(shape))
        q = fmt == "fp8" and any(t in "." + name for t in FP8_RELEASE_QUANTISED) and len(shape) == 2
        dense += n * (1 if q else (4 if (".mlp.gate." in name or len(shape) == 1) else 2))
    experts = int(cfg.num_hidden_layers * E * per_expert)
    return {"experts": experts, "dense": int(dense), "total": int(experts + dense)}


class SyntheticWeights(_WeightsBase):
    """Random weights at any depth without files: the :class:`reference.checkpoint.Checkpoint` interface
    for the engine, with the routed experts built directly in device memory (:meth:`device_experts`, which
    :class:`engine.model.EngineModel` calls instead of reading experts) and every other tensor produced on
    the host when it is read (tiled from a seeded pool, uploaded, dropped). The PLE n-gram table is held in
    host memory at the size the config says (FP8 with one table-wide scale for 'fp8' / 'nvfp4', BF16 for
    'bf16'), filled once.

    Engine-only: the reference and the official implementation cannot read the experts (they exist only on
    the device). Values: :func:`_fill_bf16` / :func:`_fill_u8` (experts), :class:`_Pool` (the rest).

    Args:
        cfg_dict: a flat ``qwen4_exp_text`` config (e.g. :func:`real_width_config`).
        fmt: one of :data:`WEIGHT_FORMATS`.
        seed: value seed.
    Raises:
        InputError: unknown ``fmt``. ConfigError: invalid config.
    """

    def __init__(self, cfg_dict: dict, fmt: str = "bf16", seed: int = 0):
        from reference.config import ModelConfig
        from reference.errors import InputError
        if fmt not in WEIGHT_FORMATS:
            raise InputError(f"--weights: expected one of {list(WEIGHT_FORMATS)}, found {fmt!r}")
        self.config = cfg = ModelConfig.from_dict(cfg_dict, where="synthetic config")
        self._cfg_dict, self.fmt, self.seed = cfg_dict, fmt, int(seed)
        self._pool = _Pool(seed)
        self._st, self._kinds, self._tables_mem = {}, {}, {}
        self._fp8_pool = None
        for stored, shape, kind, _ in _tensor_specs(cfg):
            name = stored[len("model."):] if stored.startswith("model.") else stored
            if ".mlp.experts." in name:
                continue  # on the device: device_experts
            dt = "I64" if isinstance(kind, np.ndarray) else "BF16"
            if (fmt == "fp8" and dt == "BF16" and len(shape) == 2
                    and any(t in "." + name for t in FP8_RELEASE_QUANTISED)):
                self._st[name[:-len(".weight")] + ".weight_scale_inv"] = ("F32", (-(-shape[0] // 128),
                                                                                -(-shape[1] // 128)))
                dt = "F8_E4M3"
            if "ngram_embedding" in name and fmt in ("fp8", "nvfp4"):
                dt = "F8_E4M3"
            self._st[name] = (dt, tuple(shape))
            self._kinds[name] = kind
        if fmt in ("fp8", "nvfp4"):
            for layer in cfg.ple_layers:
                self._st[f"layers.{layer}.ple.ple_embedding.ngram_embedding.weight_scale"] = ("BF16", (1,))
        self._init_common()

    def _source(self) -> str:
        return f"synthetic {self.fmt} weights"

    def _stored(self):
        return self._st

    def fingerprint(self) -> str:
        """32 hex chars of SHA-256 over the config, format and seed (the values are a function of them)."""
        return hashlib.sha256(json.dumps([self._cfg_dict, self.fmt, self.seed], sort_keys=True,
                                         default=str).encode()).hexdigest()[:32]

    def describe(self) -> str:
        """One line: format, depth and the device bytes of the weights (:func:`weights_bytes_estimate`)."""
        est = weights_bytes_estimate(self.config, self.fmt)
        return (f"synthetic {self.fmt} weights in memory: {self.config.num_hidden_layers} layers, experts "
                f"{est['experts'] / 1e9:.1f} GB + dense {est['dense'] / 1e9:.1f} GB on the device")

    def _raw(self, name: str) -> np.ndarray:
        """The host array of a non-expert tensor (FP8 codes quantised from the BF16 pool at a fixed scale)."""
        dt, shape = self._st[name]
        if name.endswith("weight_scale_inv"):
            return np.full(shape, _FP8_SCALE, np.float32)
        if name.endswith("ngram_embedding.weight_scale"):
            return np.full(shape, _FP8_SCALE, BF16)
        kind = self._kinds[name]
        if isinstance(kind, np.ndarray):
            return kind.reshape(shape)
        if "ngram_embedding" in name:
            return self._table_shard(name, dt, shape)
        vals = np.concatenate(list(self._pool.pieces(kind, int(np.prod(shape)), name))).reshape(shape)
        if dt == "F8_E4M3":
            return (vals.astype(np.float32) / _FP8_SCALE).astype(ml_dtypes.float8_e4m3fn)
        return vals

    def _table_shard(self, name: str, dt: str, shape) -> np.ndarray:
        """An n-gram table shard, filled once from the pool and kept (host memory at the configured size)."""
        t = self._tables_mem.get(name)
        if t is not None:
            return t
        if dt == "BF16":
            t, src = np.empty(shape, BF16), self._pool.pools["normal"].view(np.uint16)
            flat = t.reshape(-1).view(np.uint16)
        else:
            if self._fp8_pool is None:
                self._fp8_pool = (self._pool.pools["normal"].astype(np.float32) / _FP8_SCALE).astype(
                    ml_dtypes.float8_e4m3fn).view(np.uint8)
            t, src = np.empty(shape, ml_dtypes.float8_e4m3fn), self._fp8_pool
            flat = t.reshape(-1).view(np.uint8)
        half = src.size // 2
        off = int(hashlib.blake2s(name.encode(), digest_size=4).hexdigest(), 16) % half
        for a in range(0, flat.size, half):
            m = min(half, flat.size - a)
            flat[a:a + m] = src[off:off + m]
        self._tables_mem[name] = t
        return t

    def device_experts(self, layer: int, xp, precision: str):
        """Layer ``layer``'s routed experts built on ``xp``'s device: ``(gate_up [E, 2I, H], down [E, H, I])``
        as BF16 bits (uint16; float32 when ``precision == 'float32'``) or
        :class:`engine.kernels.quant.QuantWeight` (fp8: 128x128 scales; nvfp4: E4M3 scales 1.0 and one global
        scale per expert matrix)."""
        from engine.kernels.quant import QuantWeight
        c = self.config
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        out = []
        for j, (N, K) in enumerate(((2 * I, H), (H, I))):
            seed = (self.seed * 1000003 + layer * 7919 + j * 104729) & 0xFFFFFFFF
            if self.fmt == "bf16":
                w = _fill_bf16(xp, (E, N, K), seed)
                if precision == "float32":
                    w = (w.astype(xp.uint32) << 16).view(xp.float32)
            elif self.fmt == "fp8":
                q = _fill_u8(xp, (E, N, K), seed, 0xBF, 0)  # exponent field <= 7: |code| <= 1.875, never NaN
                s = xp.full((E, -(-N // 128), -(-K // 128)), _EXPERT_FP8_SCALE, dtype=xp.float32)
                w = QuantWeight("fp8", (E, N, K), q, s, rb=128, cb=128)
            else:
                q = _fill_u8(xp, (E, N, K // 2), seed, 0xFF, 0)
                sc = xp.full((E, N, K // 16), 0x38, dtype=xp.uint8)  # E4M3 1.0
                w = QuantWeight("nvfp4", (E, N, K), q, sc, xp.full((E,), _EXPERT_NVFP4_S2, dtype=xp.float32),
                                s2_rows=N)
            out.append(w)
        return out[0], out[1]
