"""An ``--out`` that is a symbolic link is written through to its target (README "Paths"), also when the
target does not exist yet (a dangling link whose target's folder exists): the run's directory appears at the
target and the link is kept."""
from __future__ import annotations

from parity.cli.common import staged_dir


def test_staged_dir_writes_through_a_dangling_symlink(tmp_path):
    target = tmp_path / "results"
    link = tmp_path / "out"
    link.symlink_to(target)
    with staged_dir(link, ("report.json",)) as stage:
        (stage / "report.json").write_text("{}")
    assert link.is_symlink() and (target / "report.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_staged_dir_writes_through_a_symlink_to_an_existing_directory(tmp_path):
    target = tmp_path / "results"
    target.mkdir()
    (target / "report.json").write_text("old")
    link = tmp_path / "out"
    link.symlink_to(target)
    with staged_dir(link, ("report.json",)) as stage:
        (stage / "report.json").write_text("new")
    assert link.is_symlink() and (target / "report.json").read_text() == "new"


def test_an_out_in_a_loop_of_symbolic_links_is_refused_up_front(tmp_path):
    import pytest

    from parity.cli.common import check_out
    from reference.errors import InputError
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    for kind in ("dir", "file"):
        with pytest.raises(InputError, match="'.*a': expected a symbolic link that leads to a path, found a loop"):
            check_out(a, kind=kind, overwrite=True)
