"""Shared pytest configuration for tests/ (keep small). Helpers live in ``tests/fixture_helpers.py``
(bundled fixture paths and goldens); tests import them as ``from fixture_helpers import ...``.
Fixtures are the committed files under ``fixtures/``; reading them never needs torch."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

_TESTS = Path(__file__).resolve().parent
for _p in (_TESTS.parent, _TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from fixture_helpers import FIXTURE_NAMES, seed_for_test  # noqa: E402

# The suites' pytest plugin (pytest11 entry point) is imported before this conftest: from an installed copy
# elsewhere it would bind `parity` to that copy and these tests would silently test it. Refuse that.
_parity = sys.modules.get("parity")
if _parity is not None and Path(_parity.__file__).resolve().parents[1] != _TESTS.parent:
    pytest.exit(f"parity was imported from {Path(_parity.__file__).parent}, not from this checkout "
                f"{_TESTS.parent} (the pytest plugin of another install loaded it first): run `python -m pytest` "
                f"from the checkout, or add `-p no:parity.suites.plugin`", returncode=4)

try:  # property tests draw the same examples on every run (a failure replays; no per-run luck)
    from hypothesis import settings as _hyp_settings
    _hyp_settings.register_profile("qwen4exp", derandomize=True)
    _hyp_settings.load_profile("qwen4exp")
except ImportError:
    pass


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A NumPy generator seeded by :func:`fixture_helpers.seed_for_test` (fixed per test, printed)."""
    seed = seed_for_test(request.node.nodeid)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_name(request) -> str:
    """Parametrises a test over every bundled fixture."""
    return request.param


@pytest.fixture(scope="session")
def tiny() -> Path:
    """The bundled ``tiny`` checkpoint directory (skips when the fixtures are not built)."""
    from reference.paths import bundled_model
    p = bundled_model("tiny")
    if not (p / "config.json").exists():
        pytest.skip("fixture tiny not built (run fixtures/build.py)")
    return p


@pytest.fixture
def be_module() -> str:
    """The module holding the faulty test backends (tests/parity_fakes.py): ``--backend parity_fakes:Class``."""
    return "parity_fakes"
