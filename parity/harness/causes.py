"""One root cause at a time: failures grouped by their first divergence, and a baseline of known causes.

A failure's **root cause** is ``(tap, condition)``: the first diverging tap named by tap-diff (or what stands
in for it: 'returned logits' after the last tap, 'batching', a 'selection outside the tie set' of a QSA/MoE
layer, 'logits' when no tap-diff was made) and the condition it appeared under: the operation kind
(prefill, chunked prefill, decode, batched decode, verify, restore, ...) and the regime (below or past the QSA
bound). Its ``id`` is ``"<tap> | <operation> | <regime>"``: the same bug met by several cases and scenarios
has one id, so report.json and the table list it once with every case it explains.

``--write-known FILE`` writes the run's root causes; ``--known FILE`` reads them back: a case whose root
cause is known is reported as ``known`` (not failed), so the remaining scenarios still judge the backend
(e.g. its chunking, snapshots and rollback past one selection bug at the budget bound).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["root_cause", "group_causes", "write_known", "read_known", "KNOWN_VERSION"]

KNOWN_VERSION = 1
_TAP = re.compile(r"first divergence (\S+?)(?: at position (\d+))?(?:[ ;(]|$)")
_POS = re.compile(r"(?:first failing position|at position) (\d+)")
_TIE = re.compile(r"(QSA blocks|MoE experts) of layer (\d+) at position (\d+)")


def _operation(failure: str) -> str:
    """The operation kind a failure message starts with (the Run's descriptions, parity.harness.scenarios.common)."""
    f = failure.lstrip()
    for prefix, kind in (("decode batch of 1", "decode"), ("decode batch of", "batched decode"),
                         ("verify", "verify"), ("restore", "restore"), ("rollback", "rollback"),
                         ("snapshot", "snapshot"), ("prompt", "kl")):
        if f.startswith(prefix):
            return kind
    if f.startswith("prefill"):
        return "chunked prefill" if " in chunks of " in f.split(":")[0] else "prefill"
    if "decode" in f.split(":")[0]:
        return "decode"
    return "check"


def root_cause(failure: str | None, divergence: str | None, config=None, scenario: str = "") -> dict:
    """The root cause of one failure (see the module docstring).

    Args:
        failure: the failing check's message; divergence: the located first divergence (may be None);
        config: the model config (for the QSA bound), or None.
    Returns:
        ``{"id", "tap", "layer", "block", "operation", "regime", "position"}``.
    """
    from reference.taphook import layer_of
    failure, divergence = failure or "", divergence or ""
    op = "kl decode" if "decode:" in failure and failure.startswith("prompt") else _operation(failure)
    tap, pos = "logits", None
    m = _TIE.search(failure) if "outside the tie set" in failure else None
    if m:
        tap = f"layers.{m.group(2)}." + ("self_attn.indexer.selected_blocks" if m.group(1) == "QSA blocks"
                                          else "mlp.gate.topk_ids")
        pos = int(m.group(3))
    elif (d := _TAP.search(divergence)) is not None:
        tap = d.group(1)
        pos = int(d.group(2)) if d.group(2) else None
    elif "returned logits" in divergence:
        tap = "returned logits"
    elif divergence.startswith("batching") or "batching:" in divergence:
        tap, op = "batching", "batched decode"
    elif divergence.startswith(("refused", "sequence length", "state ")):
        tap = divergence.split(":")[0].split("(")[0].strip()
    if pos is None:   # the first failing position (not the operation's start, which the description may name first)
        p = (re.search(r"first failing position (\d+)", failure) or re.search(r"first at position (\d+)", divergence)
             or _POS.search(failure))
        pos = int(p.group(1)) if p is not None else None
    regime = "?"
    if config is not None and pos is not None:
        from parity.harness.scenarios.common import sizes
        s = sizes(config)
        # position p sees p + 1 tokens; at and below `bound` visible tokens QSA keeps every token
        regime = "past the QSA bound" if (s.has_qsa and pos + 1 > s.bound) else "below the QSA bound"
    layer = layer_of(tap) if tap.startswith("layers.") else None
    block = tap.split(".")[2] if layer is not None and len(tap.split(".")) > 2 else tap
    return {"id": f"{tap} | {op} | {regime}", "tap": tap, "layer": layer, "block": block, "operation": op,
            "regime": regime, "position": pos}


def group_causes(rows) -> list[dict]:
    """Group every failing case of the report's rows by root cause id: ``[{"id", "tap", ..., "cases": [labels],
    "first": first failure message, "known": bool}]`` in order of first appearance."""
    out: dict[str, dict] = {}
    for r in rows:
        for f in getattr(r, "failures", None) or []:
            rc = f.get("root_cause") if isinstance(f, dict) else None
            if not rc:
                continue
            g = out.setdefault(rc["id"], {**rc, "cases": [], "first": f.get("failure") or f.get("reason"),
                                          "known": bool(f.get("known"))})
            label = f.get("label") or f"{f.get('scenario', r.scenario)}/{f.get('case', '?')}"
            g["cases"].append(label)
    return list(out.values())


def write_known(path, causes: list[dict], meta: dict | None = None) -> Path:
    """Write a baseline of known root causes (JSON, atomically)."""
    from reference.atomic import atomic_write_json
    doc = {"version": KNOWN_VERSION, **(meta or {}),
           "causes": [{"id": c["id"], "first": c.get("first"), "cases": c.get("cases", [])} for c in causes]}
    return atomic_write_json(path, doc, indent=1)


def read_known(path) -> set[str]:
    """The root-cause ids of a ``--known`` baseline.

    Raises:
        InputError: unreadable, not JSON, or not a baseline (naming the file and what was found).
    """
    from reference.errors import InputError
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--known {str(path)!r}: cannot be read: {e.strerror or e}") from None
    except ValueError as e:
        raise InputError(f"--known {str(path)!r}: expected a JSON baseline written by --write-known, found invalid "
                         f"JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != KNOWN_VERSION or not isinstance(doc.get("causes"), list):
        raise InputError(f"--known {str(path)!r}: expected a baseline written by --write-known (version "
                         f"{KNOWN_VERSION}, a 'causes' list), found {type(doc).__name__}"
                         + (f" with keys {sorted(doc)[:5]}" if isinstance(doc, dict) else ""))
    ids = set()
    for c in doc["causes"]:
        if not isinstance(c, dict) or not isinstance(c.get("id"), str):
            raise InputError(f"--known {str(path)!r}: expected each cause to be an object with an 'id' string, "
                             f"found {str(c)[:60]!r}")
        ids.add(c["id"])
    return ids
