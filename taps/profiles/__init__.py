"""Tolerance profiles for tap-diff: one TOML file per bundled profile in this package (``fp32.toml``,
``bf16.toml``, each bound justified in a comment), :func:`load_profile` to read one (or any TOML file),
:class:`JoinedProfile` for the loosest of several, and :func:`profile_toml` to write one back."""
from __future__ import annotations

import fnmatch
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from reference.errors import UserError

__all__ = ["ProfileError", "Profile", "JoinedProfile", "load_profile", "profile_name_for", "judging_profile",
           "profile_toml", "PROFILES_DIR"]

PROFILES_DIR = Path(__file__).resolve().parent


class ProfileError(UserError, ValueError):
    """A tolerance profile that cannot be found or read."""


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
            found = (f"no such table (tables present: {sorted(k for k, v in raw.items() if isinstance(v, dict))})"
                     if d is None else f"{d!r}")
            raise ProfileError(f"profile {str(p)!r}: expected a [{key}] table, found {found}")
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
