"""``qwen4exp bench`` on the command line: options checked before anything runs, the one --out rule,
the warm-up note and the table's labels (the measurements themselves: tests/parity/test_bench_measure.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fixture_helpers import one_line_error, one_line_error as _one_line_error
from parity.bench import runner
from parity.cli import main
from reference.paths import REPO_ROOT


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

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"

def _need_tiny():
    if not (TINY / "config.json").is_file():
        pytest.skip("fixtures/tiny not built yet")
    try:
        import engine
        getattr(engine, "Engine")
        import reference.model  # noqa: F401
    except (ImportError, AttributeError) as e:
        pytest.skip(f"reference/engine not importable yet: {e}")

def _positive_rate(r):
    return r["median"] > 0 and r["min"] > 0 and r["max"] >= r["median"] >= r["min"] and r["n"] >= 1


@pytest.mark.parametrize("argv, needles", [
    (["bench", "--precision", "fp4", "--backend", "engine", "--device", "cpu"], ["--precision", "fp4", "bf16"]),
    (["bench", "--backend", "reference", "--precision", "bf16"], ["--precision", "engine"]),
    (["bench", "--synthetic", "real-widths", "--layers", "999", "--backend", "reference"], ["--layers", "48", "999"]),
])
def test_bench_bad_arguments_exit_2_and_write_nothing(argv, needles, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    assert main(argv + ["--out", str(out), "--no-peer", "--no-extras"]) == 2
    _one_line_error(capsys, *needles)
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_bench_device_cuda_without_gpu(capsys, monkeypatch):
    import engine.backend as B
    monkeypatch.setattr(B, "gpu_available", lambda: False)
    assert main(["bench", "--device", "cuda", "--no-peer", "--no-extras"]) == 2
    _one_line_error(capsys, "--device cuda", "GPU")


def test_synthetic_refused_when_the_disk_is_too_small(tmp_path, monkeypatch):
    import shutil

    from parity.bench import synthetic as S
    from reference.errors import InputError
    cfg = S.real_width_config(1, vocab_size=1024)
    need = S.checkpoint_bytes(cfg)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need // 2))
    with pytest.raises(InputError, match="GiB free"):
        S.write_synthetic(tmp_path / "ck", cfg, progress=False)
    assert not (tmp_path / "ck").exists() and not list(tmp_path.glob(".ck.tmp*"))


def test_bench_out_directory_is_exit_2_before_running(tmp_path, capsys, monkeypatch):
    from parity.bench import runner
    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("benchmark ran before checking --out"))
    assert main(["bench", "--backend", "reference", "--no-peer", "--no-extras", "--out", str(tmp_path)]) == 2
    one_line_error(capsys, "--out", "found a directory")


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
    assert main(["bench", "--backend", "reference", "--repeats", "1", str(bad), "--no-peer"]) == 2
    one_line_error(capsys, "model.safetensors")


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


@pytest.mark.parametrize("extra, needles", [
    (["--contexts", "99999999"], ["--contexts", "max_position_embeddings=32768", "99999999"]),
    (["--contexts", "40000"], ["--contexts", "40000"]),
    (["--prompt-lens", "40000"], ["--prompt-lens", "max_position_embeddings=32768", "40000"]),
])
def test_bench_sizes_beyond_max_positions_are_exit_2_before_running(capsys, monkeypatch, extra, needles):
    from parity.bench import runner
    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("a worker ran before the check"))
    assert main(["bench", "--backend", "engine", "--device", "cpu", "--no-peer", "--no-extras", *extra]) == 2
    one_line_error(capsys, *needles)


@pytest.mark.parametrize("extra, needles", [
    (["--prompt-lens", "99999999"], ["--prompt-lens", "max_position_embeddings=32768", "99999999"]),
    (["--prompt-lens", "32760"], ["--prompt-lens", "<= 32752", "16 decode steps", "32760"]),
])
def test_bench_reference_prompt_beyond_max_positions_is_exit_2_before_running(capsys, monkeypatch, extra, needles):
    """The reference job (prefill P, then decode D) is held to max_position_embeddings as the engine's is: a
    longer --prompt-lens is one usage error before any worker starts, not a worker prefilling 1e8 random ids
    until its timeout."""
    from parity.bench import runner
    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("a worker ran before the check"))
    assert main(["bench", "--backend", "reference", "--no-peer", "--no-extras", *extra]) == 2
    one_line_error(capsys, *needles)
    from parity.bench.plan import plan
    from parity.cli import build_parser
    args = build_parser().parse_args(["bench", "--backend", "reference", "--no-peer", "--no-extras",
                                      "--prompt-lens", "32752"])
    assert dict(plan(args)[0])["reference"]["prompt_len"] == 32752  # negative control: the largest that fits


def test_bench_sizes_within_limits_plan_and_empty_items_refused(capsys):
    from parity.cli import build_parser
    from parity.bench.plan import ints as _ints, plan
    from reference.errors import InputError
    args = build_parser().parse_args(["bench", "--backend", "engine", "--device", "cpu", "--no-peer", "--no-extras",
                                      "--contexts", "32000", "--prompt-lens", "32768"])
    jobs, _, _ = plan(args)  # negative control: the largest sizes that fit are planned
    eng = dict(jobs)["engine"]
    assert eng["prompt_lens"] == [32768] and {c for _, c in eng["decode"]} == {32000}
    with pytest.raises(InputError, match="empty item"):
        _ints("1,,2")
    assert _ints("1, 2") == [1, 2]
    with pytest.raises(SystemExit) as e:
        main(["bench", "--backend", "engine", "--device", "cpu", "--batches", "1,,2"])
    assert e.value.code == 2
    assert "empty item" in capsys.readouterr().err


def test_bench_out_follows_the_one_path_rule(tmp_path, capsys, monkeypatch):
    """`bench --out` follows the one output-path rule: an existing file needs --overwrite, the parent must
    exist."""
    from parity.bench import runner
    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("ran before checking --out"))
    old = tmp_path / "r.json"
    old.write_text("old")
    assert main(["bench", "--backend", "reference", "--no-peer", "--no-extras", "--out", str(old)]) == 2
    one_line_error(capsys, "--out", "--overwrite")
    deep = tmp_path / "no" / "such" / "r.json"
    assert main(["bench", "--backend", "reference", "--no-peer", "--no-extras", "--out", str(deep)]) == 2
    one_line_error(capsys, "--out", "existing parent directory")
    assert not (tmp_path / "no").exists() and old.read_text() == "old"


def test_bench_warmup_zero_is_said_and_reference_takes_prompt_lens(capsys):
    """`bench --warmup 0` says that the Numba compile is timed; the reference is measured at --prompt-lens;
    ratio rows print their labels, not internal keys."""
    import argparse

    from parity.bench.plan import COLD_NOTE, plan
    from parity.bench.runner import ratio_label, table_rows
    from parity.cli import build_parser
    args = build_parser().parse_args(["bench", "--backend", "reference", "--no-peer", "--no-extras",
                                      "--prompt-lens", "24", "--warmup", "0"])
    jobs, settings, _ = plan(args)
    assert dict(jobs)["reference"]["prompt_len"] == 24 and settings["note"] == COLD_NOTE
    rows = table_rows({"settings": settings, "runs": {}, "ratios": {"engine_b16_vs_b1_ctx64": 5.0,
                                                                    "reference_decode_vs_peer_cpu": 1.2}})
    assert ("note", "warm-up", "-", COLD_NOTE) in rows
    labels = [r[1] for r in rows if r[0] == "ratio"]
    assert labels == [ratio_label("engine_b16_vs_b1_ctx64"), ratio_label("reference_decode_vs_peer_cpu")]
    assert all("_" not in x for x in labels)
    args = build_parser().parse_args(["bench", "--backend", "reference", "--no-peer", "--no-extras"])
    jobs, settings, _ = plan(args)  # negative control: default length, no note
    assert dict(jobs)["reference"]["prompt_len"] == 64 and "note" not in settings
    assert isinstance(args, argparse.Namespace)


def test_bench_default_without_gpu_says_the_engine_was_not_measured(monkeypatch):
    """The plain `bench` on a machine without a GPU runs the reference only and its table says why the engine
    is missing (negative control: an explicit --backend reference, or a usable GPU, adds no such row)."""
    import engine.backend as EB
    from parity.bench.plan import plan
    from parity.bench.runner import table_rows
    from parity.cli import build_parser
    monkeypatch.setattr(EB, "gpu_available", lambda: False)
    _, settings, _ = plan(build_parser().parse_args(["bench", "--no-peer", "--no-extras"]))
    rows = table_rows({"settings": settings, "runs": {}})
    assert settings["backend"] == "reference"
    assert any(r[0] == "engine" and r[1] == "not measured" and "no usable GPU" in r[3] for r in rows)
    _, settings, _ = plan(build_parser().parse_args(["bench", "--backend", "reference", "--no-peer", "--no-extras"]))
    assert "engine_skipped" not in settings and not any(r[0] == "engine" for r in table_rows({"settings": settings,
                                                                                            "runs": {}}))


def test_bench_end_to_end_tiny(tmp_path, capsys):
    _need_tiny()
    from parity.cli import main
    out = tmp_path / "r.json"
    rc = main(["bench", "--backend", "both", "--device", "cpu", "--repeats", "2", "--warmup", "1", "--no-peer",
               "--no-extras", "--decode-tokens", "2", "--json", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(out.read_text())
    assert json.loads(cap.out.strip().splitlines()[-1]) == res
    assert res["schema"] == runner.SCHEMA and set(res["runs"]) == {"reference", "engine"}
    ref, eng = res["runs"]["reference"], res["runs"]["engine"]
    assert _positive_rate(ref["prefill_tokens_per_s"]) and _positive_rate(ref["decode_tokens_per_s"])
    assert ref["prefill_tokens_per_s"]["n"] == 2 and ref["peak_rss_bytes"] > 0
    assert eng["prefill"] and all(_positive_rate(p["tokens_per_s"]) for p in eng["prefill"])
    assert {(d["batch"]) for d in eng["decode"]} == {1, 4}
    assert any(d["above_qsa_bound"] for d in eng["decode"]) and any(not d["above_qsa_bound"] for d in eng["decode"])
    for d in eng["decode"]:
        assert _positive_rate(d["tokens_per_s"]) and d["bytes_per_token"] > 0 and d["host_syncs_per_step"] >= 0
    assert res["checkpoints"]["engine"]["synthetic"] is False


def test_bench_table_printed_last(capsys):
    _need_tiny()
    from parity.cli import main
    rc = main(["bench", "--backend", "reference", "--repeats", "1", "--warmup", "0", "--no-peer", "--no-extras",
               "--decode-tokens", "2", "--format", "rich"])
    cap = capsys.readouterr()
    assert rc == 0
    lines = cap.out.strip().splitlines()
    assert any("reference CPU" in ln and "decode b1" in ln for ln in lines)
    assert lines[-1].startswith("└")  # the table is the last thing printed (rich's bottom border)


def test_bench_errors(capsys):
    from engine.backend import gpu_available
    from parity.cli import main
    if not gpu_available():
        rc = main(["bench", "--backend", "engine", "--device", "cuda", "--no-peer"])
        assert rc == 2 and "GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--batches", "0,1"])


def test_bench_rich_table_fits_the_terminal(monkeypatch):
    """--format rich: the closing table within the terminal's width (COLUMNS where stdout is no terminal), its long
    notes wrapped in their cell."""
    import io

    from parity.bench.runner import print_table
    monkeypatch.setenv("COLUMNS", "60")
    buf = io.StringIO()
    print_table({"runs": {"peer_cpu": {"unavailable": "transformers is not installed " * 4}}}, file=buf)
    lines = buf.getvalue().splitlines()
    assert lines[-1].startswith("└") and max(len(ln) for ln in lines) <= 60, buf.getvalue()
