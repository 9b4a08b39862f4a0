"""The four scenario suites: the reference and the engine's CPU path pass them on every fixture; the
negative controls (fault-injecting backends) are caught and NAMED (failing case + first divergent tap)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parity.backends import opener, open_backend, truth_model, ReferenceBackend
from parity.harness.scenarios import SCENARIOS, cases_for, run_scenario
from parity.harness.scenarios.common import CaseFailure, Run, TruthCache, sizes
from parity.harness.scenarios.runner import run_case
from parity.suites import faults

REPO = Path(__file__).resolve().parents[2]
FIXTURES = ("tiny", "tiny-hc2", "tiny-hc3", "tiny-fp8")
_TRUTH: dict = {}


def truth_for(fx: str) -> TruthCache:
    if fx not in _TRUTH:
        _TRUTH[fx] = TruthCache(truth_model(REPO / "fixtures" / fx))
    return _TRUTH[fx]


def _report(results) -> str:
    return "\n".join(f"{r.label}: {r.status}: {r.failure} | {r.divergence}" for r in results if r.status != "pass")


@pytest.mark.parametrize("fx", FIXTURES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_incremental_paths_pass(fx, scenario):
    res = run_scenario(scenario, opener("reference", REPO / "fixtures" / fx), truth_for(fx), level="ci")
    assert res and all(r.status == "pass" for r in res), _report(res)
    assert sum(r.checks for r in res) > 0


def _engine_opener(fx):
    pytest.importorskip("engine.engine", reason="the engine package is not importable")
    op = opener("engine-cpu", REPO / "fixtures" / fx)
    try:
        op().close()
    except Exception as e:  # the engine exists but cannot run: that is a failure, not a skip
        pytest.fail(f"engine-cpu could not be opened on {fx}: {type(e).__name__}: {e}")
    return op


@pytest.mark.parametrize("fx", FIXTURES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_cpu_passes(fx, scenario):
    op = _engine_opener(fx)
    cfg = open_backend("reference", REPO / "fixtures" / fx).config
    # on the main fixture a page size that divides the compress ratio and one that does not (the default plan's
    # third size, 2 * ratio, is left to `qwen4exp parity`); on the others only ratio + 1 (blocks straddle pages,
    # the harder case) to keep CI time down
    r = sizes(cfg).ratio
    pages = [r, r + 1] if fx == "tiny" else [r + 1]
    res = run_scenario(scenario, op, truth_for(fx), page_sizes=pages, level="ci")
    ran = [r for r in res if r.status != "skip"]
    assert ran and all(r.status == "pass" for r in ran), _report(res)
    assert {r.page_size for r in ran} == set(pages)


def _pick(scenario, cfg, prefix):
    return [c for c in cases_for(scenario, cfg, "ci") if c.name.startswith(prefix)][:1]


# fault -> a case prefix that exercises it (the full scenario catches it too; one case keeps CI fast)
FAULT_CASES = {
    faults.RollbackForgetsPLEConv: "accept_each_j",
    faults.RestoreSkipsIndexerKeys: "restore_fresh_handle_twice",
    faults.ChunkDropsNgramContext: "chunk_inside-compress-block",
    faults.BudgetOffByOne: "decode_across_bound",
}


@pytest.mark.parametrize("fault", list(FAULT_CASES), ids=lambda c: c.__name__)
def test_fault_is_caught_and_named(fault, tmp_path):
    scenario, must_name = faults.FAULTS[fault]
    fx = REPO / "fixtures" / "tiny"
    be = fault.open(fx)
    cases = _pick(scenario, be.config, FAULT_CASES[fault])
    assert cases, f"no case starting with {FAULT_CASES[fault]!r} in {scenario}"
    r = run_case(scenario, cases[0], be, truth_for("tiny"), archive_dir=tmp_path)
    assert r.status == "fail", f"{fault.__name__} not caught by {r.label}: {r.status} {r.failure}"
    assert "logit error" in r.failure and r.failed_op is not None and r.failed_seq
    # located: tap-diff names the first divergent tap, and it is in the faulty module
    assert "first divergence layers." in (r.divergence or ""), r.divergence
    tap = r.divergence.split("first divergence ")[1].split()[0]
    assert must_name in tap, f"{fault.__name__}: located at {tap}, expected a {must_name} tap"
    # the failing op's truth/backend archives, plus the op the error entered at when one is claimed (replayable)
    entered = r.divergence.startswith("error entered at op")
    assert len(r.archives) == (4 if entered else 2) and all(Path(p).is_dir() for p in r.archives), r.archives
    if entered:
        op_k = r.divergence.split("error entered at op ")[1].split(",")[0]
        assert all(f"entered-op{op_k}" in p for p in r.archives[2:]), r.archives


def test_correct_backend_is_not_flagged_by_the_same_cases():
    """Control of the control: the cases used above pass on the reference itself."""
    be = open_backend("reference", REPO / "fixtures" / "tiny")
    for fault, prefix in FAULT_CASES.items():
        scenario = faults.FAULTS[fault][0]
        case = _pick(scenario, be.config, prefix)[0]
        r = run_case(scenario, case, be, truth_for("tiny"))
        assert r.status == "pass", f"{r.label}: {r.failure}"


class RowsSwappedInBatch(ReferenceBackend):
    """A batching bug: rows of a batched decode come back in the wrong order."""

    def decode(self, hs, ids):
        out = super().decode(hs, ids)
        return out[::-1].copy() if len(hs) > 1 else out


def test_batching_bug_is_told_apart_from_a_state_bug():
    be = RowsSwappedInBatch.open(REPO / "fixtures" / "tiny")
    case = _pick("budget", be.config, "batch_mixed_sides_of_bound")[0]
    r = run_case("budget", case, be, truth_for("tiny"))
    assert r.status == "fail" and r.divergence.startswith("batching:"), r.divergence


class RollbackKeepsLength(ReferenceBackend):
    """Rollback that forgets to shorten the sequence (the KV length stays)."""

    def rollback(self, h, n):
        pass


def test_position_mismatch_is_named():
    be = RollbackKeepsLength.open(REPO / "fixtures" / "tiny")
    case = _pick("speculative_rollback", be.config, "accept_each_j")[0]
    r = run_case("speculative_rollback", case, be, truth_for("tiny"))
    assert r.status == "fail" and "KV length" in r.divergence, r.divergence


def test_compare_state_names_the_stale_array():
    be = open_backend("reference", REPO / "fixtures" / "tiny")
    run = Run(be, truth_for("tiny"), thresholds=__import__("parity.harness.kl", fromlist=["x"]).thresholds_for("float32"))
    ids = list(range(1, 15))
    a, b = run.new("a"), run.new("b")
    run.prefill(a, ids)
    run.prefill(b, ids)
    run.compare_state(a, b, "identical histories")  # passes
    layer = be.config.ple_layers[0]
    be._sess(b.h).state.ple[layer].conv[0, 0] += 1.0  # one stale element
    with pytest.raises(CaseFailure, match=rf"state ple\.{layer}\.conv"):
        run.compare_state(a, b, "after corruption")
    be._sess(b.h).state.ple[layer].context[0] += 1
    with pytest.raises(CaseFailure):
        run.compare_state(a, b, "integer context must match exactly")
    run.close()


def test_crashing_backend_is_an_error_not_a_pass():
    class Crashes(ReferenceBackend):
        def forward_tokens(self, h, ids):
            raise RuntimeError("boom")
    be = Crashes.open(REPO / "fixtures" / "tiny")
    case = _pick("speculative_rollback", be.config, "accept_each_j")[0]
    r = run_case("speculative_rollback", case, be, truth_for("tiny"))
    assert r.status == "error" and "boom" in r.failure


@pytest.mark.parametrize("backend,rc", [("reference", 0), ("parity.suites.faults:BudgetOffByOne", 1)])
def test_pytest_pyargs_suite_runs_against_any_backend(backend, rc):
    # `-p parity.suites.plugin`: also when this checkout is not the installed package (no entry point); with
    # the entry point installed it is the same registration (the entry point has the module's name)
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "parity.suites.plugin", "--pyargs", "parity.suites",
                        "--qwen4exp-backend", backend, "--qwen4exp-level", "ci", "-k", "decode_across_bound", "-q",
                        "-p", "no:cacheprovider",
                        "-p", "no:xdist", "-p", "no:benchmark"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == rc, out[-3000:]
    if rc:
        assert "selected_blocks" in out and "decode_across_bound" in out


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_cuda_passes(scenario):
    pytest.importorskip("cupy", reason="cupy not installed")
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    op = opener("engine-cuda", REPO / "fixtures" / "tiny")
    res = run_scenario(scenario, op, truth_for("tiny"), level="ci")
    ran = [r for r in res if r.status != "skip"]
    assert ran and all(r.status == "pass" for r in ran), _report(res)


class PrefillReturnsLastRowOnly(ReferenceBackend):
    """A protocol slip: prefill returns [V] (the last row) instead of [T, V]."""

    def prefill(self, h, ids, chunk_size=None):
        return super().prefill(h, ids, chunk_size)[-1]


def test_wrong_logits_shape_is_named_not_compared():
    be = PrefillReturnsLastRowOnly.open(REPO / "fixtures" / "tiny")
    case = _pick("budget", be.config, "decode_across_bound")[0]
    r = run_case("budget", case, be, truth_for("tiny"))
    assert r.status == "fail" and "returned logits of shape" in r.divergence, (r.failure, r.divergence)


def test_pytest_plugin_is_inert_unless_used():
    """Loaded into every pytest run of an environment with the package (the pytest11 entry point), the plugin
    only adds its prefixed options: with none given its configure hook imports nothing of ours and opens no
    model; a test without ``qwen4exp_case`` is not parametrized. Negative control: an unknown
    ``--qwen4exp-backend`` is refused at configure time."""
    code = textwrap.dedent("""
        import sys
        import pytest
        from parity.suites import plugin
        class Cfg:
            def __init__(self, **o): self.o = o
            def getoption(self, name): return self.o.get(name, plugin.OPTIONS[name][0])
        plugin.pytest_configure(Cfg())
        assert not [m for m in ("parity.backends", "reference.config", "parity.harness") if m in sys.modules]
        class MF:
            fixturenames = ["x"]
            def parametrize(self, *a, **k): raise AssertionError("parametrized a foreign test")
        plugin.pytest_generate_tests(MF())
        try:
            plugin.pytest_configure(Cfg(**{"--qwen4exp-backend": "nosuch"}))
        except pytest.UsageError as e:
            assert "--qwen4exp-backend" in str(e) and "nosuch" in str(e), e
        else:
            raise AssertionError("unknown backend accepted")
        assert all(o.startswith("--qwen4exp-") for o in plugin.OPTIONS)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_pyproject_registers_the_plugin_entry_point():
    """The installed package registers the plugin (``[project.entry-points.pytest11]``) under the module's own
    name, and no conftest registers it a second time."""
    import tomllib
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"parity.suites.plugin": "parity.suites.plugin"}
    assert not (REPO / "conftest.py").exists() or "pytest_plugins" not in (REPO / "conftest.py").read_text()
