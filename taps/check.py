"""``qwen4exp taps check DIR``: validate a tap archive against its specification (docs/tap-archive.md), so an
engine written in any language can check the dumps it writes before tap-diff compares them with ours.

:func:`check_archive` reports every problem it finds (not only the first), each naming the file, tap or
field, what the format expects and what was found; warnings are things tap-diff copes with but a producer
should know (an index tap without its companion scores, files the manifest does not name, no token ids).
With a model (``--model``), tap shapes, layer indices and layer types are checked against its config and
the manifest's ``model.config_hash`` against the config's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from taps import registry
from taps.archive import FORMAT_NAME, FORMAT_VERSION, MANIFEST, check_manifest_schema, file_sha256, require_manifest

__all__ = ["CheckReport", "check_archive"]

#: registry dtype class -> the dtypes an archive may store for it
_DTYPES = {"float": ("float32", "float64"), "int64": ("int64",)}


@dataclass
class CheckReport:
    """What :func:`check_archive` found. ``ok``: no problem (warnings allowed)."""

    path: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    taps: int = 0
    rows: int = 0

    @property
    def ok(self) -> bool:
        """True when the archive conforms (no problems)."""
        return not self.problems

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"path": self.path, "ok": self.ok, "taps": self.taps, "rows": self.rows, "problems": self.problems,
                "warnings": self.warnings}


def check_archive(path, config=None, max_problems: int = 200) -> CheckReport:
    """Validate the tap archive directory ``path`` (see docs/tap-archive.md for every rule checked).

    Args:
        config: a :class:`reference.config.ModelConfig` to check shapes / layers / identity against (optional).
        max_problems: stop collecting after this many problems.
    Returns:
        A :class:`CheckReport`; never raises for a malformed archive.
    Raises:
        ArchiveError: ``path`` is not a directory or holds no manifest file (no archive to check).
    """
    p = Path(path)
    rep = CheckReport(str(p))
    mf = require_manifest(p)   # no manifest: no archive to check (an input error, as for every reader)
    bad = rep.problems.append
    try:
        m = json.loads(mf.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        bad(f"{MANIFEST}: expected UTF-8 JSON, found unreadable content ({e})")
        return rep
    if not isinstance(m, dict):
        bad(f"{MANIFEST}: expected a JSON object, found {type(m).__name__}")
        return rep
    if m.get("format") != FORMAT_NAME:
        bad(f"{MANIFEST} 'format': expected {FORMAT_NAME!r}, found {m.get('format')!r}")
    ver = m.get("format_version")
    if not (isinstance(ver, int) and not isinstance(ver, bool) and 1 <= ver <= FORMAT_VERSION):
        bad(f"{MANIFEST} 'format_version': expected an integer in 1..{FORMAT_VERSION}, found {ver!r}")
    for k in ("taps", "order"):
        if k not in m:
            bad(f"{MANIFEST}: expected the field {k!r}, found none")
    if rep.problems:
        return rep
    schema = check_manifest_schema(m)
    if schema:
        bad(f"{MANIFEST} {schema}")
        return rep
    rv = m.get("registry_version")
    if rv is not None and rv != registry.REGISTRY_VERSION:
        bad(f"{MANIFEST} 'registry_version': expected {registry.REGISTRY_VERSION} (this tool's tap registry), "
            f"found {rv!r}")
    ids = m.get("token_ids")
    if ids is None:
        rep.warnings.append(f"{MANIFEST}: no 'token_ids': tap-diff cannot verify both runs saw the same tokens")
    _check_identity(m, config, rep)
    # a data file already reported by the 'chunks' check is not opened again (one fault, one line)
    files: dict[str, object] = dict.fromkeys(_check_chunks(p, m, rep))
    n_layers = None if config is None else config.num_hidden_layers
    for name in m["order"]:
        if len(rep.problems) >= max_problems:
            break
        t = m["taps"].get(name)
        if t is None:
            continue
        rep.taps += 1
        rep.rows += int(t["rows"])
        at = f"tap {name!r}"
        spec = registry.spec_for(name)
        if spec is None:
            near = sorted(s.pattern for s in registry.specs() if s.pattern.split(".")[-1] == name.split(".")[-1])
            bad(f"{at}: expected a registry tap name (qwen4exp taps list), found an unknown name"
                + (f"; patterns with that suffix: {near[:3]}" if near else ""))
            continue
        layer = registry.layer_of(name)
        if n_layers is not None and layer is not None and layer >= n_layers:
            bad(f"{at}: expected a layer index < num_hidden_layers={n_layers}, found {layer}")
            continue
        if config is not None and layer is not None:
            lt = config.layer_types[layer]
            if spec.layer_type in ("linear_attention", "indexed_attention") and spec.layer_type != lt:
                bad(f"{at}: expected a {spec.layer_type} layer, found layer {layer} is {lt}")
            if spec.layer_type == "ple" and layer not in config.ple_layers:
                bad(f"{at}: expected a PLE layer (0-based {list(config.ple_layers)}), found layer {layer}")
        if t.get("kind", "activation") != spec.kind:
            bad(f"{at}.kind: expected {spec.kind!r} (registry), found {t.get('kind')!r}")
        allowed = _DTYPES.get(spec.dtype, (spec.dtype,))
        if t["dtype"] not in allowed:
            bad(f"{at}.dtype: expected {' or '.join(allowed)} (registry: {spec.dtype}), found {t['dtype']!r}")
        ragged = "n_blocks" in spec.shape
        if bool(t.get("ragged", False)) != ragged:
            bad(f"{at}.ragged: expected {str(ragged).lower()} (registry shape {spec.shape}), found "
                f"{str(bool(t.get('ragged', False))).lower()}")
        want_ndim = len([d for d in spec.shape.strip()[1:-1].split(",")]) - 1
        if len(t["tail"]) != want_ndim:
            bad(f"{at}.tail: expected {want_ndim} dimension(s) after T (registry shape {spec.shape}), found "
                f"{t['tail']}")
        elif config is not None and not ragged:
            from taps.recorder import tap_row_shape
            want = list(tap_row_shape(spec, config, 1))
            if list(t["tail"]) != want:
                bad(f"{at}.tail: expected {want} ({spec.shape} for this model), found {t['tail']}")
        if spec.companion is not None:
            comp = spec.companion.replace("{i}", str(layer)) if layer is not None else spec.companion
            if comp not in m["taps"]:
                rep.warnings.append(f"{at}: its companion score tap {comp!r} is not recorded: tap-diff cannot tell "
                                    f"a near-tie flip from a selection error")
        _check_segments(p, name, t, files, ids, rep)
    _check_unlisted(p, m, rep)
    return rep


def _check_identity(m: dict, config, rep: CheckReport) -> None:
    model = m.get("model") or {}
    for k in ("config_hash", "weights_fingerprint"):
        if k in model and not isinstance(model[k], str):
            rep.problems.append(f"{MANIFEST} 'model'.{k}: expected a string, found {model[k]!r}")
    if config is not None and isinstance(model.get("config_hash"), str) and model["config_hash"] != config.config_hash():
        rep.problems.append(f"{MANIFEST} 'model'.config_hash: expected {config.config_hash()} (the given model), found "
                            f"{model['config_hash']}")
    ids = m.get("token_ids")
    if config is not None and ids:
        bad = [x for x in ids if x >= config.vocab_size]
        if bad:
            rep.problems.append(f"{MANIFEST} 'token_ids': expected ids < vocab_size={config.vocab_size}, found {bad[0]}")


def _check_chunks(p: Path, m: dict, rep: CheckReport) -> set[str]:
    """Check each data file against its 'chunks' entry (size, then checksum). Returns the files found missing,
    truncated, longer or altered: one problem line each, and nothing more is read from them (their segments
    would only repeat the same fault)."""
    broken: set[str] = set()
    for fname, want in (m.get("chunks") or {}).items():
        fp = p / fname
        if not fp.is_file():
            rep.problems.append(f"{fname}: listed in 'chunks', expected the file, found none")
            broken.add(fname)
            continue
        size = fp.stat().st_size
        if "bytes" in want and size != want["bytes"]:
            how = "truncated" if size < want["bytes"] else "longer than written"
            rep.problems.append(f"{fname}: expected {want['bytes']} bytes ('chunks'), found {size} ({how}; "
                                f"re-record the archive)")
            broken.add(fname)
        elif "sha256" in want:
            got, _ = file_sha256(fp)
            if got != want["sha256"]:
                rep.problems.append(f"{fname}: expected sha256 {want['sha256'][:16]}... ('chunks'), found {got[:16]}...")
                broken.add(fname)
    return broken


def _open_file(p: Path, fname: str, files: dict, rep: CheckReport):
    if fname in files:
        return files[fname]
    h = None
    fp = p / fname
    if not fp.is_file():
        rep.problems.append(f"{fname}: named by a segment, expected the file, found none")
    else:
        try:
            from safetensors import safe_open
            h = safe_open(str(fp), framework="np")
        except Exception as e:  # noqa: BLE001 - safetensors' own error types
            rep.problems.append(f"{fname}: expected a safetensors file, found unreadable content ({e})")
    files[fname] = h
    return h


def _check_segments(p: Path, name: str, t: dict, files: dict, ids, rep: CheckReport) -> None:
    at = f"tap {name!r}"
    tail = list(t["tail"])
    for k, sg in enumerate(t["segments"]):
        h = _open_file(p, sg["file"], files, rep)
        if h is None:
            continue
        where = f"{at} segment {k} ({sg['file']}:{sg['key']})"
        keys = set(h.keys())
        for key in (sg["key"], sg["key"] + ".pos"):
            if key not in keys:
                rep.problems.append(f"{where}: expected the tensor {key!r} in {sg['file']}, found none")
        if sg["key"] not in keys or sg["key"] + ".pos" not in keys:
            continue
        try:
            data = h.get_slice(sg["key"])
            shape, dtype = list(data.get_shape()), _st_to_np(data.get_dtype())
            pos = np.asarray(h.get_tensor(sg["key"] + ".pos"))
        except Exception as e:  # noqa: BLE001
            rep.problems.append(f"{where}: unreadable tensor ({type(e).__name__}: {e})")
            continue
        if dtype != t["dtype"]:
            rep.problems.append(f"{where}: expected dtype {t['dtype']} (manifest), found {dtype}")
        want = [sg["rows"], *tail]
        ok = (len(shape) == len(want) and shape[:-1] == want[:-1] and shape[-1] <= want[-1]) if t.get("ragged") \
            else shape == want
        if not ok:
            rep.problems.append(f"{where}: expected shape {want}{' (last dim at most)' if t.get('ragged') else ''}, "
                                f"found {shape}")
        if pos.dtype != np.int64 or pos.ndim != 1 or len(pos) != sg["rows"]:
            rep.problems.append(f"{where}.pos: expected int64 [{sg['rows']}], found {pos.dtype} {list(pos.shape)}")
            continue
        if len(pos) and pos.min() < 0:
            rep.problems.append(f"{where}.pos: expected absolute positions >= 0, found {int(pos.min())}")
        if ids is not None and len(pos) and pos.max() >= len(ids):
            rep.problems.append(f"{where}.pos: expected positions < len(token_ids)={len(ids)}, found {int(pos.max())}")
        if t.get("kind") == "index" and ok:
            v = np.asarray(h.get_tensor(sg["key"]))
            if v.size and v.min() < -1:
                rep.problems.append(f"{where}: expected index values >= -1 (-1 = padding), found {int(v.min())}")


def _check_unlisted(p: Path, m: dict, rep: CheckReport) -> None:
    named = {sg["file"] for t in m["taps"].values() for sg in t["segments"]} | set(m.get("chunks") or {})
    for f in sorted(p.iterdir()):
        if f.name != MANIFEST and f.name not in named:
            rep.warnings.append(f"{f.name}: a file the manifest does not name (ignored by readers)")


def _st_to_np(st: str) -> str:
    return {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
            "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}.get(st, st)
