"""``qwen4exp generate`` on the command line: prompts and messages, strict text, sampling flags, the
backend grammar, what is printed (the generator itself: tests/parity/test_generation.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixture_helpers import one_line_error
from parity.cli import main


REPO = Path(__file__).resolve().parents[2]


def test_generate_bf16_with_reference_is_exit_2(tiny, capsys):
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--precision", "bf16"]) == 2
    one_line_error(capsys, "--precision bf16", "reference")


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


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "1.5"), ("--top-k", "-2")])
def test_sampling_errors_name_the_flags(capsys, flag, value):
    assert main(["generate", "--prompt", "x", "--backend", "reference", flag, value]) == 2
    line = one_line_error(capsys, f"{flag}: expected")
    assert "top_p:" not in line and "top_k:" not in line


def test_generate_refuses_undecodable_argv_naming_the_argument_and_offset(capsys):
    """`generate --prompt $'\\xff'` (and --system): a one-line error, no traceback."""
    assert main(["generate", "--prompt", "ab" + "\udcff", "--backend", "reference"]) == 2
    one_line_error(capsys, "--prompt", "0xff", "byte offset 2")
    assert main(["generate", "--prompt", "hi", "--chat", "--system", "\udcfe", "--backend", "reference"]) == 2
    one_line_error(capsys, "--system", "0xfe", "byte offset 0")
    assert main(["generate", "--prompt=x\ud800", "--backend", "reference"]) == 2
    one_line_error(capsys, "--prompt", "U+D800", "byte offset 1")


def test_generate_undecodable_argv_from_a_real_shell(tmp_path):
    """The same, as a shell passes it: raw bytes in argv (Python's surrogateescape)."""
    p = subprocess.run([sys.executable, "-m", "parity.cli", "generate", "--backend", "reference", "--prompt",
                        b"caf\xe9"], cwd=REPO, capture_output=True, timeout=120)
    assert p.returncode == 2 and b"Traceback" not in p.stderr
    assert b"--prompt" in p.stderr and b"0xe9" in p.stderr and b"byte offset 3" in p.stderr


def test_generate_json_prompts_with_lone_surrogates_are_refused(tmp_path, capsys):
    """JSON prompts holding "\\ud800": a one-line error from generate, no traceback."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"messages": [{"role": "user", "content": "x\\ud800y"}]}\n')
    assert main(["generate", "--prompts", str(f), "--backend", "reference"]) == 2
    one_line_error(capsys, f"{f}:2", "messages[0].content", "U+D800", "byte offset 1")


def test_generate_notes_system_without_chat(capsys):
    """--system without --chat is noted, not silently ignored (as --no-thinking)."""
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--system", "be brief", "--greedy",
                 "--max-new-tokens", "1", "--json"]) == 0
    assert "--system has no effect without --chat" in capsys.readouterr().err


def test_generate_escapes_control_bytes_of_the_model(monkeypatch, capsys):
    """generate prints no raw control / ESC bytes from random models (a terminal would obey them)."""
    from parity import generate as G
    from parity.cli.common import safe_text
    assert safe_text("ok\x1b[2J\x07\tz\n\x9b") == "ok\\x1b[2J\\x07\tz\n\\x9b"
    assert safe_text("héllo 世界") == "héllo 世界"  # printable text is untouched (negative control)

    real = G.Generator.generate_batch

    def noisy(self, prompts, params, on_text=None, progress=True):
        res = real(self, prompts, params, on_text=None, progress=False)
        if on_text:
            on_text(0, "\x1b]0;pwned\x07\x1b[2J")
        return res
    monkeypatch.setattr(G.Generator, "generate_batch", noisy)
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--greedy", "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned" in out


def test_generate_backend_grammar(capsys):
    """generate takes the one --backend grammar; the old --precision is a deprecated alias."""
    assert main(["generate", "--prompt", "hi", "--backend", "reference:dtype=float64", "--greedy",
                 "--max-new-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "reference:dtype=float64"
    assert main(["generate", "--prompt", "hi", "--backend", "reference", "--precision", "float64", "--greedy",
                 "--max-new-tokens", "1", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["backend"] == "reference:dtype=float64" and cap.err.count("deprecated") == 1
