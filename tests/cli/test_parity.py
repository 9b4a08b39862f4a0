"""``qwen4exp parity``: the main job on the command line -- --out directories (staged, swapped in),
the verdict table (legend, limits, ERROR rows, wrapping), scenario names, page sizes, outside backends."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import types

from fixture_helpers import one_line_error
from parity.backends import Backend, ReferenceBackend
from parity.cli import main
from reference.paths import REPO_ROOT, bundled_model


class _Boom:
    @classmethod
    def open(cls, model_path, **opts):
        raise RuntimeError("device on fire\nsecond line")

@pytest.fixture()
def boom_module(monkeypatch):
    import types
    mod = types.ModuleType("h9_boom_backend")
    mod.Cls = _Boom
    monkeypatch.setitem(sys.modules, "h9_boom_backend", mod)
    return "h9_boom_backend:Cls"


def _parity(capsys, *args):
    rc = main(["parity", *args, "--level", "ci", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, json.loads(out)


@pytest.mark.parametrize("pre_existing", [False, True])
def test_parity_interrupted_leaves_no_taps_without_report(tmp_path, monkeypatch, pre_existing):
    """Ctrl-C after failing cases wrote their archives leaves no --out/taps/ without report.json (a rerun
    needs no --overwrite)."""
    import parity.harness.run as CP
    out = tmp_path / "out"
    if pre_existing:
        out.mkdir()

    def interrupted(*a, out_dir=None, **k):
        (Path(out_dir) / "taps" / "case0.taps").mkdir(parents=True)
        raise KeyboardInterrupt
    monkeypatch.setattr(CP, "run_parity", interrupted)
    assert main(["parity", "--out", str(out), "--no-progress"]) == 130
    assert not (out / "taps").exists() and not (out / "report.json").exists()
    assert out.exists() == pre_existing  # a directory the run created is gone; the user's own stays


def test_outside_backend_subclassing_ours_is_named_by_its_spec(tmp_path, monkeypatch):
    from parity.backends import open_backend
    from reference.paths import FIXTURES
    (tmp_path / "my_engine_be.py").write_text(
        "from parity.backends import EngineBackend\n\nclass Mine(EngineBackend):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    be = open_backend("my_engine_be:Mine", FIXTURES / "tiny", device="cpu")
    assert be.name == "my_engine_be:Mine"


def test_parity_out_existing_file_is_exit_2_before_running(tmp_path, capsys, monkeypatch):
    import parity.harness.run as P
    ran = []
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: ran.append(1))
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["parity", "--backend", "reference", "--scenario", "kl", "--out", str(afile)]) == 2
    one_line_error(capsys, "--out", "afile", "found an existing file")
    assert not ran, "the suite ran before the bad --out was reported"


def test_parity_out_under_proc_is_exit_2(capsys, monkeypatch):
    import parity.harness.run as P
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: pytest.fail("ran before checking --out"))
    assert main(["parity", "--backend", "reference", "--scenario", "kl", "--out", "/proc/nope"]) == 2
    one_line_error(capsys, "--out", "/proc/nope")


def _passing_report():
    """A stand-in run result with one passing row (a report with nothing passed is INCONCLUSIVE, exit 3)."""
    from parity.harness.report import ParityReport, ScenarioRow
    return ParityReport(backend="reference", model="tiny",
                        rows=[ScenarioRow("budget", 1, 0, 0.0, 0.0, None, 0.1, "pass", "")])


def test_parity_reused_out_dir_needs_overwrite_and_clears_old_archives(tmp_path, capsys, monkeypatch):
    import parity.harness.run as P
    from parity.harness.report import ParityReport
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: _passing_report())
    (tmp_path / "taps" / "budget" / "case0").mkdir(parents=True)
    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "mine.txt").write_text("keep")
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(tmp_path)]) == 2
    one_line_error(capsys, "--out", "non-empty", "--overwrite")
    assert (tmp_path / "taps").exists()
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(tmp_path),
                 "--overwrite"]) == 0
    assert not (tmp_path / "taps").exists(), "stale failing-case archives kept next to a new report"
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "pass"
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_parity_backend_open_failure_is_exit_2(boom_module, capsys):
    assert main(["parity", "--backend", boom_module, "--scenario", "budget", "--no-progress"]) == 2
    one_line_error(capsys, boom_module, "cannot be opened", "device on fire")


def test_parity_bogus_scenario_lists_kl(capsys):
    assert main(["parity", "--backend", "reference", "--scenario", "bogus"]) == 2
    line = one_line_error(capsys, "bogus")
    assert "kl" in line.split("expected one of", 1)[1]


def test_parity_table_wraps_first_divergence_to_the_terminal(monkeypatch):
    # the table stays within the terminal width (COLUMNS) and wraps long text (even one long word) onto
    # continuation lines instead of cutting it (not at 80 on a wide terminal)
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    monkeypatch.setenv("COLUMNS", "120")
    long = "layers.3.self_attn.indexer.selected_blocks: " + "x" * 250
    rep = ParityReport(backend="b", model="tiny", rows=[ScenarioRow("budget", 2, 1, 1.0, 2.0, long, 0.1, "fail")])
    text = render_table(rep)
    assert max(len(ln) for ln in text.splitlines()[:-1]) <= 120
    assert "layers.3.self_attn.indexer" in text and "..." not in text and text.count("x") == long.count("x")
    assert rep.to_json()["scenarios"][0]["first_divergence"] == long  # the JSON keeps the full text


def test_display_path_relative_inside_cwd(tmp_path, monkeypatch):
    from parity.cli.parity import display_path
    monkeypatch.chdir(REPO_ROOT)
    assert display_path(bundled_model("tiny")) == os.path.join("fixtures", "tiny")
    assert display_path("/somewhere/else") == "/somewhere/else"


def test_backend_open_returning_none_is_backend_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "mybk_none.py").write_text(textwrap.dedent("""
        class C:
            @classmethod
            def open(cls, path, **kw):
                return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from parity.backends import BackendError, open_backend
    from reference.paths import bundled_model
    with pytest.raises(BackendError, match="found None"):
        open_backend("mybk_none:C", bundled_model("tiny"))
    assert main(["parity", "--backend", "mybk_none:C", "--scenario", "kl"]) == 2
    one_line_error(capsys, "mybk_none:C", "expected", "found None")
    # negative control: a real backend still opens through the same path
    assert open_backend("reference", bundled_model("tiny")) is not None


def test_parity_unwritten_archives_surface_and_leave_no_empty_folders(tmp_path, capsys, monkeypatch):
    import parity.harness.run as P
    from parity.harness.report import ParityReport, ScenarioRow
    out = tmp_path / "p2"

    def fake_run(model, spec, scen, *, out_dir=None, **k):
        (Path(out_dir) / "taps" / "budget" / "case0").mkdir(parents=True)  # what locate._save leaves on failure
        why = "(archives not written: ArchiveWriteError: archive output 'x': could not be written: No space)"
        row = ScenarioRow("budget", 1, 1, 1.0, 1.0, "op 0", 0.1, "fail", "diverged",
                          failures=[{"case": "case0", "archives": [why]}])
        return ParityReport(backend="reference", model="tiny", rows=[row])
    monkeypatch.setattr(P, "run_parity", fake_run)
    rc = main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(out), "--json"])
    err = capsys.readouterr().err
    assert rc == 4  # output that could not be written is an environment failure (was 1)
    assert "could not be written" in err and "tap archives" in err and "Traceback" not in err
    assert not (out / "taps").exists(), "empty archive folders were left"
    assert not out.exists(), "an incomplete result set was swapped in"
    # negative control: archives that were written are not reported, and their folders are kept
    assert P.unwritten_archives({"scenarios": [{"failures": [{"archives": ["a/truth.taps"]}]}]}) == []


def test_unwritten_archives_keep_a_reason_ending_in_a_parenthesis():
    """Only the entry's own closing parenthesis is removed: a reason that ends in one (the disk-full hint
    '(is the disk full?)') keeps it, so the printed error's parentheses stay balanced."""
    import parity.harness.run as P
    from parity.harness.scenarios.locate import not_written
    why = "archive output 'x': could not be written: I/O error: No space left on device (is the disk full?)"
    entry = not_written(RuntimeError(why))
    doc = {"scenarios": [{"failures": [{"archives": [entry]}]}]}
    assert P.unwritten_archives(doc) == [f"RuntimeError: {why}"]
    # negative control: a reason without a parenthesis of its own is unchanged too
    assert P.unwritten_archives({"archives": [not_written(RuntimeError("No space"))]}) == ["RuntimeError: No space"]


@pytest.mark.parametrize("ps, needles", [
    ("99999999", ["--page-sizes", "max_position_embeddings=32768", "99999999"]),
    ("100000", ["--page-sizes", "100000"]),
    ("8192", ["--page-sizes", "<= 4096", "8192"]),
    ("16,,32", ["--page-sizes", "empty item"]),
    ("16,16", ["--page-sizes", "twice"]),
])
def test_parity_page_sizes_checked_up_front(capsys, monkeypatch, ps, needles):
    import parity.harness.run as P
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: pytest.fail("ran before checking --page-sizes"))
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--page-sizes", ps]) == 2
    one_line_error(capsys, *needles)


def test_page_sizes_on_a_backend_without_pages_run_each_case_once(tmp_path, capsys):
    """``--page-sizes`` on a backend without a paged cache (the reference): each suite case runs once, the cases
    column counts it once, and the note under the table says the sizes were not applied. The same suite on a
    backend with pages (the engine's CPU path) runs at each size: the plan follows the backend."""
    from parity.harness.scenarios import _page_plan, count_cases, page_sizes_unused
    from reference.config import load_config
    cfg = load_config(Path(__file__).resolve().parents[2] / "fixtures" / "tiny")
    one = count_cases("budget", cfg, {"page_sizes": None}, None, "ci")
    assert count_cases("budget", cfg, {"page_sizes": None}, [4, 8], "ci") == one
    assert _page_plan({"page_sizes": "any"}, cfg, [4, 8]) == [4, 8]  # negative control: a paged backend
    assert page_sizes_unused({"page_sizes": "any"}, [4, 8]) is None
    out = tmp_path / "o"
    assert main(["parity", "tiny", "--backend", "reference", "--scenario", "budget", "--level", "ci",
                 "--page-sizes", "4,8", "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "report.json").read_text())
    row = next(r for r in doc["scenarios"] if r["scenario"] == "budget")
    assert row["cases"] == one, row["cases"]
    printed = capsys.readouterr().out
    assert "page sizes 4,8 not applied: the backend has no paged cache" in " ".join(printed.split())


def test_page_sizes_parser_and_pytest_plugin():
    from parity.harness.scenarios import parse_page_sizes
    from parity.suites import plugin
    assert parse_page_sizes("4,4096", 32768) == [4, 4096]  # negative control: the limit itself is allowed

    class Cfg:
        def __init__(self, ps):
            self.opts = {"--qwen4exp-backend": "reference", "--qwen4exp-model": None, "--qwen4exp-page-sizes": ps}

        def getoption(self, name):
            return self.opts[name]
    plugin.pytest_configure(Cfg("4,8"))
    with pytest.raises(pytest.UsageError, match="max_position_embeddings=32768"):
        plugin.pytest_configure(Cfg("100000"))


def test_dir_outputs_need_an_existing_parent(tmp_path, capsys, monkeypatch):
    import parity.harness.run as P
    from parity.harness.report import ParityReport
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: _passing_report())
    out = tmp_path / "nonexist" / "deep" / "dir"
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(out)]) == 2
    one_line_error(capsys, "--out", "existing parent directory", str(tmp_path / "nonexist" / "deep"))
    assert not (tmp_path / "nonexist").exists(), "parity created the missing parents"
    ok = tmp_path / "new"  # negative control: a new directory under an existing one is created
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(ok)]) == 0
    assert (ok / "report.json").is_file()


def test_table_explains_itself(capsys):
    """The legend says what `cases 1/8`, "worst KL" (direction, limit) and "worst logit err" are, and that
    "budget" is the QSA indexer_budget scenario; passing rows show their thresholds."""
    assert main(["parity", "--backend", "reference", "--scenario", "kl", "budget", "--level", "ci",
                 "--no-progress", "--format", "text"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the legend wraps at the terminal's width (xdist workers: another width)
    for words in ("legend:", "cases: passed/run", "one case is", "KL(reference||backend)", "KL(backend||reference)",
                  "worst logit err:", "the figure the limit beside it judges", "limits:", "budget: the QSA indexer_budget"):
        assert words in flat, words
    body = [ln for ln in out.splitlines() if ln.startswith(("kl ", "budget "))]
    # the limit measured on this model (a multiple of its float32 floor, relative to the logit scale)
    assert len(body) == 2 and all("err<=" in ln and "xscale" in ln for ln in body)


def test_readme_sample_output_prints_the_whole_legend():
    """README's sample of the main command's text output holds, under 'legend:', every line the command prints
    there for its rows -- the column legend and each shown scenario's meaning, in order and unshortened."""
    from parity.harness.report import KL_MEANING, LEGEND
    from parity.harness.scenarios import meanings
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    top = next(i for i, ln in enumerate(readme) if ln.startswith("    scenario  ") and "worst KL" in ln)
    end = next(i for i in range(top, len(readme)) if readme[i].startswith("    verdict: "))
    sample = [ln[4:] for ln in readme[top:end + 1]]
    rows = [ln.split()[0] for ln in sample[2:] if ln and not ln.startswith((" ", "-"))
            and ln.split()[-1] in ("PASS", "FAIL", "ERROR", "INCONCLUSIVE", "REFUSED", "SKIP")]
    assert rows and rows[0] == "kl", sample
    meaning = {"kl": KL_MEANING, **meanings()}
    want = ["  " + ln for ln in LEGEND] + [f"  {r}: {meaning[r]}" for r in rows]
    at = sample.index("legend:")
    assert sample[at + 1:at + 1 + len(want)] == want
    assert sample[at + 1 + len(want)].startswith("resolution: ")


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


def test_report_table_and_json_handle_nan(tmp_path):
    from parity.harness.report import ParityReport, ScenarioRow, render_table, write_json_atomic
    rep = ParityReport("b", "m", [ScenarioRow("x", 2, 1, float("nan"), 1.0, "layers.0.mlp.out", 0.1, "fail")])
    text = render_table(rep)
    assert "FAIL" in text and "nan" in text and "layers.0.mlp.out" in text
    p = write_json_atomic(tmp_path / "r.json", rep.to_json())
    doc = json.loads(p.read_text())
    assert doc["exit_code"] == 1 and doc["scenarios"][0]["worst_kl"] == "nan"


def test_backend_crash_in_kl_and_in_a_case_is_an_error_row_and_exit_1(be_module, tmp_path, capsys):
    rc, doc = _parity(capsys, "--backend", f"{be_module}:CrashInDecode", "--scenario", "kl", "budget",
                      "--out", str(tmp_path))
    assert rc == 1 and doc["verdict"] == "fail" and doc["exit_code"] == 1  # a failed case, not a usage error
    kl, budget = doc["scenarios"]
    assert kl["status"] == "error" and "illegal memory access" in kl["first_divergence"]
    assert kl["failed_cases"] == kl["cases"] > 0
    assert budget["status"] == "error" and budget["failed_cases"] > 0
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "fail"


def test_usage_errors_stay_exit_2(capsys):
    assert main(["parity", "--backend", "nosuchmod_q4x:Nope", "--scenario", "budget", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "PYTHONPATH" in err  # a module:Class plugin must be importable


def test_fault_after_the_last_tap_is_named_with_its_first_position(be_module, capsys):
    rc, doc = _parity(capsys, "--backend", f"{be_module}:PerturbAfter10", "--scenario", "kl", "budget")
    assert rc == 1
    for row in doc["scenarios"]:
        assert row["status"] == "fail", row
        assert "returned logits differ from the backend's own logits tap" in row["first_divergence"], row
        assert "first at position 10" in row["first_divergence"], row
    # the failing check names the first bad position too, not only the worst
    fails = [f["failure"] for f in doc["scenarios"][1]["failures"] if "logit error" in (f["failure"] or "")]
    assert fails and all("first failing position" in f for f in fails)


def test_bf16_backend_is_judged_on_top1_in_every_scenario(be_module, capsys):
    rc, doc = _parity(capsys, "--backend", f"{be_module}:PerturbAfter10Bf16", "--scenario", "kl", "budget")
    assert rc == 1
    kl, budget = doc["scenarios"]
    # judged against 4x the bf16 store-rounding floor measured on tiny (every case row, not a fraction of flips)
    assert budget["status"] == "fail" and budget["failed_cases"] > 0
    assert any(k in (f["failure"] or "") for f in budget["failures"] for k in ("top-1 differs", "logit error"))
    assert kl["status"] == "fail" and kl["failed_cases"] > 0  # the case count shows the failing prompts


def test_out_dir_with_report_json_directory_is_refused_up_front(tmp_path, capsys):
    (tmp_path / "report.json").mkdir()
    assert main(["parity", "--backend", "reference", "--scenario", "kl", "--out", str(tmp_path), "--overwrite",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "report.json" in err and "Traceback" not in err and "kl " not in err
    (tmp_path / "report.json").rmdir()
    (tmp_path / "taps").write_text("x")
    assert main(["parity", "--backend", "reference", "--scenario", "kl", "--out", str(tmp_path), "--overwrite",
                 "--no-progress"]) == 2
    assert "taps" in capsys.readouterr().err


def test_rich_table_never_folds_or_cuts_a_name():
    """--format rich: the "first divergence" cell is not folded mid-word and no column is cropped."""
    import io

    from rich.console import Console

    from parity.harness.report import ParityReport, ScenarioRow, render_table
    name = "layers.3.self_attn.indexer.selected_blocks"
    div = f"case_5 [page 4]: first divergence {name} at position 9 (last agreeing layers.2.mlp.out)"
    rep = ParityReport("b", "m", [ScenarioRow("speculative-rollback", 12, 1, 0.5, 1.0, div, 1.0, "fail",
                                              thresholds={"max_kl": 1e-5, "min_top1": 0.98})])
    for width in (80, 120, 200):
        buf = io.StringIO()
        render_table(rep, Console(file=buf, width=width), legend=False)
        out = buf.getvalue()
        assert name in out and "layers.2.mlp.out" in out and "…" not in out, out
        for h in ("scenario", "cases", "worst KL", "limits", "worst logit err", "time", "verdict"):
            assert h in out, (width, h)



def test_rich_output_fits_a_narrow_terminal(monkeypatch, capsys):
    """--format rich at a 60-column terminal (and narrower, and wider): no line is wider than the console; from 60
    columns every scenario, figure and the first divergence's tap name are printed whole (at 60: the figures in one
    cell wrapped at spaces between scenario and verdict, the divergence under the table)."""
    import io

    from rich.console import Console

    from parity.harness.report import ParityReport, ScenarioRow, render_table
    th = {"tol_rel": 8.8e-05}
    name = "layers.3.self_attn.indexer.topk_indices"
    rows = [ScenarioRow(s, n, 0, 7.16e-12, 1e-5, None, 4.9, "pass", thresholds=th, worst_logit_err_rel=1.29e-05)
            for s, n in (("kl", 5), ("chunk-boundary", 30), ("speculative-rollback", 21))]
    rows.insert(1, ScenarioRow("budget", 27, 3, 1e-3, 1e-2, f"{name} at position 11", 3.3, "fail", thresholds=th,
                               worst_logit_err_rel=0.3))
    rep = ParityReport("engine", "fixtures/tiny", rows)
    for width in (40, 60, 80, 100, 150, 160):
        buf = io.StringIO()
        render_table(rep, Console(file=buf, width=width, color_system=None), legend=True)
        out = buf.getvalue()
        assert max(len(ln) for ln in out.splitlines()) <= width, (width, out)
        if width < 60:   # scenario and verdict alone fill the line: the figures are folded, still not cut
            continue
        head = next(ln for ln in out.splitlines() if "scenario" in ln)
        # the divergence is a column where 30 columns are left for it (wrapped there), else under the table
        assert ("first divergence" in head) == (width >= 150) and ("figures" in head) == (width < 100), (width, out)
        assert "…" not in out and name in out, (width, out)
        for word in ("speculative-rollback", "chunk-boundary", "7.16e-12", "err<=8.8e-05xscale", "1.29e-05xscale",
                     "3.00e-01xscale", "24/27", "FAIL", "PASS"):
            assert word in out, (width, word, out)
    # the command: rich's console takes the terminal's width (COLUMNS where stdout is no terminal)
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--level", "ci", "--format", "rich",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and max(len(ln) for ln in out.splitlines()) <= 60, out

def test_first_divergence_column_is_as_wide_as_its_lines():
    """A table of REFUSED rows only (the refusal in the "first divergence" cell, wrapped to the terminal): the column
    is as wide as its longest line, not the whole room the other columns leave."""
    from parity.backends.refusal import EngineRefused
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    e = EngineRefused("llama.cpp 0.3.36", "loader", "unknown model architecture: 'qwen4exp'")
    rep = ParityReport("llama.cpp", "m", [ScenarioRow("open", 1, 1, None, None, e.verdict(), 0.5, "refused", e.offer)])
    for columns in (100, 120, 1000):
        lines = render_table(rep, columns=columns).splitlines()
        start = lines[0].index("first divergence")
        width = len(lines[1][start:].split("  ")[0])
        body = lines[2:next(i for i, ln in enumerate(lines) if ln.startswith("verdict:"))]
        assert max(len(ln[start:start + width].rstrip()) for ln in body) == width, (columns, lines)
        assert " ".join(ln[start:start + width].strip() for ln in body).strip() == e.verdict(), (columns, lines)
