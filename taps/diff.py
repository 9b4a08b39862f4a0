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

This module joins the pieces: :mod:`taps.profiles` (the tolerances), :mod:`taps.accumulate` (alignment and
per-tap statistics), :mod:`taps.report` (results and the table); :mod:`taps.replay` bisects a divergence.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from reference.errors import UserError
from taps import registry
from taps.accumulate import ActivationAccumulator, IndexAccumulator, align_positions
from taps.archive import Archive, TapSource
# the public face of tap-diff: profiles and the report live in their own modules, importable from here too
from taps.profiles import (PROFILES_DIR, JoinedProfile, Profile, ProfileError, judging_profile, load_profile,
                           profile_name_for, profile_toml)
from taps.report import FAILING, DiffReport, TapResult, render_table, summary_counts

__all__ = ["DiffRefused", "ProfileError", "Profile", "JoinedProfile", "load_profile", "profile_name_for",
           "judging_profile", "profile_toml", "TapResult", "DiffReport", "diff_archives", "compare_tap", "bench_diff",
           "render_table", "summary_counts", "align_positions", "check_identity", "as_source", "FAILING",
           "PROFILES_DIR"]


class DiffRefused(UserError, ValueError):
    """The two archives are of different models or token streams (pass force to diff anyway)."""


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
        acc = IndexAccumulator(tol, as_set=registry.is_selection(name))
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
    acc = ActivationAccumulator(len(common), tol["rtol"])
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
def as_source(x) -> TapSource:
    """``x`` as a :class:`TapSource`: itself, or the archive at path ``x`` opened (:meth:`Archive.open`)."""
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
    A, B = as_source(a), as_source(b)
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
    rep = DiffReport(a=_label(a), b=_label(b), profile=prof.name, results=results, identity=ident,
                     until_position=until_position)
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


# ---------------------------------------------------------------- benchmark
def bench_diff(a, b, profile: Profile | str = "fp32", repeat: int = 1, memory_budget: int = 256 << 20) -> float:
    """Diff throughput in MB/s (bytes of tap data read from both sides per second; best of ``repeat``)."""
    best = 0.0
    for _ in range(max(1, repeat)):
        rep = diff_archives(a, b, profile, force=True, memory_budget=memory_budget)
        if rep.elapsed_s > 0:
            best = max(best, rep.bytes_read / 1e6 / rep.elapsed_s)
    return best
