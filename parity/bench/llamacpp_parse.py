"""llama.cpp's own output formats, read for the speed peer (:mod:`parity.bench.llamacpp_peer`): ``llama-bench -o
json``, ``llama-batched-bench`` tables, ``llama-quantize`` logs and the error lines of a failed run."""
from __future__ import annotations

import json
import re
from pathlib import Path

from reference.errors import InputError

__all__ = ["PeerInputError", "read_text", "read_json", "parse_llama_bench", "parse_batched_bench",
           "parse_quantize_log", "llama_error", "median"]


class PeerInputError(InputError):
    """A results file of the llama.cpp comparison is missing or not in the format its writer prints, or a step
    that makes its inputs failed (the converter, llama-quantize, the build: their own message quoted)."""


def read_text(path, what: str) -> str:
    """The text of ``path``. Raises PeerInputError naming ``what`` when it is missing or unreadable."""
    p = Path(path)
    if not p.is_file():
        raise PeerInputError(f"{what}: expected a file at {str(p)!r}, found {'a directory' if p.is_dir() else 'nothing'}")
    try:
        return p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise PeerInputError(f"{what}: expected a readable file at {str(p)!r}, found {type(e).__name__}: {e}") from e


def read_json(path, what: str):
    """``path`` parsed as JSON. Raises PeerInputError (missing file, malformed JSON, naming line and column)."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as e:
        raise PeerInputError(f"{what} {str(path)!r}: expected JSON, found malformed text ({e})") from e


_LB_KEYS = ("model_size", "model_n_params", "n_prompt", "n_gen", "n_depth", "samples_ts")


def parse_llama_bench(text: str, where: str = "llama-bench output") -> list[dict]:
    """Rows of ``llama-bench -o json`` (tools/llama-bench/llama-bench.cpp ``json_printer``: a JSON array of one
    object per test, with the ``test::get_fields()`` keys plus ``samples_ns`` / ``samples_ts``).

    An interrupted run leaves an unterminated array: the complete objects before the break are kept.
    Returns the rows with ``median_ts`` (median of ``samples_ts``, tokens/s) added.
    Raises:
        PeerInputError: no JSON array, or a row without the fields read here.
    """
    t = text.strip()
    if not t.startswith("["):
        raise PeerInputError(f"{where}: expected llama-bench's JSON array (-o json), found "
                             f"{(t[:60] or 'nothing')!r}")
    try:
        rows = json.loads(t)
    except ValueError:
        rows = None
        cut = t.rfind("}")
        while cut > 0 and rows is None:  # an interrupted run: keep its complete objects
            try:
                rows = json.loads(t[:cut + 1] + "]")
            except ValueError:
                cut = t.rfind("}", 0, cut)
        if rows is None:
            raise PeerInputError(f"{where}: expected llama-bench's JSON array (-o json), found malformed JSON")
    if not isinstance(rows, list):
        raise PeerInputError(f"{where}: expected a JSON array of tests, found {type(rows).__name__}")
    for i, r in enumerate(rows):
        miss = [k for k in _LB_KEYS if not isinstance(r, dict) or k not in r]
        if miss:
            raise PeerInputError(f"{where}: test {i}: expected llama-bench fields {list(_LB_KEYS)}, found {miss} missing")
        r["median_ts"] = median(r["samples_ts"])
    return rows


_BB_KEYS = ("pp", "tg", "pl", "n_kv", "t_tg", "speed_tg", "t_pp", "speed_pp")
_BB_MD = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                    r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*$")


def parse_batched_bench(text: str, where: str = "llama-batched-bench output") -> list[dict]:
    """Rows of ``llama-batched-bench`` (tools/batched-bench/batched-bench.cpp): with ``--output-format jsonl`` one
    ``{"n_kv_max": ..., "pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed"}`` object
    per line; the default markdown table (``|PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|T s|S t/s|``) is read
    too. Other lines (llama.cpp's log) are skipped. ``speed_tg`` = pl * tg / t_tg (tokens/s over all sequences).

    Raises:
        PeerInputError: no result row at all, or a JSON row without the fields read here.
    """
    rows = []
    for ln in text.splitlines():
        s = ln.strip()
        if s.startswith("{") and '"speed_tg"' in s:
            try:
                r = json.loads(s)
            except ValueError as e:
                raise PeerInputError(f"{where}: expected one JSON object per result line, found malformed {s[:80]!r}"
                                     f" ({e})") from e
            miss = [k for k in _BB_KEYS if k not in r]
            if miss:
                raise PeerInputError(f"{where}: expected fields {list(_BB_KEYS)}, found {miss} missing in {s[:80]!r}")
            rows.append(r)
            continue
        m = _BB_MD.match(s)
        if m:
            v = m.groups()
            rows.append({"pp": int(v[0]), "tg": int(v[1]), "pl": int(v[2]), "n_kv": int(v[3]), "t_pp": float(v[4]),
                         "speed_pp": float(v[5]), "t_tg": float(v[6]), "speed_tg": float(v[7]), "t": float(v[8]),
                         "speed": float(v[9])})
    if not rows:
        raise PeerInputError(f"{where}: expected llama-batched-bench result rows (jsonl or the markdown table), "
                             f"found none")
    return rows


_Q_TENSOR = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+-\s+\[([^\]]*)\],\s+type =\s+(\S+),\s+(converting to (\S+)|size =)")
_Q_FALLBACK = re.compile(r"warning:\s+(\S+)\s+-\s+ncols\s+(\d+)\s+not divisible by\s+(\d+)\s+\(required for type\s+"
                         r"(\S+)\)\s*(\(WARNING: must use F16 due to unusual shape\)\s*)?-> falling back to\s+(\S+)")
_Q_COUNT = re.compile(r"WARNING: (\d+) of (\d+) tensor\(s\) required fallback quantization")


def parse_quantize_log(text: str) -> dict:
    """What ``llama-quantize`` did (src/llama-quant.cpp's log): ``tensors`` (name, shape, from, to: the type it
    wrote; ``to == from`` when it kept the tensor), ``fallbacks`` (name, ncols, block, asked, used: a tensor whose
    row length is not a multiple of the asked type's block, e.g. the expert down projection's 640 columns for
    the 256-wide K-quants), ``n_fallback`` as llama-quantize counted them (None when it printed no count) and
    ``by_type`` (tensor count per written type)."""
    tensors, fallbacks = [], []
    for m in _Q_FALLBACK.finditer(text):
        fallbacks.append({"name": m.group(1), "ncols": int(m.group(2)), "block": int(m.group(3)),
                          "asked": m.group(4), "used": m.group(6), "f16_forced": bool(m.group(5))})
    for m in _Q_TENSOR.finditer(text):
        to = m.group(5) or m.group(3)
        tensors.append({"name": m.group(1), "shape": [int(x) for x in m.group(2).split(",") if x.strip()],
                        "from": m.group(3), "to": to})
    cm = _Q_COUNT.search(text)
    by_type: dict[str, int] = {}
    for t in tensors:
        by_type[t["to"]] = by_type.get(t["to"], 0) + 1
    return {"tensors": tensors, "fallbacks": fallbacks, "n_fallback": int(cm.group(1)) if cm else None,
            "by_type": by_type}


_ERR = re.compile(r"(error|failed|GGML_ASSERT|exception|terminate called|out of memory|not supported|abort)",
                  re.IGNORECASE)


def llama_error(stderr: str, rc) -> str:
    """llama.cpp's own message for a failed run: its error lines (at most the last 3, joined), else its last
    line, with the exit status."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if _ERR.search(ln)]
    msg = " | ".join(errs[-3:]) if errs else (lines[-1] if lines else "(no output)")
    return f"{msg} (exit status {rc})"


def median(xs):
    """The median of ``xs`` as a float (the mean of the middle two for an even count); None when empty."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
