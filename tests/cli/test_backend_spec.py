"""The one ``--backend NAME[:key=value,...]`` grammar: the parser in
``parity.backends.registry``, the deprecated spellings, and backends that cannot be opened."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixture_helpers import one_line_error
from parity.cli import main


def _ids(tmp_path, n=12) -> Path:
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(str((5 * i) % 500) for i in range(n)))
    return f

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_suites_unknown_backend_is_a_usage_error():
    """`pytest --pyargs parity.suites --qwen4exp-backend nosuch`: one usage error (exit 4), not a failure per case."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "parity.suites.plugin",
                        "--pyargs", "parity.suites", "--qwen4exp-backend", "nosuch", "-o", "addopts="], cwd=REPO_ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert p.returncode == 4, (p.returncode, p.stdout[-500:], p.stderr[-500:])
    assert "nosuch" in p.stderr and "failed" not in p.stdout


def test_parse_backend_spec_forms():
    """One `--backend NAME[:key=value,...]` grammar, parsed in one place."""
    from parity.backends import parse_backend_spec as P
    assert str(P("engine:device=cuda,precision=bf16")) == "engine:device=cuda,precision=bf16"
    assert P("reference:dtype=float64").options == {"dtype": "float64"}
    m = P("my_pkg.mod:MyBackend")
    assert m.plugin and m.name == "my_pkg.mod:MyBackend" and not m.options
    m = P("my_pkg.mod:MyBackend:page_size=4")
    assert m.plugin and m.options == {"page_size": "4"} and str(m) == "my_pkg.mod:MyBackend:page_size=4"
    for old, new in (("reference-f64", "reference:dtype=float64"), ("engine-cpu", "engine:device=cpu"),
                     ("engine-cuda", "engine:device=cuda")):
        s = P(old)
        assert str(s) == new and s.alias == old and new in s.deprecation()
    assert P("engine").deprecation() is None  # negative control: current spellings carry no note


@pytest.mark.parametrize("bad,needles", [
    ("engine:dtype=float64", ("engine", "dtype")),
    ("reference:dtype=f16", ("dtype", "float32, float64", "f16")),
    ("engine:device", ("engine:key=value",)),
    ("engine:device=cpu,device=cpu", ("twice",)),
    ("engine:precision=", ("key=value",)),
    ("", ("empty",)),
    ("engine:page_size=0", ("page_size", ">= 1")),
])
def test_parse_backend_spec_errors(bad, needles):
    from parity.backends import parse_backend_spec
    from reference.errors import InputError
    with pytest.raises(InputError) as e:
        parse_backend_spec(bad)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_old_backend_names_work_with_one_deprecation_line(tmp_path, capsys):
    """Old names and the --dtype/--precision/--device flags accepted for one version, with a
    one-line deprecation note on stderr."""
    ids = _ids(tmp_path)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(a), "--backend", "reference:dtype=float64"]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(b), "--dtype", "float64"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deprecated" in err and "reference:dtype=float64" in err
    assert np.array_equal(np.load(a), np.load(b))
    assert main(["logits", "tiny", "--ids", str(ids), "--out", str(b), "--overwrite", "--backend",
                 "reference:dtype=float32", "--dtype", "float64"]) == 2
    one_line_error(capsys, "--dtype", "dtype=float32")  # a flag contradicting the spec is refused


def test_suites_bad_model_is_one_usage_error(tmp_path):
    """A bad ``--qwen4exp-model`` is refused at configure time, also without ``--qwen4exp-backend``: a missing
    directory, an invalid config.json, no weights. Before, each became a collection error or one error per case,
    with a traceback."""
    import pytest

    from parity.suites import plugin

    class Cfg:
        def __init__(self, **o):
            self.o = o

        def getoption(self, name):
            return self.o.get(name, plugin.OPTIONS[name][0])

    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{"model_type": "qwen4_exp"')
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((REPO_ROOT / "fixtures" / "tiny" / "config.json").read_bytes())
    for model, needle in ((tmp_path / "nothing", "found neither"), (bad_json, "not valid JSON"),
                          (no_weights, "found none")):
        with pytest.raises(pytest.UsageError, match=needle) as e:
            plugin.pytest_configure(Cfg(**{"--qwen4exp-model": str(model)}))
        assert "--qwen4exp-model" in str(e.value) and str(model) in str(e.value), e.value
    plugin.pytest_configure(Cfg(**{"--qwen4exp-model": "tiny"}))  # negative control: a good model passes


def test_suites_refuse_a_topk_server_backend_at_configure_time():
    """The suites drive sequences; a top-k server backend (openai, vllm) has none, so every case FAILed as "backend
    refused an operation the model allows" after the server was contacted. Now one usage error before anything
    connects, naming the backend and where a server is judged (qwen4exp parity's kl-topk row)."""
    import pytest

    from parity.suites import plugin

    class Cfg:
        def __init__(self, **o):
            self.o = o

        def getoption(self, name):
            return self.o.get(name, plugin.OPTIONS[name][0])

    for spec in ("openai:url=http://127.0.0.1:1", "vllm:url=http://127.0.0.1:1"):
        with pytest.raises(pytest.UsageError, match="top-k server backend") as e:
            plugin.pytest_configure(Cfg(**{"--qwen4exp-backend": spec}))
        assert spec in str(e.value) and "qwen4exp parity" in str(e.value)
    plugin.pytest_configure(Cfg(**{"--qwen4exp-backend": "reference"}))  # negative control: a sequence backend
