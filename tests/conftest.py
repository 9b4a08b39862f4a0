"""Shared pytest configuration for tests/ (keep small). Helpers live in ``tests/fixture_helpers.py``
(bundled fixture paths and goldens); tests import them as ``from fixture_helpers import ...``.
Fixtures are the committed files under ``fixtures/``; reading them never needs torch."""
from __future__ import annotations

import functools
import importlib.util
import shutil
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


# ------------------------------------------------------------------------------ optional requirements
# The one skip mechanism for what `pip install -e '.[test]'` does not bring: a test needing an optional extra,
# a GPU or nvcc carries the marker (pyproject's [tool.pytest.ini_options] markers), and runs only where the
# requirement is present; elsewhere it is skipped with the reason. A module that imports such a package at
# its top level guards that import with pytest.importorskip (the marker alone cannot stop the import).
def _missing_modules(*names: str) -> str | None:
    for n in names:
        try:
            if importlib.util.find_spec(n) is None:
                return n
        except (ImportError, ValueError):  # a parent package absent or broken
            return n
    return None


@functools.lru_cache(maxsize=None)
def requirement_missing(marker: str) -> str | None:
    """Why the requirement of ``marker`` is absent here (None: present). Cached per process."""
    if marker == "oracle":
        m = _missing_modules("torch", "transformers", "transformers.models.qwen4_exp")
        return m and f"needs the `oracle` extra (torch + transformers with qwen4_exp): {m} not importable " \
                     f"(pip install -e '.[oracle]')"
    if marker == "llamacpp":
        m = _missing_modules("llama_cpp", "torch", "transformers")
        return m and f"needs the `llamacpp` extra: {m} not importable (pip install -e '.[llamacpp]')"
    if marker == "gpu":
        from engine.backend import gpu_available
        if gpu_available():
            return None
        if _missing_modules("torch") is None:
            import torch
            if torch.cuda.is_available():
                return None
        return "needs a CUDA GPU: none visible to cupy (pip install -e '.[gpu]') or torch"
    if marker == "nvcc":
        return None if _nvcc() else "needs nvcc (CUDA toolkit) on PATH or at /usr/local/bin/nvcc"
    raise KeyError(marker)


def _nvcc() -> str | None:
    return shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)


REQUIREMENT_MARKERS = ("oracle", "llamacpp", "gpu", "nvcc")


def pytest_runtest_setup(item):
    for marker in REQUIREMENT_MARKERS:
        if item.get_closest_marker(marker) is not None:
            why = requirement_missing(marker)
            if why:
                pytest.skip(f"[{marker}] {why}")


@pytest.fixture
def nvcc() -> str:
    """The nvcc executable (tests using it are marked ``nvcc``; skipped without the toolkit)."""
    path = _nvcc()
    assert path, "a test using the nvcc fixture must be marked nvcc"
    return path


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
