"""The re-parameterisation a llama.cpp refusal offers, and options that contradict each other: a hint a user
can follow as written, and a contradiction refused before anything runs. Needs no llama-cpp-python: the offer
is computed from the refusal's message and the checkpoint, the option check comes before llama.cpp is looked for."""
from __future__ import annotations

import re

from reference.paths import bundled_model

from parity.backends import gguf_convert as gc

TOKENIZER_MSG = "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()"
PLE_KEY_MSG = ("check_tensor_dims: tensor 'blk.1.ple_key.weight' has wrong shape; expected     64,    256, "
               "got     32,    256,      1,      1")


def _offered(offer: str) -> list[str]:
    m = re.match(r"llama\.cpp:reparam=(\S+) ", offer)
    assert m, offer
    return m.group(1).split("+")


def test_the_offer_keeps_the_reparameterisations_already_in_use():
    """tiny with reparam=tokenizer-label is refused by the loader (ple_key shape): the offer must keep
    tokenizer-label, else following it (reparam=ple-pad) is refused by the converter, whose offer drops ple-pad."""
    tiny = bundled_model("tiny")
    assert _offered(gc.offer_for(PLE_KEY_MSG, tiny, ["tokenizer-label"])) == ["tokenizer-label", "ple-pad"]
    assert _offered(gc.offer_for(TOKENIZER_MSG, tiny, ["ple-pad"])) == ["tokenizer-label", "ple-pad"]
    # nothing in use: the one re-parameterisation that gets past this refusal
    assert _offered(gc.offer_for(TOKENIZER_MSG, tiny, [])) == ["tokenizer-label"]
    # the offered spelling is one the option parser accepts, in its canonical order
    assert gc.parse_reparams("+".join(_offered(gc.offer_for(PLE_KEY_MSG, tiny, ["tokenizer-label"]))), tiny) \
        == ["tokenizer-label", "ple-pad"]


def test_no_offer_when_the_fix_is_already_in_use():
    tiny = bundled_model("tiny")
    assert gc.offer_for(PLE_KEY_MSG, tiny, ["tokenizer-label", "ple-pad"]).startswith("no function-preserving")


import pytest  # noqa: E402

from reference.errors import InputError  # noqa: E402


@pytest.mark.parametrize("opt", ["reparam=auto", "reparam=ple-pad", "sdist=/tmp/x.tar.gz", "convert_timeout=60"])
def test_a_conversion_option_with_a_given_gguf_is_refused_not_ignored(tmp_path, opt):
    """gguf= loads the file as is: reparam=, sdist= and convert_timeout= act only on the tool's own conversion,
    so giving them with gguf= is a contradiction (exit 2), never silently dropped while the report's backend
    spec still lists them."""
    from parity.backends.llamacpp import LlamaCppBackend
    k, v = opt.split("=", 1)
    with pytest.raises(InputError) as e:
        LlamaCppBackend.open(bundled_model("tiny"), gguf=str(tmp_path / "m.gguf"), **{k: v})
    msg = str(e.value)
    assert f"{k}=" in msg and "gguf=" in msg and "expected" in msg and "found" in msg, msg
    # reparam=none says the same as leaving it out: no contradiction (here: the missing file is the error)
    with pytest.raises(InputError, match="expected a GGUF file, found nothing there"):
        LlamaCppBackend.open(bundled_model("tiny"), gguf=str(tmp_path / "m.gguf"), reparam="none")


def test_parity_with_gguf_and_reparam_exits_2(tmp_path, capsys):
    from parity.cli import main
    rc = main(["parity", "tiny", "--backend", f"llama.cpp:gguf={tmp_path / 'm.gguf'},reparam=auto",
               "--scenario", "kl", "--format", "text", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "reparam=" in err and err.count("error:") == 1, err


# --- sdist=: the converter asked for is the one used --------------------------------------------------------

def _sdist(path, text: str, version: str = "0.3.36"):
    """A stand-in source distribution holding only a converter whose text is ``text``."""
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tf:
        for name, data in ((f"llama_cpp_python-{version}/vendor/llama.cpp/convert_hf_to_gguf.py", text),
                           (f"llama_cpp_python-{version}/vendor/llama.cpp/conversion/__init__.py", ""),
                           (f"llama_cpp_python-{version}/vendor/llama.cpp/gguf-py/gguf/__init__.py", "")):
            b = data.encode()
            ti = tarfile.TarInfo(name)
            ti.size = len(b)
            tf.addfile(ti, io.BytesIO(b))
    return path


def test_an_sdist_given_is_used_even_when_another_converter_is_cached(tmp_path, monkeypatch):
    """sdist= (and $QWEN4EXP_LLAMACPP_SDIST) name the converter to use: a converter already extracted from
    another sdist must not stand in for it (a patched converter would be silently ignored), and a missing
    sdist= is an error whatever the cache holds."""
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QWEN4EXP_LLAMACPP_SDIST", raising=False)
    a, b = _sdist(tmp_path / "a.tar.gz", "# A"), _sdist(tmp_path / "b.tar.gz", "# B (patched)")
    da = gc.converter_dir("0.3.36", a)
    assert (da / "convert_hf_to_gguf.py").read_text() == "# A"
    db = gc.converter_dir("0.3.36", b)
    assert (db / "convert_hf_to_gguf.py").read_text() == "# B (patched)", db
    monkeypatch.setenv("QWEN4EXP_LLAMACPP_SDIST", str(a))
    assert (gc.converter_dir("0.3.36") / "convert_hf_to_gguf.py").read_text() == "# A"
    monkeypatch.delenv("QWEN4EXP_LLAMACPP_SDIST")
    from parity.backends.base import BackendError
    with pytest.raises(BackendError, match="sdist= option .*nothing there"):
        gc.converter_dir("0.3.36", tmp_path / "missing.tar.gz")


def test_conversions_by_different_converters_are_cached_apart(tmp_path, monkeypatch):
    import subprocess
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QWEN4EXP_LLAMACPP_SDIST", raising=False)
    ran = []

    def fake_converter(conv, src, outfile, **kw):
        ran.append((conv / "convert_hf_to_gguf.py").read_text())
        Path(outfile).write_bytes(b"GGUF")
        return subprocess.CompletedProcess([], 0, "", "")
    from pathlib import Path
    monkeypatch.setattr(gc, "run_converter", fake_converter)
    a, b = _sdist(tmp_path / "a.tar.gz", "# A"), _sdist(tmp_path / "b.tar.gz", "# B (patched)")
    ca = gc.convert(bundled_model("tiny"), "0.3.36", sdist=a)
    cb = gc.convert(bundled_model("tiny"), "0.3.36", sdist=b)
    assert ran == ["# A", "# B (patched)"], ran
    assert ca["gguf"] != cb["gguf"] and ca["converter"] != cb["converter"]
    assert gc.convert(bundled_model("tiny"), "0.3.36", sdist=b) == cb and len(ran) == 2  # cached: not re-run


def test_an_sdist_that_is_no_tarball_is_one_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN4EXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QWEN4EXP_LLAMACPP_SDIST", raising=False)
    bad = tmp_path / "bad.tar.gz"
    bad.write_text("not a tarball")
    from parity.backends.base import BackendError
    with pytest.raises(BackendError) as e:
        gc.converter_dir("0.3.36", bad)
    msg = str(e.value)
    assert str(bad) in msg and "expected" in msg and "found" in msg and "gzip" in msg, msg
    assert not any((tmp_path / "cache").glob("llama.cpp-*")), "a failed extraction left a folder behind"
