"""pytest plugin of ``parity.suites`` (registered by the repository's root conftest.py): the ``--backend`` / ``--model`` / ``--parity-level`` options, the
session-wide backend opener and truth, and the (scenario, case, page size) parametrisation."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def pytest_addoption(parser):
    """Add ``--backend``, ``--model``, ``--parity-level`` and ``--page-sizes`` (skipped when already
    registered)."""
    group = parser.getgroup("qwen4exp parity")
    for args, kw in [
        (("--backend",), dict(action="store", default="reference",
                              help="backend to test: reference, reference-f64, engine, engine-cpu, engine-cuda or "
                                   "module:Class (default: reference)")),
        (("--model",), dict(action="store", default=None,
                            help="checkpoint directory or bundled fixture name (default: tiny)")),
        (("--parity-level",), dict(action="store", default="full", choices=["full", "ci", "long"],
                                   help="scenario level: full (every combination) or ci (fewer combinations)")),
        (("--page-sizes",), dict(action="store", default=None,
                                 help="comma-separated paged-cache page sizes (default: from the config)")),
    ]:
        try:
            group.addoption(*args, **kw)
        except ValueError:  # already registered by another conftest/plugin
            pass


def pytest_configure(config):
    """Refuse an unknown ``--backend`` or bad ``--page-sizes`` once, as a usage error (not one failure per
    case)."""
    from reference.errors import UserError
    try:
        spec = config.getoption("--backend")
    except ValueError:  # options not registered (plugin loaded some other way)
        return
    try:
        from parity.backends import backend_class
        backend_class(spec)
    except UserError as e:
        raise pytest.UsageError(str(e)) from None
    ps = config.getoption("--page-sizes")
    if ps is not None:
        from parity.harness.scenarios import parse_page_sizes
        try:
            from reference.config import load_config
            from reference.paths import resolve_model
            max_pos = load_config(resolve_model(config.getoption("--model"))).max_position_embeddings
            parse_page_sizes(ps, max_pos)
        except UserError as e:
            raise pytest.UsageError(str(e)) from None


def _settings(config):
    from reference.paths import resolve_model
    model = resolve_model(config.getoption("--model"))
    ps = config.getoption("--page-sizes")
    from parity.harness.scenarios import parse_page_sizes
    pages = parse_page_sizes(ps) if ps is not None else None
    return config.getoption("--backend"), model, config.getoption("--parity-level"), pages


def pytest_generate_tests(metafunc):
    """Parametrize ``parity_case`` with ``(scenario, case, page_size)`` for every case of every scenario
    at each page size of the page plan (``--page-sizes``, else the config's sizes when the backend pages, else
    one run without a page size)."""
    if "parity_case" not in metafunc.fixturenames:
        return
    from parity.harness.scenarios import SCENARIOS, cases_for, _page_plan
    from parity.backends import Backend, backend_class
    from reference.config import load_config
    spec, model, level, pages = _settings(metafunc.config)
    cfg = load_config(model)
    try:
        cls, _ = backend_class(spec)
        caps = {**Backend.capabilities, **(getattr(cls, "capabilities", None) or {})}
    except Exception:  # reported by the backend fixture when the tests run
        caps = {}
    params, ids = [], []
    for name in SCENARIOS:
        for case in cases_for(name, cfg, level):
            for ps in _page_plan(caps, cfg, pages):
                params.append((name, case.name, ps))
                ids.append(f"{name}/{case.name}" + (f"/page{ps}" if ps else ""))
    metafunc.parametrize("parity_case", params, ids=ids)


@pytest.fixture(scope="session")
def parity_settings(request):
    """Session fixture: ``(backend spec, model path, level, page sizes or None)`` from the options."""
    return _settings(request.config)


@pytest.fixture(scope="session")
def parity_truth(parity_settings):
    """Session fixture: a TruthCache over the reference truth model of the chosen model."""
    from parity.backends import truth_model
    from parity.harness.scenarios.common import TruthCache
    return TruthCache(truth_model(parity_settings[1]))


@pytest.fixture(scope="session")
def parity_backends(parity_settings):
    """A cache page_size -> open backend (opened on first use, closed at session end)."""
    from parity.backends import opener
    spec, model, _level, _pages = parity_settings
    op = opener(spec, model)
    cache: dict = {}

    def get(ps):
        if ps not in cache:
            cache[ps] = op() if ps is None else op(page_size=ps)
        return cache[ps]
    yield get
    for be in cache.values():
        if hasattr(be, "close"):
            be.close()
