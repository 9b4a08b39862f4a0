"""The hint an error gives when an optional extra is missing (the official model, llama.cpp, matplotlib) names
the exact pip command for this installation: the extra as pyproject defines it, on the editable source
directory when the package is installed that way (README: ``pip install -e '.[test]'``)."""
from __future__ import annotations

import json
import shlex
import sys
import tomllib
from importlib import metadata

import pytest

from fixture_helpers import one_line_error
from parity.cli import main
from reference import paths
from reference.paths import REPO_ROOT, install_command


class _Dist:
    """Another distribution's metadata with this package's direct_url.json replaced."""

    def __init__(self, real, direct_url):
        self._real, self._direct_url = real, direct_url

    def __getattr__(self, name):
        return getattr(self._real, name)

    def read_text(self, name):
        if name != "direct_url.json":
            return self._real.read_text(name)
        return None if self._direct_url is None else json.dumps(self._direct_url)


def _installed_as(monkeypatch, direct_url, installed=True):
    real = metadata.distribution

    def distribution(name):
        if name != paths.DIST_NAME:
            return real(name)
        if not installed:
            raise metadata.PackageNotFoundError(name)
        try:
            base = real(name)
        except metadata.PackageNotFoundError:   # a checkout run without installing it
            base = real("pip")
        return _Dist(base, direct_url)
    monkeypatch.setattr(metadata, "distribution", distribution)


def test_install_command_follows_how_the_package_is_installed(monkeypatch):
    _installed_as(monkeypatch, {"url": "file:///src/my%20clone", "dir_info": {"editable": True}})
    assert shlex.split(install_command("oracle")) == ["pip", "install", "-e", "/src/my clone[oracle]"]
    _installed_as(monkeypatch, None)   # a wheel from an index: no direct_url.json
    assert shlex.split(install_command("oracle")) == ["pip", "install", "qwen4exp-parity[oracle]"]
    _installed_as(monkeypatch, {"url": "file:///tmp/q.whl", "archive_info": {}})   # a local wheel, not editable
    assert shlex.split(install_command("llamacpp")) == ["pip", "install", "qwen4exp-parity[llamacpp]"]
    _installed_as(monkeypatch, None, installed=False)   # a checkout run without installing it
    assert shlex.split(install_command("plot")) == ["pip", "install", "-e", f"{REPO_ROOT}[plot]"]


def test_every_extra_a_hint_names_is_defined_in_pyproject():
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"oracle", "llamacpp", "gpu", "plot"} <= set(extras)
    assert paths.DIST_NAME == tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["name"]


@pytest.mark.parametrize("module, argv, extra", [
    ("transformers", ["parity", "--backend", "transformers:device=cpu", "--scenario", "budget"], "oracle"),
    ("llama_cpp", ["parity", "--backend", "llama.cpp", "--scenario", "budget"], "llamacpp"),
])
def test_missing_extra_error_names_the_exact_install_command(monkeypatch, capsys, module, argv, extra):
    _installed_as(monkeypatch, {"url": "file:///src/clone", "dir_info": {"editable": True}})
    monkeypatch.setitem(sys.modules, module, None)   # import fails as when the extra is not installed
    assert main(argv) == 2
    line = one_line_error(capsys, f"the `{extra}` extra", f"pip install -e '/src/clone[{extra}]'")
    assert "qwen4exp-parity[" not in line
