"""Turning a qwen4exp checkpoint into a GGUF with the converter of the *installed* llama.cpp.

The converter (``convert_hf_to_gguf.py`` + ``conversion/`` + ``gguf-py/``) ships only in
llama-cpp-python's source distribution (``vendor/llama.cpp``), not in its wheel. It is found, in order:
the ``sdist=PATH`` backend option, ``$QWEN4EXP_LLAMACPP_SDIST``, ``<cache>/sdist/llama_cpp_python-<v>.tar.gz``,
else ``pip download llama-cpp-python==<v> --no-binary :all: --no-deps`` into ``<cache>/sdist`` (bounded
time). Its three parts are extracted once into ``<cache>/llama.cpp-<v>/`` (an sdist asked for by the option
or the variable: into ``<cache>/llama.cpp-<v>-<digest>/``, see :func:`converter_dir`); ``<cache>`` is
``$QWEN4EXP_CACHE`` or ``~/.cache/qwen4exp``. The vendored ``gguf-py`` is used (put first on the path),
so the converter and the loader are of one version.

Re-parameterisations (:data:`REPARAMS`) rewrite a checkpoint into one that computes the *same function*
(each is checked by running the official model -- transformers when installed, else the reference --
on both checkpoints) but gets past a limitation of llama.cpp's converter/loader. They are applied only
when asked for (``llama.cpp:reparam=auto`` or a ``+``-joined list) and are recorded in the report.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from parity.backends.base import BackendError
from parity.backends.refusal import EngineRefused

#: seconds one conversion may take before it is abandoned (the real 360 GB checkpoint needs hours:
#: raise it with ``convert_timeout=``)
CONVERT_TIMEOUT_S = 900
PIP_DOWNLOAD_TIMEOUT_S = 600

#: name -> one-line description of each function-preserving re-parameterisation
REPARAMS = {
    "tokenizer-label": "the converter identifies a BPE pre-tokenizer only by the hash of known upstream "
                       "tokenizers; when it does not know the checkpoint's, the GGUF gets the llama.cpp label "
                       "whose split rules ARE the checkpoint's pre-tokenizer (tokenizer.json: a plain "
                       "ByteLevel with its GPT-2 regex -> 'gpt-2'; the Qwen3.5/3.8 Split regex -> 'qwen35'), "
                       "so llama.cpp tokenizes text as the checkpoint does. Token ids -> logits, the function "
                       "judged here, does not involve the tokenizer",
    "ple-dequant": "the FP8 n-gram table (ngram_embedding shards + one weight_scale) is stored dequantised "
                   "in float32 (shard * scale, exact: a 4-bit by 8-bit significand product)",
    "ple-pad": "llama.cpp assumes ple_embed_dim == hidden_size; each n-gram head's row is zero-padded to "
               "hidden_size / n_heads and key_proj/value_proj get matching zero columns (exact zeros add "
               "exact zeros), ple_embed_dim := hidden_size",
}


#: the Split regex of the Qwen3.5/3.8 tokenizer.json (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35 rules, label 'qwen35')
QWEN35_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
                      r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


#: the files llama.cpp's converter builds a vocabulary from (a HF fast tokenizer, a SentencePiece model, a
#: GPT-2 style vocab.json + merges.txt); a checkpoint with none of them gets the converter's 'none' vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir) -> bool:
    """Whether ``model_dir`` holds any of :data:`TOKENIZER_FILES` (else it is converted with ``no_vocab``:
    :func:`run_converter`)."""
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def pre_tokenizer_label(model_dir) -> str | None:
    """The llama.cpp pre-tokenizer label (``tokenizer.ggml.pre``) whose rules equal the checkpoint's
    ``tokenizer.json`` pre-tokenizer, or None when none is known to.

    'gpt-2': a ByteLevel pre-tokenizer with ``use_regex`` (its built-in GPT-2 split regex; llama-vocab.cpp's
    LLAMA_VOCAB_PRE_TYPE_GPT2 uses the same regex). 'qwen35': a Split on :data:`QWEN35_SPLIT_REGEX` followed
    by a ByteLevel without regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35). Anything else: None.
    """
    f = Path(model_dir) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        pt = json.loads(f.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    except ValueError:
        return None
    if pt.get("type") == "ByteLevel" and pt.get("use_regex", True):
        return "gpt-2"
    steps = pt.get("pretokenizers") if pt.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel" \
            and not steps[1].get("use_regex", True):
        pat = (steps[0].get("pattern") or {}).get("Regex")
        if pat == QWEN35_SPLIT_REGEX:
            return "qwen35"
    return None


def cache_root() -> Path:
    """``$QWEN4EXP_CACHE`` or ``~/.cache/qwen4exp``."""
    return Path(os.environ.get("QWEN4EXP_CACHE") or Path.home() / ".cache" / "qwen4exp")


def installed_version() -> str:
    """The installed llama-cpp-python version. Raises BackendError when it is not installed."""
    try:
        import llama_cpp
    except ImportError as e:
        from reference.paths import install_command
        raise BackendError(f"llama.cpp backend: expected llama-cpp-python installed (the `llamacpp` extra), found "
                           f"{e}; install it: {install_command('llamacpp')}") from e
    return str(llama_cpp.__version__)


def asked_sdist(path=None) -> Path | None:
    """The source distribution asked for: the ``sdist=`` option ``path``, else ``$QWEN4EXP_LLAMACPP_SDIST``;
    None when neither is set.

    Raises:
        BackendError: the one asked for is not a file.
    """
    for cand, why in ((path, "sdist= option"), (os.environ.get("QWEN4EXP_LLAMACPP_SDIST"), "$QWEN4EXP_LLAMACPP_SDIST")):
        if cand:
            p = Path(cand)
            if not p.is_file():
                raise BackendError(f"llama.cpp backend: {why} {str(p)!r}: expected llama-cpp-python's source "
                                   f"distribution (.tar.gz), found {'a directory' if p.is_dir() else 'nothing there'}")
            return p
    return None


def _file_digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def find_sdist(version: str, path=None) -> Path:
    """The source distribution of llama-cpp-python ``version`` (see the module docstring for the order).

    Raises:
        BackendError: not found and ``pip download`` failed (message names every place looked at).
    """
    looked = []
    asked = asked_sdist(path)
    if asked is not None:
        return asked
    d = cache_root() / "sdist"
    p = d / f"llama_cpp_python-{version}.tar.gz"
    looked.append(str(p))
    if p.is_file():
        return p
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
           "--no-deps", "-d", str(d)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
        ok = r.returncode == 0 and p.is_file()
        why = (r.stderr.strip().splitlines() or ["?"])[-1] if not ok else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        raise BackendError(f"llama.cpp backend: expected llama-cpp-python {version}'s source distribution (it "
                           f"holds the converter), found none at {looked} and `pip download` failed ({why}); "
                           f"pass llama.cpp:sdist=PATH or set QWEN4EXP_LLAMACPP_SDIST")
    return p


def converter_dir(version: str, sdist=None) -> Path:
    """``<cache>/llama.cpp-<version>/`` holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``
    extracted from the sdist (once; extracted to a temporary folder, then renamed). An sdist asked for
    (``sdist=``, ``$QWEN4EXP_LLAMACPP_SDIST``: :func:`asked_sdist`) is extracted to a folder of its own,
    ``llama.cpp-<version>-<sha256 of the file, 12 digits>``: the converter asked for is the one used, never one
    extracted earlier from another sdist (a patched converter would be silently ignored)."""
    asked = asked_sdist(sdist)
    dst = cache_root() / (f"llama.cpp-{version}" if asked is None else f"llama.cpp-{version}-{_file_digest(asked)}")
    if (dst / "convert_hf_to_gguf.py").is_file():
        return dst
    src = asked if asked is not None else find_sdist(version)
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        try:
            tf = tarfile.open(src, "r:gz")
        except (tarfile.TarError, EOFError, OSError) as e:  # not a gzipped tarball: name the file, not tarfile
            raise BackendError(f"llama.cpp backend: {str(src)!r}: expected llama-cpp-python's source distribution "
                               f"(a .tar.gz), found a file that is not one ({type(e).__name__}: {e})") from e
        with tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(wanted) and (m.isfile() or m.isdir())]
            if not any(m.name.endswith("convert_hf_to_gguf.py") for m in members):
                raise BackendError(f"llama.cpp backend: {str(src)!r}: expected {prefix}convert_hf_to_gguf.py in "
                                   f"the source distribution, found none")
            for m in members:
                m.name = m.name[len(prefix):]
                tf.extract(m, tmp, filter="data")
        try:
            os.rename(tmp, dst)
        except OSError:  # another process extracted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


# --- re-parameterisations --------------------------------------------------------------------------------

def _text_cfg(raw: dict) -> dict:
    return raw.get("text_config", raw)


def applicable_reparams(model_dir) -> list[str]:
    """The re-parameterisations of :data:`REPARAMS` that change something on this checkpoint (in order)."""
    from safetensors import safe_open
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    cfg = _text_cfg(raw)
    out = ["tokenizer-label"] if pre_tokenizer_label(model_dir) else []
    has_scale = False
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "numpy") as s:  # keys only: no torch needed to offer a reparam
            has_scale = has_scale or any(k.endswith("ngram_embedding.weight_scale") for k in s.keys())
    if has_scale:
        out.append("ple-dequant")
    if cfg.get("ple_layer_ids") and cfg.get("ple_embed_dim") != cfg.get("hidden_size"):
        n_heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
        if cfg["hidden_size"] % n_heads == 0 and cfg["ple_embed_dim"] % n_heads == 0 \
                and cfg["hidden_size"] >= cfg["ple_embed_dim"]:
            out.append("ple-pad")  # only where a function-preserving padding exists
    return out


def parse_reparams(value, model_dir) -> list[str]:
    """``reparam=`` option: 'none' / '' -> [], 'auto' -> :func:`applicable_reparams`, else a '+'-joined list.

    Raises:
        BackendError: an unknown name.
    """
    if value in (None, "", "none"):
        return []
    names = []
    for n in [n for n in str(value).split("+") if n]:
        names += applicable_reparams(model_dir) if n == "auto" else [n]
    bad = [n for n in names if n not in REPARAMS]
    if bad:
        raise BackendError(f"llama.cpp:reparam={value!r}: expected 'none', 'auto' or a '+'-joined list of "
                           f"{', '.join(REPARAMS)}, found {bad}")
    if "tokenizer-label" in names and pre_tokenizer_label(model_dir) is None:
        raise BackendError(f"llama.cpp:reparam=tokenizer-label: expected a tokenizer.json pre-tokenizer that a "
                           f"llama.cpp label reproduces (plain ByteLevel -> gpt-2, the Qwen3.5 Split -> qwen35), "
                           f"found another in {str(model_dir)!r}: no label would tokenize text as the checkpoint does")
    return [n for n in REPARAMS if n in names]


def reparameterise(src, dst, names) -> Path:
    """Write ``src`` rewritten by the checkpoint re-parameterisations ``names`` ('ple-dequant',
    'ple-pad'; 'tokenizer-label' acts on the converter, not the files) to the directory ``dst``, shard by
    shard (each shard is loaded whole: fine for CI-sized checkpoints, the only ones that need 'ple-pad').

    Raises:
        BackendError: 'ple-pad' cannot preserve the function (hidden_size not a multiple of the n-gram head
            count, so no padded row width exists).
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg = _text_cfg(raw)
    pad = "ple-pad" in names
    if pad:
        n_heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
        hid, P = cfg["hidden_size"], cfg["ple_embed_dim"]
        if hid % n_heads or P % n_heads or hid < P:
            raise BackendError(f"llama.cpp:reparam=ple-pad: expected hidden_size ({hid}) to be a multiple of the "
                               f"n-gram head count ({n_heads}) and >= ple_embed_dim ({P}), found otherwise: no "
                               f"function-preserving padding exists for this checkpoint")
        r, r2 = P // n_heads, hid // n_heads
        cols = (np.arange(n_heads)[:, None] * r2 + np.arange(r)[None, :]).reshape(-1)  # old col h*r+j -> h*r2+j
        cfg["ple_embed_dim"] = hid
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        for f in src.iterdir():
            if f.suffix == ".safetensors" or f.name == "config.json":
                continue
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        for f in sorted(src.glob("*.safetensors")):
            ts = load_file(str(f))
            out = {}
            scales = {k[: -len("weight_scale")]: v for k, v in ts.items() if k.endswith("ngram_embedding.weight_scale")}
            for k, v in ts.items():
                if "ple-dequant" in names and k.endswith("ngram_embedding.weight_scale"):
                    continue
                if "ple-dequant" in names and ".ngram_embedding.shard_" in k and v.dtype in (
                        torch.float8_e4m3fn, torch.float8_e5m2):
                    base = k[: k.index("ngram_embedding.") + len("ngram_embedding.")]
                    sc = scales.get(base)
                    if sc is None:  # the scale lives in another shard file
                        sc = _find_tensor(src, base + "weight_scale")
                    v = v.to(torch.float32) * sc.to(torch.float32).reshape(())
                if pad and ".ngram_embedding.shard_" in k:
                    z = torch.zeros((v.shape[0], r2), dtype=v.dtype)
                    z[:, :r] = v
                    v = z
                if pad and (k.endswith(".ple.key_proj.weight") or k.endswith(".ple.value_proj.weight")):
                    z = torch.zeros((v.shape[0], hid), dtype=v.dtype)
                    z[:, torch.as_tensor(cols)] = v
                    v = z
                out[k] = v.contiguous()
            save_file(out, str(tmp / f.name), metadata={"format": "pt"})
        if "ple-dequant" in names and (src / "model.safetensors.index.json").is_file():
            idx = json.loads((src / "model.safetensors.index.json").read_text(encoding="utf-8"))
            idx["weight_map"] = {k: v for k, v in idx["weight_map"].items()
                                 if not k.endswith("ngram_embedding.weight_scale")}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(idx, indent=1), encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
        if dst.exists():
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _find_tensor(model_dir, name):
    from safetensors import safe_open
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            if name in s.keys():
                return s.get_tensor(name)
    raise BackendError(f"llama.cpp:reparam=ple-dequant: expected tensor {name!r} in {str(model_dir)!r}, found none")


def _config_doc(path) -> dict:
    """``path/config.json`` as a dict ({} when unreadable: the forwards below then name the problem)."""
    try:
        doc = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def check_same_function(a, b, ids=None) -> dict:
    """Run the official model (transformers, float32, CPU) -- or the reference, when transformers is not
    installed, cannot load the checkpoint or the checkpoint is quantised -- on checkpoints ``a`` and ``b``;
    returns ``{"by", "max_abs_diff", "ok"}``. ``ok``: the logits agree to a float32 summation-order floor (zero
    padding can change the order of a BLAS reduction; 1e-5 relative to the logit scale covers it, a real change
    does not pass).
    """
    ids = list(ids) if ids is not None else [3, 17, 99, 5, 250, 7, 8, 9, 10, 11, 12, 13, 14, 200, 41, 6]
    by = None
    if any("quantization_config" in _config_doc(p) for p in (a, b)):
        # transformers' loader dequantises FP8 / NVFP4 to bf16 (warning at length): not the exact weights
        why = "a quantised checkpoint: the reference dequantises its weights exactly"
    else:
        try:
            import torch
            import transformers

            def run(p):
                m = transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
                m.eval()
                with torch.no_grad():
                    return m(torch.tensor([ids])).logits[0].float().numpy()
            la, lb, by = run(a), run(b), f"transformers {transformers.__version__} (official model)"
        except Exception as e:  # not installed, or cannot load: the reference instead
            why = f"official model unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if by is None:
        from parity.backends.base import truth_model
        la, lb = truth_model(a).forward(ids), truth_model(b).forward(ids)
        by = f"reference ({why})"
    d = float(np.max(np.abs(np.asarray(la, np.float64) - np.asarray(lb, np.float64))))
    scale = float(np.max(np.abs(la))) or 1.0
    return {"by": by, "max_abs_diff": d, "ok": d <= 1e-5 * scale}


# --- conversion ------------------------------------------------------------------------------------------

_WRAPPER = r"""
import runpy, sys
conv, label, no_vocab = sys.argv[1], sys.argv[2], sys.argv[3] == '1'
sys.argv = [conv + '/convert_hf_to_gguf.py'] + sys.argv[4:]
sys.path.insert(0, conv)
sys.path.insert(1, conv + '/gguf-py')
if label:
    import conversion.base as b
    orig = b.TextModel.get_vocab_base_pre
    def pre(self, tok):
        try:
            return orig(self, tok)
        except NotImplementedError:
            return label
    b.TextModel.get_vocab_base_pre = pre
if no_vocab:  # a checkpoint without tokenizer files: tokenizer model 'none' + vocab_size dummy tokens
    import conversion.base as b
    def none_vocab(self):
        self._set_vocab_none()
        self.gguf_writer.add_vocab_size(int(self.hparams["vocab_size"]))
    b.TextModel.set_vocab = none_vocab
    orig_prep = b.ModelBase.prepare_metadata
    def prep(self, *a, **k):
        self.set_vocab = none_vocab.__get__(self)  # the subclasses' own set_vocab would read tokenizer files
        return orig_prep(self, *a, **k)
    b.ModelBase.prepare_metadata = prep
runpy.run_path(sys.argv[0], run_name='__main__')
"""

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)|AssertionError|KeyError)\b.*")


def refusal_message(stderr: str) -> str:
    """The converter's own message: the exception line of its traceback (else its last line)."""
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _EXC_LINE.match(ln.strip()):
            return ln.strip()
    return lines[-1].strip() if lines else "(no message)"


def fingerprint(model_dir) -> str:
    """Identity of a checkpoint directory's files (names, sizes, mtimes; config.json by content)."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update((Path(model_dir) / "config.json").read_bytes())
    return h.hexdigest()[:20]


def run_converter(conv, src, outfile, *, outtype: str = "f32", label: str = "", no_vocab: bool = False,
                  timeout: float = CONVERT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``conv``'s ``convert_hf_to_gguf.py`` (``conv``: a folder holding it, ``conversion/`` and ``gguf-py/``;
    the vendored gguf-py is put first on the path) on checkpoint ``src``, writing ``outfile`` as ``outtype``.

    ``label``: the pre-tokenizer label to use when the converter does not recognise the tokenizer
    (:data:`REPARAMS` 'tokenizer-label'). ``no_vocab``: the checkpoint has no tokenizer files (synthetic
    weights): the GGUF gets tokenizer model 'none' and ``vocab_size`` dummy tokens, which llama.cpp loads as
    a vocabulary of that size (token ids -> logits only). Returns the finished process (text output captured);
    the caller judges its return code.
    Raises:
        BackendError: the converter ran past ``timeout`` seconds.
    """
    cmd = [sys.executable, "-c", _WRAPPER, str(conv), label, "1" if no_vocab else "0", str(src),
           "--outfile", str(outfile), "--outtype", outtype]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the vendored gguf-py, same version
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise BackendError(f"llama.cpp converter: expected to finish within {timeout} s, found it still running "
                           f"(raise convert_timeout=)") from e


def convert(model_dir, version: str, *, reparams=(), sdist=None, outtype="f32", timeout=CONVERT_TIMEOUT_S) -> dict:
    """Convert ``model_dir`` to GGUF (cached under ``<cache>/gguf/``); returns ``{"gguf", "reparams",
    "checks", "converter"}`` (+ ``"vocab"`` when the checkpoint has no tokenizer files).

    ``outtype`` f32: the fixtures' BF16/F32 weights are kept exactly, so what is judged is llama.cpp's
    arithmetic, not a rounding of the weights.
    Raises:
        EngineRefused: the converter exits with an error (its own exception line is the message).
        BackendError: the converter cannot be found or a re-parameterisation cannot preserve the function.
    """
    model_dir = Path(model_dir).resolve()
    conv = converter_dir(version, sdist)
    reparams = list(reparams)
    label = (pre_tokenizer_label(model_dir) or "") if "tokenizer-label" in reparams else ""
    # the label is part of the key: a GGUF labelled otherwise (an older cache) is not this conversion
    names = [f"tokenizer-label={label}" if r == "tokenizer-label" else r for r in reparams]
    # the converter is part of the key too: one from an sdist asked for (its folder's digest suffix) converts apart
    key = f"{fingerprint(model_dir)}-{'+'.join(names) or 'asis'}-{outtype}-{version}{conv.name[len(f'llama.cpp-{version}'):]}"
    root = cache_root() / "gguf" / key
    gguf = root / "model.gguf"
    info = root / "info.json"
    if gguf.is_file() and info.is_file():
        return json.loads(info.read_text(encoding="utf-8"))
    root.mkdir(parents=True, exist_ok=True)
    src, checks = model_dir, []
    file_reparams = [r for r in reparams if r != "tokenizer-label"]
    if file_reparams:
        src = reparameterise(model_dir, root / "checkpoint", file_reparams)
        chk = check_same_function(model_dir, src)
        checks.append({"reparams": file_reparams, **chk})
        if not chk["ok"]:
            raise BackendError(f"llama.cpp:reparam={'+'.join(file_reparams)}: expected the re-parameterised "
                               f"checkpoint to compute the same function, found max |dlogit| {chk['max_abs_diff']:.3g} "
                               f"({chk['by']})")
    tmp = root / "model.gguf.part"
    # no tokenizer files (synthetic weights): token ids -> logits, the function judged, needs none; the GGUF
    # gets the converter's 'none' vocabulary of vocab_size dummy tokens, as the bench's peer conversion does
    no_vocab = not has_tokenizer(model_dir)
    r = run_converter(conv, src, tmp, outtype=outtype, label=label, no_vocab=no_vocab, timeout=timeout)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        msg = refusal_message(r.stderr)
        if msg.startswith("ModuleNotFoundError"):  # our environment, not llama.cpp's defect
            raise BackendError(f"llama.cpp converter: expected its Python dependencies installed, found {msg}")
        raise EngineRefused(f"llama.cpp {version}", "converter", msg, offer_for(msg, model_dir, reparams))
    os.replace(tmp, gguf)
    doc = {"gguf": str(gguf), "reparams": reparams, "checks": checks, "converter": str(conv),
           **({"tokenizer_label": label} if label else {}),
           **({"vocab": f"none: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in the checkpoint, so the GGUF "
                        f"holds vocab_size dummy tokens (token ids -> logits only)"} if no_vocab else {})}
    info.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return doc


#: refusal message pattern -> the re-parameterisation that gets past it
_FIXES = (("BPE pre-tokenizer was not recognized", "tokenizer-label"),
          ("ngram_embedding.weight_scale", "ple-dequant"),
          (".ple_key.weight' has wrong shape", "ple-pad"))


def offer_for(message: str, model_dir, used) -> str:
    """The hint attached to a refusal: the re-parameterisation that gets past it, when one exists, spelt
    together with those already in ``used`` (a ``reparam=`` value to use as written: offering the new one
    alone would drop those, and their refusal would come back)."""
    for pat, fix in _FIXES:
        if pat in message:
            if fix in used:
                break
            if fix in applicable_reparams(model_dir):
                names = "+".join(n for n in REPARAMS if n in used or n == fix)
                return (f"llama.cpp:reparam={names} (or auto) offers a function-preserving re-parameterisation: "
                        f"{REPARAMS[fix]}")
            break
    return "no function-preserving re-parameterisation gets past this"
