"""Bundled-fixture helpers for tests: paths and goldens (import: ``from fixture_helpers import ...``).

Fixtures are the committed files under ``fixtures/`` (built by ``python fixtures/build.py``);
tests never need torch to read them.
"""
from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FIXTURES = REPO / "fixtures"
FIXTURE_NAMES = ("tiny", "tiny-hc2", "tiny-hc3", "tiny-fp8", "tiny-nvfp4")


def seed_for_test(nodeid: str | None = None) -> int:
    """The fixed random seed of a test: crc32 of its pytest node id (``nodeid``, default the running test's,
    from ``$PYTEST_CURRENT_TEST``). Every run of a test draws the same inputs (its checks and negative
    controls never depend on a seed that changes per run); different tests and parametrisations draw
    different inputs."""
    if nodeid is None:
        nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    return zlib.crc32(nodeid.encode())


def fixture_dir(name: str = "tiny") -> Path:
    """Directory of a bundled fixture checkpoint."""
    return FIXTURES / name


def load_golden(name: str = "tiny") -> tuple[dict[str, np.ndarray], dict]:
    """(golden.npz arrays, golden.json metadata) of a bundled fixture; keys are documented in
    ``fixtures/build.py:_goldens`` (``<prompt>/ids|logits|hidden|mixer_out``, ``decode/<prompt>/...``)."""
    d = fixture_dir(name)
    with np.load(d / "golden.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((d / "golden.json").read_text())


def golden_prompts(name: str = "tiny") -> list[str]:
    """Prompt names of a fixture's goldens (``short``, ``qsa``, ``eos``, ``maxid``, ``chat``)."""
    return list(load_golden(name)[1]["prompts"])


def one_line_error(capsys, *needles, absent=()):
    """The captured stderr holds exactly one line, without a traceback, naming every needle (and none of
    ``absent``). Returns that line."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    for n in absent:
        assert n not in lines[0], (n, lines[0])
    return lines[0]
