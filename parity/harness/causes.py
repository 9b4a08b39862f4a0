"""One root cause at a time: failures grouped by their first divergence, and a baseline of known causes.

A failure's **root cause** is the first diverging tap named by tap-diff (or what stands in for it: 'returned
logits' after the last tap, 'batching', a 'selection outside the tie set' of a QSA/MoE layer that no earlier tap
explains, 'logits' when no tap-diff was made). Its ``id`` is that tap: one bug diverges first at one tap, whatever
operation met it (a one-block MLP bug fails the kl prompts, every prefill, chunked prefill, batch and decode at
the same tap and first position), so report.json and the table list it once with every case it explains, the
operations it was met in and its first position. The failure's own operation kind (prefill, chunked prefill,
decode, batched decode, verify, restore, ...) and regime (below or past the QSA bound) stay in the record; a cause
carries the regime label only where the bound matters -- every failure of it lies past the QSA bound (below it
the indexer keeps every token, so such a bug is one of selection).

A failure also carries its **fault** (:func:`fault_of`): where it is -- every failing position of the failing
comparison (``"prompt I position P"`` in the KL harness) -- with the logit error there (in units of the logit
scale, what the verdict judges) and whether the top-1 token flipped there.

``--write-known FILE`` writes the run's root causes with their faults, the model's identity (config hash,
weights fingerprint) and the ``--backend`` spec; ``--known FILE`` reads them back (:class:`KnownCauses`; a
baseline of another model or backend is refused). A failing case is excused -- reported ``known``, not
failed, so the remaining scenarios still judge the backend -- only when its root cause id is in the baseline
AND every failing position is one the baseline recorded for that id AND the error there exceeds the
recorded one by at most one tolerance band (:data:`KNOWN_BAND`) AND no top-1 flip is new there. Anything else
fails, naming what is new.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from parity.harness.jsonio import jsonable
from parity.harness.sizes import sizes
from parity.harness.thresholds import position_faults
from reference import atomic
from reference.errors import InputError
from reference.taphook import layer_of

__all__ = ["root_cause", "cause_id", "cause_id_of", "group_causes", "fault_of", "model_identity", "prompts_identity", "write_known", "read_known",
           "KnownCauses",
           "KNOWN_VERSION", "KNOWN_BAND"]

# 2: model identity, backend spec and per-position faults (version 1 held bare ids, which excused any failure of
# the same tap/operation/regime wherever and however large it was)
KNOWN_VERSION = 2
# a known fault may exceed its recorded error by this many tolerance bands (tol_rel x the logit scale at that
# position, the run's pass limit from the measured floor): the deviation a PASS allows from the truth is the
# deviation allowed from the recorded fault -- a re-run of the same fault measures the same error (a
# deterministic backend: exactly), a second bug on top of it adds more than the floor-derived band
KNOWN_BAND = 1.0
_TAP = re.compile(r"first divergence (\S+?)(?: at position (\d+))?(?:[ ;(]|$)")
_POS = re.compile(r"(?:first failing position|at position) (\d+)")
_TIE = re.compile(r"(QSA blocks|MoE experts) of layer (\d+) at position (\d+)")


def _operation(failure: str) -> str:
    """The operation kind a failure message starts with (the Run's descriptions, parity.harness.scenarios.common)."""
    f = failure.lstrip()
    head = f.split(":")[0]
    if f.startswith(("ragged prefill_batch", "prefill_batch")):   # Run.prefill_batch's (and the suites') words
        return "chunked prefill_batch" if " in chunks of " in head else "prefill_batch"
    for prefix, kind in (("decode batch of 1", "decode"), ("decode batch of", "batched decode"),
                         ("verify", "verify"), ("restore", "restore"), ("rollback", "rollback"),
                         ("snapshot", "snapshot"), ("prompt", "kl")):
        if f.startswith(prefix):
            return kind
    if f.startswith("prefill"):
        return "chunked prefill" if " in chunks of " in head else "prefill"
    if f.startswith("piece ["):   # one piece of a chunked prefill interleaved with other sequences' pieces
        return "chunked prefill"
    if "decode" in head:
        return "decode"
    return "check"


def cause_id(tap: str) -> str:
    """The root cause id of a first divergence at ``tap``: the tap itself (a baseline written with the older
    ``"<tap> | <operation> | <regime>"`` ids reads back through :func:`cause_id_of`)."""
    return str(tap)


def cause_id_of(old_or_new: str) -> str:
    """A stored cause id in the current form: ``"<tap> | <operation> | <regime>"`` (older baselines) -> ``"<tap>"``."""
    return cause_id(str(old_or_new).split(" | ")[0])


def _earlier(tap: str, tap_pos, sel_layer: int, sel_pos: int) -> bool:
    """Whether a tap-diff first divergence ``tap`` at ``tap_pos`` (None: unknown) comes before a selection of layer
    ``sel_layer`` at ``sel_pos`` in the forward: an earlier position, or the same position in an earlier layer (or
    outside the layers before them: the embedding)."""
    if tap_pos is None:
        return False
    tap_pos = int(tap_pos)
    if tap_pos != sel_pos:
        return tap_pos < sel_pos
    if not tap.startswith("layers."):
        return tap.startswith(("embed", "hc_expand", "ple_input"))
    return layer_of(tap) < sel_layer


def root_cause(failure: str | None, divergence: str | None, config=None, scenario: str = "",
               raised_in: str | None = None) -> dict:
    """The root cause of one failure (see the module docstring).

    Args:
        failure: the failing check's message; divergence: the located first divergence (may be None);
        config: the model config (for the QSA bound), or None; raised_in: for a case whose backend raised, the
        operation it raised in ('?' unknown): the cause is then the exception there, no tap.
    Returns:
        ``{"id", "tap", "layer", "block", "operation", "regime", "position"}``.
    """
    if raised_in is not None:
        return {"id": cause_id("backend raised"), "tap": "backend raised", "layer": None, "block": "backend raised",
                "operation": raised_in, "regime": "?", "position": None}
    failure, divergence = failure or "", divergence or ""
    op = "kl decode" if "decode:" in failure and failure.startswith("prompt") else _operation(failure)
    gen = re.match(r"prompt \d+: (prefill_last|decode_greedy) ", failure.lstrip())
    if gen:   # the generation path (parity.harness.kl.generation_paths)
        op = f"kl {gen.group(1)}"
    tap, pos = "logits", None
    m = _TIE.search(failure) if "outside the tie set" in failure else None
    d = _TAP.search(divergence)
    if m and d is not None and _earlier(d.group(1), d.group(2), int(m.group(2)), int(m.group(3))):
        m = None   # the pick outside the tie set follows from an earlier divergence: that one is the cause
    if m:
        tap = f"layers.{m.group(2)}." + ("self_attn.indexer.selected_blocks" if m.group(1) == "QSA blocks"
                                          else "mlp.gate.topk_ids")
        pos = int(m.group(3))
    elif d is not None:
        tap = d.group(1)
        pos = int(d.group(2)) if d.group(2) else None
    elif "nondeterministic" in divergence:   # identical runs differ: no tap, no operation is to blame
        tap = "nondeterministic"
    elif divergence.startswith("batching") or "batching:" in divergence:
        # a batch of requests: one prefill_batch call, else a batched decode (its rows then agree inside: the
        # batch, not the returned logits of a single sequence, is the cause)
        tap, op = "batching", (op if op.endswith("prefill_batch") else "batched decode")
    elif "returned logits" in divergence:
        tap = "returned logits"
    elif divergence.startswith(("refused", "sequence length", "state ")):
        tap = divergence.split(":")[0].split("(")[0].strip()
    if pos is None:   # the first failing position (not the operation's start, which the description may name first)
        p = (re.search(r"first failing position (\d+)", failure) or re.search(r"first at position (\d+)", divergence)
             or _POS.search(failure))
        pos = int(p.group(1)) if p is not None else None
    regime = "?"
    if config is not None and pos is not None:
        s = sizes(config)
        # position p sees p + 1 tokens; at and below `bound` visible tokens QSA keeps every token
        regime = "past the QSA bound" if (s.has_qsa and pos + 1 > s.bound) else "below the QSA bound"
    layer = layer_of(tap) if tap.startswith("layers.") else None
    block = tap.split(".")[2] if layer is not None and len(tap.split(".")) > 2 else tap
    return {"id": cause_id(tap), "tap": tap, "layer": layer, "block": block, "operation": op,
            "regime": regime, "position": pos}


def fault_of(cmp, th, offset: int = 0, prefix: str = "") -> dict:
    """The fault of a failing logit comparison: ``{location: [logit error / scale, top-1 flipped]}`` at every
    position failing the verdict's rules (:func:`parity.harness.kl.position_faults`).

    Args:
        cmp: a :class:`parity.harness.kl.LogitComparison` of ``n`` rows; th: the ``KLThresholds`` judging it;
        offset: the absolute position of row 0; prefix: put before each location (``"prompt 3 "``).
    Returns:
        ``{"<prefix>position P": [err_rel (float; inf for a non-finite row), top1_flip (bool)]}``.
    """
    bad = np.nonzero(position_faults(cmp, th))[0]
    rel = np.asarray(cmp.rel_err(), dtype=np.float64)
    top1 = np.asarray(cmp.top1, dtype=bool)
    out = {}
    for i in bad:
        e = float(rel[i])
        out[f"{prefix}position {offset + int(i)}"] = [e if np.isfinite(e) else float("inf"), bool(not top1[i])]
    return out


def _fault_or_place(fault: dict | None, rc: dict) -> dict:
    """A failure's fault, or -- for one without compared logits (a refusal, a check, an error) -- its root
    cause's position with no error figure."""
    if fault:
        return fault
    pos = rc.get("position")
    return {(f"position {pos}" if pos is not None else "unlocated"): [None, False]}


def _err(x) -> float | None:
    """A stored error figure as a float (JSON keeps inf / nan as strings; nan counts as inf), or None."""
    if x is None:
        return None
    x = float(x)
    return float("inf") if x != x else x


def _places(locs, n: int = 3) -> str:
    locs = list(locs)
    return ", ".join(locs[:n]) + (f" and {len(locs) - n} more" if len(locs) > n else "")


def group_causes(rows) -> list[dict]:
    """Group every failing case of the report's rows by root cause id (its tap): ``[{"id", "tap", ..., "operations":
    [every operation kind it was met in], "position": its first position, "regime": "past the QSA bound" when
    every failure of it lies past the bound else None, "cases": [labels],
    "first": first failure message, "known": bool, "fault": {location: [worst err_rel, any top-1 flip]},
    "worst_logit_err_rel", "top1_flip"[, "known_note"]}]`` in order of first appearance (``known``: every case
    of it was excused by the ``--known`` baseline; ``known_note``: what is new in the first one it did not)."""
    out: dict[str, dict] = {}
    for r in rows:
        for f in getattr(r, "failures", None) or []:
            rc = f.get("root_cause") if isinstance(f, dict) else None
            if not rc:
                continue
            g = out.setdefault(rc["id"], {**rc, "cases": [], "first": f.get("failure") or f.get("reason"),
                                          "known": True, "fault": {}, "operations": [], "regimes": []})
            if rc.get("operation") not in g["operations"]:
                g["operations"].append(rc.get("operation"))
            g["regimes"].append(rc.get("regime"))
            p = rc.get("position")
            if p is not None and (g.get("position") is None or p < g["position"]):
                g["position"] = p
            g["known"] = g["known"] and bool(f.get("known"))
            if f.get("known_note") and not g.get("known_note"):   # the first reason the baseline did not excuse it
                g["known_note"] = f["known_note"]
            for loc, (e, flip) in _fault_or_place(f.get("fault"), rc).items():
                e0, flip0 = g["fault"].get(loc, [None, False])
                e, e0 = _err(e), _err(e0)
                g["fault"][loc] = [e if e0 is None else (e0 if e is None else max(e, e0)), bool(flip or flip0)]
            label = f.get("label") or f"{f.get('scenario', r.scenario)}/{f.get('case', '?')}"
            g["cases"].append(label)
    for g in out.values():
        errs = [e for e, _ in g["fault"].values() if e is not None]
        g["worst_logit_err_rel"] = max(errs) if errs else None
        g["top1_flip"] = any(fl for _, fl in g["fault"].values())
        regimes = g.pop("regimes")
        # the bound matters only when the cause shows nowhere below it
        g["regime"] = "past the QSA bound" if regimes and all(x == "past the QSA bound" for x in regimes) else None
        g["operation"] = ", ".join(str(o) for o in g["operations"])
    return list(out.values())


def model_identity(model_path) -> dict:
    """``{"config_hash", "weights_fingerprint"}`` of the checkpoint at ``model_path`` (the identity taps archives
    and snapshot files carry; the fingerprint reads a few bytes per tensor).

    Raises:
        CheckpointError / ConfigError: the checkpoint cannot be opened.
    """
    from reference.checkpoint import Checkpoint   # slow to import (over 1 s): only for a --known baseline
    ck = Checkpoint.open(str(model_path))
    return {"config_hash": ck.config.config_hash(), "weights_fingerprint": ck.fingerprint()}


def prompts_identity(prompts) -> str:
    """sha256 of the kl prompts' token ids (``[[int]]``, in order): a baseline's positions ("prompt I position P")
    mean something only for the prompts they were measured on."""
    return hashlib.sha256(json.dumps([[int(t) for t in p] for p in prompts]).encode()).hexdigest()


def write_known(path, causes: list[dict], meta: dict | None = None) -> Path:
    """Write a baseline of known root causes (JSON, atomically: :func:`reference.atomic.atomic_write_json`).

    Args:
        causes: :func:`group_causes` of the run (each with its ``fault``).
        meta: the run's identity: ``model`` (:func:`model_identity`, plus ``path``), ``backend_spec`` (the
            ``--backend`` spec, normalised), ``backend`` (its name), ``level``, ``scenarios``, ``tol_rel``,
            ``prompts`` (:func:`prompts_identity` of the kl prompts).
    The caller checks the path first (``parity.cli.common.check_out``: no overwrite without --overwrite, the
    parent must exist).
    """
    doc = {"version": KNOWN_VERSION, **(meta or {}),
           "causes": [{"id": c["id"], "tap": c.get("tap"), "operation": c.get("operation"), "regime": c.get("regime"),
                       "worst_logit_err_rel": c.get("worst_logit_err_rel"), "top1_flip": bool(c.get("top1_flip")),
                       "positions": c.get("fault") or {}, "first": c.get("first"), "cases": c.get("cases", [])}
                      for c in causes]}
    return atomic.atomic_write_json(path, jsonable(doc), indent=1)


class KnownCauses:
    """A ``--known`` baseline (:func:`read_known`): which failures it excuses (:meth:`judge`).

    Attributes:
        path: the file; model: its ``{"config_hash", "weights_fingerprint", ...}``; backend_spec: its
        ``--backend`` spec; tol_rel: the tolerance of the run that wrote it; causes: ``{id: {location: [err_rel
        or None, top1_flip]}}``.
    """

    def __init__(self, path, doc: dict):
        self.path = str(path)
        self.model = doc.get("model") or {}
        self.backend_spec = doc.get("backend_spec")
        self.prompts = doc.get("prompts")
        self.tol_rel = _err(doc.get("tol_rel"))
        self.causes: dict[str, dict] = {}
        for c in doc["causes"]:
            at = self.causes.setdefault(cause_id_of(c["id"]), {})
            for loc, (e, flip) in (c.get("positions") or {}).items():
                at[loc] = [_err(e), bool(flip)]

    def __len__(self) -> int:
        return len(self.causes)

    def check_identity(self, model: dict, backend_spec: str, model_path=None, prompts: str | None = None) -> None:
        """Refuse a baseline measured on another model (config hash or weights fingerprint), another backend, or
        other kl prompts (``prompts``: :func:`prompts_identity` of this run's; a baseline without one is refused
        when this run's is given, since its "prompt I position P" places cannot be matched).

        Raises:
            InputError: naming the file, this run's model / backend and the baseline's.
        """
        diff = [k for k in ("config_hash", "weights_fingerprint") if self.model.get(k) != model.get(k)]
        if diff:
            here = ", ".join(f"{k} {model.get(k)}" for k in diff)
            there = ", ".join(f"{k} {self.model.get(k)}" for k in diff)
            raise InputError(f"--known {self.path!r}: expected a baseline of this model ({model_path or 'MODEL'}: "
                             f"{here}), found one of another model ({self.model.get('path', '?')}: {there}); a known "
                             f"divergence holds only for the model it was measured on (write a baseline for this "
                             f"model with --write-known)")
        if self.backend_spec != backend_spec:
            raise InputError(f"--known {self.path!r}: expected a baseline of backend {backend_spec!r}, found one of "
                             f"backend {self.backend_spec!r}; a known divergence holds only for the backend it was "
                             f"measured on (write a baseline for this backend with --write-known)")
        if prompts is not None and self.prompts != prompts:
            raise InputError(f"--known {self.path!r}: expected a baseline measured on this run's kl prompts (sha256 "
                             f"{prompts[:12]}...), found one of " + (f"other prompts (sha256 {self.prompts[:12]}...)"
                                                                     if self.prompts else "unrecorded prompts")
                             + "; its 'prompt I position P' places hold only for the prompts they were measured on "
                             "(write a baseline with these --prompts and --write-known)")

    def judge(self, rc: dict, fault: dict | None, tol_rel: float | None) -> tuple[bool, str]:
        """Whether the baseline excuses a failure with root cause ``rc`` (:func:`root_cause`) and ``fault``
        (:func:`fault_of`; None for a failure without compared logits).

        Excused only when ``rc["id"]`` is a known cause, every failing location is one it recorded, the error
        there is at most the recorded one + :data:`KNOWN_BAND` x ``tol_rel`` (this run's tolerance; None: the
        baseline's), and no top-1 flip is new there. Returns ``(excused, what is new)`` (``""`` when excused).
        """
        at = self.causes.get(cause_id_of(rc.get("id")))
        if at is None:
            return False, f"root cause {rc.get('id')!r} is not in the --known baseline"
        tol = tol_rel if tol_rel is not None else (self.tol_rel or 0.0)
        band = KNOWN_BAND * tol
        new, larger, flips = [], [], []
        for loc, (e, flip) in _fault_or_place(fault, rc).items():
            if loc not in at:
                new.append(loc)
                continue
            e, (e0, flip0) = _err(e), at[loc]
            if e is not None and (e0 is None or e > e0 + band):
                larger.append(f"{loc}: {e:.3g} > " + ("none" if e0 is None else f"{e0:.3g}") + f" + {band:.2g}")
            if flip and not flip0:
                flips.append(loc)
        why = []
        if new:
            why.append(f"new failing position(s) {_places(new)} (the baseline's {rc['id']!r} is at "
                       f"{_places(at) or 'no position'})")
        if larger:
            why.append("logit error / scale larger than the known one by more than one tolerance band at "
                       + _places(larger))
        if flips:
            why.append(f"top-1 flips the baseline did not have at {_places(flips)}")
        return (not why), "; ".join(why)


def read_known(path) -> KnownCauses:
    """A ``--known`` baseline (:class:`KnownCauses`; check it with :meth:`KnownCauses.check_identity`).

    Raises:
        InputError: unreadable, not JSON, not a baseline, or one of an older version (naming the file and
            what was found).
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--known {str(path)!r}: expected a readable baseline written by --write-known, found "
                         f"{'no such file' if isinstance(e, FileNotFoundError) else (e.strerror or e)}") from None
    except ValueError as e:
        raise InputError(f"--known {str(path)!r}: expected a JSON baseline written by --write-known, found invalid "
                         f"JSON ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("version"), int) and doc["version"] < KNOWN_VERSION:
        raise InputError(f"--known {str(path)!r}: expected a baseline of version {KNOWN_VERSION} (with the model's "
                         f"identity and each cause's positions and size), found version {doc['version']} (bare cause "
                         f"ids, which cannot tell a new fault from the known one): write it again with --write-known")
    if not isinstance(doc, dict) or doc.get("version") != KNOWN_VERSION or not isinstance(doc.get("causes"), list):
        raise InputError(f"--known {str(path)!r}: expected a baseline written by --write-known (version "
                         f"{KNOWN_VERSION}, a 'causes' list), found {type(doc).__name__}"
                         + (f" with keys {sorted(doc)[:5]}" if isinstance(doc, dict) else ""))
    for c in doc["causes"]:
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(c.get("positions", {}), dict):
            raise InputError(f"--known {str(path)!r}: expected each cause to be an object with an 'id' string and "
                             f"a 'positions' object, found {str(c)[:60]!r}")
        for loc, v in c.get("positions", {}).items():
            ok = isinstance(v, list) and len(v) == 2 and (v[0] is None or isinstance(v[0], (int, float, str)))
            try:
                _err(v[0]) if ok else None
            except ValueError:
                ok = False
            if not ok:
                raise InputError(f"--known {str(path)!r}: cause {c['id']!r} position {loc!r}: expected [error or "
                                 f"null, top-1 flipped], found {str(v)[:60]!r}")
    if not isinstance(doc.get("model"), dict) or not doc.get("backend_spec"):
        raise InputError(f"--known {str(path)!r}: expected the baseline's 'model' identity and 'backend_spec', found "
                         + ("no model" if not isinstance(doc.get("model"), dict) else "no backend_spec"))
    return KnownCauses(path, doc)
