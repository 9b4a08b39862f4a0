"""Bad input: non-UTF-8 files, a file given as MODEL, a directory without
config.json, config.json without model_type / vocab_size, non-string JSON prompts, --precision help.

Every case runs the command: exit 2, ONE stderr line naming the thing, no traceback.
Each group carries a negative control (the same input made valid is accepted), so a check that refused
everything would fail here too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parity.cli import main
from reference.paths import check_checkpoint_dir, resolve_model
from fixture_helpers import one_line_error

# bytes that are not UTF-8 at offset 0 (0xff never occurs in UTF-8), then more invalid sequences
NOT_UTF8 = b"\xff\xfe\xc3\x28 random \xa0\xa1 bytes \xe2\x28\xa1"


def _copy(tiny, dst):
    """A copy of tiny (1-2 MB: cheap)."""
    shutil.copytree(tiny, dst)
    return dst




def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------ 1. non-UTF-8 files
def test_generate_prompts_file_of_random_bytes_is_exit_2(tmp_path, capsys, tiny):
    f = tmp_path / "bin.txt"
    f.write_bytes(NOT_UTF8)
    assert main(["generate", str(tiny), "--prompts", str(f)]) == 2
    one_line_error(capsys, "--prompts", "bin.txt", "not UTF-8")


def test_generate_prompts_negative_control_utf8_is_read(tmp_path):
    from parity.cli.generate import _read_prompts
    f = tmp_path / "ok.txt"
    f.write_bytes("héllo\n{\"prompt\": \"wörld\"}\n".encode("utf-8"))
    assert _read_prompts(str(f)) == ["héllo", "wörld"]


@pytest.mark.parametrize("argv", [["info"], ["info", "--config-only"], ["taps", "list"]])
def test_non_utf8_config_json_is_exit_2_naming_the_file(tmp_path, capsys, tiny, argv):
    d = _copy(tiny, tmp_path / "ck")
    (d / "config.json").write_bytes(NOT_UTF8)
    assert main(argv + [str(d)]) == 2
    one_line_error(capsys, "config.json", "not UTF-8")


@pytest.mark.parametrize("backend", ["reference", "engine:device=cpu"])
def test_non_utf8_config_json_parity_names_the_file(tmp_path, capsys, tiny, backend):
    # the message names config.json, not just "--backend 'engine': cannot be opened ... UnicodeDecodeError"
    d = _copy(tiny, tmp_path / "ck")
    (d / "config.json").write_bytes(NOT_UTF8)
    assert main(["parity", str(d), "--backend", backend, "--scenario", "kl", "--no-progress"]) == 2
    one_line_error(capsys, str(d / "config.json"), "not UTF-8")


def test_non_utf8_safetensors_index_is_exit_2_naming_the_file(tmp_path, capsys, tiny):
    d = _copy(tiny, tmp_path / "ck")
    (d / "model.safetensors.index.json").write_bytes(NOT_UTF8)
    assert main(["info", str(d)]) == 2
    one_line_error(capsys, "model.safetensors.index.json", "not UTF-8")


def test_valid_index_negative_control_opens(tmp_path, tiny):
    from reference.checkpoint import Checkpoint
    d = _copy(tiny, tmp_path / "ck")
    with Checkpoint.open(d) as ck:
        names = ck.names()
    with Checkpoint.open(d) as ck0:
        wm = {ck0.stored_name(n): "model.safetensors" for n in names}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with Checkpoint.open(d) as ck:
        assert ck.names() == names


@pytest.mark.parametrize("fname,needle", [("tokenizer.json", "tokenizer.json"),
                                          ("generation_config.json", "generation_config.json"),
                                          ("tokenizer_config.json", "tokenizer_config.json"),
                                          ("chat_template.jinja", "chat_template.jinja")])
def test_generate_non_utf8_tokenizer_side_files_are_exit_2(tmp_path, capsys, tiny, fname, needle):
    d = _copy(tiny, tmp_path / "ck")
    (d / fname).write_bytes(NOT_UTF8)
    assert main(["generate", str(d), "--prompt", "hi", "--chat", "--backend", "reference",
                 "--max-new-tokens", "1"]) == 2
    one_line_error(capsys, needle)


def test_chat_template_negative_control_utf8_jinja_is_used(tmp_path, tiny):
    from parity import generate as G
    d = _copy(tiny, tmp_path / "ck")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}·", encoding="utf-8")
    assert G.load_chat_template(d) == "{{ messages[0]['content'] }}·"


# ------------------------------------------------------------------ 2. one MODEL resolution
FILE_AS_MODEL = {
    "info": lambda m, t: ["info", m],
    "info-config-only": lambda m, t: ["info", "--config-only", m],
    "logits": lambda m, t: ["logits", m, "--ids", str(t / "ids.txt"), "--out", str(t / "o.npy")],
    "taps-record": lambda m, t: ["taps", "record", m, "--ids", str(t / "ids.txt"), "--out", str(t / "arch")],
    "taps-list": lambda m, t: ["taps", "list", m],
    "parity": lambda m, t: ["parity", m, "--backend", "reference", "--scenario", "kl", "--no-progress"],
    "generate": lambda m, t: ["generate", m, "--prompt", "hi", "--backend", "reference"],
    "kl": lambda m, t: ["kl", m, "--a", "reference", "--b", "reference", "--no-progress"],
}


@pytest.mark.parametrize("inner", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("cmd", sorted(FILE_AS_MODEL))
def test_file_inside_checkpoint_as_model_is_refused(tmp_path, capsys, tiny, cmd, inner):
    (tmp_path / "ids.txt").write_text("1 2 3")
    assert main(FILE_AS_MODEL[cmd](str(tiny / inner), tmp_path)) == 2
    one_line_error(capsys, inner, "expected a checkpoint directory", "found a file", absent=("tokenizer",))
    assert not (tmp_path / "o.npy").exists() and not (tmp_path / "arch").exists()


def test_model_resolution_negative_controls(tmp_path, tiny):
    from reference.checkpoint import Checkpoint, CheckpointError
    from reference.config import ConfigError
    from reference.errors import InputError
    assert resolve_model(str(tiny)) == tiny and resolve_model("tiny") == tiny
    assert check_checkpoint_dir(tiny) == tiny
    with pytest.raises(InputError, match="found a file"):
        check_checkpoint_dir(tiny / "model.safetensors")
    with pytest.raises(ConfigError, match="config.json"):
        check_checkpoint_dir(tmp_path)
    # the library entry point follows the same rule: a file is never silently its parent
    with pytest.raises(CheckpointError, match="found a file"):
        Checkpoint.open(tiny / "model.safetensors")
    with Checkpoint.open(tiny) as ck:
        assert ck.names()


@pytest.mark.parametrize("argv", [["generate", "{d}", "--prompt", "hi"], ["info", "{d}"],
                                  ["parity", "{d}", "--backend", "reference", "--scenario", "kl"]])
def test_directory_without_config_json_names_config_json_first(tmp_path, capsys, argv):
    d = tmp_path / "emptydir"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")  # not the first complaint either way
    assert main([a.format(d=d) for a in argv]) == 2
    one_line_error(capsys, "emptydir", "config.json", absent=("tokenizer",))


# ------------------------------------------------------------------ 3. required config keys
def test_config_without_model_type_is_refused(tmp_path, capsys, tiny):
    from reference.config import ConfigError, load_config
    d = _copy(tiny, tmp_path / "ck")
    assert load_config(d).vocab_size > 0          # negative control: the copy as is loads
    _edit_config(d, model_type=None)
    with pytest.raises(ConfigError, match="model_type"):
        load_config(d)
    assert main(["info", "--config-only", str(d)]) == 2
    one_line_error(capsys, "config.json", "model_type", "qwen4_exp")


@pytest.mark.parametrize("mt", ["qwen3_next", "", 7])
def test_config_with_wrong_model_type_is_refused(tmp_path, tiny, mt):
    from reference.config import ConfigError, load_config
    d = _copy(tiny, tmp_path / "ck")
    _edit_config(d, model_type=mt)
    with pytest.raises(ConfigError, match="model_type"):
        load_config(d)


def test_config_without_vocab_size_is_caught_at_the_embedding(tmp_path, capsys, tiny):
    # the official Qwen4ExpTextConfig defaults vocab_size to 248320, so the config alone is valid;
    # the checkpoint's embedding [V, H] must then disagree, and the message must say why
    from reference.checkpoint import Checkpoint, CheckpointError
    d = _copy(tiny, tmp_path / "ck")
    V = json.loads((d / "config.json").read_text())["vocab_size"]
    with Checkpoint.open(d) as ck:                # negative control: the intact copy validates
        ck.validate()
    _edit_config(d, vocab_size=None)
    with Checkpoint.open(d) as ck:
        assert ck.config.vocab_size == 248320
        with pytest.raises(CheckpointError, match=r"vocab_size.*248320") as ei:
            ck.validate()
    assert f"found [{V}," in str(ei.value)
    assert main(["info", str(d)]) == 2
    one_line_error(capsys, "vocab_size", "248320", f"[{V},", "default")
    (tmp_path / "ids.txt").write_text("1 2 3")
    assert main(["logits", str(d), "--ids", str(tmp_path / "ids.txt"), "--out", str(tmp_path / "o.npy")]) == 2
    one_line_error(capsys, "vocab_size", "embed_tokens.weight")


def test_config_with_wrong_vocab_size_names_vocab_size_without_default_note(tmp_path, capsys, tiny):
    d = _copy(tiny, tmp_path / "ck")
    V = json.loads((d / "config.json").read_text())["vocab_size"]
    _edit_config(d, vocab_size=V + 8)
    assert main(["info", str(d)]) == 2
    one_line_error(capsys, "vocab_size", f"{V + 8}", absent=("default",))


# ------------------------------------------------------------------ 4. JSON prompts
@pytest.mark.parametrize("line,needles", [
    ('{"prompt": 42}', ["'prompt'", "a string", "a number (42)"]),
    ('{"prompt": ["a", "b"]}', ["'prompt'", "a list"]),
    ('{"prompt": null}', ["'prompt'", "null"]),
    ('{"messages": "hi"}', ["'messages'", "a string"]),
    ('{"text": "hi"}', ["neither", "text"]),
])
def test_generate_json_prompt_of_wrong_type_names_the_type(tmp_path, capsys, tiny, line, needles):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    assert main(["generate", str(tiny), "--prompts", str(f)]) == 2
    msg = one_line_error(capsys, "p.jsonl:2", *needles)
    if "neither" not in needles:
        assert "found keys" not in msg


# ------------------------------------------------------------------ 5. help
def test_generate_help_documents_precision(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    opts = out[out.index("options:"):]
    block = opts[opts.index("--precision"):].split("\n  --", 1)[0]  # the option's own help paragraph
    assert "bf16" in block and "float32" in block and "float64" in block, block


def test_a_folder_named_like_a_fixture_does_not_shadow_it(tmp_path, monkeypatch, capsys, tiny):
    """MODEL ``tiny`` with a folder ./tiny in the current directory: the bundled fixture, and a note on stderr naming
    both; the folder is MODEL ``./tiny``. In the fixtures folder itself (the same directory) there is no note."""
    mine = tmp_path / "tiny"
    shutil.copytree(tiny, mine)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny") == tiny
    err = capsys.readouterr().err
    assert err.startswith("note: MODEL 'tiny' is the bundled fixture") and str(tiny) in err and "./tiny" in err, err
    assert resolve_model("./tiny").resolve() == mine.resolve() and resolve_model(str(mine)) == mine
    assert capsys.readouterr().err == ""
    monkeypatch.chdir(tiny.parent)
    assert resolve_model("tiny") == tiny and capsys.readouterr().err == ""


def test_a_folder_named_like_a_fixture_is_never_shown_as_the_fixture_name(tmp_path, monkeypatch, capsys, tiny):
    """MODEL ``./tiny`` (a folder beside the bundled fixture's name): its errors, report.json and the verdict line
    name it so that it cannot be read as the fixture ``tiny`` (Path('./tiny') prints as 'tiny')."""
    from parity.cli.parity import display_path
    mine = tmp_path / "tiny"
    shutil.copytree(tiny, mine)
    monkeypatch.chdir(tmp_path)
    here = Path.cwd() / "tiny"  # the current directory as the process sees it (tmp_path may pass a symbolic link)
    assert str(resolve_model("./tiny")) not in ("tiny", "./tiny") and resolve_model("./tiny") == here
    assert display_path(mine) == "./tiny"
    cfg = json.loads((mine / "config.json").read_text())
    cfg["hidden_size"] = 128
    (mine / "config.json").write_text(json.dumps(cfg))
    assert main(["info", "./tiny"]) == 2
    err = capsys.readouterr().err
    assert str(here) in err and "error: tiny:" not in err, err
    # negative controls: the fixture itself and an ordinary folder keep their names
    assert resolve_model("tiny") == tiny
    other = tmp_path / "mine"
    shutil.copytree(tiny, other)
    assert str(resolve_model("mine")) == "mine" and display_path(other) == "mine"
    monkeypatch.chdir(tiny.parent.parent)
    assert display_path(tiny) == "fixtures/tiny"


@pytest.mark.parametrize("verb", ["logits", "taps record"])
def test_the_fixture_name_note_is_printed_once_per_command(tmp_path, monkeypatch, capsys, tiny, verb):
    """MODEL ``tiny`` beside a folder ./tiny: the command that resolves MODEL and then computes on it says which
    was used once, not once per place that opens the model."""
    shutil.copytree(tiny, tmp_path / "tiny")
    (tmp_path / "ids.txt").write_text("1 2 3")
    monkeypatch.chdir(tmp_path)
    argv = {"logits": ["logits", "tiny", "--ids", "ids.txt", "--out", "out.npy"],
            "taps record": ["taps", "record", "tiny", "--ids", "ids.txt", "--out", "arc", "--taps", "logits"]}[verb]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("note: MODEL 'tiny' is the bundled fixture") == 1, err
