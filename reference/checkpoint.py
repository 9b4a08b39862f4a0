"""Lazy, memory-mapped reader of qwen4exp safetensors checkpoints (and an in-memory twin).

Canonical tensor names carry no ``model.`` / ``model.language_model.`` prefix
(``embed_tokens.weight``, ``layers.3.self_attn.q_proj.weight``, ``lm_head.weight``; the vision tower
is listed as ``visual.*``, the MTP head as ``mtp.*``).

What is read, and how (sources: transformers ``models/qwen4_exp/modeling_qwen4_exp.py`` for the
module tree and shapes — ``Qwen4ExpTextModel.__init__`` and the classes it builds;
``conversion_mapping.py`` entry ``qwen4_exp_text`` for the sharded n-gram table (``Concatenate``
over ``split_ngram_parts`` shards, dim 0, shard order) and the per-expert <-> fused expert merge):

* safetensors headers are parsed directly (8-byte little-endian header length + JSON) so that
  truncated or corrupt files are diagnosed up front and every dtype (incl. BF16 and FP8, which
  numpy's safetensors backend cannot map) is memory-mapped through ``np.memmap`` views;
* dtypes F64/F32/F16/BF16 (ml_dtypes), I64/I32/I16/I8/U8/BOOL, F8_E4M3 (ml_dtypes float8_e4m3fn)
  and F8_E5M2. FP8 weights are dequantised exactly in float32: block scales ``weight_scale_inv``
  ``[ceil(rows/b0), ceil(cols/b1)]`` (``b = quantization_config.weight_block_size``, default 128x128,
  the layout of the official FP8 release: ``w * scale_inv[r // b0, c // b1]``) or one per-tensor
  scale (``weight_scale``, e.g. the FP8 n-gram table's single table-wide scale);
* NVFP4 (ModelOpt, model-facts section 4b/4c): a ``U8`` weight ``[out, in/2]`` (two E2M1 codes per byte,
  element ``2j`` in the low nibble) with ``weight_scale`` F8_E4M3 ``[out, in/16]`` (one scale per 16
  elements, row-major) and ``weight_scale_2`` F32 (one global scale) is dequantised exactly in float32 as
  ``(e2m1(code) * float32(weight_scale)) * weight_scale_2`` (the first product is exact); its shape is
  checked as the logical ``[out, in]``. ``input_scale`` (activation quantisation of W4A4 serving) is not
  applied: the model is the official one on the dequantised weights;
* the PLE n-gram table is gathered row by row with ``os.preadv`` straight into the output buffer:
  never materialised, never mapped, so resident memory stays flat however large the table is.

Shapes are validated against the config lazily, when a tensor is first read.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.config import ModelConfig, load_config
from reference.errors import CheckpointError, InputError
# the file format and the tensor schema live in their own modules; their public names are re-exported here
from reference.safetensors_file import DTYPES, _INT, _Entry, _parse_file, _st_dtype_name, write_safetensors  # noqa: F401
from reference.tensor_schema import (MTP_LAYER, _NGRAM_FULL, _NGRAM_SHARD_RE, _defaulted_note,  # noqa: F401
                                     _iter_required, _near, canonical_name, expected_shape, expected_shapes,
                                     mtp_expected_shapes, required_names)

__all__ = ["Checkpoint", "DictWeights", "CheckpointError", "canonical_name", "expected_shapes", "expected_shape",
           "required_names", "write_safetensors", "DTYPES", "mtp_expected_shapes", "MTP_LAYER",
           "E2M1_VALUES", "nvfp4_dequantize"]

_FP8 = ("F8_E4M3", "F8_E5M2")
#: the checkpoint's integer buffers (name suffixes); every other parameter is stored in a float dtype or as NVFP4 codes
_INT_BUFFERS = (".layer_multipliers", ".ngram_heads_offsets", ".ngram_heads_vocab_sizes")
#: E2M1 (NVFP4) code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


def nvfp4_dequantize(packed: np.ndarray, scale: np.ndarray, scale2) -> np.ndarray:
    """NVFP4 codes -> float32 ``[..., N, K]``: ``(e2m1(code) * scale) * scale2``.

    Args:
        packed: uint8 ``[..., N, K/2]`` (element ``2j`` in the low nibble of byte ``j``).
        scale: float32 ``[..., N, K/16]`` (the E4M3 per-16 scales, already decoded exactly).
        scale2: float32 global scale(s), broadcastable to ``[..., N, 1]``.
    The first product is exact in float32 (2-bit x 4-bit significands); only ``* scale2`` rounds.
    """
    q = np.asarray(packed, dtype=np.uint8)
    codes = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float32)
    codes[..., 0::2] = E2M1_VALUES[q & 15]
    codes[..., 1::2] = E2M1_VALUES[q >> 4]
    codes *= np.repeat(np.asarray(scale, np.float32), 16, axis=-1)
    codes *= np.asarray(scale2, np.float32)
    return codes


# --------------------------------------------------------------------------- shared logic
@dataclass(frozen=True)
class _NgramTable:
    layer: int
    shards: tuple[str, ...]            # canonical stored names, in shard order
    starts: np.ndarray                 # int64 [n_shards + 1] first row of each shard (+ total)
    head_dim: int
    scale_name: str | None            # table-wide per-tensor scale (FP8), or None


#: BF16 tensors of at least this many values are upcast on all threads (reference.numba_kernels.bf16_upcast,
#: exact as NumPy's cast; the lm_head of a real vocabulary is 636M values)
_THREADED_UPCAST = 1 << 22


class _WeightsBase:
    """The interface of docs/design.md over an abstract store of named arrays."""

    config: ModelConfig

    # --- to implement -------------------------------------------------------------------
    def _stored(self) -> dict[str, tuple[str, tuple[int, ...]]]:  # canonical -> (dtype, shape)
        raise NotImplementedError

    def _raw(self, name: str) -> np.ndarray:  # stored dtype, stored shape (may be a memmap view)
        raise NotImplementedError

    def _gather(self, name: str, rows: np.ndarray) -> np.ndarray:  # raw rows of a 2-D tensor
        return np.asarray(self._raw(name))[rows]

    def _source(self) -> str:
        return "weights"

    # --- derived state ------------------------------------------------------------------
    def _init_common(self) -> None:
        self._expected = {**expected_shapes(self.config), **mtp_expected_shapes(self.config)}
        self._checked: set[str] = set()
        self._tables: dict[int, _NgramTable] = {}
        # quantization_config sits in the text config or, in the multimodal wrapper, at the root
        q = self.config.extra.get("quantization_config") or (self.config.source or {}).get("quantization_config") or {}
        bs = q.get("weight_block_size") or [128, 128]
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
            raise CheckpointError(f"{self._source()}: quantization_config.weight_block_size: expected two positive "
                                  f"integers, found {bs!r}")
        self._block = (int(bs[0]), int(bs[1]))

    # --- listing ------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Stored canonical tensor names, sorted (quantisation scales and buffers included)."""
        return sorted(self._stored())

    def _virtual(self, name: str) -> str | None:
        """What a name that is not stored stands for: 'tied' lm_head, 'ngram' whole table, or None."""
        st = self._stored()
        if name in st:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings and "embed_tokens.weight" in st:
            return "tied"
        m = re.match(r"^layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.weight$", name)
        if m and int(m.group(1)) in self.config.ple_layers and f"{name[:-len('.weight')]}.shard_0.weight" in st:
            return "ngram"
        return None

    def has(self, name: str) -> bool:
        """True when ``name`` is stored, or is the tied lm_head / the whole sharded n-gram table."""
        return name in self._stored() or self._virtual(name) is not None

    def _file_key(self, name: str) -> str:
        """``name`` (canonical) as this store's own keys spell it; in memory the canonical name itself."""
        return name

    def _missing(self, name: str) -> CheckpointError:
        """The error for a required tensor ``name`` (canonical) that is not stored: it names the key the store
        would hold (a file's ``model.`` / ``model.language_model.`` prefix included), the shape and dtype the
        config expects, and what is there instead (near names, or how many tensors)."""
        near = [self._file_key(n) for n in _near(name, self._stored())]
        m = re.match(r"^layers\.(\d+)\.(linear_attn|self_attn)\.", name)
        kind = ""
        if m and int(m.group(1)) < len(self.config.layer_types):  # which mixer the config gives that layer
            kind = (f"; layer {m.group(1)} is {self.config.layer_types[int(m.group(1))]!r} by layer_types"
                    f"{_defaulted_note(self.config, ('layer_types',))}")
        exp = expected_shape(self.config, name, self._expected)
        want = ""
        if exp is not None:
            want = (f": expected {'an integer' if name.endswith(_INT_BUFFERS) else 'a float'} tensor of shape "
                    f"{list(exp)} (shape from config.json), found no such key")
        return CheckpointError(f"{self._source()}: missing tensor {self._file_key(name)!r}{want}{kind}"
                               + (f"; near names present: {near}" if near else
                                  f"; {len(self._stored())} tensors present"))

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape (for the whole sharded n-gram table: rows summed over shards)."""
        st = self._stored()
        if name in st:
            return tuple(st[name][1])
        v = self._virtual(name)
        if v == "tied":
            return self.shape("embed_tokens.weight")
        if v == "ngram":
            t = self._table(int(name.split(".")[1]))
            return (int(t.starts[-1]), t.head_dim)
        raise self._missing(name)

    def dtype(self, name: str) -> str:
        """Stored safetensors dtype name (``BF16``, ``F8_E4M3``, ...)."""
        st = self._stored()
        if name in st:
            return st[name][0]
        v = self._virtual(name)
        if v == "tied":
            return self.dtype("embed_tokens.weight")
        if v == "ngram":
            return self.dtype(self._table(int(name.split(".")[1])).shards[0])
        raise self._missing(name)

    def is_nvfp4(self, name: str) -> bool:
        """True when ``name`` is a ModelOpt NVFP4 weight: stored ``U8`` with a sibling ``weight_scale_2``."""
        st = self._stored()
        if name not in st or st[name][0] != "U8" or not name.endswith(".weight"):
            return False
        return name[:-len(".weight")] + ".weight_scale_2" in st

    def _dequant_nvfp4(self, name: str, raw: np.ndarray) -> np.ndarray:
        """NVFP4 -> float32 ``[out, in]``: ``(e2m1(code) * float32(weight_scale)) * weight_scale_2``."""
        base = name[:-len(".weight")]
        st = self._stored()
        q = np.asarray(raw, dtype=np.uint8)
        if q.ndim != 2:
            raise CheckpointError(f"{self._source()}: NVFP4 tensor {name!r}: expected a matrix [out, in/2], found "
                                  f"shape {list(q.shape)}")
        out_f, half = q.shape
        sc_name = base + ".weight_scale"
        if sc_name not in st or st[sc_name][0] != "F8_E4M3":
            raise CheckpointError(f"{self._source()}: NVFP4 tensor {name!r}: expected {sc_name!r} (F8_E4M3 "
                                  f"[{out_f}, {2 * half // 16}]), found "
                                  f"{'none' if sc_name not in st else st[sc_name][0]}")
        sc = np.asarray(self._raw(sc_name)).astype(np.float32)
        if tuple(sc.shape) != (out_f, 2 * half // 16) or (2 * half) % 16:
            raise CheckpointError(f"{self._source()}: scale {sc_name!r} of NVFP4 tensor {name!r}: unexpected "
                                  f"shape: expected [{out_f}, {2 * half // 16}] (one per 16 of {2 * half} "
                                  f"columns), found {list(sc.shape)}")
        g = np.asarray(self._raw(base + ".weight_scale_2")).astype(np.float32)
        if g.size != 1:
            raise CheckpointError(f"{self._source()}: {base + '.weight_scale_2'!r}: expected one global scale, "
                                  f"found shape {list(g.shape)}")
        return nvfp4_dequantize(q, sc, g.reshape(()))

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if name in self._checked:
            return
        if self.is_nvfp4(name):
            shape = tuple(shape[:-1]) + (2 * shape[-1],)  # two E2M1 codes per stored byte
        exp = expected_shape(self.config, name, self._expected)
        if exp is not None and not name.endswith(_INT_BUFFERS):
            self._check_weight_dtype(name)
        m = _NGRAM_SHARD_RE.match(name)
        if exp is not None and tuple(shape) != exp:
            if name in ("embed_tokens.weight", "lm_head.weight"):
                cfg = self.config
                what = (f"[vocab_size, hidden_size] = {list(exp)}"
                        + _defaulted_note(cfg, ("vocab_size", "hidden_size")))
            else:
                what = f"{list(exp)} (from config.json)"
            raise CheckpointError(f"{self._source()}: tensor {self._file_key(name)!r}: unexpected shape: expected {what}, "
                                  f"found {list(shape)}")
        if m is not None:
            i = int(m.group(2))
            if i in self.config.ple_layers:
                hd = self.config.ple_layout(i).head_dim
                if len(shape) != 2 or shape[1] != hd:
                    raise CheckpointError(f"{self._source()}: tensor {self._file_key(name)!r}: unexpected shape: expected "
                                          f"[rows, {hd}] (head_dim = ple_embed_dim / ngram heads), found {list(shape)}")
        self._checked.add(name)

    def _check_weight_dtype(self, name: str) -> None:
        """A model parameter is stored in a float dtype, or as NVFP4 U8 codes (with its ``weight_scale_2``); an
        integer dtype would be read as integers and silently change the model's function. Only the integer
        buffers (:data:`_INT_BUFFERS`) are integers."""
        sd = self._stored()[name][0]
        if sd in _INT and not self.is_nvfp4(name):
            raise CheckpointError(f"{self._source()}: tensor {self._file_key(name)!r}: expected a float dtype (F32, BF16, F16, F64, "
                                  f"F8_E4M3) or NVFP4 U8 codes with a weight_scale_2, found {sd}")

    # --- reading ------------------------------------------------------------------------
    def get_raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (ml_dtypes bfloat16 / float8_e4m3fn for BF16 / FP8), read-only,
        memory-mapped where the store is a file. The whole sharded n-gram table is concatenated (this
        materialises it: meant for small models; use :meth:`ngram_rows` otherwise).

        Raises:
            CheckpointError: missing tensor, unexpected shape, unknown dtype, unreadable data.
        """
        st = self._stored()
        if name in st:
            self._check_shape(name, st[name][1])
            return self._raw(name)
        v = self._virtual(name)
        if v == "tied":
            return self.get_raw("embed_tokens.weight")
        if v == "ngram":
            t = self._table(int(name.split(".")[1]))
            return np.concatenate([self.get_raw(s) for s in t.shards], axis=0)
        raise self._missing(name)

    def _scale_for(self, name: str) -> str | None:
        """Name of the FP8 scale of ``name``: ``<name>_scale_inv`` / ``<name>_scale`` (so ``X.weight_scale_inv``),
        and for an n-gram shard also the table-wide ``ngram_embedding.weight_scale[_inv]``."""
        st = self._stored()
        cands = [name + "_scale_inv", name + "_scale"]
        m = _NGRAM_SHARD_RE.match(name)
        if m:
            cands += [m.group(1) + ".weight_scale_inv", m.group(1) + ".weight_scale"]
        for c in cands:
            if c in st:
                return c
        return None

    def _dequant(self, name: str, raw: np.ndarray, scale_name: str | None) -> np.ndarray:
        """FP8 -> float32: ``w * scale`` in float32 (block-wise over the last two dims or per tensor)."""
        w = raw.astype(np.float32)
        if scale_name is None:
            raise CheckpointError(f"{self._source()}: FP8 tensor {name!r}: expected a scale tensor "
                                  f"({name.removesuffix('.weight')}.weight_scale_inv or .weight_scale), found none")
        s = np.asarray(self._raw(scale_name)).astype(np.float32)
        if s.size == 1:
            return w * s.reshape(())
        if w.ndim < 2:
            raise CheckpointError(f"{self._source()}: FP8 tensor {name!r}: block scales need a matrix, "
                                  f"found shape {list(w.shape)}")
        b0, b1 = self._block
        r, c = w.shape[-2:]
        exp = tuple(w.shape[:-2]) + (math.ceil(r / b0), math.ceil(c / b1))
        if tuple(s.shape) != exp:
            raise CheckpointError(f"{self._source()}: scale {scale_name!r} of FP8 tensor {name!r}: unexpected shape: "
                                  f"expected {list(exp)} ({b0}x{b1} blocks of {list(w.shape)}), found {list(s.shape)}")
        # in place, one row block at a time: peak memory ~ the float32 output (+ one block row of scales)
        for bi in range(exp[-2]):
            rows = slice(bi * b0, min((bi + 1) * b0, r))
            w[..., rows, :] *= np.repeat(s[..., bi:bi + 1, :], b1, axis=-1)[..., :c]
        return w

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        """The tensor as a new ``dtype`` array (float32 default, float64 on request): BF16/F16 upcast
        exactly; FP8 dequantised in float32 (``w * weight_scale_inv`` per 128x128 block, or per-tensor
        ``weight_scale``) then cast. Integer tensors (PLE buffers) come back as int64 whatever ``dtype``.

        Raises:
            CheckpointError: missing tensor, unexpected shape, unknown dtype, FP8 without a scale.
        """
        v = self._virtual(name)
        if v == "tied":
            return self.get("embed_tokens.weight", dtype)
        if v == "ngram":
            t = self._table(int(name.split(".")[1]))
            return np.concatenate([self.get(s, dtype) for s in t.shards], axis=0)
        raw = self.get_raw(name)
        sd = self.dtype(name)
        if sd == "U8" and self.is_nvfp4(name):
            return self._dequant_nvfp4(name, raw).astype(dtype, copy=False)
        if sd in _INT:
            return np.array(raw, dtype=np.int64)
        if sd in _FP8:
            return self._dequant(name, raw, self._scale_for(name)).astype(dtype, copy=False)
        if sd == "BF16" and raw.size >= _THREADED_UPCAST and np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64)):
            from reference.numba_kernels import bf16_upcast   # Numba: only for tensors worth the threads
            return bf16_upcast(raw, dtype)
        return np.array(raw, dtype=dtype)

    # --- experts ------------------------------------------------------------------------
    def expert(self, layer: int, e: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Routed expert ``e`` of decoder layer ``layer`` (``"mtp"``: the MTP head's layer,
        ``mtp.layers.0.mlp.experts.*``): ``(gate [I, H], up [I, H], down [H, I])``.

        Reads either layout: per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what
        save_pretrained writes) or fused ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first,
        as ``Qwen4ExpTextExperts.forward`` chunks it) + ``mlp.experts.down_proj [E, H, I]``.

        Raises:
            InputError: layer or expert index out of range.  CheckpointError: tensors missing / mis-shaped.
        """
        cfg = self.config
        if layer == MTP_LAYER:
            m = "mtp.layers.0.mlp.experts."
        elif isinstance(layer, str) or not 0 <= layer < cfg.num_hidden_layers:
            raise InputError(f"expert(): layer: expected 0..{cfg.num_hidden_layers - 1} or {MTP_LAYER!r}, "
                             f"found {layer!r}")
        else:
            m = f"layers.{layer}.mlp.experts."
        if not 0 <= e < cfg.num_experts:
            raise InputError(f"expert(): expert: expected 0..{cfg.num_experts - 1}, found {e}")
        if self.has(f"{m}{e}.gate_proj.weight"):
            return (self.get(f"{m}{e}.gate_proj.weight", dtype), self.get(f"{m}{e}.up_proj.weight", dtype),
                    self.get(f"{m}{e}.down_proj.weight", dtype))
        if self.has(m + "gate_up_proj"):
            I = cfg.moe_intermediate_size
            gu_name, dn_name = m + "gate_up_proj", m + "down_proj"
            gu = self._expert_slice(gu_name, e, dtype)
            dn = self._expert_slice(dn_name, e, dtype)
            return gu[:I].copy(), gu[I:].copy(), dn
        raise self._missing(f"{m}{e}.gate_proj.weight")

    def _expert_slice(self, name: str, e: int, dtype) -> np.ndarray:
        raw = self.get_raw(name)
        sd = self.dtype(name)
        if sd in _FP8:
            sc = self._scale_for(name)
            if sc is None:
                return self._dequant(name, raw[e], None)
            s = np.asarray(self._raw(sc))
            if s.size == 1:
                return (raw[e].astype(np.float32) * s.astype(np.float32).reshape(())).astype(dtype)
            # block scales [E, rb, cb]: dequantise the one expert's slice
            w = raw[e].astype(np.float32)
            b0, b1 = self._block
            r, c = w.shape
            exp = (raw.shape[0], math.ceil(r / b0), math.ceil(c / b1))
            if tuple(s.shape) != exp:
                raise CheckpointError(f"{self._source()}: scale {sc!r} of FP8 tensor {name!r}: unexpected shape: "
                                      f"expected {list(exp)}, found {list(s.shape)}")
            full = np.repeat(np.repeat(s[e].astype(np.float32), b0, 0), b1, 1)[:r, :c]
            return (w * full).astype(dtype)
        return np.array(raw[e], dtype=dtype)

    # --- PLE n-gram table ---------------------------------------------------------------
    def _table(self, layer: int) -> _NgramTable:
        if layer in self._tables:
            return self._tables[layer]
        cfg = self.config
        if layer not in cfg.ple_layers:
            raise InputError(f"ngram_rows(): layer {layer}: expected a PLE layer "
                             f"(0-based {list(cfg.ple_layers)}), found one without PLE")
        lay = cfg.ple_layout(layer)
        st = self._stored()
        full = _NGRAM_FULL.format(i=layer)
        base = full[:-len(".weight")]
        if full in st:
            shards = [full]
        else:
            idx = sorted(int(m.group(3)) for n in st if (m := _NGRAM_SHARD_RE.match(n)) and int(m.group(2)) == layer)
            if not idx:
                raise self._missing(full)
            if idx != list(range(len(idx))):
                gaps = sorted(set(range(max(idx) + 1)) - set(idx))
                raise CheckpointError(f"{self._source()}: n-gram table of layer {layer}: expected shards "
                                      f"0..{max(idx)} in sequence, found missing shard(s) {gaps[:10]}")
            shards = [f"{base}.shard_{k}.weight" for k in idx]
        starts = [0]
        for s in shards:
            shp = st[s][1]
            self._check_shape(s, shp)
            if st[s][0] not in DTYPES or st[s][0] in _INT:
                raise CheckpointError(f"{self._source()}: tensor {s!r}: expected a float dtype, found {st[s][0]}")
            starts.append(starts[-1] + shp[0])
        if starts[-1] != lay.padded_rows:
            raise CheckpointError(f"{self._source()}: n-gram table of layer {layer}: unexpected shape: expected "
                                  f"{lay.padded_rows} rows in total (padded prime head sizes from config.json), "
                                  f"found {starts[-1]} over {len(shards)} shard(s)")
        scale = None
        for c in (base + ".weight_scale", base + ".weight_scale_inv"):
            if c in st:
                scale = c
        t = _NgramTable(layer, tuple(shards), np.asarray(starts, dtype=np.int64), lay.head_dim, scale)
        self._tables[layer] = t
        return t

    def ngram_rows(self, layer: int, rows) -> np.ndarray:
        """Gather rows of PLE layer ``layer``'s n-gram table without materialising it.

        Args:
            layer: 0-based decoder layer with PLE.
            rows: int array ``[...]`` of global row ids (head offsets already added).
        Returns:
            float32 ``[..., head_dim]``; BF16 upcast exactly, FP8 times its per-shard or table scale.
        Raises:
            InputError: not a PLE layer, or a row outside ``[0, padded_rows)``.
            CheckpointError: table missing, shards out of sequence, rows not summing to the padded size.
        """
        t = self._table(layer)
        r = np.asarray(rows)
        if r.dtype.kind not in "iu":
            raise InputError(f"ngram_rows(): rows: expected an integer array, found dtype {r.dtype}")
        flat = r.reshape(-1).astype(np.int64)
        total = int(t.starts[-1])
        if flat.size and (flat.min() < 0 or flat.max() >= total):
            bad = flat[(flat < 0) | (flat >= total)][:5]
            raise InputError(f"ngram_rows(): layer {layer}: rows: expected ids in [0, {total}), found {bad.tolist()}")
        out = np.empty((flat.size, t.head_dim), dtype=np.float32)
        which = np.searchsorted(t.starts, flat, side="right") - 1
        for k in np.unique(which):
            sel = np.nonzero(which == k)[0]
            name = t.shards[int(k)]
            raw = self._gather(name, flat[sel] - t.starts[k])
            if self.dtype(name) in _FP8:
                out[sel] = raw.astype(np.float32) * np.float32(self.ngram_shard_scale(name))
            else:
                out[sel] = raw.astype(np.float32)
        return out.reshape(r.shape + (t.head_dim,))

    def ngram_shard_scale(self, name: str) -> float:
        """The per-tensor dequantisation scale of FP8 n-gram table shard ``name`` (official FP8 release:
        one ``ngram_embedding.weight_scale`` for the whole table).

        Raises:
            CheckpointError: no scale tensor, or one that is not a single value.
        """
        sc = self._scale_for(name)
        if sc is None:
            raise CheckpointError(f"{self._source()}: FP8 n-gram shard {name!r}: expected a scale "
                                  f"(ngram_embedding.weight_scale), found none")
        s = np.asarray(self._raw(sc)).astype(np.float32)
        if s.size != 1:
            raise CheckpointError(f"{self._source()}: scale {sc!r}: expected one per-tensor value, found "
                                  f"shape {list(s.shape)}")
        return float(s.reshape(()))

    # --- checks, identity, overrides --------------------------------------------------------
    def validate(self, *, require_complete: bool = True) -> list[str]:
        """Check every stored text tensor's shape against the config (reads headers only) and, with
        ``require_complete``, that every required tensor is present. Returns the stored names the
        model does not know (other than MTP / vision / scales).

        Raises:
            CheckpointError: the first missing or mis-shaped tensor.
        """
        st = self._stored()
        unknown = []
        for n, (_dt, shp) in st.items():
            if self._is_model_tensor(n):
                self._check_shape(n, shp)
            elif not self._is_optional(n):
                unknown.append(n)
        if require_complete:
            for n in _iter_required(self.config, st):
                if n not in st:
                    raise self._missing(n)
            for layer in self.config.ple_layers:
                self._table(layer)
        return unknown

    def _is_model_tensor(self, name: str) -> bool:
        """The text model (or the MTP head) reads ``name``: a shape is expected for it."""
        return expected_shape(self.config, name, self._expected) is not None or bool(_NGRAM_SHARD_RE.match(name))

    @staticmethod
    def _is_optional(name: str) -> bool:
        """Known and optional though no shape is listed: anything of the MTP head or the vision tower, and the
        quantisation scales (FP8 ``weight_scale_inv`` / ``weight_scale``, NVFP4 ``weight_scale_2`` /
        ``input_scale``)."""
        return name.startswith(("mtp.", "visual.")) or name.endswith(("_scale_inv", "_scale", "_scale_2"))

    def unused_names(self) -> list[str]:
        """Stored canonical names the model does not use (neither a text-model or MTP tensor nor a known optional
        one: vision tower, quantisation scales), sorted. Reads names only; the tensors are ignored."""
        return sorted(n for n in self._stored() if not (self._is_model_tensor(n) or self._is_optional(n)))

    def has_mtp(self) -> bool:
        """True when the checkpoint carries the MTP head (``mtp.*``, plain or ``model.``-prefixed names).

        Raises:
            CheckpointError: some ``mtp.*`` tensors are stored but a required one is missing (a partial head).
        """
        st = self._stored()
        if not any(n.startswith("mtp.") for n in st):
            return False
        fused = "mtp.layers.0.mlp.experts.gate_up_proj" in st
        for n in mtp_expected_shapes(self.config):
            if ".mlp.experts." in n and not fused:
                continue
            if n.endswith(".bias"):
                continue
            if n not in st:
                raise self._missing(n)
        if not fused:
            for e in range(self.config.num_experts):
                for w in ("gate", "up", "down"):
                    if f"mtp.layers.0.mlp.experts.{e}.{w}_proj.weight" not in st:
                        raise self._missing(f"mtp.layers.0.mlp.experts.{e}.{w}_proj.weight")
        return True

    def with_override(self, name: str, array: np.ndarray) -> "_WeightsBase":
        """A patched view: ``name`` reads as ``array`` (shape-checked against the config), the rest as here.
        Used for perturbation controls; this object is not modified.

        Raises:
            CheckpointError: ``array`` has the wrong shape for ``name``.
        """
        return _OverrideView(self, {name: np.asarray(array)})


class _OverrideView(_WeightsBase):
    def __init__(self, base: _WeightsBase, overrides: dict[str, np.ndarray]):
        self.config = base.config
        self._base = base
        self._init_common()
        self._block = base._block
        self._ov = dict(getattr(base, "_ov", {}))
        if isinstance(base, _OverrideView):
            self._base = base._base
        for n, a in overrides.items():
            exp = expected_shape(self.config, n, self._expected)
            if not self._base.has(n) and exp is None:
                raise self._base._missing(n)
            if exp is None and self._base.has(n):
                exp = self._base.shape(n)
            if exp is not None and tuple(a.shape) != tuple(exp):
                raise CheckpointError(f"with_override({n!r}): expected shape {list(exp)}, found {list(a.shape)}")
            self._ov[n] = a
        st = dict(self._base._stored())
        for n, a in self._ov.items():
            m = re.match(r"^(layers\.\d+\.ple\.ple_embedding\.ngram_embedding)\.weight$", n)
            if m:  # a whole-table override replaces the shards
                st = {k: v for k, v in st.items() if not k.startswith(m.group(1) + ".")}
            st[n] = (_st_dtype_name(a), tuple(a.shape))
        self._st = st

    def _source(self) -> str:
        return self._base._source() + f" (+{len(self._ov)} override(s))"

    def _stored(self):
        return self._st

    def _raw(self, name):
        if name in self._ov:
            return self._ov[name]
        return self._base._raw(name)

    def _gather(self, name, rows):
        if name in self._ov:
            return np.asarray(self._ov[name])[rows]
        return self._base._gather(name, rows)

    def fingerprint(self) -> str:
        """32 hex chars of SHA-256 over the base checkpoint's fingerprint and every override's name, dtype,
        shape and bytes (in name order): changes whenever an override does."""
        h = hashlib.sha256(self._base.fingerprint().encode())
        for n in sorted(self._ov):
            a = np.ascontiguousarray(self._ov[n])
            h.update(n.encode() + str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
        return h.hexdigest()[:32]


# --------------------------------------------------------------------------- in-memory weights
class DictWeights(_WeightsBase):
    """The :class:`Checkpoint` interface over in-memory arrays (tests, perturbation controls).

    Args:
        config: the :class:`ModelConfig`.
        arrays: ``{name: ndarray}``; names canonical or with a ``model.`` / ``model.language_model.`` prefix.
    Raises:
        CheckpointError: a name given twice (after prefix removal) or an unsupported dtype.
    """

    def __init__(self, config: ModelConfig, arrays: dict[str, np.ndarray]):
        self.config = config
        self._arrays: dict[str, np.ndarray] = {}
        for k, v in arrays.items():
            c = canonical_name(k)
            if c in self._arrays:
                raise CheckpointError(f"DictWeights: tensor {c!r} given twice (as {k!r} and another prefix form)")
            a = np.asarray(v)
            _st_dtype_name(a)
            self._arrays[c] = a
        self._st = {k: (_st_dtype_name(a), tuple(a.shape)) for k, a in self._arrays.items()}
        self._init_common()

    def _source(self) -> str:
        return "DictWeights"

    def _stored(self):
        return self._st

    def _raw(self, name):
        a = self._arrays[name]
        v = a.view()
        v.flags.writeable = False
        return v

    def fingerprint(self) -> str:
        """sha256 (32 hex chars) of the config hash and every tensor's name, dtype, shape and bytes."""
        h = hashlib.sha256(self.config.config_hash().encode())
        for n in sorted(self._arrays):
            a = np.ascontiguousarray(self._arrays[n])
            h.update(n.encode() + str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
        return h.hexdigest()[:32]

    @classmethod
    def from_checkpoint(cls, ck: "_WeightsBase") -> "DictWeights":
        """Copy every stored tensor of ``ck`` into memory (small models only)."""
        return cls(ck.config, {n: np.array(ck._raw(n)) for n in ck.names()})


class Checkpoint(_WeightsBase):
    """A lazily read safetensors checkpoint (see the module docstring). Open with :meth:`open`.

    Tensors are read when first asked for; :meth:`get_raw` returns a memory-mapped view, :meth:`get`
    a new array of the requested dtype, so peak memory stays near the tensor being read.
    Usable as a context manager (closes file descriptors and maps).
    """

    def __init__(self, root: Path, config: ModelConfig, entries: dict[str, _Entry], metadata: dict):
        self.root = root
        self.config = config
        self._entries = entries
        self.metadata = metadata
        self._st = {k: (v.dtype, v.shape) for k, v in entries.items()}
        self._maps: dict[Path, np.memmap] = {}
        self._fds: dict[Path, int] = {}
        self._init_common()

    # ---- construction
    @classmethod
    def open(cls, path: str | os.PathLike, *, report_unused: bool = True) -> "Checkpoint":
        """Open a checkpoint directory (config.json + model.safetensors, or shards listed by
        model.safetensors.index.json, or else every ``*.safetensors`` in it).

        Stored tensors the model does not use (:meth:`unused_names`) are ignored; with ``report_unused`` one note
        on stderr says so (their count and up to 5 of their stored names), once per checkpoint and process, when
        every required tensor is present (otherwise the missing one's error says what is wrong).

        Raises:
            ConfigError: config.json missing or invalid.
            CheckpointError: ``path`` is a file (not its directory) or nothing; no weights, an index
                naming a missing shard or tensor, a non-UTF-8 or invalid index, a truncated or corrupt
                file, or a tensor name present twice.
        """
        from reference.paths import check_checkpoint_dir
        root = check_checkpoint_dir(path, "checkpoint", CheckpointError)  # a file is never silently its parent
        config = load_config(root)
        index = root / "model.safetensors.index.json"
        files: list[Path]
        wanted: dict[str, str] | None = None
        if index.exists():
            from reference.textio import read_utf8
            text = read_utf8(index, str(index), "JSON file", CheckpointError)
            try:
                idx = json.loads(text)
            except ValueError as e:   # json.JSONDecodeError is a ValueError
                raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object, found unreadable content "
                                      f"({type(e).__name__}: {e})") from None
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict):
                found = (type(idx).__name__ if not isinstance(idx, dict) else
                         "no 'weight_map' key" if "weight_map" not in idx else f"'weight_map' as {type(wm).__name__}")
                raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object, found {found}")
            wanted = dict(wm)
            for n, fn in wanted.items():
                if not (isinstance(fn, str) and fn and Path(fn).name == fn):
                    raise CheckpointError(f"{index}: weight_map[{n!r}]: expected a shard file name (a string such as "
                                          f"'model-00001-of-00002.safetensors'), found {fn!r} ({type(fn).__name__})")
            files = sorted({root / f for f in wanted.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"{index}: names shard file(s) that do not exist: {missing[:5]}"
                                      f"{' ...' if len(missing) > 5 else ''} (expected them next to the index in {root})")
        elif (root / "model.safetensors").exists():
            files = [root / "model.safetensors"]
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{root}: expected model.safetensors, model.safetensors.index.json or "
                                      f"*.safetensors files, found none")
        entries: dict[str, _Entry] = {}
        metadata: dict = {}
        stored_seen: dict[str, Path] = {}
        for f in files:
            ents, meta = _parse_file(f)
            metadata.update(meta)
            for en in ents:
                c = canonical_name(en.stored_name)
                if c in entries:
                    raise CheckpointError(f"{root}: tensor {c!r} stored twice ({entries[c].stored_name!r} in "
                                          f"{entries[c].file.name} and {en.stored_name!r} in {f.name})")
                entries[c] = en
                stored_seen[en.stored_name] = f
        if wanted is not None:
            for n, fn in wanted.items():
                if stored_seen.get(n) != root / fn:
                    raise CheckpointError(f"{index}: tensor {n!r}: expected in {fn}, found "
                                          f"{'in ' + stored_seen[n].name if n in stored_seen else 'nowhere'}")
        ck = cls(root, config, entries, metadata)
        if report_unused:
            ck._note_unused()
        return ck

    def _source(self) -> str:
        return str(self.root)

    def _note_unused(self) -> None:
        """One note naming the stored tensors the model ignores: a checkpoint of another variant, or a converter
        writing extra tensors, would otherwise be accepted without a word."""
        from reference.notes import note_once, noted
        key = ("unused tensors", str(self.root.resolve()))
        if noted(key):  # a run opens one checkpoint several times: list its names once
            return
        unused = self.unused_names()
        # a checkpoint lacking a required tensor gets that error (naming its near names) when it is used; a note
        # before it would add a second message about the same mismatch (often the unused names are the culprits)
        if not unused or any(n not in self._st for n in _iter_required(self.config, self._st)):
            return
        shown = ", ".join(repr(self._entries[n].stored_name) for n in unused[:5])
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        note_once(key, f"{self.root}: {len(unused)} stored tensor(s) the model does not use, ignored: {shown}{more}")

    def _stored(self):
        return self._st

    # ---- file access
    def _map(self, path: Path) -> np.memmap:
        m = self._maps.get(path)
        if m is None:
            m = np.memmap(path, dtype=np.uint8, mode="r")
            self._maps[path] = m
        return m

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            self._fds[path] = fd
        return fd

    def _dt(self, en: _Entry, name: str) -> np.dtype:
        if en.dtype not in DTYPES:
            raise CheckpointError(f"{self.root}: tensor {name!r} in {en.file.name}: unknown dtype: expected one of "
                                  f"{sorted(DTYPES)}, found {en.dtype!r}")
        return DTYPES[en.dtype]

    def _raw(self, name: str) -> np.ndarray:
        en = self._entries[name]
        dt = self._dt(en, name)
        if en.nbytes == 0:
            return np.zeros(en.shape, dtype=dt)
        buf = self._map(en.file)[en.start:en.start + en.nbytes]
        return buf.view(dt).reshape(en.shape)

    def _gather(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a 2-D stored tensor through ``os.preadv`` into one buffer: no map, flat RSS."""
        en = self._entries[name]
        dt = self._dt(en, name)
        row_bytes = en.shape[1] * dt.itemsize
        out = np.empty((rows.size, en.shape[1]), dtype=dt)
        mv = memoryview(out.view(np.uint8).reshape(-1))
        fd = self._fd(en.file)
        order = np.argsort(rows, kind="stable")
        for j in order.tolist():
            off = en.start + int(rows[j]) * row_bytes
            got = os.preadv(fd, [mv[j * row_bytes:(j + 1) * row_bytes]], off)
            if got != row_bytes:
                raise CheckpointError(f"{en.file}: truncated file: short read of {name!r} row {int(rows[j])}")
        return out

    def close(self) -> None:
        """Release memory maps and file descriptors (views handed out keep their map alive)."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _file_key(self, name: str) -> str:
        """``name`` (canonical) as this checkpoint's files spell it: the stored key where it is stored, else the
        prefix its files give that part of the model (the most common one among the stored names of the same
        top-level module, else of the text trunk), so that a missing tensor is named as the file would hold it."""
        en = self._entries.get(name)
        if en is not None:
            return en.stored_name
        top = name.split(".", 1)[0]
        same: dict[str, int] = {}
        trunk: dict[str, int] = {}
        for c, e in self._entries.items():
            prefix = e.stored_name[:len(e.stored_name) - len(c)]
            t = c.split(".", 1)[0]
            if t == top:
                same[prefix] = same.get(prefix, 0) + 1
            if t not in ("lm_head", "mtp", "visual"):
                trunk[prefix] = trunk.get(prefix, 0) + 1
        if same:
            return max(same, key=same.get) + name
        if top in ("lm_head", "mtp"):  # the official layouts store both outside the text model's prefix
            return name
        if top == "visual":
            return "model." + name
        if trunk:
            return max(trunk, key=trunk.get) + name
        # nothing stored to copy from: the official layout of this config (the multimodal wrapper nests the text)
        return ("model.language_model." if isinstance((self.config.source or {}).get("text_config"), dict)
                else "model.") + name

    def stored_name(self, name: str) -> str:
        """The name as written in the file (with its prefix)."""
        if name not in self._entries:
            raise self._missing(name)
        return self._entries[name].stored_name

    def fingerprint(self) -> str:
        """Cheap weights identity (32 hex chars): sha256 over the config hash and, per canonical tensor, its
        name, dtype, shape and up to 3 x 64 sampled bytes (start, middle, end). Independent of the name
        prefix and of the split into files; comparable between Checkpoints (DictWeights hash all bytes)."""
        h = hashlib.sha256(self.config.config_hash().encode())
        for n in sorted(self._entries):
            en = self._entries[n]
            h.update(f"{n}|{en.dtype}|{list(en.shape)}|{en.nbytes}".encode())
            if en.nbytes:
                fd = self._fd(en.file)
                for off in sorted({0, max(0, en.nbytes // 2 - 32), max(0, en.nbytes - 64)}):
                    h.update(os.pread(fd, min(64, en.nbytes - off), en.start + off))
        return h.hexdigest()[:32]
