"""``qwen4exp kl``: the logit-KL verb -- backends a / b, prompts (files, pipes, no tokenizer), outputs,
the plot, and backends failing mid-run."""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fixture_helpers import one_line_error
from parity.cli import main


REPO = Path(__file__).resolve().parents[2]

def _fifo(tmp_path, data: bytes, name="fifo") -> tuple[Path, threading.Thread]:
    """A named pipe (what `<(...)` gives) fed with ``data`` by a thread."""
    p = tmp_path / name
    os.mkfifo(p)

    def feed():
        with open(p, "wb") as f:
            f.write(data)
    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return p, t

def _tiny_without_tokenizer(tiny, tmp_path) -> Path:
    d = tmp_path / "notok"
    shutil.copytree(tiny, d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink(missing_ok=True)
    return d

def test_kl_with_a_corrupt_tokenizer_is_refused_not_taken_for_missing(tiny, tmp_path, capsys):
    """A tokenizer.json that does not load is bad input (exit 2, naming the file), never the silent token-id
    fallback of a checkpoint that has none (negative control: the same copy without the file falls back)."""
    d = tmp_path / "badtok"
    shutil.copytree(tiny, d)
    (d / "tokenizer.json").write_text("{")
    assert main(["kl", str(d), "--b", "reference", "--greedy-tokens", "0", "--no-progress"]) == 2
    line = one_line_error(capsys, "tokenizer.json", "does not load")
    assert "no tokenizer.json" not in line
    (d / "tokenizer.json").unlink()
    assert main(["kl", str(d), "--b", "reference", "--greedy-tokens", "0", "--no-progress"]) == 0
    assert "no tokenizer.json" in capsys.readouterr().err


def _rows_all_error():
    from parity.harness.scenarios import summarize_results
    from parity.harness.scenarios.common import CaseResult
    res = [CaseResult("budget", f"c{i}", 4, "error", failure="RuntimeError: x", divergence="RuntimeError: x")
           for i in range(3)]
    return summarize_results("budget", res, 0.1)

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


def test_kl_plot_path_checked_up_front(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import parity.harness.run as K
    monkeypatch.setattr(K, "run_kl_command", lambda *a, **k: pytest.fail("ran before checking --plot"))
    assert main(["kl", "--a", "reference", "--b", "reference", "--plot", str(tmp_path)]) == 2
    one_line_error(capsys, "--plot", "found a directory")


def test_kl_backend_open_failure_is_exit_2(boom_module, capsys):
    assert main(["kl", "--b", boom_module, "--greedy-tokens", "0"]) == 2
    one_line_error(capsys, boom_module, "RuntimeError", "device on fire")


def test_kl_negative_greedy_tokens_is_exit_2(capsys):
    assert main(["kl", "--a", "reference", "--b", "reference", "--greedy-tokens", "-1"]) == 2
    one_line_error(capsys, "--greedy-tokens", "-1")


def test_kl_json_prompts_with_lone_surrogates_are_refused(tmp_path, capsys):
    """A JSON prompt file holding "\\ud800": a one-line error from kl/parity, no traceback."""
    f = tmp_path / "p.json"
    f.write_text('["fine", "bad \\ud800 text"]')
    assert main(["kl", "--b", "reference", "--prompts", str(f)]) == 2
    one_line_error(capsys, "--prompts", "item 1", "U+D800", "byte offset 4")
    assert main(["parity", "--backend", "reference", "--scenario", "kl", "--prompts", str(f)]) == 2
    one_line_error(capsys, "--prompts", "item 1", "U+D800")


def test_kl_prompts_from_a_pipe(tmp_path, capsys):
    """Inputs accept pipes (`<(...)`)."""
    p, t = _fifo(tmp_path, b"[[1, 2, 3, 4, 5, 6]]")
    assert main(["kl", "--b", "reference", "--prompts", str(p), "--greedy-tokens", "0", "--no-progress"]) == 0
    t.join(5)
    assert "6 positions" in capsys.readouterr().out


def test_kl_without_tokenizer_falls_back_to_token_id_prompts(tiny, tmp_path, capsys):
    """kl/parity on a checkpoint without a tokenizer: the bundled set falls back to seeded token-id prompts,
    and a text --prompts file is refused saying token-id lists work."""
    d = _tiny_without_tokenizer(tiny, tmp_path)
    assert main(["kl", str(d), "--b", "reference", "--greedy-tokens", "0", "--no-progress", "--json"]) == 0
    cap = capsys.readouterr()
    assert "no tokenizer.json" in cap.err and "token-id prompts" in cap.err
    from parity.prompts import ID_PROMPT_LENGTHS
    assert json.loads(cap.out)["positions"] if "positions" in json.loads(cap.out) else True
    assert sum(ID_PROMPT_LENGTHS) > 0
    f = tmp_path / "texts.json"
    f.write_text('["a text"]')
    assert main(["kl", str(d), "--b", "reference", "--prompts", str(f)]) == 2
    one_line_error(capsys, "--prompts", "token-id lists")
    # the same prompts on every run: seeded
    from parity.prompts import load_prompts
    a, b = load_prompts(None, d, 512), load_prompts(None, d, 512)
    assert a == b and len(a) >= len(ID_PROMPT_LENGTHS)


def test_kl_out_file_and_stdout(tmp_path, capsys):
    """One --out rule for kl too: existing refused without --overwrite, '-' = stdout."""
    out = tmp_path / "k.json"
    out.write_text("old")
    assert main(["kl", "--b", "reference", "--out", str(out), "--greedy-tokens", "0", "--no-progress"]) == 2
    one_line_error(capsys, "--out", "--overwrite")
    assert out.read_text() == "old"
    assert main(["kl", "--b", "reference", "--out", "-", "--greedy-tokens", "0", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["b"] == "reference"


def test_kl_plot_has_integer_counts_and_the_limit_line(monkeypatch):
    """The kl plot has whole position counts and a threshold line."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from parity.cli import kl as K
    from parity.harness.run import run_kl_command
    rep = run_kl_command(REPO / "fixtures" / "tiny", "reference", "reference", [[1, 2, 3]], greedy_tokens=0,
                         progress=False)
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    assert K.plot_png(rep)[:4] == b"\x89PNG"
    h, line = figs[0].axes
    assert any(abs(y - rep.thresholds.max_kl) < 1e-30 for ln in line.get_lines() for y in ln.get_ydata()[:1])
    assert all(float(t).is_integer() for t in h.get_yticks())


def test_all_error_scenario_is_shown_as_error_not_zero_kl():
    """A scenario whose cases all errored shows no `worst KL 0.00e+00` (which would read as perfect)."""
    from parity.harness.report import ParityReport, render_table
    row = _rows_all_error()
    assert np.isnan(row.worst_kl) and row.status == "error"
    text = render_table(ParityReport("b", "m", [row]), columns=200)
    assert "0.00e+00" not in text and text.splitlines()[2].split()[2] == "ERROR"


def test_kl_reference_vs_reference_passes(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "Hello lighthouse"]))
    rc = main(["kl", "--a", "reference", "--b", "reference", "--prompts", str(prompts), "--greedy-tokens", "2",
               "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["controls_ok"] and doc["metrics"]["top1_agreement"] == 1.0
    assert set(doc["controls"]) == {"determinism", "precision_floor", "negative_control"}
    assert set(doc["metrics"]["kl_ab"]) == {"mean", "median", "p90", "p99", "p99.9", "max"}


def test_kl_passing_comparison_with_a_failed_control_reads_inconclusive(tmp_path, capsys, monkeypatch):
    """A comparison that passes while a control failed is no PASS anywhere in the text: the verdict line says
    INCONCLUSIVE, the controls say FAIL, exit 3 (negative control of the wording: the same run with the control
    flagged says PASS, exit 0)."""
    import parity.harness.kl as KH
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([list(range(1, 13))]))
    argv = ["kl", "--a", "reference", "--b", "reference", "--prompts", str(prompts), "--greedy-tokens", "0",
            "--no-progress"]
    assert main(argv) == 0
    assert "verdict b: PASS" in capsys.readouterr().out
    real = KH.negative_control

    def unflagged(*a, **k):
        c = real(*a, **k)
        return dict(c, ok=False, inconclusive=True, detail="NOT flagged (forced for this test)")
    monkeypatch.setattr(KH, "negative_control", unflagged)
    assert main(argv) == 3
    out = capsys.readouterr().out
    verdict_line = next(ln for ln in out.splitlines() if "verdict b:" in ln)
    assert "INCONCLUSIVE" in verdict_line and "PASS" not in verdict_line.split("(")[0]
    assert "CONTROLS FAILED" in out


def test_kl_with_a_not_the_reference_still_sizes_its_negative_control(tmp_path, capsys):
    """--a engine (no reference model to force picks on): the control perturbing the reference forces its
    selections to the unperturbed reference's picks, so it is sized on the continuous response and flagged
    (was: a selection flip at the first size, then a re-size into the floor noise, never flagged: exit 3)."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([list(range(5, 25)), [7, 3, 9, 11, 2, 40, 41]]))
    rc = main(["kl", "--a", "engine", "--b", "engine", "--prompts", str(prompts), "--greedy-tokens", "0",
               "--no-progress", "--json"])
    doc = json.loads(capsys.readouterr().out)
    nc = doc["controls"]["negative_control"]
    assert rc == 0 and nc["ok"] and nc["forced"], nc["detail"]
    assert nc["intended_rel"] / 2 <= nc["effect_rel"] <= 2 * nc["intended_rel"]


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


def test_kl_plot_is_written_when_matplotlib_is_present(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (optional) not installed")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7, 8]]))
    png = tmp_path / "kl.png"
    rc = main(["kl", "--b", "reference", "--prompts", str(prompts), "--greedy-tokens", "0", "--plot", str(png),
               "--no-progress"])
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*")) and not [p for p in tmp_path.iterdir() if p.suffix == ".png" and p != png]


@pytest.mark.parametrize("flag", ["--a", "--b"])
def test_kl_bad_backend_names_its_option(flag, capsys):
    assert main(["kl", flag, "bogus", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}:" in err and "--backend" not in err


def test_kl_names_a_deprecated_backend_alias_by_its_current_spelling(capsys):
    """--b engine-cpu (a deprecated alias, still accepted) is reported as engine:device=cpu, the spelling --backend
    takes now; the deprecation note names the alias once on stderr."""
    assert main(["kl", "--b", "engine-cpu", "--out", "-", "--greedy-tokens", "0", "--no-progress"]) in (0, 1)
    cap = capsys.readouterr()
    assert json.loads(cap.out)["b"] == "engine:device=cpu", cap.out[:300]
    assert "engine-cpu" in cap.err


def test_kl_progress_numbers_prompts_as_the_report_does(tmp_path, capsys):
    """The progress lines name each prompt by the number the report gives it (the JSON's ``prompt`` field, the
    greedy line's ``prompt N``, parity's ``kl/prompt N`` cases): from 0."""
    p = tmp_path / "p.json"
    p.write_text("[[1, 2, 3, 4], [5, 6, 7]]")
    assert main(["kl", "--b", "reference", "--prompts", str(p), "--greedy-tokens", "1", "--out", "-"]) == 0
    cap = capsys.readouterr()
    assert [g["prompt"] for g in json.loads(cap.out)["greedy"]] == [0, 1]
    finished = [ln.split(" finished ")[1].split(",")[0] for ln in cap.err.splitlines() if " finished " in ln]
    assert finished == ["prompt 0 (4 tokens)", "prompt 1 (3 tokens)"], cap.err


def test_kl_out_and_plot_naming_one_file_are_refused(tmp_path, capsys, monkeypatch):
    """``kl --out F --plot F`` (or two spellings of F): the PNG silently replaced the JSON report (exit 0);
    refused before anything runs, exit 2, naming both flags; nothing written."""
    from fixture_helpers import one_line_error
    from parity.cli import main
    monkeypatch.chdir(tmp_path)
    for a, b in (("same.json", "same.json"), ("same.json", "./same.json"), (str(tmp_path / "same.json"), "same.json")):
        assert main(["kl", "--b", "reference", "--greedy-tokens", "0", "--no-progress", "--out", a, "--plot", b]) == 2
        one_line_error(capsys, "--plot", "--out")
        assert list(tmp_path.iterdir()) == []
