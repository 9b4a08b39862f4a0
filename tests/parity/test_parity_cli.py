"""``qwen4exp parity`` and ``qwen4exp kl``: exit codes, the verdict table, the JSON report, archives."""
from __future__ import annotations

import json

import pytest

from parity.cli import main


def test_parity_reference_passes_and_writes_report(tmp_path, capsys):
    rc = main(["parity", "--backend", "reference", "--scenario", "budget", "--level", "ci", "--out",
               str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "budget" in out and "PASS" in out and "worst KL" in out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["exit_code"] == 0 and doc["scenarios"][0]["scenario"] == "budget"
    assert doc["scenarios"][0]["cases"] > 0


def test_parity_fault_fails_names_divergence_and_writes_archives(tmp_path, capsys):
    rc = main(["parity", "--backend", "parity.suites.faults:BudgetOffByOne", "--scenario", "kl", "budget",
               "--level", "ci", "--json", "--out", str(tmp_path), "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["verdict"] == "fail"
    kl, row = doc["scenarios"]
    # the KL row is located too: tap-diff of the worst prompt's one-shot logits
    assert kl["scenario"] == "kl" and kl["status"] == "fail" and "indexer.selected_blocks" in kl["first_divergence"]
    assert row["status"] == "fail" and "indexer.selected_blocks" in row["first_divergence"]
    arcs = [a for f in row["failures"] for a in f["archives"]]
    assert arcs and all((tmp_path / "taps").exists() for _ in arcs)
    assert any(a.endswith("backend.taps") for a in arcs) and any(a.endswith("truth.taps") for a in arcs)


def test_parity_bad_scenario_is_exit_2(capsys):
    assert main(["parity", "--backend", "reference", "--scenario", "nope"]) == 2
    assert "scenario 'nope'" in capsys.readouterr().err


def test_parity_missing_engine_is_exit_2_with_hint(monkeypatch, capsys):
    monkeypatch.setenv("QWEN4EXP_NO_GPU", "1")
    from engine.backend import cupy_or_none
    cupy_or_none.cache_clear()
    try:
        rc = main(["parity", "--backend", "engine-cuda", "--scenario", "budget", "--no-progress"])
    finally:
        cupy_or_none.cache_clear()
    assert rc == 2 and "cuda" in capsys.readouterr().err


def test_kl_reference_vs_reference_passes(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "Hello lighthouse"]))
    rc = main(["kl", "--a", "reference", "--b", "reference", "--prompts", str(prompts), "--greedy-tokens", "2",
               "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["controls_ok"] and doc["metrics"]["top1_agreement"] == 1.0
    assert set(doc["controls"]) == {"determinism", "precision_floor", "negative_control"}
    assert set(doc["metrics"]["kl_ab"]) == {"mean", "median", "p90", "p99", "p99.9", "max"}


def test_kl_flags_a_perturbed_backend(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([list(range(5, 25))]))  # 20 tokens: past the QSA bound (11) of tiny
    rc = main(["kl", "--b", "parity.suites.faults:BudgetOffByOne", "--prompts", str(prompts), "--greedy-tokens",
               "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1 and "verdict b: FAIL" in out


@pytest.mark.parametrize("content,match", [("{}", "non-empty JSON list"), ("[[]]", "empty prompt"),
                                           ("[[1, 99999]]", "token ids in"), ("[1.5]", "text or a list"),
                                           ("not json", "JSON list")])
def test_kl_bad_prompt_files_are_exit_2(tmp_path, capsys, content, match):
    p = tmp_path / "p.json"
    p.write_text(content)
    assert main(["kl", "--b", "reference", "--prompts", str(p), "--no-progress"]) == 2
    assert match in capsys.readouterr().err


def test_kl_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import builtins
    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    assert main(["kl", "--b", "reference", "--plot", str(tmp_path / "x.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_report_table_and_json_handle_nan(tmp_path):
    from parity.harness.report import ParityReport, ScenarioRow, render_table, write_json_atomic
    rep = ParityReport("b", "m", [ScenarioRow("x", 2, 1, float("nan"), 1.0, "layers.0.mlp.out", 0.1, "fail")])
    text = render_table(rep)
    assert "FAIL" in text and "nan" in text and "layers.0.mlp.out" in text
    p = write_json_atomic(tmp_path / "r.json", rep.to_json())
    doc = json.loads(p.read_text())
    assert doc["exit_code"] == 1 and doc["scenarios"][0]["worst_kl"] == "nan"


def test_kl_plot_is_written_when_matplotlib_is_present(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (optional) not installed")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7, 8]]))
    png = tmp_path / "kl.png"
    rc = main(["kl", "--b", "reference", "--prompts", str(prompts), "--greedy-tokens", "0", "--plot", str(png),
               "--no-progress"])
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*")) and not [p for p in tmp_path.iterdir() if p.suffix == ".png" and p != png]
