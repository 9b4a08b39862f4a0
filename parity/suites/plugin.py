"""pytest plugin of ``parity.suites``, registered through the ``pytest11`` entry point of the installed
package (pyproject.toml), so ``pytest --pyargs parity.suites --qwen4exp-backend NAME`` works in any
repository after ``pip install qwen4exp-parity``, without a conftest. Without an installed entry point
(a plain checkout on ``PYTHONPATH``) load it with ``-p parity.suites.plugin``; ``-p no:parity.suites.plugin``
turns it off.

Loaded into every pytest run of an environment that has the package, it stays inert unless used: its
options are prefixed (``--qwen4exp-backend``, ``--qwen4exp-model``, ``--qwen4exp-level``,
``--qwen4exp-page-sizes``), its configure hook checks them only when one is given, it parametrizes only
tests that ask for the ``qwen4exp_case`` fixture (``parity/suites/test_scenarios.py``) and its fixtures
(all ``qwen4exp_*``) do nothing until requested."""
from __future__ import annotations

import pytest

#: option name -> (default, help)
OPTIONS = {
    "--qwen4exp-backend": (None, "backend to test: a --backend SPEC of qwen4exp parity (NAME[:key=value,...] or "
                                 "module:Class[:key=value,...]; default: reference)"),
    "--qwen4exp-model": (None, "checkpoint directory or bundled fixture name (default: tiny)"),
    "--qwen4exp-level": ("full", "scenario level: full (every combination), ci (fewer combinations) or long (the real caps)"),
    "--qwen4exp-page-sizes": (None, "comma-separated paged-cache page sizes (default: from the config)"),
}
DEFAULT_BACKEND = "reference"


def pytest_addoption(parser):
    """Add the ``--qwen4exp-*`` options (group "qwen4exp parity")."""
    group = parser.getgroup("qwen4exp parity")
    for name, (default, help_) in OPTIONS.items():
        kw = dict(action="store", default=default, help=help_)
        if name == "--qwen4exp-level":
            kw["choices"] = ["full", "ci", "long"]
        group.addoption(name, **kw)


def pytest_configure(config):
    """When ``--qwen4exp-backend``, ``--qwen4exp-model`` or ``--qwen4exp-page-sizes`` is given: refuse an unknown
    backend, a missing or unreadable checkpoint (config.json, tensor headers) or bad page sizes once, as a usage
    error (not a collection error, nor one error per case). Does nothing otherwise."""
    spec = config.getoption("--qwen4exp-backend")
    ps = config.getoption("--qwen4exp-page-sizes")
    if spec is None and ps is None and config.getoption("--qwen4exp-model") is None:
        return
    from reference.errors import UserError
    try:
        from parity.backends import backend_class, capabilities_of
        cls, _ = backend_class(spec or DEFAULT_BACKEND, flag="--qwen4exp-backend")
    except UserError as e:
        raise pytest.UsageError(str(e)) from None
    if capabilities_of(cls).get("sequences", True) is False:  # else every case FAILs as a refused operation
        raise pytest.UsageError(f"--qwen4exp-backend {spec!r}: expected a backend that runs sequences (the suites "
                                f"prefill, decode, verify, roll back), found a top-k server backend; judge it with "
                                f"qwen4exp parity --backend {spec} (its kl-topk row)")
    model = _model(config)  # a missing checkpoint is one usage error too
    try:
        # what collection and the session fixtures read next: a bad config.json or a missing / mis-shaped
        # tensor would otherwise surface as a traceback there (headers only: cheap)
        from reference.checkpoint import Checkpoint
        ck = Checkpoint.open(model)
        try:
            max_pos = ck.config.max_position_embeddings
            ck.validate()
        finally:
            ck.close()
    except UserError as e:
        raise pytest.UsageError(f"--qwen4exp-model: {e}") from None
    if ps is not None:
        from parity.harness.scenarios import parse_page_sizes
        try:
            parse_page_sizes(ps, max_pos, flag="--qwen4exp-page-sizes")
        except UserError as e:
            raise pytest.UsageError(str(e)) from None


def _model(config):
    """The checkpoint of ``--qwen4exp-model`` (default: the bundled fixture ``tiny``, present in a checkout).

    Raises:
        pytest.UsageError: no checkpoint there (naming the option).
    """
    from reference.errors import UserError
    from reference.paths import resolve_model
    given = config.getoption("--qwen4exp-model")
    try:
        return resolve_model(given)
    except UserError as e:
        hint = "" if given else (" (the bundled fixtures live in a checkout of the repository, not in the "
                                 "installed package: pass --qwen4exp-model DIR)")
        raise pytest.UsageError(f"--qwen4exp-model: {e}{hint}") from None


def _settings(config):
    from parity.harness.scenarios import parse_page_sizes
    model = _model(config)
    ps = config.getoption("--qwen4exp-page-sizes")
    pages = parse_page_sizes(ps, flag="--qwen4exp-page-sizes") if ps is not None else None
    spec = config.getoption("--qwen4exp-backend") or DEFAULT_BACKEND
    return spec, model, config.getoption("--qwen4exp-level"), pages


def pytest_generate_tests(metafunc):
    """Parametrize ``qwen4exp_case`` with ``(scenario, case, page_size)`` for every case of every scenario
    at each page size of the page plan (``--qwen4exp-page-sizes``, else the config's sizes when the backend
    pages, else one run without a page size). Tests without that fixture are left alone."""
    if "qwen4exp_case" not in metafunc.fixturenames:
        return
    from parity.backends import Backend, backend_class
    from parity.harness.scenarios import SCENARIOS, _page_plan, cases_for
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
    metafunc.parametrize("qwen4exp_case", params, ids=ids)


@pytest.fixture(scope="session")
def qwen4exp_settings(request):
    """Session fixture: ``(backend spec, model path, level, page sizes or None)`` from the options."""
    return _settings(request.config)


@pytest.fixture(scope="session")
def qwen4exp_truth(qwen4exp_settings):
    """Session fixture: a TruthCache over the reference truth model of the chosen model."""
    from parity.backends import truth_model
    from parity.harness.scenarios.common import TruthCache
    return TruthCache(truth_model(qwen4exp_settings[1]))


@pytest.fixture(scope="session")
def qwen4exp_backends(qwen4exp_settings):
    """A cache page_size -> open backend (opened on first use through ``parity.backends.opener``, closed
    at session end)."""
    from parity.backends import opener
    spec, model, _level, _pages = qwen4exp_settings
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


def thresholds_of(model, weights, backend):
    """The :class:`parity.harness.kl.KLThresholds` ``qwen4exp parity`` judges ``backend`` by on ``model``: the
    floor of the backend's stores measured on ``weights`` (the truth's) over the default KL prompt set
    (:func:`parity.harness.floor.thresholds_for_run`, as the CLI without ``--prompts``)."""
    from parity.harness.floor import thresholds_for_run
    from parity.prompts import load_prompts
    cfg = backend.config
    prompts = load_prompts(None, model, cfg.vocab_size, cfg.max_position_embeddings)
    return thresholds_for_run(weights, backend, prompts)[0]


@pytest.fixture(scope="session")
def qwen4exp_thresholds(qwen4exp_settings, qwen4exp_truth):
    """Session fixture: ``get(backend) -> KLThresholds``, the limits every case is judged by, derived as
    ``qwen4exp parity`` and ``qwen4exp kl`` derive them (:func:`thresholds_of`), so one model + backend + level
    gets one limit whichever entry point runs it. Measured once per activation-store set of the backends."""
    from parity.harness.floor import stores_label, stores_of
    cache: dict = {}

    def get(be):
        key = (stores_label(stores_of(be)), getattr(be, "precision", "float32"))
        if key not in cache:
            cache[key] = thresholds_of(qwen4exp_settings[1], qwen4exp_truth.model.weights, be)
        return cache[key]
    return get
