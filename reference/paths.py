"""Where the bundled fixtures live, and the one place a MODEL argument is turned into a checkpoint directory."""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# a checkout's fixtures/, else the copy an installed wheel carries (pyproject's data-files)
_INSTALLED_FIXTURES = Path(sys.prefix) / "share" / "qwen4exp-parity" / "fixtures"
FIXTURES = REPO_ROOT / "fixtures" if (REPO_ROOT / "fixtures").is_dir() else _INSTALLED_FIXTURES


DIST_NAME = "qwen4exp-parity"


def install_command(extra: str) -> str:
    """The exact pip command that adds the optional dependency group ``extra`` (pyproject's
    ``[project.optional-dependencies]``: ``oracle``, ``llamacpp``, ``gpu``, ``plot``) to this installation, for
    error hints: an editable install (``pip install -e '.[test]'``, README) gets ``pip install -e
    '<its source directory>[extra]'`` (right from any working directory), another install ``pip install
    'qwen4exp-parity[extra]'`` (pip keeps the installed package and adds the extra's dependencies), a source
    checkout run without installing ``pip install -e '<the checkout>[extra]'``."""
    import json
    import shlex
    from importlib import metadata
    from urllib.parse import unquote, urlparse
    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        try:
            url = json.loads(dist.read_text("direct_url.json") or "null") or {}
        except ValueError:
            url = {}
        u = urlparse(str(url.get("url", "")))
        if (url.get("dir_info") or {}).get("editable") and u.scheme == "file":
            return f"pip install -e {shlex.quote(unquote(u.path) + f'[{extra}]')}"
        return f"pip install {shlex.quote(f'{DIST_NAME}[{extra}]')}"
    if (REPO_ROOT / "pyproject.toml").is_file():
        return f"pip install -e {shlex.quote(f'{REPO_ROOT}[{extra}]')}"
    return f"pip install {shlex.quote(f'{DIST_NAME}[{extra}]')}"


def bundled_fixtures() -> list[str]:
    """The names of the bundled fixtures that exist (a directory under :data:`FIXTURES` with a config.json),
    ``tiny`` first, the rest sorted: what help texts and errors list."""
    try:
        names = sorted(d.name for d in FIXTURES.iterdir() if (d / "config.json").exists())
    except OSError:
        return []
    return sorted(names, key=lambda n: (n != "tiny", n))


def bundled_model(name: str = "tiny") -> Path:
    """Path of a bundled fixture checkpoint (``fixtures/<name>``); ``tiny`` is the default model."""
    return FIXTURES / name


def check_checkpoint_dir(path: str | os.PathLike, what: str = "MODEL", error: type | None = None) -> Path:
    """``path`` as a checkpoint directory, checked: it must be a directory holding ``config.json``.

    A file (``.../tiny/config.json``, ``.../tiny/model.safetensors``) is refused rather than silently
    replaced by its parent, and a directory without ``config.json`` is reported as such before any
    later complaint (tokenizer, weights). ``what`` names the argument in the message; ``error`` is the
    class raised for a file or a missing path (default InputError; the checkpoint reader passes its own).

    Raises:
        InputError (or ``error``): ``path`` is a file, or does not exist.
        ConfigError: ``path`` is a directory without ``config.json``.
    """
    from reference.errors import InputError
    error = error or InputError
    p = Path(path)
    if p.is_file():
        raise error(f"{what} {str(p)!r}: expected a checkpoint directory (config.json + *.safetensors), "
                         f"found a file (pass its directory {str(p.parent)!r})")
    if not p.is_dir():
        raise error(f"{what} {str(p)!r}: expected a checkpoint directory (config.json + *.safetensors), "
                         f"found {'something that is not a directory' if p.exists() else 'nothing there'}")
    if not (p / "config.json").is_file():
        from reference.config import ConfigError
        raise ConfigError(f"{what} {str(p)!r}: config.json not found (expected a checkpoint directory holding "
                          f"config.json, found a directory without it)")
    return p


def resolve_model(model: str | None) -> Path:
    """A MODEL argument -> checkpoint directory: a bundled fixture name, an existing path (checked by
    :func:`check_checkpoint_dir`), or None for ``tiny``. Every command resolves its MODEL through here.

    A bare fixture name (``tiny``, no path separator) is the bundled fixture even where the current directory
    holds a folder of that name: that folder is MODEL ``./tiny``; a note on stderr says which was used.

    Raises:
        InputError: neither an existing path nor a bundled fixture name; or a file given as the model.
        ConfigError: a directory without config.json.
    """
    if model is None:
        return check_checkpoint_dir(bundled_model("tiny"))
    p = Path(model)
    if not any(sep and sep in model for sep in (os.sep, os.altsep)) and model in bundled_fixtures():
        fixture = bundled_model(model)
        if p.exists() and p.resolve() != fixture.resolve():
            print(f"note: MODEL {model!r} is the bundled fixture {str(fixture)!r}, not the folder {model!r} here "
                  f"(for that folder, write ./{model})", file=sys.stderr)
        return check_checkpoint_dir(fixture)
    if p.exists():
        # a folder that would print as a fixture name ('./tiny' prints as 'tiny') is named by its absolute path,
        # so that no message or report reads as the bundled fixture
        return check_checkpoint_dir(p.absolute() if str(p) in bundled_fixtures() else p)
    if (FIXTURES / model).is_dir():
        return check_checkpoint_dir(FIXTURES / model)
    from reference.errors import InputError
    raise InputError(f"model {model!r}: expected a checkpoint directory or a bundled fixture name "
                     f"({', '.join(bundled_fixtures()) or 'none built'}), found neither")


def check_output_spares_model(out, model, flag: str) -> None:
    """An output directory that a run replaces (``taps record --out``, ``slice DST``) must neither be the
    model it reads nor hold it: with ``--overwrite`` the checkpoint would be deleted with the old contents.

    Raises:
        InputError: naming ``flag``, the output and the model.
    """
    from reference.errors import InputError
    o, m = Path(os.path.realpath(out)), Path(os.path.realpath(model))
    if o == m or o in m.parents:
        where = "is" if o == m else "holds"
        raise InputError(f"{flag} {str(out)!r}: expected an output directory other than the model and not holding "
                         f"it, found it {where} the model {str(model)!r} (replacing it would delete the checkpoint)")
