"""tap-diff rules the parity harness's location shares: ``until_position`` (a tap first
beyond tolerance after the first failing position is not the cause), the joined profile (never tighter than any
part) and the profile file saved beside a location's archives (``taps diff --profile`` judges as it did)."""
from __future__ import annotations

import numpy as np

from taps.diff import JoinedProfile, Profile, diff_archives, judging_profile, load_profile, profile_toml
from taps.recorder import Recorder

T, D = 10, 16


def _arcs(out_dir=None):
    """A and B: ``embed_tokens.out`` differs (1e-2 of the rms) from position 7 on, ``layers.0.linear_attn.out``
    (later in forward order) at position 3 only; everything else identical."""
    rng = np.random.default_rng(0)
    e, x = rng.standard_normal((T, D)).astype(np.float32), rng.standard_normal((T, D)).astype(np.float32)
    e2, x2 = e.copy(), x.copy()
    e2[7:] += 1e-2
    x2[3] += 1e-2
    arcs = []
    for tag, (a, b) in (("A", (e, x)), ("B", (e2, x2))):
        with Recorder(None if out_dir is None else out_dir / tag, meta={"token_ids": list(range(T))}) as rec:
            rec.emit("embed_tokens.out", a, positions=np.arange(T))
            rec.emit("layers.0.linear_attn.out", b, positions=np.arange(T))
        arcs.append(rec.archive() if out_dir is None else out_dir / tag)
    return arcs


def test_until_position_counts_only_taps_first_beyond_tolerance_at_or_before_it():
    A, B = _arcs()
    full = diff_archives(A, B, "fp32")
    assert full.first_divergence == "embed_tokens.out" and full.result("embed_tokens.out").first_position == 7
    # the first failing position is 5: embed_tokens.out (first beyond tolerance at 7) cannot be its cause
    at5 = diff_archives(A, B, "fp32", until_position=5)
    assert at5.first_divergence == "layers.0.linear_attn.out"
    assert "after position 5: not counted" in at5.result("embed_tokens.out").note
    # before every divergence: nothing counts (agree, exit 0); every position was still compared
    at2 = diff_archives(A, B, "fp32", until_position=2)
    assert at2.agree and at2.exit_code == 0 and at2.result("embed_tokens.out").rows == T


def test_cli_until_position(tmp_path, capsys):
    from parity.cli import main
    a, b = _arcs(tmp_path)
    assert main(["taps", "diff", str(a), str(b)]) == 1
    assert main(["taps", "diff", str(a), str(b), "--until-position", "2"]) == 0
    capsys.readouterr()
    assert main(["taps", "diff", str(a), str(b), "--until-position", "5", "--format", "json"]) == 1
    assert '"first_divergence": "layers.0.linear_attn.out"' in capsys.readouterr().out


def test_joined_profile_is_never_tighter_than_a_part_and_round_trips_through_toml(tmp_path):
    base = load_profile("fp32")
    tight = Profile("tight", {"rel_l2": 1e-6, "rtol": 0.0, "atol_rms": 1e-6, "atol": 0.0, "cos_min": 1.0},
                    dict(base.index), [{"pattern": "logits", "rel_l2": 5e-3, "atol_rms": 5e-3, "cos_min": 0.99}])
    j = judging_profile("float32", tight, base)
    assert isinstance(j, JoinedProfile)
    for name in ("embed_tokens.out", "logits", "layers.1.ple.gate"):
        t, b, got = tight.for_tap(name), base.for_tap(name), j.for_tap(name)
        for k in ("rel_l2", "rtol", "atol_rms", "atol"):
            assert got[k] == max(t[k], b[k]), (name, k)
        assert got["cos_min"] == min(t["cos_min"], b["cos_min"])
    assert j.for_tap("logits")["rel_l2"] == 5e-3    # the looser part wins tap by tap
    assert judging_profile("float32").name == "fp32" and judging_profile("bf16").name == "bf16"
    assert judging_profile("float32", tight) is tight
    p = tmp_path / "profile.toml"
    names = ["embed_tokens.out", "logits", "layers.1.ple.gate"]
    p.write_text(profile_toml(j, names))
    back = load_profile(p)
    for name in names:
        assert back.for_tap(name) == j.for_tap(name), name


def test_cli_until_position_before_every_divergence_does_not_claim_every_tap_agrees(tmp_path, capsys):
    from parity.cli import main
    a, b = _arcs(tmp_path)
    assert main(["taps", "diff", str(a), str(b), "--until-position", "2"]) == 0
    out = capsys.readouterr().out
    assert "every common tap is within tolerance" not in out
    assert "AGREE up to position 2" in out and "2 taps diverged only after it (not counted)" in out


def test_cli_until_position_negative_is_a_usage_error(tmp_path, capsys):
    from parity.cli import main
    a, b = _arcs(tmp_path)
    assert main(["taps", "diff", str(a), str(b), "--until-position", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--until-position -1: expected a token position >= 0, found -1" in err


def test_profile_file_without_a_table_names_the_tables_it_has(tmp_path):
    import pytest
    from taps.profiles import ProfileError
    p = tmp_path / "p.toml"
    p.write_text("[default]\nrtol = 1e-3\n")
    with pytest.raises(ProfileError, match=r"expected a \[activation\] table, found no such table \(tables present: "
                                           r"\['default'\]\)"):
        load_profile(p)
