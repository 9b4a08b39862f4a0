"""The one exit-code contract of every verb: 0 pass, 1 divergence, 2 usage/input, 3
inconclusive, 4 environment; a backend's SystemExit, import failure or crash is caught at the boundary."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixture_helpers import one_line_error
from parity.cli import main
import os

REPO = Path(__file__).resolve().parents[2]

EXITING = """
import sys
from parity.backends import ReferenceBackend


class ExitInPrefill(ReferenceBackend):
    '''The reference, but its prefill calls sys.exit(CODE): a backend that ends the process from inside a case.'''

    @classmethod
    def open(cls, model_path, **opts):
        be = ReferenceBackend.open(model_path, **opts)
        be.__class__ = cls
        return be

    def prefill(self, h, ids, chunk_size=None):
        sys.exit(CODE)


class RaiseInPrefill(ExitInPrefill):
    def prefill(self, h, ids, chunk_size=None):
        raise RuntimeError("kernel launch failed: the porting engineer's bug")  # LINE-MARK
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Plugin modules on sys.path: exit0 / exit1 (sys.exit in prefill), broken_syntax, exits_at_import,
    raises_at_import."""
    d = tmp_path / "plugins"
    d.mkdir()
    for code in (0, 1):
        (d / f"exit{code}.py").write_text(EXITING.replace("CODE", str(code)))
    (d / "broken_syntax.py").write_text("def open(:\n    pass\n")
    (d / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (d / "raises_at_import.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")
    (d / "valueerror_at_import.py").write_text("raise ValueError('bad build flag')\n")
    monkeypatch.syspath_prepend(str(d))
    for m in ("exit0", "exit1", "broken_syntax", "exits_at_import", "raises_at_import", "valueerror_at_import"):
        sys.modules.pop(m, None)
    return d


def test_exit_codes_are_defined_once_and_shown_in_help(capsys):
    """What to build: the contract documented in `qwen4exp -h` from the one definition (reference.errors)."""
    from reference.errors import (EXIT_CODES, EXIT_DIVERGENCE, EXIT_ENVIRONMENT, EXIT_INCONCLUSIVE, EXIT_OK,
                                  EXIT_USAGE)
    assert (EXIT_OK, EXIT_DIVERGENCE, EXIT_USAGE, EXIT_INCONCLUSIVE, EXIT_ENVIRONMENT) == (0, 1, 2, 3, 4)
    with pytest.raises(SystemExit) as e:
        main(["-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for code, meaning in EXIT_CODES.items():
        assert f"  {code}  {meaning}" in out
    assert "exit codes" in out and "environment failure" in out and "inconclusive" in out
    readme = (REPO / "README.md").read_text()
    assert all(f"| {c} " in readme for c in EXIT_CODES), "README's exit-code table is missing a code"
    # the rows README adds to the contract (signals, an outside engine's abort, a backend's os._exit) are in -h too
    for code in ("130 / 143 / 129", "134", "other"):
        if f"| {code} |" in readme:
            assert f"\n  {code} " in out, f"README's exit-code row {code!r} is missing from -h"


def test_cli_error_class_is_gone():
    """CLIError is raised where it is handled (no dead handler)."""
    import parity.cli as C
    assert not hasattr(C, "CLIError")


@pytest.mark.parametrize("code", [0, 1])
def test_backend_sys_exit_in_a_case_is_an_error_row_not_its_code(plugins, tmp_path, capsys, code):
    """A backend calling sys.exit inside a case gives ERROR rows, exit 1 and a report.json, never the
    backend's own code (sys.exit(0) must not read as a pass in CI)."""
    out = tmp_path / "out"
    rc = main(["parity", "--backend", f"exit{code}:ExitInPrefill", "--scenario", "kl", "budget", "--level", "ci",
               "--no-progress", "--out", str(out), "--format", "text"])
    assert rc == 1
    text = capsys.readouterr().out
    assert "ERROR" in text and "SystemExit" in text
    doc = json.loads((out / "report.json").read_text())
    assert doc["exit_code"] == 1 and {r["status"] for r in doc["scenarios"]} == {"error"}
    assert all("SystemExit" in r["traceback"] for r in doc["scenarios"])


def test_backend_sys_exit_in_kl_is_an_error_verdict(plugins, capsys):
    """The same for `kl`: exit 1 with an ERROR verdict, never the backend's own code."""
    assert main(["kl", "--b", "exit0:ExitInPrefill", "--no-progress"]) == 1
    assert "verdict: ERROR" in capsys.readouterr().out


def test_plugin_syntax_error_or_raising_at_import_is_exit_2_with_the_reason(plugins, capsys):
    """A module:Class whose module has a SyntaxError or raises at import is exit 2 with the reason, no
    traceback (the documented contract)."""
    assert main(["parity", "--backend", "broken_syntax:B", "--scenario", "kl"]) == 2
    one_line_error(capsys, "broken_syntax", "SyntaxError", "broken_syntax.py:1")
    assert main(["kl", "--b", "exits_at_import:B"]) == 2
    one_line_error(capsys, "--b", "exits_at_import", "SystemExit")
    ids = plugins / "ids.txt"
    ids.write_text("1 2 3")
    assert main(["taps", "record", "tiny", "--ids", str(ids), "--out", str(plugins / "x"),
                 "--backend", "valueerror_at_import:B"]) == 2
    one_line_error(capsys, "valueerror_at_import", "ValueError", "bad build flag")
    assert main(["parity", "--backend", "raises_at_import:B", "--scenario", "kl"]) == 2
    one_line_error(capsys, "raises_at_import", "libfoo.so")


def test_kl_backend_raising_mid_run_is_an_error_verdict_not_a_traceback(plugins, capsys):
    """`qwen4exp kl` with a backend raising mid-run gives an ERROR verdict (as `parity`'s ERROR row), not a
    traceback."""
    assert main(["kl", "--b", "exit0:RaiseInPrefill", "--no-progress"]) == 1
    cap = capsys.readouterr()
    assert "verdict: ERROR" in cap.out and "kernel launch failed" in cap.out
    assert "Traceback" not in cap.err and "--traceback" in cap.err


def test_backend_tracebacks_in_report_json_and_behind_traceback(plugins, tmp_path, capsys):
    """A backend's full stack (not just `RuntimeError: <message>`) is in report.json (and kl's JSON), and on
    stderr with --traceback, so the failing line can be found."""
    out = tmp_path / "o"
    assert main(["parity", "--backend", "exit0:RaiseInPrefill", "--scenario", "budget", "--level", "ci",
                 "--no-progress", "--out", str(out)]) == 1
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err  # not printed without --traceback, but said where it is
    row = json.loads((out / "report.json").read_text())["scenarios"][0]
    where = str(plugins / "exit0.py")
    assert where in row["traceback"] and "kernel launch failed" in row["traceback"]
    assert any(where in json.dumps(f.get("traceback")) for f in row["failures"])
    assert main(["parity", "--backend", "exit0:RaiseInPrefill", "--scenario", "budget", "--level", "ci",
                 "--no-progress", "--traceback"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and where in err and "# LINE-MARK" in err
    assert main(["kl", "--b", "exit0:RaiseInPrefill", "--no-progress", "--json"]) == 1
    assert where in json.loads(capsys.readouterr().out)["traceback"]
    # negative control: a passing run carries no traceback
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--level", "ci", "--no-progress",
                 "--json"]) == 0
    assert all(r["traceback"] is None for r in json.loads(capsys.readouterr().out)["scenarios"])


def test_uncaught_crash_is_exit_4_with_traceback(monkeypatch, capsys):
    """A crash of qwen4exp itself is exit 4 (environment / internal), never 1 (divergence) or 0."""
    import parity.cli.info as I

    def boom(args):
        raise ZeroDivisionError("internal")
    parser_run = I.run
    monkeypatch.setattr(I, "run", boom)
    try:
        assert main(["info"]) == 4
    finally:
        monkeypatch.setattr(I, "run", parser_run)
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err
    assert main(["info", "--json"]) == 0  # negative control


def test_full_disk_is_exit_4_for_every_writer(tmp_path, capsys):
    """A full disk is exit 4 (environment), never 1 (divergence). /dev/full as stdout for a JSON printer."""
    code = "import sys; from parity.cli import main; sys.exit(main(['taps', 'list', '--json']))"
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           timeout=120)
    assert p.returncode == 4 and "Traceback" not in p.stderr, p.stderr
    from reference.atomic import OutputWriteError
    from taps.archive import ArchiveWriteError
    assert OutputWriteError.exit_code == ArchiveWriteError.exit_code == 4


def test_python_m_parity_cli_runs(tmp_path):
    """`python -m parity.cli` (what these tests and a source checkout use) is the CLI."""
    p = subprocess.run([sys.executable, "-m", "parity.cli", "info", "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["config"]["vocab_size"] == 512
    p = subprocess.run([sys.executable, "-m", "parity.cli", "info", "no-such-model"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and textwrap.dedent(p.stderr).count("\n") == 1


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_output_to_a_full_disk_is_one_line_exit_4():
    code = "import sys; from parity.cli import main; sys.exit(main(['info', '--json']))"
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE, text=True,
                           cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert p.returncode == 4 and "Traceback" not in p.stderr, p.stderr
    assert "could not write output" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_atomic_dir_full_disk_is_output_write_error(tmp_path):
    import errno
    import os

    from reference.atomic import OutputWriteError, atomic_dir
    with pytest.raises(OutputWriteError, match="could not be written"):
        with atomic_dir(tmp_path / "d") as t:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):  # negative control: not a write failure, not re-worded
        with atomic_dir(tmp_path / "d") as t:
            open(t / "missing" / "x")
    with atomic_dir(tmp_path / "d") as t:
        (t / "x").write_text("ok")
    assert (tmp_path / "d" / "x").read_text() == "ok"


def test_report_exit_code_follows_the_contract():
    """ParityReport maps its rows onto the contract: fail/error -> 1 before inconclusive -> 3 before pass -> 0."""
    from parity.harness.report import ParityReport, ScenarioRow

    def rep(*statuses):
        return ParityReport("b", "m", [ScenarioRow(f"s{i}", 1, 0, 0.0, 0.0, None, 0.1, s) for i, s in enumerate(statuses)])
    assert rep("pass", "pass").exit_code == 0
    assert rep("pass", "inconclusive").exit_code == 3 and rep("inconclusive").to_json()["verdict"] == "inconclusive"
    assert rep("inconclusive", "fail").exit_code == 1 and rep("error", "pass").exit_code == 1


REFUSING = '''
from parity.backends.refusal import EngineRefused


class B:
    @classmethod
    def open(cls, model_path, **opts):
        raise EngineRefused("fakeengine 1.0", "converter", "ValueError: no such tensor map", "reparam=x gets past it")
'''


def test_kl_engine_refusing_the_checkpoint_is_a_refused_verdict_as_in_parity(plugins, tmp_path, capsys):
    """An outside engine refusing a valid checkpoint is `kl`'s REFUSED verdict (exit 1, the engine's own message,
    report.json `refused`), as `parity`'s open row; not an ERROR saying a backend raised while the harness ran."""
    (plugins / "refusing.py").write_text(REFUSING)
    sys.modules.pop("refusing", None)
    out = tmp_path / "kl.json"
    assert main(["kl", "--b", "refusing:B", "--no-progress", "--out", str(out)]) == 1
    cap = capsys.readouterr()
    assert "verdict: REFUSED by fakeengine 1.0 converter: ValueError: no such tensor map; reparam=x" in cap.out
    assert "ERROR" not in cap.out and "--traceback" not in cap.err
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "refused" and doc["exit_code"] == 1
    assert doc["refused"] == {"engine": "fakeengine 1.0", "stage": "converter",
                              "message": "ValueError: no such tensor map", "offer": "reparam=x gets past it"}
    assert main(["parity", "--backend", "refusing:B", "--scenario", "kl", "--no-progress"]) == 1
    assert "REFUSED by fakeengine 1.0 converter" in capsys.readouterr().out
