"""Fresh-eyes findings on the CLI's inputs and outputs: each bad input is ONE line naming the thing (exit 2),
each output that cannot be written is one line (exit 1), nothing half-written is left. Every test
reproduces one finding (numbered as in the report) and carries a negative control (the good input passes).
"""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from parity.cli import main
from fixture_helpers import one_line_error




# --------------------------------------------------------------------------- 1. --prompts messages
@pytest.mark.parametrize("msg, needles", [
    ({"role": "user", "content": 5}, [":2:", "messages[0].content", "a number (5)"]),
    ({"role": "user"}, [":2:", "messages[0].content", "no content"]),
    ({"content": "hi"}, [":2:", "messages[0].role", "no role"]),
    ({"role": 3, "content": "hi"}, [":2:", "messages[0].role", "a number"]),
    ({"role": "user", "content": [{"type": "text", "text": 7}]}, [":2:", "messages[0].content[0].text"]),
])
def test_prompts_messages_are_validated_naming_file_and_line(tmp_path, capsys, msg, needles):
    from parity import generate as G
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + json.dumps({"messages": [msg]}) + "\n")
    assert main(["generate", "--prompts", str(f), "--backend", "reference", "--max-new-tokens", "1"]) == 2
    one_line_error(capsys, str(f), *needles)
    # negative control: well-formed messages (string and typed-part content) pass and render
    from parity.cli.generate import _read_prompts
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                            {"role": "assistant", "content": None,
                                             "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}) + "\n")
    got = _read_prompts(str(f))
    assert len(got) == 2 and got[0][0]["content"] == "hi"
    assert G.render_chatml(got[0]).startswith("<|im_start|>user\nhi")


def test_template_type_error_names_the_line(tmp_path, capsys, monkeypatch):
    """A template that trips on a value (a TypeError inside jinja) is one line naming FILE:LINE."""
    from parity import generate as G

    def boom(*a, **k):
        raise TypeError('can only concatenate str (not "list") to str')
    monkeypatch.setattr(G, "render_chat", boom)
    f = tmp_path / "p.jsonl"
    f.write_text("\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    assert main(["generate", "--prompts", str(f), "--backend", "reference", "--max-new-tokens", "1"]) == 2
    one_line_error(capsys, f"{f}:2", "TypeError")


# --------------------------------------------------------------------------- 2. tap-diff manifest schema
def _archive(path, token_ids=(1, 2, 3)):
    from taps.archive import ArchiveWriter
    w = ArchiveWriter(path)
    w.add("embed", np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(3, dtype=np.int64))
    w.close({"backend": "reference", "dtype": "float32", "token_ids": list(token_ids)})
    return path


@pytest.mark.parametrize("field, value, needles", [
    ("taps", 5, ["'taps'", "an integer (5)"]),
    ("chunks", "x", ["'chunks'", "a string"]),
    ("token_ids", "abc", ["'token_ids'", "a string"]),
    ("token_ids", [1, "b", 3], ["'token_ids'", "index 1"]),
    ("format_version", "1", ["'format_version'", "a string"]),
    ("order", ["nope"], ["'order'", "'nope'"]),
])
def test_tap_diff_refuses_a_malformed_manifest_naming_the_field(tmp_path, capsys, field, value, needles):
    a = _archive(tmp_path / "a.taps")
    xm = tmp_path / "xm"
    shutil.copytree(a, xm)
    assert main(["tap-diff", str(a), str(xm)]) == 0  # negative control: the intact copy agrees
    capsys.readouterr()
    m = json.loads((xm / "manifest.json").read_text())
    m[field] = value
    (xm / "manifest.json").write_text(json.dumps(m))
    assert main(["tap-diff", str(a), str(xm)]) == 2
    line = one_line_error(capsys, "xm", *needles, absent=("token ids differ", "newer than"))
    assert "manifest.json" in line


def test_tap_diff_format_version_newer_and_null_token_ids(tmp_path, capsys):
    a = _archive(tmp_path / "a.taps")
    xm = tmp_path / "xm"
    shutil.copytree(a, xm)
    m = json.loads((xm / "manifest.json").read_text())
    (xm / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    assert main(["tap-diff", str(a), str(xm)]) == 2
    one_line_error(capsys, "newer than this reader supports")
    # token_ids null is what a recording without known ids writes: the identity is reported unverified
    (xm / "manifest.json").write_text(json.dumps({**m, "token_ids": None}))
    assert main(["tap-diff", str(a), str(xm), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "token ids differ" not in json.dumps(rep)


# --------------------------------------------------------------------------- 3. a backend whose open() returns None
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


# --------------------------------------------------------------------------- 4. bench sizes
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


def test_bench_sizes_within_limits_plan_and_empty_items_refused(capsys):
    from parity.cli import build_parser
    from parity.cli.bench import _ints, plan
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


# --------------------------------------------------------------------------- 5. output that cannot be written
def test_logits_full_disk_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3")

    def short_write(fh, arr, **k):  # what numpy raises on a full disk: an OSError without errno
        fh.write(b"\x93NUMPY")
        raise OSError("153600 requested and 16352 written")
    monkeypatch.setattr(np, "save", short_write)
    out = tmp_path / "o.npy"
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(out)]) == 1
    one_line_error(capsys, "o.npy", "could not be written", "153600")
    assert list(tmp_path.iterdir()) == [f], "a temp file or partial output was left"
    monkeypatch.undo()  # negative control: the same command writes when the disk has room
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(out)]) == 0
    assert np.load(out).shape[0] == 3


def test_taps_record_full_disk_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    import safetensors.numpy as SN
    from safetensors import SafetensorError
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3")
    real = SN.save_file

    def full(tensors, path, *a, **k):
        Path(path).write_bytes(b"x" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(SN, "save_file", full)
    out = tmp_path / "t.taps"
    assert main(["taps", "record", "tiny", "--ids", str(f), "--out", str(out), "--taps", "logits"]) == 1
    one_line_error(capsys, "t.taps", "could not be written", "No space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.txt"], "a temp archive was left"
    monkeypatch.setattr(SN, "save_file", real)  # negative control
    assert main(["taps", "record", "tiny", "--ids", str(f), "--out", str(out), "--taps", "logits"]) == 0
    assert (out / "manifest.json").is_file()


def test_parity_unwritten_archives_surface_and_leave_no_empty_folders(tmp_path, capsys, monkeypatch):
    import parity.cli.parity as P
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
    assert rc == 1
    assert "could not be written" in err and "tap archives" in err and "Traceback" not in err
    assert not (out / "taps").exists(), "empty archive folders were left"
    assert (out / "report.json").is_file()
    # negative control: archives that were written are not reported, and their folders are kept
    assert P._unwritten_archives({"scenarios": [{"failures": [{"archives": ["a/truth.taps"]}]}]}) == []


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


# --------------------------------------------------------------------------- 6. page sizes
@pytest.mark.parametrize("ps, needles", [
    ("99999999", ["--page-sizes", "max_position_embeddings=32768", "99999999"]),
    ("100000", ["--page-sizes", "100000"]),
    ("8192", ["--page-sizes", "<= 4096", "8192"]),
    ("16,,32", ["--page-sizes", "empty item"]),
    ("16,16", ["--page-sizes", "twice"]),
])
def test_parity_page_sizes_checked_up_front(capsys, monkeypatch, ps, needles):
    import parity.cli.parity as P
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: pytest.fail("ran before checking --page-sizes"))
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--page-sizes", ps]) == 2
    one_line_error(capsys, *needles)


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


# --------------------------------------------------------------------------- 7. ids longer than the model
def test_logits_and_taps_refuse_ids_beyond_max_positions(tmp_path, capsys, monkeypatch):
    import parity.cli.logits as L
    monkeypatch.setattr(L, "compute_logits", lambda *a, **k: pytest.fail("computed before the length check"))
    f = tmp_path / "ids32769.txt"
    f.write_text(" ".join(["1"] * 32769))
    assert main(["logits", "tiny", "--ids", str(f), "--out", str(tmp_path / "o.npy")]) == 2
    one_line_error(capsys, "--ids", "max_position_embeddings=32768", "32769")
    assert main(["taps", "record", "tiny", "--ids", str(f), "--out", str(tmp_path / "t.taps")]) == 2
    one_line_error(capsys, "max_position_embeddings=32768", "32769")
    assert not (tmp_path / "o.npy").exists() and not (tmp_path / "t.taps").exists()
    L.check_length(32768, 32768)  # negative control: exactly max_position_embeddings ids are allowed
    from reference.errors import InputError
    with pytest.raises(InputError):
        L.check_length(32769, 32768)


# --------------------------------------------------------------------------- 8. option consistency
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


def test_two_d_npy_ids_refused(tmp_path):
    from reference.errors import InputError
    from reference.ids_file import read_ids_file
    p = tmp_path / "ids.npy"
    np.save(p, np.arange(6).reshape(2, 3))
    with pytest.raises(InputError, match=r"1-D .*2-D array of shape \[2, 3\]"):
        read_ids_file(p)
    np.save(p, np.arange(6))  # negative control
    assert read_ids_file(p).tolist() == list(range(6))


# --------------------------------------------------------------------------- 9. directory outputs need a parent
def test_dir_outputs_need_an_existing_parent(tmp_path, capsys, monkeypatch):
    import parity.cli.parity as P
    from parity.harness.report import ParityReport
    monkeypatch.setattr(P, "run_parity", lambda *a, **k: ParityReport(backend="reference", model="tiny"))
    out = tmp_path / "nonexist" / "deep" / "dir"
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(out)]) == 2
    one_line_error(capsys, "--out", "existing parent directory", str(tmp_path / "nonexist" / "deep"))
    assert not (tmp_path / "nonexist").exists(), "parity created the missing parents"
    ok = tmp_path / "new"  # negative control: a new directory under an existing one is created
    assert main(["parity", "--backend", "reference", "--scenario", "budget", "--out", str(ok)]) == 0
    assert (ok / "report.json").is_file()


# --------------------------------------------------------------------------- 10. an empty model path
@pytest.mark.parametrize("argv", [["info", ""], ["logits", "", "--ids", "x", "--out", "o.npy"]])
def test_empty_model_path_is_reported_as_typed(capsys, argv):
    assert main(argv) == 2
    line = one_line_error(capsys, "MODEL ''", "empty")
    assert "'.'" not in line


# --------------------------------------------------------------------------- 11. sampling errors name the flags
@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "1.5"), ("--top-k", "-2")])
def test_sampling_errors_name_the_flags(capsys, flag, value):
    assert main(["generate", "--prompt", "x", "--backend", "reference", flag, value]) == 2
    line = one_line_error(capsys, f"{flag}: expected")
    assert "top_p:" not in line and "top_k:" not in line
