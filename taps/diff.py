"""tap-diff: align two tap recordings by name and position, measure every tap, and name the first
divergence in forward order (with the last agreeing tap before it).

Metrics per activation tap (over the positions both recordings hold; float64 accumulation):
  * ``max_abs`` = max |b - a|;  ``max_rel`` = max |b - a| / max(|a|, |b|) (0 where both are 0);
  * ``rel_l2`` = ||b - a|| / ||a||;  ``cosine`` = <a, b> / (||a|| ||b||) (1 when both are 0);
  * ``nonfinite`` = elements where a non-finite value differs (NaN never agrees; equal infinities
    agree and are left out of the norms);
  * the tolerance test of the profile (see ``taps/profiles/fp32.toml``), the first position that
    breaks it, and ``limit_ratio`` (how close the tap came to the profile's limits; 1.0 = at one).
Index taps: a selection tap's rows (registry ``as_set``: QSA blocks/tokens, routed experts) are compared as
sets of valid ids (``registry.selection_ids``: -1 padding, the padded width and the order of the ids do not
count, so two recordings padded to different widths compare position by position); other index taps
(``ngram_ids``: one id per head) id by id, a width mismatch being a divergence; exact-match rate of rows, mean set overlap, and per differing row a verdict:
  * *error*: B's pick contradicts B's own companion scores (including the canonical tie-break:
    higher score first, then lower index), or the best item B dropped beats the worst item B took
    by more than the profile's score tolerance on A's scores, or no scores to judge by;
  * *flip*: otherwise (both items lie within the score tolerance of the cut-off), with its margin.
A divergence at or after a flip (later in forward order, at or after the flip's position) is
reported as possibly explained by it.

Memory stays bounded: each tap is read in row chunks sized to ``memory_budget`` bytes.
"""
from __future__ import annotations

import fnmatch
import json
import math
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from reference.errors import UserError
from taps import registry
from taps.archive import Archive, TapSource

__all__ = ["DiffRefused", "ProfileError", "Profile", "JoinedProfile", "load_profile", "profile_name_for",
           "judging_profile", "profile_toml", "TapResult", "DiffReport", "diff_archives", "compare_tap", "bench_diff",
           "replay_check", "render_table", "PROFILES_DIR"]

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(UserError, ValueError):
    """A tolerance profile that cannot be found or read."""


class DiffRefused(UserError, ValueError):
    """The two archives are of different models or token streams (pass force to diff anyway)."""


# ---------------------------------------------------------------- profiles
_ACT_KEYS = {"rel_l2": float, "rtol": float, "atol_rms": float, "atol": float, "cos_min": float}
_IDX_KEYS = {"score_rtol": float, "score_atol": float}


@dataclass
class Profile:
    """Tolerances by tap kind with per-pattern overrides (first matching ``[[tap]] pattern`` wins)."""

    name: str
    activation: dict
    index: dict
    overrides: list[dict] = field(default_factory=list)
    source: str = ""

    def for_tap(self, name: str) -> dict:
        """The merged tolerance dict for tap ``name`` (activation and index keys)."""
        tol = {**self.activation, **self.index}
        for o in self.overrides:
            if fnmatch.fnmatchcase(name, o["pattern"]):
                tol.update({k: v for k, v in o.items() if k != "pattern"})
                break
        return tol


def load_profile(spec: str | Path = "fp32") -> Profile:
    """Load a tolerance profile: a bundled name (``fp32``, ``bf16``) or a TOML file path.

    Raises:
        ProfileError: unknown name / missing file / invalid TOML / missing or non-numeric bounds.
    """
    p = Path(spec)
    if not p.suffix and not p.exists():
        p = PROFILES_DIR / f"{spec}.toml"
        if not p.is_file():
            names = sorted(x.stem for x in PROFILES_DIR.glob("*.toml"))
            raise ProfileError(f"profile {str(spec)!r}: expected one of {names} or a TOML file, found neither")
    if not p.is_file():
        raise ProfileError(f"profile {str(spec)!r}: expected a TOML file, found no file")
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # non-UTF-8 bytes: one clear error too
        raise ProfileError(f"profile {str(p)!r}: not valid TOML ({e})") from None

    def section(key, keys):
        d = raw.get(key)
        if not isinstance(d, dict):
            raise ProfileError(f"profile {str(p)!r}: expected a [{key}] table, found {d!r}")
        out = {}
        for k, typ in keys.items():
            v = d.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                raise ProfileError(f"profile {str(p)!r}: [{key}] {k}: expected a number >= 0, found {v!r}")
            out[k] = float(v)
        return out

    act = section("activation", _ACT_KEYS)
    idx = section("index", _IDX_KEYS)
    overrides = []
    for o in raw.get("tap", []):
        if not isinstance(o, dict) or not isinstance(o.get("pattern"), str):
            raise ProfileError(f"profile {str(p)!r}: each [[tap]] needs a string 'pattern', found {o!r}")
        for k, v in o.items():
            if k != "pattern" and (k not in _ACT_KEYS and k not in _IDX_KEYS or not isinstance(v, (int, float))):
                raise ProfileError(f"profile {str(p)!r}: [[tap]] {o['pattern']!r}: key {k!r}: expected one of "
                                   f"{sorted({**_ACT_KEYS, **_IDX_KEYS})} with a number, found {v!r}")
        overrides.append(dict(o))
    return Profile(name=str(raw.get("name", p.stem)), activation=act, index=idx, overrides=overrides, source=str(p))


@dataclass
class JoinedProfile(Profile):
    """The loosest of several profiles, tap by tap: per tolerance key the largest bound (``cos_min``: the
    smallest). A tap beyond a joined profile is therefore beyond EVERY part, e.g. beyond the bundled profile
    ``qwen4exp taps diff`` uses by default: a divergence named under it is one ``taps diff`` names too."""

    parts: tuple = ()

    def for_tap(self, name: str) -> dict:
        """The joined tolerance dict for tap ``name``."""
        tols = [p.for_tap(name) for p in self.parts]
        out: dict = {}
        for t in tols:
            for k, v in t.items():
                out[k] = v if k not in out else (min(out[k], v) if k == "cos_min" else max(out[k], v))
        return out


def profile_name_for(precision: str) -> str:
    """The bundled profile ``taps diff`` judges a backend of ``precision`` with: ``bf16`` for a bf16/fp8
    backend (8 or fewer mantissa bits somewhere on its path), ``fp32`` otherwise."""
    return "bf16" if precision in ("bf16", "fp8") else "fp32"


def judging_profile(precision: str = "float32", *measured: Profile | None) -> Profile:
    """The one profile every automatic tap-diff judges with (the parity scenarios' and kl's failure location,
    their locate-through-state search): the join (:class:`JoinedProfile`, the looser bound tap by tap) of the
    ``measured`` per-tap floor profiles given (``parity.harness.floor.tap_floor_profile``: one measured on the
    very history being located, and the run's own), else the bundled profile of ``precision``
    (:func:`profile_name_for`, what ``qwen4exp taps diff`` uses by default). A floor measured on another prompt
    alone can sit below the reference's own float32 error on this one (measured: 1.1e-5 allowed where the float32
    reference is 2.4e-5 off float64), and naming such a tap sends a porting team to a block that is right;
    the floor of the same history cannot."""
    parts = tuple(m for m in measured if m is not None)
    if not parts:
        return load_profile(profile_name_for(precision))
    if len(parts) == 1:
        return parts[0]
    return JoinedProfile(name=" joined with ".join(p.name for p in parts), activation=dict(parts[0].activation),
                         index=dict(parts[0].index), source=" + ".join(p.source for p in parts), parts=parts)


def profile_toml(profile: Profile, names) -> str:
    """``profile`` as a TOML profile file (:func:`load_profile` reads it back) with one exact ``[[tap]]`` per
    name in ``names``: saved next to a located failure's archives so ``taps diff --profile FILE`` judges them
    with the very tolerances the locate used."""
    def fmt(d):
        return "\n".join(f"{k} = {float(d[k])!r}" for k in sorted(d) if k in _ACT_KEYS or k in _IDX_KEYS)
    act = {**profile.activation}
    idx = {**profile.index}
    if isinstance(profile, JoinedProfile):   # the defaults of a joined profile: the join of its parts' defaults
        for part in profile.parts:
            for k, v in part.activation.items():
                act[k] = min(act.get(k, v), v) if k == "cos_min" else max(act.get(k, v), v)
            for k, v in part.index.items():
                idx[k] = max(idx.get(k, v), v)
    desc = json.dumps("saved by " + (profile.source or "tap-diff"))
    out = [f"name = {json.dumps(profile.name)}", f"description = {desc}", "", "[activation]", fmt(act), "",
           "[index]", fmt(idx)]
    for n in names:
        if any(c in n for c in "*?["):
            continue
        out += ["", "[[tap]]", f"pattern = {json.dumps(n)}", fmt(profile.for_tap(n))]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- results
FAILING = ("diverged", "no-overlap")   # statuses that make a tap-diff fail (exit 1)

@dataclass
class TapResult:
    """The comparison of one tap. ``status``: agree / flip / diverged / missing-in-a / missing-in-b /
    no-overlap. ``first_position``: the first position beyond tolerance (None when none).

    ``no-overlap`` (recorded in both, at no common position) is NOT agreement: like ``diverged`` it
    makes the report fail (see :attr:`failed`). A tap recorded on one side only (``missing-in-*``,
    e.g. different ``--taps`` filters) is listed but does not decide the verdict."""

    name: str
    kind: str
    status: str
    rows: int = 0
    metrics: dict = field(default_factory=dict)
    first_position: int | None = None
    note: str = ""
    flips: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when ``status`` is 'agree' or 'flip'."""
        return self.status in ("agree", "flip")

    @property
    def failed(self) -> bool:
        """Diverged, or recorded on both sides but impossible to compare (counts as a divergence)."""
        return self.status in FAILING


@dataclass
class DiffReport:
    """Everything tap-diff found. ``exit_code``: 0 agree, 1 diverged."""

    a: str
    b: str
    profile: str
    results: list[TapResult]
    identity: dict
    first_divergence: str | None = None
    last_agreeing: str | None = None
    explained_by_flip: str | None = None
    replay: dict | None = None
    elapsed_s: float = 0.0
    bytes_read: int = 0

    @property
    def agree(self) -> bool:
        """True when no tap diverged (``first_divergence`` is None)."""
        return self.first_divergence is None

    @property
    def exit_code(self) -> int:
        """0 when :attr:`agree`, else 1."""
        return 0 if self.agree else 1

    @property
    def missing_in_a(self) -> list[str]:
        """Taps recorded by B only (forward order): with A the truth, B's *extra* taps."""
        return [r.name for r in self.results if r.status == "missing-in-a"]

    @property
    def missing_in_b(self) -> list[str]:
        """Taps recorded by A only (forward order): with A the truth, the taps B is *missing*."""
        return [r.name for r in self.results if r.status == "missing-in-b"]

    def coverage_note(self, a_label: str = "a", b_label: str = "b", show: int = 4) -> str:
        """One clause listing the taps only one side recorded (empty when both recorded the same set), e.g.
        ``missing in b: layers.1.ple.conv_out, layers.2.self_attn.indexer.block_keys (+3 more)``: a one-line
        summary must not hide that a block was never compared."""
        def names(xs):
            return ", ".join(xs[:show]) + (f" (+{len(xs) - show} more)" if len(xs) > show else "")
        parts = []
        if self.missing_in_b:
            parts.append(f"missing in {b_label}: {names(self.missing_in_b)}")
        if self.missing_in_a:
            parts.append(f"extra in {b_label} (not in {a_label}): {names(self.missing_in_a)}")
        return "; ".join(parts)

    def result(self, name: str) -> TapResult | None:
        """The :class:`TapResult` of tap ``name``, or None when it is not in the report."""
        for r in self.results:
            if r.name == name:
                return r
        return None

    def to_dict(self) -> dict:
        """The report as a JSON-ready dict: the report's fields, ``agree``, every tap's result and, when a
        tap diverged, ``first_divergence_detail`` (tap, layer, official module, position, metrics, note)."""
        d = {"a": self.a, "b": self.b, "profile": self.profile, "agree": self.agree, "identity": self.identity,
             "first_divergence": self.first_divergence, "last_agreeing": self.last_agreeing,
             "explained_by_flip": self.explained_by_flip, "replay": self.replay,
             "elapsed_s": self.elapsed_s, "bytes_read": self.bytes_read,
             "missing_in_a": self.missing_in_a, "missing_in_b": self.missing_in_b,
             "taps": [asdict(r) for r in self.results]}
        fd = self.result(self.first_divergence) if self.first_divergence else None
        if fd is not None:
            d["first_divergence_detail"] = {"tap": fd.name, "layer": registry.layer_of(fd.name),
                                            "module": (registry.spec_for(fd.name).module.replace(
                                                "{i}", str(registry.layer_of(fd.name)))
                                                if registry.spec_for(fd.name) else None),
                                            "position": fd.first_position, "metrics": fd.metrics, "note": fd.note}
        return d

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=1, default=_json_default)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# ---------------------------------------------------------------- alignment
def align_positions(pa: np.ndarray, pb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Align two recorded position lists (emit order, may repeat: a position recorded twice -- e.g.
    after a rollback -- counts by its LAST row).

    Returns: ``(positions [n], rows_a [n], rows_b [n])``: the common positions in ascending order and
    the row index holding each in A and in B.
    """
    pa = np.asarray(pa, dtype=np.int64)
    pb = np.asarray(pb, dtype=np.int64)

    def last_rows(p):
        # unique positions with the index of their last occurrence
        rev = p[::-1]
        u, first_in_rev = np.unique(rev, return_index=True)
        return u, (len(p) - 1 - first_in_rev).astype(np.int64)

    ua, ra = last_rows(pa)
    ub, rb = last_rows(pb)
    common, ia, ib = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    return common.astype(np.int64), ra[ia], rb[ib]


# ---------------------------------------------------------------- activation comparison
_ROW_KERNEL = None


def _row_kernel():
    """The fused per-row statistics kernel (Numba, compiled on first use, cached on disk)."""
    global _ROW_KERNEL
    if _ROW_KERNEL is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def rows_stats(a, b, rtol, out, out_i):
            # out[r] = d2, a2, b2, ab, excess, max_abs, max_rel ; out_i[r] = nonfinite, n_finite, argmax col
            n, m = a.shape
            for r in range(n):
                d2 = 0.0
                a2 = 0.0
                b2 = 0.0
                ab = 0.0
                exc = -np.inf
                mx = -1.0
                mxc = 0
                mr = 0.0
                bad = 0
                nf = 0
                for c in range(m):
                    x = np.float64(a[r, c])
                    y = np.float64(b[r, c])
                    if np.isfinite(x) and np.isfinite(y):
                        nf += 1
                        d = abs(y - x)
                        ax = abs(x)
                        d2 += d * d
                        a2 += x * x
                        b2 += y * y
                        ab += x * y
                        e = d - rtol * ax
                        if e > exc:
                            exc = e
                        if d > mx:
                            mx = d
                            mxc = c
                        den = max(ax, abs(y))
                        if den > 0.0 and d / den > mr:
                            mr = d / den
                    else:
                        if not (x == y):
                            bad += 1
                        if 0.0 > exc:
                            exc = 0.0
                        if mx < 0.0:
                            mx = 0.0
                            mxc = c
                out[r, 0] = d2
                out[r, 1] = a2
                out[r, 2] = b2
                out[r, 3] = ab
                out[r, 4] = exc
                out[r, 5] = max(mx, 0.0)
                out[r, 6] = mr
                out_i[r, 0] = bad
                out_i[r, 1] = nf
                out_i[r, 2] = mxc
        _ROW_KERNEL = rows_stats
    return _ROW_KERNEL


class _ActAcc:
    """Streaming accumulator for one activation tap (per-row statistics from one fused pass)."""

    def __init__(self, n_rows: int, rtol: float):
        self.rtol = rtol
        self.n = 0
        self.nonfinite = 0
        self.max_abs = 0.0
        self.max_abs_at = None
        self.max_rel = 0.0
        self.d2 = self.a2 = self.b2 = self.ab = 0.0
        self.row_excess = np.zeros(n_rows)   # max over the row of |d| - rtol*|a|
        self.row_nonfinite = np.zeros(n_rows, dtype=bool)
        self.row_d2 = np.zeros(n_rows)
        self.row_a2 = np.zeros(n_rows)

    def add(self, r0: int, a: np.ndarray, b: np.ndarray, pos: np.ndarray):
        """Accumulate rows ``r0 .. r0 + n`` of the tap: ``a``/``b`` ``[n, ...]`` (flattened to ``[n, -1]``; compared
        in float64 when the dtypes differ or are not floating), ``pos`` int ``[n]`` their positions."""
        a = np.ascontiguousarray(a.reshape(len(a), -1))
        b = np.ascontiguousarray(b.reshape(len(b), -1))
        if a.dtype != b.dtype:
            a, b = a.astype(np.float64), b.astype(np.float64)
        n = len(a)
        if n == 0:
            return
        if a.dtype.kind != "f":
            a, b = a.astype(np.float64), b.astype(np.float64)
        out = np.empty((n, 7))
        out_i = np.empty((n, 3), dtype=np.int64)
        _row_kernel()(a, b, float(self.rtol), out, out_i)
        self.nonfinite += int(out_i[:, 0].sum())
        self.row_nonfinite[r0:r0 + n] = out_i[:, 0] > 0
        self.n += int(out_i[:, 1].sum())
        k = int(np.argmax(out[:, 5]))
        if out[k, 5] > self.max_abs or self.max_abs_at is None:
            self.max_abs = float(out[k, 5])
            self.max_abs_at = (int(pos[k]), int(out_i[k, 2]))
        self.max_rel = max(self.max_rel, float(out[:, 6].max()))
        self.row_excess[r0:r0 + n] = out[:, 4]
        self.row_d2[r0:r0 + n] = out[:, 0]
        self.row_a2[r0:r0 + n] = out[:, 1]
        self.d2 += float(out[:, 0].sum())
        self.a2 += float(out[:, 1].sum())
        self.b2 += float(out[:, 2].sum())
        self.ab += float(out[:, 3].sum())

    def finish(self, tol: dict, positions: np.ndarray) -> tuple[dict, bool, int | None, str]:
        """Judge the accumulated statistics against profile tolerances ``tol`` (keys ``rel_l2``, ``rtol``,
        ``atol``, ``atol_rms``, ``cos_min``); ``positions [n_rows]`` maps rows to positions.

        Returns:
            ``(metrics, diverged, first_position or None, reasons joined by '; ')``.
        """
        na, nb = math.sqrt(self.a2), math.sqrt(self.b2)
        nd = math.sqrt(self.d2)
        rel_l2 = 0.0 if nd == 0 else (nd / na if na > 0 else math.inf)
        cos = 1.0 if na == 0 and nb == 0 else (self.ab / (na * nb) if na > 0 and nb > 0 else 0.0)
        rms = math.sqrt(self.a2 / self.n) if self.n else 0.0
        bound = tol["atol_rms"] * rms + tol["atol"]
        elem_bad = self.row_excess > bound
        mean_row_a = math.sqrt(self.a2 / max(1, len(self.row_a2)))
        row_rel = np.sqrt(self.row_d2) / mean_row_a if mean_row_a > 0 else np.where(self.row_d2 > 0, np.inf, 0.0)
        reasons = []
        if self.nonfinite:
            reasons.append(f"{self.nonfinite} non-finite mismatches")
        if rel_l2 > tol["rel_l2"]:
            reasons.append(f"rel_l2 {rel_l2:.3g} > {tol['rel_l2']:.3g}")
        if elem_bad.any():
            reasons.append(f"{int(elem_bad.sum())} positions with |b-a| > {tol['rtol']:.3g}|a| + {bound:.3g}")
        if cos < tol["cos_min"]:
            reasons.append(f"cosine {cos:.7f} < {tol['cos_min']}")
        diverged = bool(reasons)
        first = None
        if diverged:
            bad_rows = elem_bad | self.row_nonfinite | (row_rel > tol["rel_l2"])
            if bad_rows.any():
                first = int(positions[np.nonzero(bad_rows)[0][0]])
        metrics = {"max_abs": self.max_abs, "max_abs_at": self.max_abs_at, "max_rel": self.max_rel,
                   "rel_l2": rel_l2, "cosine": cos, "nonfinite": self.nonfinite, "rms_a": rms,
                   "bad_positions": int(elem_bad.sum())}
        # how close to the profile's limits (1.0 = at a limit): the largest of the three ratios
        ex = float(self.row_excess.max()) if len(self.row_excess) else 0.0
        ratios = [rel_l2 / tol["rel_l2"] if tol["rel_l2"] > 0 else (math.inf if rel_l2 > 0 else 0.0),
                  (ex / bound if bound > 0 else (math.inf if ex > 0 else 0.0)) if ex > 0 else 0.0,
                  ((1 - cos) / (1 - tol["cos_min"]) if tol["cos_min"] < 1 else (math.inf if cos < 1 else 0.0))]
        metrics["limit_ratio"] = math.inf if self.nonfinite else max(0.0, *ratios)
        return metrics, diverged, first, "; ".join(reasons)


# ---------------------------------------------------------------- index comparison
_OWN_EPS = 1e-6  # ~8 float32 ulps: B's picks are judged against its own scores up to this relative slack
                 # (a selection made on, e.g., softmax probabilities can order two logits that close
                 # either way); exact ties must follow the canonical lower-index rule.


def _beats(s: np.ndarray, x: int, y: int) -> bool:
    """Does item ``x`` rank clearly before ``y`` under scores ``s`` (canonical: higher score, then lower index)?"""
    sx, sy = float(s[x]), float(s[y])
    if sx == sy:
        return x < y
    if math.isnan(sx) or math.isnan(sy):
        return False
    if math.isinf(sx) or math.isinf(sy):
        return sx > sy
    return sx - sy > _OWN_EPS * max(abs(sx), abs(sy))


def _canonical_violation(taken: np.ndarray, scores: np.ndarray) -> tuple[int, int] | None:
    """Is the set ``taken`` (a -1 padded row of picks, any order: a selection is compared as a set) the
    canonical top-k of ``scores`` (score descending, then lower index), up to a relative slack of ``_OWN_EPS``
    between unequal scores?

    Returns: a violating ``(better_item, item_B_put_in_its_place)`` pair, or None.
    """
    items = list(registry.selection_ids(taken))
    n = scores.shape[-1]
    if any(x >= n for x in items):
        return (items[-1], items[-1])  # out of range: certainly wrong
    if not items:
        return None
    # the weakest pick (lowest score; among equal scores the highest index) against every unpicked
    # visible candidate, vectorised
    sc = np.asarray(scores, dtype=np.float64)
    j = max(items, key=lambda t: (-sc[t], t))
    sj = sc[j]
    cand = np.ones(n, dtype=bool)
    cand[items] = False
    cand &= np.isfinite(sc)
    idx = np.arange(n)
    with np.errstate(invalid="ignore"):
        clear = sc - sj > _OWN_EPS * np.maximum(np.abs(sc), abs(sj)) if math.isfinite(sj) else sc > sj
    hit = cand & (clear | ((sc == sj) & (idx < j)))
    if hit.any():
        return (int(np.nonzero(hit)[0][0]), int(j))
    return None


class _IdxAcc:
    """Streaming accumulator for one index tap (with optional companion scores)."""

    def __init__(self, tol: dict, max_examples: int = 20, as_set: bool = True):
        self.tol = tol
        self.as_set = as_set  # rows are selections (registry.is_selection): compared as sets of valid ids
        self.max_examples = max_examples
        self.rows = 0
        self.exact = 0
        self.overlap = 0.0
        self.n_flips = 0
        self.n_errors = 0
        self.n_unjudged = 0
        self.flips: list[dict] = []
        self.errors: list[dict] = []
        self.first_error_pos = None
        self.first_flip_pos = None
        self.max_flip_margin = 0.0

    def _tol(self, x, y):
        return self.tol["score_atol"] + self.tol["score_rtol"] * max(abs(x), abs(y))

    def add(self, a, b, pos, sa=None, sb=None):
        """Accumulate index rows ``a``/``b`` ``[n, ...]`` (flattened to ``[n, -1]``; negative entries are padding) at
        positions ``pos [n]``; ``sa``/``sb``: optional companion scores per row, used to judge each differing row as a
        near-tie flip or an error."""
        a = a.reshape(len(a), -1)
        b = b.reshape(len(b), -1)
        # rows agree when their valid ids agree as sets (registry.selection_ids): identical rows take the fast
        # path; the rest (another order, another padded width) are compared id set by id set
        same = (a == b).all(axis=1) if a.shape == b.shape else np.zeros(len(a), dtype=bool)
        if self.as_set:
            for r in np.nonzero(~same)[0]:
                same[r] = registry.same_selection(a[r], b[r])
        n_same = int(same.sum())
        self.rows += n_same
        self.exact += n_same
        self.overlap += n_same
        for r in np.nonzero(~same)[0]:
            self.rows += 1
            ar, br = a[r], b[r]
            sA = set(registry.selection_ids(ar))
            sB = set(registry.selection_ids(br))
            self.overlap += (len(sA & sB) / len(sA)) if sA else (1.0 if not sB else 0.0)
            p = int(pos[r])
            verdict = self._judge(ar, br, sA, sB, None if sa is None else sa[r], None if sb is None else sb[r])
            verdict["position"] = p
            if verdict["kind"] == "flip":
                self.n_flips += 1
                self.max_flip_margin = max(self.max_flip_margin, verdict["margin"])
                if self.first_flip_pos is None:
                    self.first_flip_pos = p
                if len(self.flips) < self.max_examples:
                    self.flips.append(verdict)
            else:
                self.n_errors += 1
                if verdict.get("unjudged"):
                    self.n_unjudged += 1
                if self.first_error_pos is None:
                    self.first_error_pos = p
                if len(self.errors) < self.max_examples:
                    self.errors.append(verdict)

    def _judge(self, ar, br, sA, sB, sa, sb) -> dict:
        dropped, taken = sorted(sA - sB), sorted(sB - sA)
        base = {"a": [int(x) for x in ar], "b": [int(x) for x in br], "dropped": dropped, "taken": taken}
        na, nb = len(registry.selection_ids(ar)), len(registry.selection_ids(br))
        if na != nb:
            return {**base, "kind": "error", "why": f"A picked {na} items, B {nb}"}
        if not dropped or not taken:  # same count, yet no id swapped for another
            return {**base, "kind": "error", "why": ("an id picked more than once" if self.as_set else
                                                     "the same ids in other places (this tap is positional)")}
        if sb is not None:
            v = _canonical_violation(br, np.asarray(sb, dtype=np.float64))
            if v is not None:
                better, worse = v
                tie = float(sb[better]) == float(sb[worse]) if better < len(sb) and worse < len(sb) else False
                why = (f"B's pick contradicts its own scores: item {better} ranks before {worse}"
                       + (" (tie: the lower index wins)" if tie else ""))
                return {**base, "kind": "error", "why": why, "tie_break": tie}
        if sa is None:
            return {**base, "kind": "error", "unjudged": True, "why": "no companion scores to judge the pick by"}
        sa = np.asarray(sa, dtype=np.float64)
        x = max(dropped, key=lambda i: sa[i])
        y = min(taken, key=lambda i: sa[i])
        margin, t = float(sa[x] - sa[y]), self._tol(sa[x], sa[y])
        pair = (x, y)
        if math.isnan(margin) or margin == math.inf:
            return {**base, "kind": "error", "why": f"non-finite score margin ({margin})", "margin": margin}
        if margin > t:
            return {**base, "kind": "error", "why": f"dropped item {pair[0]} beats taken item {pair[1]} by "
                    f"{margin:.4g} > tolerance {t:.3g} (A's scores)", "margin": margin, "tolerance": t}
        return {**base, "kind": "flip", "margin": max(margin, 0.0), "tolerance": t, "pair": list(pair) if pair else None}

    def finish(self):
        """Returns ``(metrics, status, first_position or None, note)``; ``status`` is 'diverged' (any
        selection error), 'flip' (only near-tie flips) or 'agree'."""
        metrics = {"exact_match": self.exact / self.rows if self.rows else 1.0,
                   "set_overlap": self.overlap / self.rows if self.rows else 1.0,
                   "flips": self.n_flips, "errors": self.n_errors, "unjudged": self.n_unjudged,
                   "max_flip_margin": self.max_flip_margin}
        if self.n_errors:
            status, first = "diverged", self.first_error_pos
            note = f"{self.n_errors} selection errors" + (f", {self.n_flips} flips" if self.n_flips else "")
            if self.errors:
                note += f"; first at position {self.errors[0]['position']}: {self.errors[0]['why']}"
        elif self.n_flips:
            status, first = "flip", self.first_flip_pos
            note = f"{self.n_flips} near-tie flips (max margin {self.max_flip_margin:.3g})"
        else:
            status, first, note = "agree", None, ""
        return metrics, status, first, note


# ---------------------------------------------------------------- one tap
def _pad_scores(x: np.ndarray, width: int) -> np.ndarray:
    if x.shape[-1] == width:
        return x
    out = np.full((*x.shape[:-1], width), -np.inf, dtype=np.float64)
    out[..., :x.shape[-1]] = x
    return out


def _span(pos: np.ndarray) -> str:
    pos = np.asarray(pos)
    return "no positions" if len(pos) == 0 else f"{len(pos)} rows at positions {int(pos.min())}..{int(pos.max())}"


def compare_tap(A: TapSource, B: TapSource, name: str, profile: Profile, memory_budget: int = 256 << 20,
                stats: dict | None = None) -> TapResult:
    """Compare tap ``name`` of ``A`` (the reference side) and ``B``, streamed in row chunks.

    Raises:
        ArchiveError: the tap is missing from either side.
    """
    ia, ib = A.info(name), B.info(name)
    kind = ia.kind
    tol = profile.for_tap(name)
    common, ra, rb = align_positions(A.positions(name), B.positions(name))
    if len(common) == 0:
        return TapResult(name, kind, "no-overlap", 0,
                         note=(f"cannot be compared: the two recordings share no position of this tap (A has "
                               f"{_span(A.positions(name))}, B has {_span(B.positions(name))})"))
    comp = registry.companion_of(name) if kind == registry.INDEX else None
    ragged = bool(A._tap(name).get("ragged") or B._tap(name).get("ragged"))
    # an index row is a set of valid ids (registry.selection_ids): its padded width is no shape of its own
    index_pair = kind == registry.INDEX and ib.kind == registry.INDEX and registry.is_selection(name)
    if ia.tail != ib.tail and not index_pair and not (ragged and ia.tail[:-1] == ib.tail[:-1]
                                                      and len(ia.tail) == len(ib.tail) >= 1):
        return TapResult(name, kind, "diverged", len(common), first_position=int(common[0]),
                         note=f"shape differs: A rows {ia.tail}, B rows {ib.tail}")
    width = max(ia.tail[-1], ib.tail[-1]) if ragged else None
    row_bytes = max(ia.row_bytes, ib.row_bytes, 8)
    chunk = max(1, int(memory_budget // (row_bytes * 12)))
    if kind == registry.INDEX:
        have_scores = comp is not None and A.has(comp) and B.has(comp)
        sa_map = sb_map = None
        if have_scores:
            ca, cra, crb = align_positions(A.positions(comp), B.positions(comp))
            sa_map = dict(zip(ca.tolist(), cra.tolist()))
            sb_map = dict(zip(ca.tolist(), crb.tolist()))
        acc = _IdxAcc(tol, as_set=registry.is_selection(name))
        for s in range(0, len(common), chunk):
            sl = slice(s, s + chunk)
            a, b = A.read_rows(name, ra[sl]), B.read_rows(name, rb[sl])
            if stats is not None:
                stats["bytes"] = stats.get("bytes", 0) + a.nbytes + b.nbytes
            sa = sb = None
            if have_scores and all(int(p) in sa_map for p in common[sl]):
                sa = A.read_rows(comp, np.array([sa_map[int(p)] for p in common[sl]]))
                sb = B.read_rows(comp, np.array([sb_map[int(p)] for p in common[sl]]))
                w = max(sa.shape[-1], sb.shape[-1])
                sa, sb = _pad_scores(sa, w), _pad_scores(sb, w)
            acc.add(a, b, common[sl], sa, sb)
        metrics, status, first, note = acc.finish()
        if comp is not None and not have_scores:
            note = (note + "; " if note else "") + f"companion {comp} not in both archives: differing picks unjudged"
        return TapResult(name, kind, status, len(common), metrics, first, note, acc.flips, acc.errors)
    acc = _ActAcc(len(common), tol["rtol"])
    for s in range(0, len(common), chunk):
        sl = slice(s, s + chunk)
        a, b = A.read_rows(name, ra[sl]), B.read_rows(name, rb[sl])
        if stats is not None:
            stats["bytes"] = stats.get("bytes", 0) + a.nbytes + b.nbytes
        if width is not None:
            a, b = _pad_scores(a, width), _pad_scores(b, width)
        acc.add(s, a, b, common[sl])
    metrics, diverged, first, note = acc.finish(tol, common)
    return TapResult(name, kind, "diverged" if diverged else "agree", len(common), metrics, first, note)


# ---------------------------------------------------------------- identity
def check_identity(A: TapSource, B: TapSource) -> tuple[dict, list[str]]:
    """Compare model identity and token ids. Returns ``(identity dict, list of mismatch messages)``;
    a field missing from either side is reported as unverified, not as a mismatch."""
    ident, problems = {}, []
    for key in ("config_hash", "weights_fingerprint"):
        va, vb = A.model.get(key), B.model.get(key)
        ident[key] = {"a": va, "b": vb, "verified": va is not None and vb is not None}
        if va is not None and vb is not None and va != vb:
            problems.append(f"{key} differs: A {va}, B {vb}")
    ta, tb = A.token_ids, B.token_ids
    ident["token_ids"] = {"verified": ta is not None and tb is not None, "a_len": None if ta is None else len(ta),
                          "b_len": None if tb is None else len(tb)}
    if ta is not None and tb is not None and list(ta) != list(tb):
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        problems.append(f"token ids differ (A {len(ta)} tokens, B {len(tb)}; first difference at index {k})")
    ident["backend"] = {"a": A.backend, "b": B.backend}
    ident["dtype"] = {"a": A.dtype, "b": B.dtype}
    return ident, problems


# ---------------------------------------------------------------- the diff
def _open(x) -> TapSource:
    return x if isinstance(x, TapSource) else Archive.open(x)


def diff_archives(a, b, profile: Profile | str = "fp32", force: bool = False, taps: list[str] | None = None,
                  memory_budget: int = 256 << 20, progress: bool = False,
                  until_position: int | None = None) -> DiffReport:
    """Diff recordings ``a`` (the reference side) and ``b``: archive paths or :class:`TapSource` objects.

    Args:
        profile: a :class:`Profile` or a name/path for :func:`load_profile`.
        force: diff even when the model identity or the token ids differ.
        taps: only taps matching these globs.
        until_position: a tap whose first position beyond tolerance is AFTER it does not count as the first
            divergence (``taps diff --until-position``; the parity harness passes the first failing logit position:
            a cause lies at or before it). Every position is still compared, at the tap's whole-recording scale.
        memory_budget: approximate bytes held per tap chunk (bounded-memory streaming).
        progress: show a tqdm bar on stderr.

    Returns: a :class:`DiffReport` (``first_divergence``, ``last_agreeing``, ``explained_by_flip``, per-tap results).

    Raises:
        DiffRefused: different models or tokens and not ``force``.
        ArchiveError / ProfileError: unreadable inputs.
    """
    t0 = time.perf_counter()
    A, B = _open(a), _open(b)
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    ident, problems = check_identity(A, B)
    if problems and not force:
        raise DiffRefused(f"archives {_label(a)} and {_label(b)}: expected recordings of the same model and "
                          f"tokens, found: {'; '.join(problems)} (pass --force to diff anyway)")
    ident["forced_past"] = problems
    names_a, names_b = set(A.names()), set(B.names())
    names = sorted(names_a | names_b, key=registry.order_key)
    if taps:
        names = [n for n in names if registry.matches(n, taps)]
        if not names:
            raise DiffRefused(f"--taps {' '.join(taps)}: expected a glob matching taps of the archives, found 0 "
                              f"matching ({len(names_a)} taps in A, {len(names_b)} in B; `qwen4exp taps list MODEL` "
                              f"lists the names)")
    results: list[TapResult] = []
    stats: dict = {}
    it = names
    if progress:
        from tqdm import tqdm
        it = tqdm(names, desc="tap-diff", unit="tap", file=sys.stderr)
    out_a, out_b = _outside(A), _outside(B)
    for n in it:
        if n not in names_b:
            results.append(_one_sided(n, A, "b", out_b))
        elif n not in names_a:
            results.append(_one_sided(n, B, "a", out_a))
        else:
            results.append(compare_tap(A, B, n, prof, memory_budget, stats))
    if not any(r.status in ("agree", "flip", "diverged", "no-overlap") for r in results):
        raise DiffRefused(f"archives {_label(a)} and {_label(b)}: expected taps recorded at common positions in "
                          f"both, found none to compare ({len(names_a)} taps in A, {len(names_b)} in B"
                          f"{', after --taps' if taps else ''})")
    rep = DiffReport(a=_label(a), b=_label(b), profile=prof.name, results=results, identity=ident)
    _conclude(rep, until_position)
    rep.elapsed_s = time.perf_counter() - t0
    rep.bytes_read = int(stats.get("bytes", 0))
    return rep


def _outside(S: TapSource) -> tuple[list, set]:
    """(positions ranges, tap names) a recording's run emitted outside its ``positions`` filter
    (manifest ``outside_positions``, written by :class:`taps.recorder.Recorder`); empty when none."""
    o = (getattr(S, "manifest", None) or {}).get("outside_positions") or {}
    return list(o.get("positions") or []), set(o.get("taps") or [])


def _one_sided(name: str, S: TapSource, other: str, other_outside: tuple[list, set]) -> TapResult:
    """A tap recorded only in ``S``. When the other side's run did emit it, but only at positions its
    filter dropped, the tap was produced by both and shares no position: ``no-overlap`` (a divergence,
    e.g. a backend whose position bookkeeping is off), else ``missing-in-<other>`` (not a verdict)."""
    from taps.recorder import format_ranges
    ranges, names = other_outside
    if name in names:
        return TapResult(name, S.info(name).kind, "no-overlap", 0,
                         note=(f"cannot be compared: {other.upper()}'s run emitted this tap only at positions "
                               f"{format_ranges(ranges)}, outside its recorded positions; "
                               f"{'B' if other == 'a' else 'A'} has {_span(S.positions(name))}"))
    return TapResult(name, S.info(name).kind, f"missing-in-{other}",
                     note=f"recorded only in {'B' if other == 'a' else 'A'}")


def _label(x) -> str:
    return getattr(x, "where", None) if isinstance(x, TapSource) else str(x)


def _conclude(rep: DiffReport, until_position: int | None = None) -> None:
    """Name the first divergence (forward order), the last agreeing tap before it, and an earlier
    flip that may explain it. ``until_position``: a tap first beyond tolerance after it is not counted."""
    last_ok = None
    flips: list[TapResult] = []
    for r in rep.results:
        if r.failed and until_position is not None and r.first_position is not None \
                and r.first_position > int(until_position):
            r.note = (r.note + "; " if r.note else "") + (f"first beyond tolerance at position {r.first_position}, "
                                                          f"after position {int(until_position)}: not counted")
            continue
        if r.failed:
            rep.first_divergence = r.name
            rep.last_agreeing = last_ok
            for f in flips:
                if r.first_position is None or f.first_position is None or f.first_position <= r.first_position:
                    rep.explained_by_flip = f.name
                    r.note = (r.note + "; " if r.note else "") + f"possibly explained by the earlier flip at {f.name}"
                    break
            return
        if r.status == "flip":
            flips.append(r)
        if r.ok:
            last_ok = r.name


# ---------------------------------------------------------------- replay (bisect)
def replay_check(model, B: TapSource, tap: str, profile: Profile | str = "fp32", A: TapSource | None = None) -> dict:
    """Re-run the block producing ``tap`` in the reference ``model`` on B's recorded input to that block
    and compare the replayed output with B's recorded ``tap``.

    Uses ``model.replay_inputs(tap) -> list[str]`` and ``model.replay(tap, inputs, token_ids) -> dict``.

    Returns: ``{"tap", "inputs", "verdict": "block" | "upstream", "message", "replayed_vs_b": metrics}``:
    ``block`` when B's output is wrong given its own input (a block bug), ``upstream`` when the
    reference, fed B's input, reproduces B's output (the input already carried the error).

    Raises:
        ArchiveError: B lacks an input tap or the token ids the replay needs.
        UserError: the model cannot replay this tap.
    """
    from taps.archive import ArchiveError, MemoryArchive
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    B = _open(B)
    need = list(model.replay_inputs(tap))
    token_ids = B.token_ids
    if token_ids is None:
        raise ArchiveError(f"{B.where}: replay of {tap!r}: expected the archive's token ids, found none")
    inputs = {}
    for n in need:
        if not B.has(n):
            raise ArchiveError(f"{B.where}: replay of {tap!r} needs the input tap {n!r}, which was not recorded "
                               f"(record it too, e.g. --taps '{n}')")
        pos = B.positions(n)
        common, _, rows = align_positions(pos, pos)
        if len(common) != len(token_ids) or (len(common) and (common[0] != 0 or common[-1] != len(token_ids) - 1)):
            raise ArchiveError(f"{B.where}: replay of {tap!r}: input tap {n!r} must cover positions 0..{len(token_ids)-1}, "
                               f"found {len(common)} positions")
        inputs[n] = B.read_rows(n, rows)
    out = model.replay(tap, inputs, list(token_ids))
    if tap not in out:
        raise UserError(f"replay of {tap!r}: the model returned {sorted(out)} but not the tap itself")
    positions = np.arange(len(token_ids), dtype=np.int64)
    manifest = {"order": [], "taps": {}}
    data = {}
    for n, v in out.items():
        v = np.asarray(v)
        kind = (registry.spec_for(n).kind if registry.spec_for(n) else "activation")
        manifest["order"].append(n)
        manifest["taps"][n] = {"dtype": str(v.dtype), "tail": list(v.shape[1:]), "rows": len(v), "kind": kind}
        data[n] = [(positions[:len(v)], v)]
    R = MemoryArchive(manifest, data)
    res = compare_tap(R, B, tap, prof)
    verdict = "upstream" if res.ok else "block"
    vs_a = None
    if A is not None:
        A = _open(A)
        if A.has(tap):
            vs_a = compare_tap(R, A, tap, prof)
    if verdict == "block":
        msg = (f"block bug: fed B's own recorded input ({', '.join(need)}), the reference block does not "
               f"reproduce B's {tap} ({res.note})")
        if vs_a is not None and vs_a.ok:
            msg += "; it reproduces A's instead"
    else:
        msg = (f"look upstream: fed B's recorded input ({', '.join(need)}), the reference block reproduces B's "
               f"{tap}; the error was already in the block's input")
    return {"tap": tap, "inputs": need, "verdict": verdict, "message": msg, "replayed_vs_b": res.metrics,
            "status": res.status, "replayed_vs_a": None if vs_a is None else vs_a.metrics}


# ---------------------------------------------------------------- output
_STYLE = {"agree": "green", "flip": "yellow", "diverged": "bold red", "missing-in-a": "magenta",
          "missing-in-b": "magenta", "no-overlap": "magenta"}


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


# the summary's words for each tap status, in the order they are listed
_STATUS_WORDS = (("agree", "agree"), ("flip", "with flips only"), ("diverged", "diverged"),
                 ("no-overlap", "not comparable (no common position)"), ("missing-in-b", "only in A (missing in B)"),
                 ("missing-in-a", "only in B (missing in A)"))


def summary_counts(results) -> str:
    """``N taps, n agree, n with flips only, n diverged[, n <other status>...]``: every tap counted once, under
    its status (a status not in :data:`_STATUS_WORDS` by its own name), so the parts add up to N."""
    from collections import Counter
    c = Counter(r.status for r in results)
    parts = [f"{c.pop(k, 0)} {w}" for k, w in _STATUS_WORDS[:3]]
    parts += [f"{c.pop(k)} {w}" for k, w in _STATUS_WORDS[3:] if k in c]
    parts += [f"{n} {k}" for k, n in sorted(c.items())]
    return f"{len(results)} taps, " + ", ".join(parts)


def render_table(rep: DiffReport, show_all: bool = False, file=None, color: bool | None = None) -> None:
    """Print the report as an aligned table (colour only when ``file`` is a terminal, or ``color``).

    Without ``show_all`` only non-agreeing taps, the first divergence and the last agreeing tap are listed.
    """
    from rich.console import Console
    from rich.table import Table
    file = file or sys.stdout
    tty = file.isatty() if hasattr(file, "isatty") else False
    color = tty if color is None else color
    con = Console(file=file, color_system="auto" if color else None, force_terminal=color, width=200 if not tty else None,
                  highlight=False, soft_wrap=False)
    rows = [r for r in rep.results if show_all or not r.status == "agree" or r.name in
            (rep.first_divergence, rep.last_agreeing)]
    t = Table(box=None, pad_edge=False, show_edge=False)
    for col in ("tap", "status", "rows", "max_abs", "max_rel", "rel_l2", "cosine", "match/flip/err", "first_pos"):
        t.add_column(col, justify="left" if col in ("tap", "status") else "right", no_wrap=True)
    for r in rows:
        m = r.metrics
        if r.kind == registry.INDEX:
            mf = (f"{m.get('exact_match', 0):.3f}/{m.get('flips', 0)}/{m.get('errors', 0)}" if m else "-")
            cols = ["-", "-", "-", "-", mf]
        else:
            cols = [_fmt(m.get("max_abs")), _fmt(m.get("max_rel")), _fmt(m.get("rel_l2")),
                    _fmt(m.get("cosine"), ".7f") if m.get("cosine") is not None else "-", "-"]
        status = r.status
        mark = " <- FIRST DIVERGENCE" if r.name == rep.first_divergence else (
            " <- last agreeing" if r.name == rep.last_agreeing and rep.first_divergence else "")
        st = f"[{_STYLE.get(status, '')}]{status}[/]" if color else status
        t.add_row(r.name + mark, st, str(r.rows), *cols, _fmt(r.first_position))
    if rows:
        con.print(t)
    con.print(f"A: {rep.a}\nB: {rep.b}\nprofile {rep.profile}: {summary_counts(rep.results)}")
    if rep.identity.get("forced_past"):
        con.print("forced past identity checks: " + "; ".join(rep.identity["forced_past"]))
    if rep.first_divergence:
        fd = rep.result(rep.first_divergence)
        layer = registry.layer_of(fd.name)
        where = ", ".join(x for x in (None if layer is None else f"layer {layer}",
                                      None if fd.first_position is None else f"position {fd.first_position}") if x)
        con.print(f"FIRST DIVERGENCE: {fd.name}" + (f" ({where})" if where else "") + f": {fd.note}")
        con.print("last agreeing tap before it: " + (rep.last_agreeing or "none (the first compared tap diverged)"))
        if rep.explained_by_flip:
            con.print(f"note: this divergence comes after near-tie flips at {rep.explained_by_flip}; it may be "
                      f"explained by them rather than by a bug")
    else:
        con.print("AGREE: every common tap is within tolerance")
    for r in rep.results:
        if r.flips and (show_all or r.name == rep.explained_by_flip or rep.agree):
            for f in r.flips[:3]:
                con.print(f"flip at {r.name}, position {f['position']}: A {f['a']} vs B {f['b']}, score margin "
                          f"{f['margin']:.3g} <= tolerance {f['tolerance']:.3g}")
            if r.metrics.get("flips", 0) > 3:
                con.print(f"  ... {r.metrics['flips'] - 3} more flips at {r.name} (see --json)")
    if rep.replay:
        con.print(f"replay of {rep.replay['tap']}: {rep.replay['message']}")


# ---------------------------------------------------------------- benchmark
def bench_diff(a, b, profile: Profile | str = "fp32", repeat: int = 1, memory_budget: int = 256 << 20) -> float:
    """Diff throughput in MB/s (bytes of tap data read from both sides per second; best of ``repeat``)."""
    best = 0.0
    for _ in range(max(1, repeat)):
        rep = diff_archives(a, b, profile, force=True, memory_budget=memory_budget)
        if rep.elapsed_s > 0:
            best = max(best, rep.bytes_read / 1e6 / rep.elapsed_s)
    return best
