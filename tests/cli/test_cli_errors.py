"""Bad input to ``qwen4exp`` commands: exit 2 with ONE line naming the thing, checked before any work;
no tracebacks. Also --version, broken pipes, umask-honouring output files and bench signal cleanup.

Each test reproduces a finding of a new user's break-the-tool session (see the test names).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from parity.cli import main
from reference.paths import REPO_ROOT, bundled_model
from fixture_helpers import one_line_error




def ids_file(tmp_path, content="1 2 3 4 5 6", name="ids.txt"):
    f = tmp_path / name
    f.write_text(content)
    return f


# ------------------------------------------------------------------ output paths validated up front
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


def test_parity_reused_out_dir_needs_overwrite_and_clears_old_archives(tmp_path, capsys, monkeypatch):
    import parity.harness.run as P
    from parity.harness.report import ParityReport
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: ParityReport(backend="reference", model="tiny"))
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


def test_logits_out_directory_is_exit_2(tiny, tmp_path, capsys, monkeypatch):
    import parity.harness.logits as L
    monkeypatch.setattr(L, "compute_logits", lambda *a, **k: pytest.fail("computed before checking --out"))
    d = tmp_path / "nu"
    d.mkdir()
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path)), "--out", str(d)]) == 2
    one_line_error(capsys, "--out", "found a directory")


def test_bench_out_directory_is_exit_2_before_running(tmp_path, capsys, monkeypatch):
    from parity.bench import runner
    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("benchmark ran before checking --out"))
    assert main(["bench", "--backend", "reference", "--no-peer", "--no-extras", "--out", str(tmp_path)]) == 2
    one_line_error(capsys, "--out", "found a directory")


def test_kl_plot_path_checked_up_front(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import parity.harness.run as K
    monkeypatch.setattr(K, "run_kl_command", lambda *a, **k: pytest.fail("ran before checking --plot"))
    assert main(["kl", "--a", "reference", "--b", "reference", "--plot", str(tmp_path)]) == 2
    one_line_error(capsys, "--plot", "found a directory")


# ------------------------------------------------------------------ backends that cannot be opened
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


def test_kl_backend_open_failure_is_exit_2(boom_module, capsys):
    assert main(["kl", "--b", boom_module, "--greedy-tokens", "0"]) == 2
    one_line_error(capsys, boom_module, "RuntimeError", "device on fire")


def test_parity_backend_open_failure_is_exit_2(boom_module, capsys):
    assert main(["parity", "--backend", boom_module, "--scenario", "budget", "--no-progress"]) == 2
    one_line_error(capsys, boom_module, "cannot be opened", "device on fire")


# ------------------------------------------------------------------ ids files
@pytest.mark.parametrize("content,needles", [
    ("99999999999999999999999", ["vocab_size=512", "99999999999999999999999"]),
    ("1,2,,3", ["empty item", "item 2"]),
])
def test_logits_bad_ids_exit_2(tiny, tmp_path, capsys, content, needles):
    out = tmp_path / "o.npy"
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path, content)), "--out", str(out)]) == 2
    one_line_error(capsys, "--ids", *needles)
    assert not out.exists()


def test_logits_reads_npy_ids(tiny, tmp_path, capsys):
    ids = np.array([1, 5, 9, 300, 2], dtype=np.int32)
    f = tmp_path / "ids.npy"
    np.save(f, ids)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(a)]) == 0
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path, "1 5 9 300 2")), "--out", str(b)]) == 0
    assert np.array_equal(np.load(a), np.load(b)) and np.load(a).shape == (5, 512)


def test_logits_help_says_ids_is_a_file(capsys):
    with pytest.raises(SystemExit):
        main(["logits", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a FILE holding token ids" in out and ".npy" in out


# ------------------------------------------------------------------ precision
def test_logits_bf16_with_reference_is_exit_2(tiny, tmp_path, capsys):
    assert main(["logits", "tiny", "--ids", str(ids_file(tmp_path)), "--out", str(tmp_path / "o.npy"),
                 "--precision", "bf16"]) == 2
    one_line_error(capsys, "--precision bf16", "reference")


def test_generate_bf16_with_reference_is_exit_2(tiny, capsys):
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--precision", "bf16"]) == 2
    one_line_error(capsys, "--precision bf16", "reference")


def test_logits_engine_bf16_notes_bf16_exact_weights(tiny, tmp_path, capsys):
    pytest.importorskip("engine.engine", reason="engine not importable")
    from reference.checkpoint import Checkpoint
    from parity.harness.logits import weights_bf16_exact
    assert weights_bf16_exact(Checkpoint.open(tiny))  # tiny is stored in BF16
    f = ids_file(tmp_path)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(a), "--backend", "engine:device=cpu,precision=bf16"]) == 0
    err = capsys.readouterr().err
    assert "stored in BF16 already" in err and err.count("note:") == 1
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(b), "--backend", "engine", "--device", "cpu",
                 "--precision", "float32"]) == 0
    assert "BF16" not in capsys.readouterr().err
    # the notice states a fact: numerics are unchanged, so the two outputs are identical
    assert np.array_equal(np.load(a), np.load(b))


def test_bf16_exact_is_false_for_float32_weights(tmp_path):
    from parity.harness.logits import weights_bf16_exact

    class Ck:
        def __init__(self, dts):
            self.d = dts

        def names(self):
            return list(self.d)

        def dtype(self, n):
            return self.d[n]
    assert weights_bf16_exact(Ck({"a": "BF16", "b": "I64"}))
    assert not weights_bf16_exact(Ck({"a": "BF16", "b": "F32"}))
    assert not weights_bf16_exact(Ck({"a": "F8_E4M3", "a_scale_inv": "F32"}))


# ------------------------------------------------------------------ values accepted without complaint
def test_kl_negative_greedy_tokens_is_exit_2(capsys):
    assert main(["kl", "--a", "reference", "--b", "reference", "--greedy-tokens", "-1"]) == 2
    one_line_error(capsys, "--greedy-tokens", "-1")


@pytest.mark.parametrize("flag", ["--timeout-s", "--budget-s"])
def test_bench_zero_seconds_is_exit_2(flag, capsys):
    assert main(["bench", "--backend", "reference", "--no-peer", flag, "0"]) == 2
    one_line_error(capsys, flag, "> 0")


def test_bench_layers_without_synthetic_is_exit_2(capsys):
    assert main(["bench", "--backend", "reference", "--no-peer", "--layers", "2"]) == 2
    one_line_error(capsys, "--layers", "--synthetic")


def test_bench_accepts_positional_model(tiny, monkeypatch, capsys, tmp_path):
    from parity.bench import runner
    seen = []
    monkeypatch.setattr(runner, "run_worker", lambda spec, **k: seen.append(spec) or {"kind": spec["kind"]})
    assert main(["bench", "tiny", "--backend", "reference", "--no-peer", "--no-extras", "--json"]) == 0
    assert seen and Path(seen[0]["model"]).resolve() == tiny.resolve()
    capsys.readouterr()
    assert main(["bench", str(tmp_path / "nothing"), "--backend", "reference", "--no-peer"]) == 2
    one_line_error(capsys, "nothing")


def test_bench_truncated_checkpoint_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    from parity.bench import runner
    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("worker started on a bad checkpoint"))
    bad = tmp_path / "trunc"
    shutil.copytree(tiny, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert main(["bench", "--backend", "reference", "--repeats", "1", "--model", str(bad), "--no-peer"]) == 2
    one_line_error(capsys, "model.safetensors")


def test_generate_notes_and_errors(tiny, tmp_path, capsys):
    # an argument error is one line: the 'random weights' note is not printed before it
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--top-p", "5"]) == 2
    one_line_error(capsys, "--top-p")
    # a bad generation_config.json is named
    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    (m / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 5}))
    assert main(["generate", str(m), "--prompt", "hi", "--backend", "reference"]) == 2
    one_line_error(capsys, "generation_config.json", "top_p")
    # --no-thinking without --chat is not silently ignored
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--no-thinking", "--greedy",
                 "--max-new-tokens", "1", "--json"]) == 0
    assert "--no-thinking has no effect without --chat" in capsys.readouterr().err


# ------------------------------------------------------------------ parity table / scenario names
def test_parity_bogus_scenario_lists_kl(capsys):
    assert main(["parity", "--backend", "reference", "--scenario", "bogus"]) == 2
    line = one_line_error(capsys, "bogus")
    assert "kl" in line.split("expected one of", 1)[1]


def test_parity_table_wraps_first_divergence_to_the_terminal(monkeypatch):
    # the table stays within the terminal width (COLUMNS) and wraps long text (even one long word) onto
    # continuation lines instead of cutting it (second user's finding 6: cut at 80 even on wide terminals)
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


# ------------------------------------------------------------------ info
def test_info_header_shape_mismatch_is_exit_2(tiny, tmp_path, capsys):
    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] + 1
    (m / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(m)]) == 2
    one_line_error(capsys, "tensor", "expected", str(cfg["hidden_size"]))
    assert main(["info", str(tiny)]) == 0


# ------------------------------------------------------------------ cli: --version, broken pipe
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


# ------------------------------------------------------------------ file modes honour the umask
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


# ------------------------------------------------------------------ bench: SIGTERM stops the worker
def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return st != "Z"


def test_bench_sigterm_stops_worker_and_removes_temp_dir(tmp_path):
    """SIGTERM on a running bench: exit 143, the measure child is gone, its temp dir removed."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # a worker that never finishes on its own: the real run_worker, a measure spec that sleeps
    code = textwrap.dedent("""
        import sys, time
        from parity.bench import runner
        import parity.bench.measure  # noqa: F401
        from parity.cli import main
        real = runner.run_worker
        def slow(spec, **kw):
            return real({"kind": "sleep-forever"}, **kw)
        runner.run_worker = slow
        sys.exit(main(["bench", "tiny", "--backend", "reference", "--no-peer", "--no-extras"]))
    """)
    # the measure child: `python -m parity.bench.measure` with an unknown kind would exit at once, so
    # point PYTHONSTARTUP-free sitecustomize at a module that sleeps for that kind
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys, time
        if len(sys.argv) > 1 and 'sleep-forever' in sys.argv[-1]:
            time.sleep(600)
    """))
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=f"{site}{os.pathsep}{REPO_ROOT}")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (kids and list(tmpdir.glob("qwen4exp-bench-*"))):
            time.sleep(0.2)
            kids[:] = _children(p.pid)
            assert p.poll() is None, p.stderr.read().decode()
        assert kids and list(tmpdir.glob("qwen4exp-bench-*")), "the worker did not start"
        time.sleep(1.0)  # let the child reach its sleep
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
        err = p.stderr.read().decode()
        assert rc == 143, err
        assert "Traceback" not in err, err
        for k in kids:
            for _ in range(50):
                if not _alive(k):
                    break
                time.sleep(0.1)
            assert not _alive(k), f"worker {k} still running after SIGTERM"
        assert not list(tmpdir.glob("qwen4exp-bench-*")), "temp dir left behind"
    finally:
        for k in kids:  # only the worker this test started
            if not _alive(k):
                continue
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()
