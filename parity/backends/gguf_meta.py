"""A GGUF file's metadata (its key/value header) and the check that it is a conversion of the checkpoint MODEL.

``--backend llama.cpp:gguf=PATH`` runs the user's own GGUF while MODEL gives the config and the truth: a GGUF
of another model would be judged against the wrong reference. :func:`check_gguf_matches` compares the
header's architecture, layer count, hidden size and vocabulary size with MODEL's config.json before llama.cpp
loads anything, and refuses a mismatch naming each key, the expected and the found value.

The header is read with the ``gguf`` package (llama.cpp's gguf-py) when it is importable, else by
:func:`read_header` here (GGUF versions 2 and 3, little-endian: the layout of gguf-py's ``GGUFReader``); both
give the same :class:`GGUFMeta`. A file the ``gguf`` package cannot read because it ends inside its tensor data is
refused naming the first tensor cut short (:func:`check_tensor_data`).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from reference.errors import InputError

#: the architecture name llama.cpp's converter writes for qwen4_exp (``general.architecture``)
GGUF_ARCH = "qwen4exp"

_MAGIC = b"GGUF"
# GGUF value types: id -> struct format of a scalar (8 string, 9 array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFMeta:
    """A GGUF header's key/value metadata.

    Attributes:
        version: the GGUF format version.
        values: scalar and string values by key.
        array_lengths: the number of items of each array-valued key (e.g. ``tokenizer.ggml.tokens``).
    """

    version: int
    values: dict = field(default_factory=dict)
    array_lengths: dict = field(default_factory=dict)


class _Header:
    def __init__(self, f, path: str):
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise InputError(f"GGUF {self.path!r}: expected a complete GGUF header, found the file ending at byte "
                             f"{self.f.tell()}")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.f.seek(self.unpack("<Q"), 1)
        elif vtype in _SCALARS:
            self.f.seek(struct.calcsize(_SCALARS[vtype]), 1)
        else:
            raise InputError(f"GGUF {self.path!r}: expected a GGUF value type, found {vtype} at byte {self.f.tell()}")


def _read_kv(h: _Header) -> tuple[GGUFMeta, int]:
    """The magic, version and key/value metadata of the GGUF open in ``h``: ``(metadata, tensor count)``, the file
    left at the tensor-info table."""
    f, path = h.f, h.path
    magic = f.read(4)
    if magic != _MAGIC:
        raise InputError(f"GGUF {path!r}: expected a GGUF file (magic b'GGUF'), found {magic!r}")
    version = h.unpack("<I")
    if version not in (2, 3):
        raise InputError(f"GGUF {path!r}: expected GGUF version 2 or 3, found {version}")
    n_tensors = h.unpack("<Q")
    meta = GGUFMeta(version)
    for _ in range(h.unpack("<Q")):
        key = h.string()
        vtype = h.unpack("<I")
        if vtype == _ARRAY:
            itype, n = h.unpack("<I"), h.unpack("<Q")
            if itype in _SCALARS:
                f.seek(n * struct.calcsize(_SCALARS[itype]), 1)
            else:
                for _i in range(n):
                    h.skip_value(itype)
            meta.array_lengths[key] = int(n)
        elif vtype == _STRING:
            meta.values[key] = h.string()
        elif vtype in _SCALARS:
            meta.values[key] = h.unpack(_SCALARS[vtype])
        else:
            raise InputError(f"GGUF {path!r}: key {key!r}: expected a GGUF value type, found {vtype}")
    return meta, int(n_tensors)


def read_header(path) -> GGUFMeta:
    """The metadata of the GGUF at ``path``, read from its header with no dependency (versions 2 and 3).

    Raises:
        InputError: not a GGUF (magic), an unsupported version, or a truncated / malformed header.
    """
    path = str(path)
    with open(path, "rb") as f:
        return _read_kv(_Header(f, path))[0]


def check_tensor_data(path) -> None:
    """Refuse a GGUF whose file ends before the data its tensor-info table declares (a truncated download or
    copy), naming the first tensor cut short, the bytes it needs and where the file ends. The storage types'
    sizes come from the ``gguf`` package (``GGML_QUANT_SIZES``): without it, or for a type it does not know,
    nothing is checked (llama.cpp's loader then refuses the file itself).

    Raises:
        InputError: the header or tensor-info table is cut short, or a tensor's data runs past the end of the file.
    """
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h = _Header(f, path)
        meta, n_tensors = _read_kv(h)
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            dims = [h.unpack("<Q") for _d in range(h.unpack("<I"))]
            infos.append((name, dims, h.unpack("<I"), h.unpack("<Q")))
        align = int(meta.values.get("general.alignment") or 32)
        start = -(-f.tell() // align) * align   # the data section: the first aligned byte after the table
    for name, dims, ttype, offset in sorted(infos, key=lambda t: t[3]):
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            continue
        begin = start + offset
        end = begin + math.prod(dims) * type_size // block
        if end > size:
            raise InputError(f"GGUF {path!r}: tensor {name!r} ({qtype.name}, dims {dims}): expected its data at "
                             f"bytes {begin}..{end}, found the file ending at byte {size} (a truncated file: an "
                             f"incomplete download or copy)")


def unreadable_message(path, e: BaseException) -> str:
    """The one message for a GGUF the ``gguf`` package's reader raised ``e`` on: a truncated file named with its
    first cut tensor (:func:`check_tensor_data`), else what the reader said."""
    try:
        check_tensor_data(path)
    except InputError as cut:
        return str(cut)
    except OSError:
        pass
    return f"GGUF {str(path)!r}: expected a GGUF file, found {type(e).__name__}: {e}"


def read_metadata(path) -> GGUFMeta:
    """The metadata of the GGUF at ``path``: with the ``gguf`` package's ``GGUFReader`` when importable, else
    :func:`read_header`.

    Raises:
        InputError: the file is not a readable GGUF.
    """
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError:
        return read_header(path)
    try:
        rd = GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError / struct errors on a bad magic or a truncated file
        raise InputError(unreadable_message(path, e)) from e
    version = rd.fields.get("GGUF.version")
    meta = GGUFMeta(int(version.contents()) if version is not None else 0)
    for key, fld in rd.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the file header
            continue
        if fld.types and fld.types[0] == GGUFValueType.ARRAY:
            meta.array_lengths[key] = len(fld.data)
        else:
            v = fld.contents()
            meta.values[key] = v.item() if hasattr(v, "item") else v
    return meta


def gguf_mismatches(meta: GGUFMeta, cfg) -> list[str]:
    """What in ``meta`` disagrees with the checkpoint config ``cfg``: one ``key: expected E (...), found F`` per
    key (architecture, layer count, hidden size, vocabulary size); [] when the GGUF matches.

    The layer count expected is ``num_hidden_layers``, plus the GGUF's ``{arch}.nextn_predict_layers`` (MTP
    layers a converter may append) when it declares them; the vocabulary is ``{arch}.vocab_size`` or, without
    it, the number of ``tokenizer.ggml.tokens``.
    """
    out = []

    def judge(key, expected, what):
        found = meta.values.get(key, meta.array_lengths.get(key))
        if found != expected:
            out.append(f"{key}: expected {expected!r} ({what}), found "
                       + (repr(found) if found is not None else "no such key"))
    judge("general.architecture", GGUF_ARCH, "llama.cpp's name for qwen4_exp")
    arch = meta.values.get("general.architecture")
    if arch != GGUF_ARCH:  # the per-architecture keys below would be looked up under another name
        return out
    nextn = meta.values.get(f"{arch}.nextn_predict_layers") or 0
    judge(f"{arch}.block_count", cfg.num_hidden_layers + int(nextn),
          "config.json num_hidden_layers" + (f" + {arch}.nextn_predict_layers {nextn}" if nextn else ""))
    judge(f"{arch}.embedding_length", cfg.hidden_size, "config.json hidden_size")
    vkey = f"{arch}.vocab_size" if f"{arch}.vocab_size" in meta.values else "tokenizer.ggml.tokens"
    judge(vkey, cfg.vocab_size, "config.json vocab_size" + (", as the number of tokens" if vkey.startswith("tok")
                                                            else ""))
    return out


#: Rows of ``token_embd.weight`` compared with MODEL's embedding (a sample: the check must stay cheap at 248k rows).
EMBED_ROWS = 64

#: Relative L2 distance (over :data:`EMBED_ROWS` rows) beyond which the GGUF's token embedding is not MODEL's. A
#: faithful conversion differs by its storage format's rounding only (F32 / F16 / BF16 ~1e-3 and below; Q8_0
#: ~1e-2; the 4-bit k-quants ~1e-1); another model's embedding of the same shape is an independent matrix, at a
#: distance of ~sqrt(2) for two draws of one distribution and >= 1 whenever their scales differ (measured on
#: the bundled fixtures: 1.41). 0.5 sits between the two with margin on both sides.
EMBED_MISMATCH_REL = 0.5


def embedding_distance(path, model_path) -> float | None:
    """Relative L2 distance between the GGUF's ``token_embd.weight`` (dequantised by the ``gguf`` package) and
    MODEL's ``embed_tokens.weight`` over the first :data:`EMBED_ROWS` token rows, or None when it cannot be
    measured (no ``gguf`` package, no such tensor, a storage type the package cannot dequantise, other shapes:
    the header check still stands).

    Raises:
        nothing: an unreadable tensor is None (the header was read already).
    """
    try:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize

        from reference.checkpoint import Checkpoint
        t = next((t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight"), None)
        if t is None:
            return None
        ck = Checkpoint.open(str(model_path))
        shape = ck.shape("embed_tokens.weight")
        n = min(EMBED_ROWS, shape[0])
        if len(shape) != 2 or t.data.ndim != 2 or t.data.shape[0] != shape[0]:
            return None
        if ck.dtype("embed_tokens.weight") in ("BF16", "F16", "F32", "F64"):   # exact upcast of the sampled rows
            ref = np.asarray(ck.get_raw("embed_tokens.weight")[:n], np.float64)   # (memory-mapped: ~1 MB read)
        else:   # a scaled format: the whole tensor's dequantisation (block scales span rows)
            ref = np.asarray(ck.get("embed_tokens.weight", dtype=np.float32)[:n], np.float64)
        g = np.asarray(dequantize(t.data[:n], t.tensor_type), dtype=np.float64)   # the sampled rows only
        if g.shape != ref.shape:
            return None
        d = float(np.linalg.norm(g - ref))
        r = float(np.linalg.norm(ref))
        return d / r if r else (0.0 if d == 0 else float("inf"))
    except Exception:  # noqa: BLE001 - the identity check is best effort beyond the header
        return None


def storage_types(path) -> dict[str, int] | None:
    """How many of the GGUF's tensors each storage type holds (``{"F32": 120, "Q8_0": 44}``), read with the
    ``gguf`` package; None when it cannot be read (best effort: the header was checked already)."""
    try:
        from gguf import GGUFReader
        out: dict[str, int] = {}
        for t in GGUFReader(str(path)).tensors:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return dict(sorted(out.items()))
    except Exception:  # noqa: BLE001 - a report figure, never a reason to refuse
        return None


def rounding_finding(path, types) -> dict | None:
    """The engine finding of a GGUF that stores tensors in a format other than F32 (``types``: from
    :func:`storage_types`): llama.cpp then computes with weights rounded to that format, and the float32
    thresholds judge that rounding as a divergence (first where such a tensor is first used), which is the
    GGUF's doing, not llama.cpp's computation. None for an all-F32 GGUF or unknown types."""
    if not types:
        return None
    other = {k: v for k, v in types.items() if k != "F32"}
    if not other:
        return None
    n = sum(types.values())
    held = ", ".join(f"{v} as {k}" for k, v in other.items())
    return {"id": "gguf:weights-not-f32", "where": f"GGUF {str(path)!r}: {held} (of {n} tensors)",
            "message": f"the GGUF stores {held} of its {n} tensors: llama.cpp computes with those weights, rounded "
                       f"to that format unless MODEL's own are in it, and the float32 thresholds count that "
                       f"rounding as a divergence (first at the first tap that uses such a tensor); to judge "
                       f"llama.cpp's computation give a GGUF converted with --outtype f32, or leave gguf= out (the "
                       f"tool converts to f32)"}


def check_gguf_matches(path, cfg, model_path) -> GGUFMeta:
    """Refuse a GGUF that is not a conversion of the checkpoint ``model_path`` (config ``cfg``). Returns its
    metadata.

    Raises:
        InputError: the file is not a readable GGUF, or one error naming every mismatching key with the
            expected and the found value (:func:`gguf_mismatches`), or, the header matching, a token embedding
            that is not MODEL's (:func:`embedding_distance` beyond :data:`EMBED_MISMATCH_REL`).
    """
    meta = read_metadata(path)
    bad = gguf_mismatches(meta, cfg)
    if not bad:   # same shape: the weights themselves (another fixture of one shape would pass the header)
        rel = embedding_distance(path, model_path)
        if rel is not None and not rel <= EMBED_MISMATCH_REL:
            bad.append(f"token_embd.weight: expected MODEL's embed_tokens.weight up to the storage format's rounding "
                       f"(relative L2 distance <= {EMBED_MISMATCH_REL} over the first {EMBED_ROWS} rows), found "
                       f"{rel:.3g}")
    if bad:
        raise InputError(f"llama.cpp:gguf={str(path)!r}: the GGUF does not match MODEL {str(Path(model_path))!r}: "
                         + "; ".join(bad) + " (a GGUF of another model would be judged against the wrong reference)")
    return meta
