"""A tap archive's output that is a symbolic link is written through (README "Paths"): the archive appears at
the link's target -- an existing archive replaced with overwrite, or a target not there yet -- and the link
is kept."""
from __future__ import annotations

import numpy as np

from taps.archive import ArchiveWriter


def _write(out, overwrite):
    w = ArchiveWriter(out, overwrite=overwrite)
    w.add("embed", np.ones((2, 4), np.float32), np.arange(2, dtype=np.int64))
    return w.close({})


def test_archive_written_through_a_symlink_to_an_existing_archive(tmp_path):
    target = tmp_path / "arch"
    _write(target, overwrite=False)
    link = tmp_path / "link"
    link.symlink_to(target)
    _write(link, overwrite=True)
    assert link.is_symlink() and (target / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch", "link"]


def test_archive_written_through_a_dangling_symlink(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "arch")
    _write(link, overwrite=False)
    assert link.is_symlink() and (tmp_path / "arch" / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch", "link"]
