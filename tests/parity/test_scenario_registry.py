"""The scenario-suite registry (parity/harness/scenarios.SUITES) is the one list of suites: the run order,
the truthless suites, the report's legend lines, the ``--level long`` cases and the ``parity`` help are all
derived from it, and every suite module's own ``SUITE`` is registered."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from parity.cli import main
from parity.harness import scenarios
from parity.harness.report import KL_MEANING
from parity.harness.scenarios.suite import Suite
from reference.config import load_config
from reference.errors import InputError
from reference.paths import bundled_model

REPO = Path(__file__).resolve().parents[2]
SCEN_DIR = REPO / "parity" / "harness" / "scenarios"


def _suite_modules(folder: Path) -> list[str]:
    """Modules of ``folder`` defining a top-level ``cases(config, level=...)`` (a suite), read from the source."""
    out = []
    for f in sorted(folder.glob("*.py")):
        for node in ast.parse(f.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name == "cases" and [a.arg for a in node.args.args] == [
                    "config", "level"]:
                out.append(f.stem)
    return out


def test_every_suite_module_is_registered_once():
    assert sorted(_suite_modules(SCEN_DIR)) == sorted(scenarios.SUITES)
    for name, suite in scenarios.SUITES.items():
        mod = importlib.import_module(f"parity.harness.scenarios.{name}")
        assert mod.SUITE is suite and isinstance(suite, Suite) and suite.name == mod.NAME == name
        assert suite.cases is mod.cases


def test_the_module_scan_sees_an_unregistered_suite(tmp_path):
    # negative control: a suite module without a registry line is found by the scan above
    (tmp_path / "prefix_cache.py").write_text("def cases(config, level='full'):\n    return []\n")
    (tmp_path / "helpers.py").write_text("def cases(scenario, config):\n    return []\n")
    assert _suite_modules(tmp_path) == ["prefix_cache"]


def test_derived_lists_legend_and_help(capsys):
    assert scenarios.SCENARIOS == tuple(scenarios.SUITES)
    assert scenarios.TRUTHLESS == tuple(n for n, s in scenarios.SUITES.items() if not s.needs_truth)
    meaning = scenarios.meanings()
    assert list(meaning) == [s.label for s in scenarios.SUITES.values()]
    assert KL_MEANING and all(meaning.values())  # every suite has its legend line (self-consistency included)
    with pytest.raises(SystemExit):
        main(["parity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    with pytest.raises(InputError) as ei:
        scenarios.normalize_name("no-such-suite")
    for s in scenarios.SUITES.values():
        assert s.label in text and s.label in str(ei.value)


def test_long_level_reads_each_suites_long_cases():
    cfg = load_config(bundled_model("tiny"))
    for name, s in scenarios.SUITES.items():
        got = [c.name for c in scenarios.cases_for(name, cfg, level="long")]
        want = [c.name for c in (s.long_cases(cfg) if s.long_cases else s.cases(cfg, level="ci"))]
        assert got == want and got, name
        if s.long_cases:
            assert all(n.startswith("long_") for n in got)


def test_no_hand_kept_list_of_suite_names():
    # a literal holding three suite names (either spelling) outside the registry is a second list to keep
    names = set(scenarios.SUITES) | {s.label for s in scenarios.SUITES.values()}
    bad = []
    for f in sorted((REPO / "parity").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                elts = node.keys if isinstance(node, ast.Dict) else node.elts
                held = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
                if len(held) >= 3:
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno}: {sorted(held)}")
    assert not bad, "hand-kept suite name lists:\n" + "\n".join(bad)
