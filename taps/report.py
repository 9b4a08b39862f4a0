"""What tap-diff reports: one :class:`TapResult` per tap, the :class:`DiffReport` (first divergence, last
agreeing tap, JSON form) and its aligned table (:func:`render_table`)."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from taps import registry

__all__ = ["FAILING", "TapResult", "DiffReport", "summary_counts", "render_table"]


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
    until_position: int | None = None
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
    elif any(r.failed for r in rep.results):   # every divergence starts after --until-position: none counted
        n = sum(r.failed for r in rep.results)
        con.print(f"AGREE up to position {rep.until_position}: no tap is first beyond tolerance at or before it; "
                  f"{n} tap{'s' if n != 1 else ''} diverged only after it (not counted)")
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
