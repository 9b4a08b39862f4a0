"""The ``qwen4exp`` dispatcher itself (parity/cli/__init__.py): version, broken pipes, empty MODEL, the
shared output-path rule, umask, options refused in contradiction across verbs."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from fixture_helpers import one_line_error
from parity.cli import main
from reference.paths import REPO_ROOT


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    from parity.cli import package_version
    v = package_version()
    assert v != "unknown" and v in capsys.readouterr().out


def test_broken_pipe_is_not_a_traceback(tiny, monkeypatch):
    class Closed:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise OSError("no fd")

        def isatty(self):
            return False
    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["info", "--json"]) == 0


def test_broken_pipe_subprocess():
    """`qwen4exp info --json | head -c 1`: no traceback on stderr (the whole real pipeline)."""
    code = "import sys; from parity.cli import main; sys.exit(main(['info', '--json']))"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    p.stdout.close()  # the reader is gone before anything is written
    err = p.stderr.read().decode()
    assert p.wait() == 0 and "Traceback" not in err, err


def test_output_files_honour_umask(tmp_path):
    from parity.bench.runner import write_json_atomic as bench_json
    from parity.harness.report import write_json_atomic as report_json
    from reference.atomic import atomic_dir, atomic_save_npy, atomic_write_bytes
    from reference.checkpoint import write_safetensors
    old = os.umask(0o022)
    try:
        paths = [atomic_write_bytes(tmp_path / "a.bin", b"x"), atomic_save_npy(tmp_path / "a.npy", np.zeros(2)),
                 report_json(tmp_path / "r.json", {"a": 1}), bench_json(tmp_path / "b.json", {"a": 1.0}),
                 write_safetensors(tmp_path / "w.safetensors", {"x": np.zeros(2, np.float32)})]
        with atomic_dir(tmp_path / "d") as d:
            (d / "f").write_text("y")
        for p in paths + [tmp_path / "d" / "f"]:
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o644, p
        assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o755
        os.umask(0o077)
        p = atomic_write_bytes(tmp_path / "private.bin", b"x")
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    finally:
        os.umask(old)
    assert not list(tmp_path.glob(".*.tmp"))


def test_check_output_path_kinds(tmp_path):
    from reference.atomic import check_output_path
    from reference.errors import InputError
    f = tmp_path / "f"
    f.write_text("x")
    assert check_output_path(tmp_path / "new" / "x.json") == tmp_path / "new" / "x.json"
    with pytest.raises(InputError, match="existing one"):
        check_output_path(f, "file", overwrite=False)
    with pytest.raises(InputError, match="found a directory"):
        check_output_path(tmp_path, "file")
    with pytest.raises(InputError, match="existing file"):
        check_output_path(f, "dir")
    with pytest.raises(InputError, match="is a file"):
        check_output_path(f / "sub" / "x.json", "file")
    assert check_output_path(tmp_path / "empty", "dir", overwrite=False)


@pytest.mark.parametrize("argv, needles", [
    (["taps", "record", "tiny", "--backend", "reference", "--precision", "bf16"], ["--precision bf16", "reference"]),
    (["logits", "tiny", "--device", "tpu"], ["--device", "tpu"]),
    (["logits", "tiny", "--device", "cuda"], ["--device", "reference", "CPU"]),
    (["logits", "tiny", "--backend", "engine", "--dtype", "float64"], ["--dtype", "engine", "--precision"]),
])
def test_contradictory_options_are_refused(tmp_path, capsys, argv, needles):
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3")
    out = tmp_path / ("t.taps" if argv[0] == "taps" else "o.npy")
    assert main([*argv, "--ids", str(f), "--out", str(out)]) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


def test_empty_out_is_refused_not_ignored(capsys, monkeypatch):
    """`parity --out ''` is refused before the job runs (an empty --out must not read as "no --out")."""
    import parity.harness.run as P
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: pytest.fail("ran with --out ''"))
    assert main(["parity", "--backend", "reference", "--out", ""]) == 2
    one_line_error(capsys, "--out", "empty string")


@pytest.mark.parametrize("argv", [["info", ""], ["logits", "", "--ids", "x", "--out", "o.npy"]])
def test_empty_model_path_is_reported_as_typed(capsys, argv):
    assert main(argv) == 2
    line = one_line_error(capsys, "MODEL ''", "empty")
    assert "'.'" not in line


@pytest.mark.parametrize("argv, usage, unknown, hint", [
    (["parity", "--scenrio", "kl"], "usage: qwen4exp parity ", "--scenrio", "did you mean --scenario?"),
    (["taps", "record", "tiny", "--ids", "x", "--out", "y", "--idz", "x"], "usage: qwen4exp taps record ",
     "--idz x", "did you mean --ids?"),
    (["tap-diff", "a", "b", "--profle", "bf16"], "usage: qwen4exp tap-diff ", "--profle bf16",
     "did you mean --profile?"),
    (["info", "tiny", "extra"], "usage: qwen4exp info ", "extra", None),
    # a mistyped REQUIRED option: named as unknown, not hidden behind "the following arguments are required"
    (["logits", "tiny", "--idz", "1,2", "--out", "y.npy"], "usage: qwen4exp logits ", "--idz", "did you mean --ids?"),
    (["taps", "diff", "--nope"], "usage: qwen4exp taps diff ", "--nope", None),
    # kl takes --a / --b, not --backend: said so (before: "did you mean --traceback?", the shared '--' matching)
    (["kl", "--backend", "engine"], "usage: qwen4exp kl ", "--backend", "kl takes two backends, --a SPEC"),
    # no option is near '--bogus' once the '--' every option has is set aside (before: "did you mean --out?")
    (["parity", "--bogus"], "usage: qwen4exp parity ", "--bogus", None),
])
def test_unknown_option_of_a_subcommand_shows_that_subcommands_usage(capsys, argv, usage, unknown, hint):
    """A mistyped option is refused by the subcommand it was given to: its usage (which lists the right
    spelling), the argument found, a close match as the expected one, and exit 2 (usage error)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "usage: qwen4exp [-h]" not in err
    prog = usage[len("usage: "):].rstrip()
    assert f"{prog}: error: unrecognized arguments: {unknown}" in err, err
    if hint:
        assert hint in err, err
    else:
        assert "did you mean" not in err, err


def test_unknown_top_level_option_keeps_the_top_level_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--bogus", "info"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: qwen4exp [-h]") and "qwen4exp: error: unrecognized arguments: --bogus" in err


def test_ctrl_c_while_the_commands_import_is_an_interrupt_not_a_crash(capsys, monkeypatch):
    """Ctrl-C during the first second (the command modules importing Numba) gives exit 130 and one line,
    no traceback, as it does later in the run."""
    import parity.cli as C

    def slow_import():
        raise KeyboardInterrupt
    monkeypatch.setattr(C, "build_parser", slow_import)
    assert C.main(["info", "tiny"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "qwen4exp info: interrupted" and "Traceback" not in err


def test_every_verb_takes_the_shared_traceback_option():
    """README: one grammar for every verb; `--traceback` is a shared option, so every subcommand's parser
    (nested ones included) takes it itself (negative control: an option no verb has is refused by each)."""
    import argparse

    from parity.cli import build_parser

    def leaves(p, path=()):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield path, p
        for a in subs:
            for name, sp in a.choices.items():
                yield from leaves(sp, path + (name,))
    found = list(leaves(build_parser()))
    assert len(found) >= 10
    for path, p in found:
        assert "--traceback" in p._option_string_actions, path
        assert "--no-such-option" not in p._option_string_actions, path
