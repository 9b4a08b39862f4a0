"""``qwen4exp slice``: cut a qwen4exp checkpoint into a small one that is still a valid qwen4exp model.

What a slice keeps (everything else is copied byte for byte, in its stored dtype -- BF16, FP8 with its
scales, NVFP4's packed bytes and scales: no tensor is decoded, so any layout the reader can open slices):

* the first ``layers`` decoder layers (``num_hidden_layers``, ``layer_types`` cut; ``ple_layer_ids`` keeps the
  1-based ids <= N, in order, so each kept PLE layer keeps its ``ple_layer_index`` and hence its hash
  multipliers and table layout); the final ``hyper_connection_mixer``, ``embed_tokens`` and ``lm_head``;
  the vision tower as stored. The MTP head (``mtp.*``) is dropped (it reads the LAST trunk layer's output,
  which a slice changes) and ``mtp_num_hidden_layers`` set to 0 where present.
* optionally a subset of routed experts (``experts``: a count -- the first k -- or a list of ids): per-expert
  tensors (and their ``weight_scale_inv`` / ``weight_scale``) are kept and renumbered 0..k-1, fused
  ``gate_up_proj`` / ``down_proj`` (and their scales) are cut on the expert axis, the router
  ``mlp.gate.weight`` keeps those rows (a router with FP8 block scales is refused: its rows share scales);
  ``num_experts`` = k, ``num_experts_per_tok`` clipped to k (``SlicePlan.changed`` says so). Ids are kept in
  ascending order whatever order they are given in; an id given twice is refused. The router's softmax then runs over the kept
  experts only: a different (valid) model, with the real router rows and margins among those experts.
* optionally a subset of the vocabulary (``vocab``: a count -- ids 0..n-1 -- or a list of ids; the EOS, PAD and
  BOS ids of config.json / generation_config.json and every added (special) token are always kept): rows of
  ``embed_tokens`` / ``lm_head`` are kept in id order and renumbered 0..n-1; ``tokenizer.json`` keeps those
  tokens (ids renumbered), the BPE merges whose two parts and result all survive, and the added tokens;
  ``tokenizer_config.json``'s ``added_tokens_decoder`` and the config / generation config token ids are
  renumbered the same way. A row-sliced tensor with FP8 block scales is refused (rows share scales).

What the PLE n-gram hash needs: the hash of an n-gram mixes the raw token ids (``id * multiplier`` xor ...)
and its multipliers depend on ``vocab_size`` (``2 * (splitmix64(..) % ((2**63 - 1) // vocab_size // 2)) + 1``,
``_build_layer_multipliers``); the tables' sizes depend only on ``ngram_vocab_size_base``, the heads and the
PLE layer index. So the layer and expert cuts keep the PLE function exactly, while a vocabulary subset
(renumbered ids, smaller ``vocab_size``) keeps the tables whole but makes the same text hash to other rows of
them: the slice is a valid model with the real tables, not the original's n-gram features. The stored
``layer_multipliers`` buffers are rewritten from the new config (transformers loads stored buffers over its
derived ones; the reference derives them), so both read the slice the same way.

The source is read through ``reference.checkpoint.Checkpoint``'s memory maps and written shard by shard
(one output shard per source shard holding kept tensors), each tensor streamed in row blocks: memory stays
near one block whatever the checkpoint's size. Everything is built in a temporary directory next to the
output and renamed into place (``reference.atomic.atomic_dir``); the result is opened and validated before
it is published.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reference.errors import InputError, UserError
from reference.safetensors_file import StreamedTensor, write_streamed

__all__ = ["SliceError", "SlicePlan", "plan_slice", "slice_checkpoint"]

_BLOCK_BYTES = 64 << 20  # rows are streamed in blocks of about this many bytes
_PER_EXPERT_RE = re.compile(r"^(layers\.(\d+)\.mlp\.experts\.)(\d+)(\..+)$")
_FUSED_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv|_scale|)$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_WEIGHT_FILES = ("model.safetensors.index.json",)


class SliceError(UserError, ValueError):
    """A slice that cannot be made as asked (bad counts or ids, a quantisation layout rows cannot be cut from)."""


@dataclass
class SlicePlan:
    """What :func:`slice_checkpoint` will write. ``experts`` / ``vocab``: kept old ids in order (None: all)."""

    layers: int
    experts: list[int] | None
    vocab: list[int] | None
    config: dict = field(default_factory=dict)  # the new config.json document
    notes: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # config values changed beyond the cut asked for (top-k)


def _text(doc: dict) -> dict:
    return doc["text_config"] if isinstance(doc.get("text_config"), dict) else doc


def _ids_of(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def _keep_list(spec, total: int, what: str, always=(), repeats: bool = True) -> list[int] | None:
    """A count (the first n) or a list of ids -> sorted unique kept ids (with ``always`` added), or None.
    ``repeats`` False: an id given twice is refused (a list that should name k distinct ids)."""
    if spec is None:
        return None
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if not 1 <= int(spec) <= total:
            raise SliceError(f"slice {what}: expected a count in 1..{total}, found {int(spec)}")
        ids = list(range(int(spec)))
    else:
        try:
            ids = [int(x) for x in spec]
        except (TypeError, ValueError):
            raise SliceError(f"slice {what}: expected a count or a list of ids, found {spec!r}") from None
        if not ids:
            raise SliceError(f"slice {what}: expected at least one id, found none")
        bad = [i for i in ids if not 0 <= i < total]
        if bad:
            raise SliceError(f"slice {what}: expected ids in [0, {total}), found {bad[:5]}")
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice and not repeats:
            raise SliceError(f"slice {what}: expected each id once, found {twice[:5]} given more than once "
                             f"(in {','.join(map(str, ids))})")
    return sorted(set(ids) | {int(a) for a in always if a is not None and 0 <= int(a) < total})


def plan_slice(src, *, layers: int | None = None, experts=None, vocab=None) -> SlicePlan:
    """The plan (kept layers, experts, vocabulary and the new config) of a slice of checkpoint ``src``.

    Args:
        layers: keep decoder layers 0..layers-1 (None: all).
        experts: None, a count k (experts 0..k-1) or a list of expert ids.
        vocab: None, a count n (ids 0..n-1) or a list of token ids; special ids are always added.
    Raises:
        SliceError: counts or ids out of range. ConfigError: an invalid config.json.
    """
    from reference.config import ModelConfig
    src = Path(src)
    doc = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg = ModelConfig.from_dict(_text(doc), where=str(src / "config.json"))
    n = cfg.num_hidden_layers if layers is None else int(layers)
    if not 1 <= n <= cfg.num_hidden_layers:
        raise SliceError(f"slice layers: expected 1..{cfg.num_hidden_layers} (num_hidden_layers), found {n}")
    ex = _keep_list(experts, cfg.num_experts, "experts", repeats=False)
    specials = _special_ids(src, doc)
    vo = _keep_list(vocab, cfg.vocab_size, "vocab", always=specials)
    new = json.loads(json.dumps(doc))
    t = _text(new)
    t["num_hidden_layers"] = n
    if t.get("layer_types") is not None:
        t["layer_types"] = list(t["layer_types"])[:n]
    if t.get("ple_layer_ids"):
        t["ple_layer_ids"] = [i for i in t["ple_layer_ids"] if int(i) <= n]
    notes = [f"layers 0..{n - 1} of {cfg.num_hidden_layers}"]
    for d in (new, t):
        if "mtp_num_hidden_layers" in d:
            d["mtp_num_hidden_layers"] = 0
    changed = []
    if ex is not None:
        t["num_experts"] = len(ex)
        top_k = int(t.get("num_experts_per_tok", cfg.num_experts_per_tok))
        if top_k > len(ex):
            t["num_experts_per_tok"] = len(ex)
            changed.append(f"num_experts_per_tok {top_k} -> {len(ex)}: a token cannot be routed to more experts "
                           f"than the {len(ex)} kept")
        renum = "0" if len(ex) == 1 else f"0..{len(ex) - 1} in that order"
        notes.append(f"experts {ex} of {cfg.num_experts}, renumbered {renum} (router softmax over these only)")
    if vo is not None:
        remap = {o: k for k, o in enumerate(vo)}
        t["vocab_size"] = len(vo)
        for d in ([new, t] if t is not new else [new]):
            for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
                if d.get(key) is not None:
                    v = d[key]
                    d[key] = [remap[int(x)] for x in v] if isinstance(v, list) else remap[int(v)]
        notes.append(f"vocabulary: {len(vo)} of {cfg.vocab_size} ids (renumbered; PLE n-grams hash to other rows)")
    ModelConfig.from_dict(_text(new), where="the sliced config")  # the slice's config must be valid
    return SlicePlan(n, ex, vo, new, notes, changed)


def _special_ids(src: Path, doc: dict) -> list[int]:
    """Token ids a vocabulary subset always keeps: config / generation-config EOS, PAD, BOS, and every added token."""
    out: list[int] = []
    for d in (doc, _text(doc)):
        for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
            out += _ids_of(d.get(k))
    g = src / "generation_config.json"
    if g.is_file():
        gd = json.loads(g.read_text(encoding="utf-8"))
        for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
            out += _ids_of(gd.get(k))
    tj = src / "tokenizer.json"
    if tj.is_file():
        out += [int(a["id"]) for a in json.loads(tj.read_text(encoding="utf-8")).get("added_tokens", [])]
    return out


# ----------------------------------------------------------------------------------------------- writing
def slice_checkpoint(src, dst, *, layers: int | None = None, experts=None, vocab=None,
                     overwrite: bool = False) -> SlicePlan:
    """Write the slice of checkpoint ``src`` (see the module docstring) to directory ``dst``.

    Returns the :class:`SlicePlan` that was written.
    Raises:
        SliceError: bad counts/ids, or a quantised tensor whose rows cannot be cut (FP8 block scales).
        InputError: ``dst`` exists and ``overwrite`` is false (or is a file / its parent is missing).
        CheckpointError / ConfigError: an unreadable source, or (never expected) an invalid result.
    """
    from reference.atomic import atomic_dir, check_output_path
    from reference.checkpoint import Checkpoint
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise InputError(f"slice: expected an output directory other than the source, found {str(dst)!r} for both")
    from reference.paths import check_output_spares_model
    check_output_spares_model(dst, src, "DST")
    check_output_path(dst, "dir", overwrite=overwrite, flag="DST")
    plan = plan_slice(src, layers=layers, experts=experts, vocab=vocab)
    ck = Checkpoint.open(src)
    try:
        jobs = _jobs(ck, plan)
        with atomic_dir(dst) as tmp:
            by_file: dict[Path, list] = {}
            for job in jobs:
                by_file.setdefault(job["file"], []).append(job)
            files = sorted(by_file)
            names = (["model.safetensors"] if len(files) == 1 else
                     [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])
            weight_map, total = {}, 0
            for f, out_name in zip(files, names):
                total += _write_shard(ck, tmp / out_name, by_file[f], ck.metadata)
                weight_map.update({j["out"]: out_name for j in by_file[f]})
            if len(files) > 1:
                (tmp / "model.safetensors.index.json").write_text(json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
            _copy_side_files(src, tmp, plan)
            # a slice that does not open as a qwen4exp model is never published; an unused tensor is the error
            # below, not a note
            with Checkpoint.open(tmp, report_unused=False) as out:
                unknown = out.validate()
            if unknown:
                raise SliceError(f"slice: the result holds tensors the sliced config does not know: {unknown[:5]}")
    finally:
        ck.close()
    return plan


def _jobs(ck, plan: SlicePlan) -> list[dict]:
    """One job per output tensor: source entry, output (stored) name, rows of the first axis to keep (None:
    all), or a replacement array (rewritten PLE multipliers)."""
    from reference.config import ModelConfig
    cfg_new = ModelConfig.from_dict(_text(plan.config))
    ex = plan.experts
    ex_map = None if ex is None else {o: k for k, o in enumerate(ex)}
    jobs = []
    for name, en in sorted(ck._entries.items()):
        if name.startswith("mtp."):
            continue
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= plan.layers:
            continue
        stored, rows, array = en.stored_name, None, None
        if ex is not None and (pm := _PER_EXPERT_RE.match(name)):
            e = int(pm.group(3))
            if e not in ex_map:
                continue
            new_canon = f"{pm.group(1)}{ex_map[e]}{pm.group(4)}"
            stored = stored[:len(stored) - len(name)] + new_canon
        elif ex is not None and _FUSED_RE.match(name):
            rows = ex
        elif ex is not None and re.match(r"^layers\.\d+\.mlp\.gate\.weight(_scale_inv|_scale)?$", name):
            rows = _rows_or_refuse(ck, name, en, ex, "router")
        elif plan.vocab is not None and name in ("embed_tokens.weight", "lm_head.weight",
                                                 "embed_tokens.weight_scale_inv", "lm_head.weight_scale_inv",
                                                 "embed_tokens.weight_scale", "lm_head.weight_scale"):
            rows = _rows_or_refuse(ck, name, en, plan.vocab, "vocabulary")
        elif name.endswith(".ple_embedding.layer_multipliers") and plan.vocab is not None:
            i = int(m.group(1))
            from reference.checkpoint import DTYPES
            array = np.asarray(cfg_new.ple_layout(i).multipliers, dtype=np.int64).astype(DTYPES[en.dtype])
        jobs.append({"file": en.file, "entry": en, "name": name, "out": stored, "rows": rows, "array": array})
    return jobs


def _rows_or_refuse(ck, name, en, rows, what):
    """``rows`` to keep of tensor ``name``; refuses FP8 block-scaled tensors (a block's rows share one scale)."""
    if name.endswith(("_scale_inv", "_scale")):
        if int(np.prod(en.shape)) == 1:
            return None  # one per-tensor scale: unchanged by a row cut
        raise SliceError(f"slice {what}: tensor {name!r} has block scales {list(en.shape)}: rows sharing a scale "
                         f"block cannot be cut apart (slice without this option, or dequantise first)")
    for sc in (name + "_scale_inv", name + "_scale", name.removesuffix(".weight") + ".weight_scale_inv"):
        if sc in ck._entries and int(np.prod(ck._entries[sc].shape)) > 1 and sc != name:
            raise SliceError(f"slice {what}: tensor {name!r} is quantised with block scales ({sc}): rows sharing "
                             f"a scale block cannot be cut apart (slice without this option, or dequantise first)")
    return rows


def _write_shard(ck, path: Path, jobs: list[dict], metadata: dict | None) -> int:
    """Write one safetensors shard (:func:`reference.safetensors_file.write_streamed`), streaming each
    tensor's kept rows from the source map in blocks. Returns the bytes of tensor data written."""
    out = []
    for j in sorted(jobs, key=lambda j: j["out"]):
        en = j["entry"]
        if j["array"] is not None:
            a = np.ascontiguousarray(j["array"])
            out.append(StreamedTensor(j["out"], en.dtype, a.shape, a.nbytes, (a,)))
            continue
        rows = j["rows"]
        shape = list(en.shape)
        row_bytes = en.nbytes // shape[0] if shape and shape[0] else en.nbytes
        if rows is not None:
            shape[0] = len(rows)
        nbytes = row_bytes * shape[0] if shape else en.nbytes
        out.append(StreamedTensor(j["out"], en.dtype, tuple(shape), nbytes, _row_blocks(ck, en, rows)))
    return write_streamed(path, out, metadata, atomic=False)  # inside the slice's atomic_dir


def _row_blocks(ck, en, rows):
    """The kept rows of source entry ``en`` (all when ``rows`` is None) as buffers of about _BLOCK_BYTES."""
    mm = ck._map(en.file)
    if not en.shape or not en.shape[0] or rows is None:
        for s in range(0, en.nbytes, _BLOCK_BYTES):
            yield memoryview(mm[en.start + s:en.start + min(en.nbytes, s + _BLOCK_BYTES)])
        return
    row_bytes = en.nbytes // en.shape[0]
    per = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    rows = np.asarray(rows, dtype=np.int64)
    for s in range(0, rows.size, per):
        blk = rows[s:s + per]
        if blk.size and np.all(np.diff(blk) == 1):  # a contiguous run: one slice of the map
            a = en.start + int(blk[0]) * row_bytes
            yield memoryview(mm[a:a + blk.size * row_bytes])
        else:
            view = mm[en.start:en.start + en.nbytes].reshape(en.shape[0], row_bytes)
            yield np.ascontiguousarray(view[blk])


def _copy_side_files(src: Path, dst: Path, plan: SlicePlan) -> None:
    """config.json (new), tokenizer / generation config (renumbered for a vocabulary subset), other files as is."""
    (dst / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n", encoding="utf-8")
    remap = None if plan.vocab is None else {o: k for k, o in enumerate(plan.vocab)}
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name == "config.json" or p.name.endswith(".safetensors") or p.name in _WEIGHT_FILES:
            continue
        if p.name.startswith("golden."):
            continue  # a fixture's expected outputs are the source's, not the slice's
        if remap is not None and p.name == "tokenizer.json":
            (dst / p.name).write_text(json.dumps(_slice_tokenizer(json.loads(p.read_text(encoding="utf-8")), remap),
                                                 ensure_ascii=False), encoding="utf-8")
        elif remap is not None and p.name == "tokenizer_config.json":
            d = json.loads(p.read_text(encoding="utf-8"))
            if isinstance(d.get("added_tokens_decoder"), dict):
                d["added_tokens_decoder"] = {str(remap[int(k)]): v for k, v in d["added_tokens_decoder"].items()
                                             if int(k) in remap}
            (dst / p.name).write_text(json.dumps(d, indent=2, ensure_ascii=False), encoding="utf-8")
        elif remap is not None and p.name == "generation_config.json":
            d = json.loads(p.read_text(encoding="utf-8"))
            for k in ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id"):
                if d.get(k) is not None:
                    d[k] = [remap[int(x)] for x in d[k]] if isinstance(d[k], list) else remap[int(d[k])]
            (dst / p.name).write_text(json.dumps(d, indent=2), encoding="utf-8")
        else:
            shutil.copy2(p, dst / p.name)


def _slice_tokenizer(tok: dict, remap: dict[int, int]) -> dict:
    """A tokenizers ``tokenizer.json`` reduced to the kept ids (renumbered): BPE / WordPiece / WordLevel vocab,
    the merges whose parts and result survive, the added tokens.

    Raises:
        SliceError: a tokenizer model this cannot reduce (Unigram / unknown), or a post-processor naming a
            special token id that is not kept.
    """
    model = tok.get("model") or {}
    kind = model.get("type")
    if kind not in ("BPE", "WordPiece", "WordLevel"):
        raise SliceError(f"slice vocab: tokenizer.json model type: expected BPE, WordPiece or WordLevel, found {kind!r}")
    vocab = {t: remap[i] for t, i in model["vocab"].items() if i in remap}
    model["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    if kind == "BPE":
        keep = []
        for m in model.get("merges", []):
            a, b = m if isinstance(m, list) else m.split(" ", 1)
            if a in vocab and b in vocab and (a + b) in vocab:
                keep.append(m)
        model["merges"] = keep
    tok["added_tokens"] = [{**a, "id": remap[int(a["id"])]} for a in tok.get("added_tokens", []) if int(a["id"]) in remap]
    pp = json.dumps(tok.get("post_processor"))
    if '"ids"' in pp:
        def fix(x):
            if isinstance(x, dict):
                return {k: ([remap[int(i)] for i in v] if k == "ids" and isinstance(v, list) else fix(v))
                        for k, v in x.items()}
            if isinstance(x, list):
                return [fix(v) for v in x]
            return x
        try:
            tok["post_processor"] = fix(tok["post_processor"])
        except KeyError as e:
            raise SliceError(f"slice vocab: the tokenizer's post-processor uses token id {e} which the vocabulary "
                             f"subset drops (add it to the kept ids)") from None
    return tok
