"""llama.cpp (CUDA) as the speed peer of the engine bench, on the same shapes in one run.

The same synthetic real-width checkpoint the engine bench uses (:func:`parity.bench.synthetic.cached_synthetic`:
one period = 3 GDN + 1 QSA layers by default) is converted by the trimmed llama.cpp tree's own converter
(:func:`parity.backends.gguf_convert.run_converter`; the synthetic checkpoint has no tokenizer files, so the GGUF
gets tokenizer model 'none' with ``vocab_size`` dummy tokens, which is all llama-bench needs: it feeds random ids)
to a BF16 GGUF, quantised by ``llama-quantize`` to Q8_0 and Q4_K_M. Each GGUF runs in ``llama-bench`` (prefill
512 / 4096 at depth 0, decode tg128 at depth 1024, i.e. decode at context 1024 as the engine's) and
``llama-batched-bench`` (16 sequences, each with its own 1024-token prompt, then decode); the engine runs
``qwen4exp bench --synthetic real-widths --backend engine --weights W`` on the same config for W = bf16 / fp8 /
nvfp4. The comparison pairs bf16 <-> BF16, fp8 <-> Q8_0, nvfp4 <-> Q4_K_M.

Subcommands (``python -m parity.bench.llamacpp_peer --help``):

    prepare   synthetic checkpoint -> BF16 GGUF -> Q8_0, Q4_K_M (+ manifest.json with each GGUF's tensor table)
    llama     llama-bench + llama-batched-bench on each GGUF (raw outputs and llama.cpp's stderr kept)
    engine    the engine bench on the same shapes, one process per weight format
    table     pair the two, check both ran the same model, ratios against the goals -> JSON + markdown
    run       llama + engine + table

The same-model check: llama.cpp's ``model_n_params`` (llama-bench JSON) less the PLE n-gram table must be within
1% of the engine's parameter count from its config's shapes (:func:`engine_params`, the same exclusion) -- the
table is left out on both sides because the engine's in-memory fp8 / nvfp4 weights hold it at the real size in
host memory (320M rows) while the GGUF carries the checkpoint's scaled-down table; the table is read a few rows
per token, not streamed. A mismatch refuses the ratio with a message naming both counts.

Goals: engine decode >= 1.5x llama.cpp's, prefill >= 2x, at comparable bytes per weight.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# llama.cpp's output formats (parsed in their own module; importable from here too)
from parity.bench.llamacpp_parse import (PeerInputError, llama_error, median, parse_batched_bench,  # noqa: F401
                                         parse_llama_bench, parse_quantize_log, read_json, read_text)
from reference.errors import InputError

#: engine weight format -> the llama.cpp type it is compared with (comparable bytes per weight: BF16 = 2 B,
#: FP8 block-scaled ~1.0 B vs Q8_0 1.07 B, NVFP4 experts 0.56 B vs Q4_K_M ~0.70 B at these shapes: its expert down
#: projections fall back to Q5_0 / Q8_0, 640 columns not being a multiple of 256; each run prints both sides)
PAIRS = {"bf16": "BF16", "fp8": "Q8_0", "nvfp4": "Q4_K_M"}
#: goal: engine / llama.cpp throughput ratio at least this
GOALS = {"decode": 1.5, "prefill": 2.0}
#: the same-model check's relative tolerance on the parameter counts (1%: the converter adds or drops only a few
#: small tensors -- the int64 PLE hash constants become metadata; a different depth or width is off by far more)
PARAMS_RTOL = 0.01
PROMPT_LENS = (512, 4096)
CONTEXT = 1024   # decode context (the engine bench's --contexts, llama-bench's -d)
BATCH = 16       # batched decode
TG = 128         # llama-bench decode tokens per repetition
BATCHED_TG = 64  # llama-batched-bench decode steps


# --------------------------------------------------------------------------------------------- the models

def engine_params(cfg_dict: dict) -> dict:
    """Parameter counts of the checkpoint ``cfg_dict`` describes (:func:`reference.checkpoint.expected_shapes`):
    ``total`` (every floating-point tensor; the int64 PLE hash constants are not parameters: the converter writes
    them as metadata), ``table`` (the PLE n-gram table) and ``compared`` = total - table (what the same-model check
    compares)."""
    import numpy as np

    from reference.checkpoint import expected_shapes
    from reference.config import ModelConfig
    cfg = ModelConfig.from_dict(cfg_dict, where="engine bench config")
    total = table = 0
    for name, shape in expected_shapes(cfg).items():
        n = int(np.prod(shape))
        if ".ple_embedding." in name and "ngram_embedding" not in name:
            continue  # layer_multipliers / ngram_heads_*: int64 hash constants
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        total += n
        if "ngram_embedding" in name:
            table += n
    return {"total": total, "table": table, "compared": total - table}


#: GGUF tensor name of the PLE n-gram table (gguf-py MODEL_TENSOR.PER_LAYER_TOKEN_EMBD)
GGUF_TABLE = "per_layer_token_embd.weight"
#: GGUF key of the per-layer QSA compress ratios (0 = llama.cpp builds that layer's attention dense)
GGUF_COMPRESS_RATIOS = "qwen4exp.attention.compress_ratios"


def qsa_check(cfg_dict: dict, found) -> dict:
    """Whether a GGUF's per-layer compress ratios (``found``) are the config's (``indexer_compress_ratio`` on each
    attention layer, 0 on GDN layers): llama.cpp builds an attention layer whose ratio is 0 as dense attention,
    not QSA (docs/outside-engines.md finding 6: its converter writes the ratio only for layer type
    'full_attention', and a transformers that knows qwen4_exp renames those to 'indexed_attention').
    ``{"expected", "found", "ok", "message"}``; :func:`patch_compress_ratios` makes a GGUF pass it."""
    exp = [int(cfg_dict["indexer_compress_ratio"]) if t != "linear_attention" else 0 for t in cfg_dict["layer_types"]]
    found = None if found is None else [int(x) for x in found]
    ok = found == exp
    msg = ("QSA as in the config (compress ratios " + str(exp) + ")" if ok else
           f"llama.cpp runs the QSA layers as DENSE attention: the GGUF's {GGUF_COMPRESS_RATIOS} is {found}, "
           f"expected {exp} (converter defect, docs/outside-engines.md finding 6): its attention cost is not QSA's")
    return {"expected": exp, "found": found, "ok": ok, "message": msg}


def gguf_summary(path, gguf_py=None) -> dict:
    """The tensor table of the GGUF at ``path`` (read with llama.cpp's own gguf-py; ``gguf_py``: its folder when
    not importable): ``n_params``, ``bytes``, ``table_params`` / ``table_bytes`` (:data:`GGUF_TABLE`), and
    ``by_type`` {type: {"tensors", "params", "bytes"}}.

    Raises:
        PeerInputError: gguf-py not found, or the file is not a GGUF.
    """
    if gguf_py and str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise PeerInputError(f"GGUF {str(path)!r}: expected llama.cpp's gguf-py importable (pass its folder), "
                             f"found {e}") from e
    if not Path(path).is_file():
        raise PeerInputError(f"GGUF: expected a file at {str(path)!r}, found nothing")
    try:
        rd = GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError / struct errors on a bad magic or a truncated file
        from parity.backends.gguf_meta import unreadable_message
        raise PeerInputError(unreadable_message(path, e)) from e
    out = {"n_params": 0, "bytes": 0, "table_params": 0, "table_bytes": 0, "by_type": {}}
    f = rd.fields.get(GGUF_COMPRESS_RATIOS)
    if f is not None:
        out["compress_ratios"] = [int(x) for x in f.contents()]
    for t in rd.tensors:
        ty = t.tensor_type.name
        d = out["by_type"].setdefault(ty, {"tensors": 0, "params": 0, "bytes": 0})
        d["tensors"] += 1
        d["params"] += int(t.n_elements)
        d["bytes"] += int(t.n_bytes)
        out["n_params"] += int(t.n_elements)
        out["bytes"] += int(t.n_bytes)
        if t.name == GGUF_TABLE:
            out["table_params"] += int(t.n_elements)
            out["table_bytes"] += int(t.n_bytes)
    return out


def patch_compress_ratios(path, want, gguf_py=None) -> list[int]:
    """Write ``want`` into the GGUF's :data:`GGUF_COMPRESS_RATIOS` array in place (same length; gguf-py's
    read-write memmap, as tests/parity/test_llamacpp.py's QSA fixture does). Returns the values it replaced.

    Raises:
        PeerInputError: the key is missing or has another length (nothing is written then).
    """
    if gguf_py and str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader
    r = GGUFReader(str(path), "r+")
    f = r.fields.get(GGUF_COMPRESS_RATIOS)
    if f is None or len(f.data) != len(want):
        raise PeerInputError(f"GGUF {str(path)!r}: expected {GGUF_COMPRESS_RATIOS} with {len(want)} entries, found "
                             f"{'none' if f is None else len(f.data)}")
    old = [int(x) for x in f.contents()]
    for i, part in enumerate(f.data):
        f.parts[part][0] = want[i]
    r.data.flush()
    del r
    return old


# ------------------------------------------------------------------------------------------ the comparison

def _engine_figures(doc: dict) -> dict:
    """{"prefill_512": tok/s, "prefill_4096", "decode_b1", "decode_b16", "params", "bytes_on_device", "error"} from
    one ``qwen4exp bench --out`` JSON (runs.engine)."""
    eng = (doc.get("runs") or {}).get("engine") or {}
    out: dict = {"error": eng.get("error")}
    for p in eng.get("prefill") or []:
        if p.get("prompt_len") in PROMPT_LENS and not p.get("projected"):
            out[f"prefill_{p['prompt_len']}"] = (p.get("tokens_per_s") or {}).get("median")
    for d in eng.get("decode") or []:
        if d.get("context") == CONTEXT and d.get("batch") in (1, BATCH) and not d.get("projected"):
            out[f"decode_b{d['batch']}"] = (d.get("tokens_per_s") or {}).get("median")
    cfg = ((eng.get("spec") or {}).get("synthetic") or {}).get("config")
    if cfg is None:  # a file checkpoint: its config.json
        path = ((doc.get("checkpoints") or {}).get("engine") or {}).get("path")
        if path and (Path(path) / "config.json").is_file():
            cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    out["params"] = engine_params(cfg) if cfg else None
    out["bytes_on_device"] = eng.get("weight_bytes_on_device")
    out["weights_format"] = eng.get("weights_format")
    return out


def _llama_figures(res: dict) -> dict:
    """The same figures from one GGUF's llama.cpp results (:func:`run_llama` output for one type)."""
    out: dict = {"errors": {}}
    lb = res.get("llama_bench") or {}
    rows = lb.get("rows") or []
    for P in PROMPT_LENS:
        r = [x for x in rows if x["n_prompt"] == P and x["n_gen"] == 0 and x["n_depth"] == 0]
        if r:
            out[f"prefill_{P}"] = r[0]["median_ts"]
        elif lb.get("error"):
            out["errors"][f"prefill_{P}"] = lb["error"]
        else:
            out["errors"][f"prefill_{P}"] = f"llama-bench printed no pp{P} row at depth 0"
    r = [x for x in rows if x["n_prompt"] == 0 and x["n_gen"] > 0 and x["n_depth"] == CONTEXT]
    if r:
        out["decode_b1"] = r[0]["median_ts"]
    else:
        out["errors"]["decode_b1"] = lb.get("error") or f"llama-bench printed no tg row at depth {CONTEXT}"
    bb = res.get("batched_bench") or {}
    b16 = [x["speed_tg"] for x in bb.get("rows") or [] if x["pl"] == BATCH and x["pp"] == CONTEXT]
    if b16:
        out["decode_b16"] = median(b16)
    else:
        out["errors"]["decode_b16"] = bb.get("error") or f"llama-batched-bench printed no B={BATCH} row"
    b1 = [x["speed_tg"] for x in bb.get("rows") or [] if x["pl"] == 1 and x["pp"] == CONTEXT]
    out["decode_b1_batched_bench"] = median(b1) if b1 else None
    if rows:
        out["model_n_params"], out["model_size"] = int(rows[0]["model_n_params"]), int(rows[0]["model_size"])
        out["model_type"] = rows[0].get("model_type")
        out["n_batch"], out["n_ubatch"] = rows[0].get("n_batch"), rows[0].get("n_ubatch")
    out["gguf"] = res.get("gguf")
    return out


def same_model(engine_params_: dict | None, llama: dict) -> dict:
    """The same-model check: llama.cpp's ``model_n_params`` (llama-bench; else the GGUF's tensor table, which
    llama.cpp sums the same way) less the GGUF's n-gram table vs the engine's ``compared`` count (``engine_params_``:
    :func:`engine_params`); ``{"ok", "engine", "llama", "rel", "message"}``; ``ok`` None when a count is missing
    (the ratio is then given, flagged by the message)."""
    n, src = llama.get("model_n_params"), "model_n_params"
    g = llama.get("gguf") or {}
    if n is None and g.get("n_params") is not None:  # llama-bench printed no row: the GGUF's own tensor table
        n, src = g["n_params"], "the GGUF's tensor table"
    table = g.get("table_params")
    if engine_params_ is None or n is None:
        return {"ok": None, "message": "no parameter count on " + ("the engine side" if engine_params_ is None
                                                                    else "the llama.cpp side (no llama-bench row)")}
    lc = n - (table or 0)
    e = engine_params_["compared"]
    rel = abs(lc - e) / max(e, 1)
    ok = rel <= PARAMS_RTOL
    msg = (f"same model: llama.cpp {lc:,} parameters ({src} {n:,} less the n-gram table {table or 0:,}) vs "
           f"the engine's {e:,} from its shapes ({rel:.2%} apart)")
    if not ok:
        msg = (f"ratio refused: expected both sides to run the same model (parameter counts within {PARAMS_RTOL:.0%},"
               f" n-gram table excluded), found llama.cpp {lc:,} vs the engine {e:,} ({rel:.1%} apart): the GGUF is "
               f"not the engine's shapes")
    return {"ok": ok, "engine": e, "llama": lc, "rel": rel, "message": msg}


#: (row key, label, goal kind)
ROWS = (("decode_b1", f"decode batch 1, context {CONTEXT}", "decode"),
        ("decode_b16", f"decode batch {BATCH}, context {CONTEXT}", "decode"),
        ("prefill_512", "prefill 512", "prefill"),
        ("prefill_4096", "prefill 4096", "prefill"))


def compare(engine_docs: dict, llama_results: dict) -> dict:
    """The comparison document: for each pair of :data:`PAIRS` present on either side, the four figures of
    :data:`ROWS` (engine tok/s, llama.cpp tok/s, ratio engine / llama.cpp, goal, met), bytes per weight of both
    sides and the same-model check. A ratio is None, with the reason in ``note``, when a side has no figure
    (llama.cpp's own error is quoted) or the same-model check failed.

    Args:
        engine_docs: weight format -> one ``qwen4exp bench --out`` JSON.
        llama_results: llama.cpp type -> :func:`run_llama` result for that GGUF.
    """
    pairs = []
    for fmt, qt in PAIRS.items():
        if fmt not in engine_docs and qt not in llama_results:
            continue
        e = _engine_figures(engine_docs[fmt]) if fmt in engine_docs else {"error": "the engine bench did not run"}
        lres = llama_results.get(qt)
        lf = _llama_figures(lres) if lres is not None else {"errors": {k: "llama.cpp did not run" for k, *_ in ROWS}}
        chk = same_model(e.get("params"), lf)
        rows = []
        for key, label, kind in ROWS:
            ev, lv = e.get(key), lf.get(key)
            row = {"key": key, "setting": label, "engine": ev, "llama": lv, "goal": GOALS[kind], "ratio": None,
                   "met": None}
            if ev is None:
                row["note"] = f"engine: {e.get('error') or 'no figure'}"
            elif lv is None:
                row["note"] = f"llama.cpp: {lf['errors'].get(key, 'no figure')}"
            elif chk["ok"] is False:
                row["note"] = chk["message"]
            else:
                row["ratio"] = ev / lv
                row["met"] = row["ratio"] >= GOALS[kind]
            rows.append(row)
        ep = e.get("params") or {}
        bpw_e = (e["bytes_on_device"] / ep["compared"]) if e.get("bytes_on_device") and ep.get("compared") else None
        g = lf.get("gguf") or {}
        bpw_l = ((g["bytes"] - g.get("table_bytes", 0)) / (g["n_params"] - g.get("table_params", 0))
                 if g.get("n_params") else (lf["model_size"] / lf["model_n_params"]
                                            if lf.get("model_n_params") else None))
        pairs.append({"engine_format": fmt, "llama_type": qt, "rows": rows, "same_model": chk,
                      "qsa": g.get("qsa"),
                      "bytes_per_weight": {"engine": bpw_e, "llama": bpw_l},
                      "llama_decode_b1_batched_bench": lf.get("decode_b1_batched_bench"),
                      "llama_model": {k: lf.get(k) for k in ("model_type", "model_size", "model_n_params", "n_batch",
                                                             "n_ubatch")},
                      "quantize": (lres or {}).get("quantize")})
    return {"schema": 1, "goals": GOALS, "params_rtol": PARAMS_RTOL, "pairs": pairs}


def _fmt(v, nd=1):
    return "-" if v is None else f"{v:,.{nd}f}"


def markdown(doc: dict) -> str:
    """The comparison as a markdown table (one row per pair and setting), then the notes."""
    out = ["| engine | llama.cpp | setting | engine tok/s | llama.cpp tok/s | ratio | goal | met |",
           "|---|---|---|---:|---:|---:|---:|---|"]
    notes = []
    for p in doc["pairs"]:
        b = p["bytes_per_weight"]
        by_note: dict[str, list[str]] = {}
        for r in p["rows"]:
            met = {True: "met", False: "not met", None: "-"}[r["met"]]
            out.append(f"| {p['engine_format']} ({_fmt(b['engine'], 2)} B/w) | {p['llama_type']} ({_fmt(b['llama'], 2)}"
                       f" B/w) | {r['setting']} | {_fmt(r['engine'])} | {_fmt(r['llama'])} | "
                       f"{_fmt(r['ratio'], 2)}{'x' if r['ratio'] is not None else ''} | >= {r['goal']}x | {met} |")
            if r.get("note"):
                by_note.setdefault(r["note"], []).append(r["setting"])
        for note, settings in by_note.items():  # one line per distinct reason
            notes.append(f"- {p['engine_format']} / {p['llama_type']}, {'; '.join(settings)}: {note}")
        notes.append(f"- {p['engine_format']} / {p['llama_type']}: {p['same_model']['message']}")
        if p.get("qsa") and (not p["qsa"]["ok"] or p["qsa"].get("patched_from") is not None):
            notes.append(f"- {p['llama_type']}: {p['qsa']['message']}")
        q = p.get("quantize") or {}
        if q.get("fallbacks"):
            used = sorted({(f['asked'], f['used']) for f in q['fallbacks']})
            notes.append(f"- {p['llama_type']}: llama-quantize could not use the asked type for {len(q['fallbacks'])} "
                         f"tensor(s) ({', '.join(f'{a} -> {u}' for a, u in used)}; e.g. "
                         f"{q['fallbacks'][0]['name']}, {q['fallbacks'][0]['ncols']} columns not a multiple of "
                         f"{q['fallbacks'][0]['block']})")
    return "\n".join(out + ([""] + notes if notes else []))


# ------------------------------------------------------------------------------------------------ running

def _run(cmd, log_out: Path, log_err: Path | None = None, timeout=None, env=None) -> tuple[int, float]:
    """Run ``cmd`` with stdout to ``log_out`` (and stderr to ``log_err``, else the same file); (rc, seconds)."""
    t0 = time.monotonic()
    with open(log_out, "w") as fo, (open(log_err, "w") if log_err else open(os.devnull, "w")) as fe:
        try:
            rc = subprocess.run([str(c) for c in cmd], stdout=fo, stderr=fe if log_err else subprocess.STDOUT,
                                timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        except OSError as e:
            (fe if log_err else fo).write(f"error: could not start {cmd[0]}: {e}\n")
            rc = 127
    return rc, time.monotonic() - t0


def gguf_names(models: Path, layers: int) -> dict:
    """llama.cpp type -> the GGUF path ``prepare`` writes for a ``layers``-layer synthetic checkpoint."""
    return {qt: models / f"qwen4exp-realwidth-L{layers}-{qt}.gguf" for qt in ("BF16", "Q8_0", "Q4_K_M")}


def prepare(src: Path, bin_dir: Path, models: Path, layers: int = 4, *, build_dir: Path | None = None,
            keep_safetensors: bool = False, wait_build_s: float = 900, overrides: dict | None = None,
            patch_qsa: bool = True, log=print) -> dict:
    """Synthetic checkpoint -> BF16 GGUF (the trimmed tree ``src``'s converter) -> Q8_0 / Q4_K_M
    (``bin_dir``/llama-quantize, waiting up to ``wait_build_s`` for ``build_dir``/BUILD_DONE). Steps already done
    are kept (``overrides``: config fields replaced, as :func:`parity.bench.synthetic.real_width_config` takes them;
    tests use small widths). When the converter wrote the QSA compress ratios as 0 (:func:`qsa_check`) and
    ``patch_qsa``, the BF16 GGUF gets the config's (:func:`patch_compress_ratios`) before it is quantised;
    ``qsa_converter`` in the manifest records what the converter wrote. Writes ``models``/manifest.json: the
    config, each GGUF's :func:`gguf_summary`, the quantize logs' :func:`parse_quantize_log`, the seconds each
    step took (GGUFs of another config found there are replaced). The safetensors copy is deleted once converted
    (unless ``keep_safetensors`` or it existed before this call: another bench may be using it).

    Raises:
        PeerInputError: the converter or llama-quantize failed (their own message), or the build did not finish.
    """
    from parity.backends import gguf_convert as gc
    from parity.bench import synthetic as S
    from reference.atomic import atomic_write_json
    models.mkdir(parents=True, exist_ok=True)
    names = gguf_names(models, layers)
    man_path = models / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.is_file() else {}
    cfg = S.real_width_config(layers, overrides=overrides)
    if man.get("config") not in (None, cfg) or (not man and any(p.is_file() for p in names.values())):
        for p in names.values():  # GGUFs of other shapes (or of unknown ones): not this comparison's
            p.unlink(missing_ok=True)
        man = {}
    man.setdefault("steps", {})
    man["config"] = cfg
    if not names["BF16"].is_file():
        need = 2 * S.checkpoint_bytes(cfg)  # BF16 + Q8_0 + Q4_K_M GGUFs: ~1 + 0.53 + 0.3 of the BF16 bytes
        free = shutil.disk_usage(models).free
        if need > free:
            raise PeerInputError(f"GGUF folder {str(models)!r}: needs ~{need / 1e9:.0f} GB for the BF16, Q8_0 and Q4_K_M "
                                 f"GGUFs, found {free / 1e9:.0f} GB free (set LLAMA_MODELS to a larger disk)")
        t0 = time.monotonic()
        key_dir_existed = any(S.cache_dir().glob(f"realwidth-L{layers}-*")) if S.cache_dir().is_dir() else False
        ck = S.cached_synthetic(layers, overrides=overrides, progress=False)
        man["steps"]["synthetic_s"] = round(time.monotonic() - t0, 1)
        log(f"llamacpp_peer: synthetic checkpoint {ck} ({S.checkpoint_bytes(cfg) / 1e9:.1f} GB) in "
            f"{man['steps']['synthetic_s']} s")
        t0 = time.monotonic()
        tmp = names["BF16"].with_suffix(".gguf.part")
        r = gc.run_converter(src, ck, tmp, outtype="bf16", no_vocab=True, timeout=3600)
        (models / "convert.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise PeerInputError(f"llama.cpp converter on {ck}: expected a BF16 GGUF, found it failed: "
                                 f"{gc.refusal_message(r.stderr)} (log {models / 'convert.log'})")
        g = gguf_summary(tmp, src / "gguf-py")
        chk = qsa_check(cfg, g.get("compress_ratios"))
        man["qsa_converter"] = chk
        if not chk["ok"] and patch_qsa and g.get("compress_ratios") is not None:
            # defect A (docs/outside-engines.md finding 6): llama.cpp would run dense attention; the config's
            # ratios are written in, so llama.cpp runs the function the engine runs (reported, not hidden)
            patch_compress_ratios(tmp, chk["expected"], src / "gguf-py")
            man["qsa_converter"]["patched"] = True
            log(f"llamacpp_peer: {chk['message']}; patched to {chk['expected']} (LLAMA_QSA_PATCH=0 keeps it dense)")
        os.replace(tmp, names["BF16"])
        man["steps"]["convert_s"] = round(time.monotonic() - t0, 1)
        log(f"llamacpp_peer: converted to {names['BF16']} in {man['steps']['convert_s']} s")
        if not keep_safetensors and not key_dir_existed:
            shutil.rmtree(ck, ignore_errors=True)
            log(f"llamacpp_peer: removed the safetensors copy {ck}")
    gguf_py = src / "gguf-py"

    def summary(qt):
        g = {"path": str(names[qt]), **gguf_summary(names[qt], gguf_py)}
        g["qsa"] = qsa_check(cfg, g.get("compress_ratios"))
        if (man.get("qsa_converter") or {}).get("patched"):
            g["qsa"]["patched_from"] = man["qsa_converter"]["found"]
            g["qsa"]["message"] += (f"; the converter wrote {man['qsa_converter']['found']} (defect A, docs/"
                                    f"outside-engines.md finding 6), patched in before quantising")
        return g
    man.setdefault("gguf", {})["BF16"] = summary("BF16")
    log(f"llamacpp_peer: {man['gguf']['BF16']['qsa']['message']}")
    for qt in ("Q8_0", "Q4_K_M"):
        if names[qt].is_file() and qt in man["gguf"]:
            continue
        if build_dir is not None:
            t0 = time.monotonic()
            while not (build_dir / "BUILD_DONE").is_file():
                if (build_dir / "BUILD_FAILED").is_file() or time.monotonic() - t0 > wait_build_s:
                    raise PeerInputError(f"llama-quantize: expected the llama.cpp build in {build_dir} to finish, "
                                         f"found {'it failed' if (build_dir / 'BUILD_FAILED').is_file() else 'it still running'}")
                time.sleep(5)
        t0 = time.monotonic()
        tmp = names[qt].with_suffix(".gguf.part")
        qlog = models / f"quantize-{qt}.log"
        rc, dt = _run([bin_dir / "llama-quantize", names["BF16"], tmp, qt, str(os.cpu_count() or 1)], qlog)
        text = qlog.read_text(errors="replace")
        if rc != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise PeerInputError(f"llama-quantize {qt}: expected a GGUF, found it failed: {llama_error(text, rc)}")
        os.replace(tmp, names[qt])
        man["steps"][f"quantize_{qt}_s"] = round(dt, 1)
        man.setdefault("quantize", {})[qt] = parse_quantize_log(text)
        man["gguf"][qt] = summary(qt)
        q = man["quantize"][qt]
        log(f"llamacpp_peer: {qt} in {dt:.0f} s; types written {q['by_type']}; {len(q['fallbacks'])} fallback(s)")
    atomic_write_json(man_path, man)
    return man


def run_llama(bin_dir: Path, manifest: dict, out: Path, *, reps: int = 3, types=("BF16", "Q8_0", "Q4_K_M"),
              timeout: float = 240, log=print) -> dict:
    """llama-bench and llama-batched-bench on each GGUF of ``manifest`` (see the module docstring for the
    settings); raw stdout / stderr of each under ``out``. Returns {type: {"llama_bench": {"rows" | "error", "cmd",
    "seconds"}, "batched_bench": {...}, "gguf", "quantize"}}; a run that fails keeps llama.cpp's own error."""
    res = {}
    fa = os.environ.get("LLAMA_FA", "on")  # flash attention on (the goals' setting); LLAMA_FA=auto|off to compare
    for qt in types:
        g = (manifest.get("gguf") or {}).get(qt)
        if g is None:
            res[qt] = {"llama_bench": {"error": "no GGUF (prepare did not make it)"},
                       "batched_bench": {"error": "no GGUF (prepare did not make it)"}}
            continue
        r: dict = {"gguf": {k: v for k, v in g.items()}, "quantize": (manifest.get("quantize") or {}).get(qt)}
        cmd = [bin_dir / "llama-bench", "-m", g["path"], "-ngl", "99", "-fa", fa,
               "-p", ",".join(map(str, PROMPT_LENS)), "-n", str(TG), "-d", f"0,{CONTEXT}", "-r", str(reps),
               "-o", "json"]
        so, se = out / f"llama-bench-{qt}.json", out / f"llama-bench-{qt}.stderr"
        rc, dt = _run(cmd, so, se, timeout=timeout)
        lb: dict = {"cmd": " ".join(map(str, cmd)), "seconds": round(dt, 1), "rc": rc}
        try:
            lb["rows"] = parse_llama_bench(so.read_text(errors="replace"), f"llama-bench {qt}")
        except PeerInputError:
            lb["rows"] = []
        if rc != 0:
            lb["error"] = llama_error(se.read_text(errors="replace"), rc)
        r["llama_bench"] = lb
        log(f"llamacpp_peer: llama-bench {qt}: {len(lb['rows'])} rows in {dt:.0f} s" + (f"; {lb['error']}" if rc else ""))
        pls = ",".join(["1"] * reps + [str(BATCH)] * reps)  # each B repeated: batched-bench has no repetitions
        cmd = [bin_dir / "llama-batched-bench", "-m", g["path"], "-ngl", "99", "-fa", fa,
               # each sequence's own KV stream holds its prompt + decode, with 256 cells of room (llama.cpp
               # splits n_ctx evenly over n_seq_max streams and pads sizes to 256)
               "-c", str(BATCH * (CONTEXT + BATCHED_TG + 256)), "-npp", str(CONTEXT), "-ntg", str(BATCHED_TG),
               "-npl", pls, "--output-format", "jsonl"]
        so, se = out / f"batched-bench-{qt}.jsonl", out / f"batched-bench-{qt}.stderr"
        rc, dt = _run(cmd, so, se, timeout=timeout)
        bb: dict = {"cmd": " ".join(map(str, cmd)), "seconds": round(dt, 1), "rc": rc}
        try:
            bb["rows"] = parse_batched_bench(so.read_text(errors="replace"), f"llama-batched-bench {qt}")
        except PeerInputError:
            bb["rows"] = []
        if rc != 0:
            bb["error"] = llama_error(se.read_text(errors="replace"), rc)
        r["batched_bench"] = bb
        log(f"llamacpp_peer: llama-batched-bench {qt}: {len(bb['rows'])} rows in {dt:.0f} s" +
            (f"; {bb['error']}" if rc else ""))
        res[qt] = r
    return res


def run_engine(out: Path, layers: int = 4, formats=tuple(PAIRS), *, repeats: int = 3, timeout: float = 240,
               log=print) -> dict:
    """``qwen4exp bench --synthetic real-widths --backend engine --weights W`` for each format on the shapes
    ``prepare`` converted (``--layers``; in-memory weights: no files); JSON and log per format under ``out``.
    Returns {format: bench JSON} for the runs that wrote one."""
    docs = {}
    for w in formats:
        f = out / f"engine-{w}.json"
        cmd = [sys.executable, "-m", "parity.cli", "bench", "--synthetic", "real-widths", "--backend", "engine",
               "--device", "cuda", "--layers", str(layers), "--weights", w,
               "--prompt-lens", ",".join(map(str, PROMPT_LENS)), "--batches", f"1,{BATCH}", "--contexts", str(CONTEXT),
               "--repeats", str(repeats), "--warmup", "1", "--decode-tokens", "16", "--no-extras", "--no-peer",
               "--budget-s", str(max(30, timeout - 60)), "--timeout-s", str(timeout), "--out", f, "--overwrite"]
        rc, dt = _run(cmd, out / f"engine-{w}.log", timeout=timeout + 30)
        if f.is_file():
            docs[w] = json.loads(f.read_text())
        else:
            tail = [ln.strip() for ln in (out / f"engine-{w}.log").read_text(errors="replace").splitlines() if ln.strip()]
            docs[w] = {"runs": {"engine": {"error": f"the engine bench wrote no JSON (exit status {rc}: "
                                                     f"{tail[-1] if tail else 'no output'}; log engine-{w}.log)"}}}
        log(f"llamacpp_peer: engine {w}: exit {rc} in {dt:.0f} s")
    return docs


def table(engine_files: dict, llama_json, out=None, log=print) -> dict:
    """:func:`compare` over ``engine_files`` (format -> bench JSON path, or the document itself) and ``llama_json`` (the ``llama``
    step's llamacpp.json); writes ``out`` (atomic) and prints :func:`markdown`.

    Raises:
        PeerInputError: a missing or malformed input file.
    """
    from reference.atomic import atomic_write_json
    eng = {}
    for fmt, p in engine_files.items():
        d = p if isinstance(p, dict) else read_json(p, f"engine bench JSON ({fmt})")
        if not isinstance(d, dict) or "runs" not in d:
            raise PeerInputError(f"engine bench JSON ({fmt}) {str(p)!r}: expected a `qwen4exp bench --out` document "
                                 f"(with 'runs'), found {type(d).__name__} without it")
        eng[fmt] = d
    lj = read_json(llama_json, "llama.cpp results JSON")
    if not isinstance(lj, dict) or not isinstance(lj.get("results"), dict):
        raise PeerInputError(f"llama.cpp results JSON {str(llama_json)!r}: expected an object with 'results' "
                             f"(written by the llama step), found otherwise")
    doc = compare(eng, lj["results"])
    doc["llama_cpp"] = {k: lj.get(k) for k in ("commit", "bin", "manifest_steps")}
    if out:
        atomic_write_json(out, doc)
    log(markdown(doc))
    return doc


def main(argv=None) -> int:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m parity.bench.llamacpp_peer",
                                 description="llama.cpp (CUDA) as the speed peer of the engine bench: prepare the "
                                             "GGUFs, run llama-bench / llama-batched-bench and the engine bench on the "
                                             "same shapes, and tabulate engine / llama.cpp ratios against the goals "
                                             "(decode >= 1.5x, prefill >= 2x).")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, *names):
        if "src" in names:
            p.add_argument("--src", type=Path, default=Path(os.environ.get("LLAMA_SRC", "/tmp/llama-src")),
                           help="the trimmed llama.cpp tree (converter, gguf-py)")
        if "bin" in names:
            p.add_argument("--bin", type=Path, default=Path(os.environ.get("LLAMA_BUILD", "/tmp/llama-build")) / "bin",
                           help="folder of llama-bench / llama-batched-bench / llama-quantize")
        if "models" in names:
            p.add_argument("--models", type=Path, default=Path(os.environ.get("LLAMA_MODELS", "/tmp/llamacpp-models")),
                           help="where the GGUFs and manifest.json are")
        if "out" in names:
            p.add_argument("--out-dir", type=Path, required=True, help="results folder")
        if "layers" in names:
            p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4 = one period)")
        if "reps" in names:
            p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")

    p = sub.add_parser("prepare", help="synthetic checkpoint -> BF16 GGUF -> Q8_0 / Q4_K_M")
    common(p, "src", "bin", "models", "layers")
    p.add_argument("--build-dir", type=Path, default=None, help="wait for BUILD_DONE here before quantizing")
    p.add_argument("--keep-safetensors", action="store_true")
    p.add_argument("--overrides", type=json.loads, default=None, metavar="JSON",
                   help="config fields to replace (small widths for a dry run off the GPU machine)")
    p = sub.add_parser("llama", help="llama-bench + llama-batched-bench on each GGUF")
    common(p, "bin", "models", "out", "reps")
    p = sub.add_parser("engine", help="the engine bench on the same shapes, per weight format")
    common(p, "out", "layers", "reps")
    p.add_argument("--formats", default=",".join(PAIRS), help="comma-separated (default bf16,fp8,nvfp4)")
    p = sub.add_parser("table", help="the comparison from saved results")
    p.add_argument("--engine", action="append", default=[], metavar="FORMAT=FILE",
                   help="an engine bench JSON per format (repeat)")
    p.add_argument("--llama", type=Path, required=True, help="llamacpp.json written by the llama step")
    p.add_argument("--out", type=Path, default=None, help="comparison JSON to write")
    p = sub.add_parser("run", help="llama + engine + table")
    common(p, "bin", "models", "out", "layers", "reps")
    p.add_argument("--formats", default=",".join(PAIRS), help="engine formats (default bf16,fp8,nvfp4)")
    args = ap.parse_args(argv)
    try:
        return _dispatch(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    from reference.atomic import atomic_write_json
    if args.cmd == "prepare":
        prepare(args.src, args.bin, args.models, args.layers, build_dir=args.build_dir,
                keep_safetensors=args.keep_safetensors, overrides=args.overrides,
                patch_qsa=os.environ.get("LLAMA_QSA_PATCH", "1") != "0")
        return 0
    if args.cmd == "table":
        files = {}
        for s in args.engine:
            fmt, sep, path = s.partition("=")
            if not sep or fmt not in PAIRS:
                raise PeerInputError(f"--engine {s!r}: expected FORMAT=FILE with FORMAT one of {list(PAIRS)}, found "
                                     f"otherwise")
            files[fmt] = Path(path)
        table(files, args.llama, args.out)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rc = 0
    if args.cmd in ("llama", "run"):
        man = read_json(args.models / "manifest.json", "GGUF manifest (run the prepare step first)")
        res = run_llama(args.bin, man, args.out_dir, reps=args.reps)
        commit = None
        src = Path(os.environ.get("LLAMA_SRC", "/tmp/llama-src")) / "LLAMACPP_COMMIT"
        if src.is_file():
            commit = src.read_text().strip()
        atomic_write_json(args.out_dir / "llamacpp.json", {"results": res, "commit": commit, "bin": str(args.bin),
                                                           "manifest_steps": man.get("steps"),
                                                           "config": man.get("config")})
    docs = {}
    if args.cmd in ("engine", "run"):
        fmts = tuple(f for f in getattr(args, "formats", ",".join(PAIRS)).split(",") if f)
        bad = [f for f in fmts if f not in PAIRS]
        if bad:
            raise PeerInputError(f"--formats: expected a comma-separated subset of {list(PAIRS)}, found {bad}")
        docs = run_engine(args.out_dir, args.layers, fmts, repeats=args.reps)
    if args.cmd == "run":
        doc = table(docs, args.out_dir / "llamacpp.json", args.out_dir / "llamacpp_peer.json")
        # 1 when a ratio is missing (a side failed or the same-model check refused): said, not hidden
        rc = 0 if doc["pairs"] and all(r["ratio"] is not None for p in doc["pairs"] for r in p["rows"]) else 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
