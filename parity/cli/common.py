"""Argument groups and output rules shared by every ``qwen4exp`` verb: MODEL, ``--backend``, ``--format``,
``--out`` / ``--overwrite``, ``--traceback``. One spelling per concept: a verb adds the group, and reads the
value back through the helper here, so every verb parses and checks them the same way."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

FORMATS = ("text", "rich", "json")
def model_help() -> str:
    """MODEL's help: a checkpoint directory or one of the bundled fixtures that exist (reference.paths)."""
    from reference.paths import bundled_fixtures
    return (f"checkpoint directory or bundled fixture name ({', '.join(bundled_fixtures()) or 'none built'}; a "
            f"fixture name means the fixture even beside a folder of that name: write ./NAME for the folder)")


def add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    """The positional MODEL every verb takes (default: the bundled ``tiny`` unless ``required``)."""
    if required:
        p.add_argument("model", metavar="MODEL", help=model_help())
    else:
        p.add_argument("model", metavar="MODEL", nargs="?", default=None, help=model_help() + " (default: tiny)")


def add_backend(p, default: str | None, flag: str = "--backend", what: str = "the backend under test",
                metavar: str = "SPEC") -> None:
    """One ``--backend SPEC`` option (:func:`parity.backends.parse_backend_spec` reads it)."""
    from parity.backends.registry import backend_help
    dest = flag.lstrip("-").replace("-", "_")
    p.add_argument(flag, dest=dest, default=default, metavar=metavar,
                   help=f"{what}: {backend_help()}" + (f" (default: {default})" if default else ""))


def backend_spec(args, flag: str = "--backend", legacy: dict | None = None):
    """The parsed ``flag`` value of ``args`` as a :class:`parity.backends.BackendSpec`, with the deprecated
    spellings noted once on stderr: an old name (``engine-cpu``) or an old flag (``--device cpu``,
    ``--dtype``, ``--precision``) given in ``legacy`` as ``{'--device': value}``.

    Raises:
        InputError: a malformed spec, an option the backend does not take, a flag contradicting the spec.
    """
    from parity.backends import parse_backend_spec
    dest = flag.lstrip("-").replace("-", "_")
    sp = parse_backend_spec(getattr(args, dest), flag)
    note = sp.deprecation()
    given = {k: v for k, v in (legacy or {}).items() if v is not None}
    if given:
        sp = sp.with_options(given, flag)
        note = (f"note: {', '.join(f'{k} {v}' for k, v in given.items())} is deprecated and will be removed "
                f"after 0.2; write {flag} {sp}")
    if note:
        print(note.replace("--backend", flag), file=sys.stderr)
    return sp


def legacy_device(device, backend: str) -> str | None:
    """The deprecated ``--device`` flag as the backend option :func:`backend_spec` takes in ``legacy``: None when
    unset or ``auto``, and for ``cpu`` on the reference (it runs on the CPU: nothing to say); ``backend`` is the
    ``--backend`` value (its name is what precedes the first ':').

    Raises:
        InputError: a value other than auto / cpu / cuda, or ``cuda`` on the reference.
    """
    from reference.errors import InputError
    if device is not None and device not in ("auto", "cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected one of auto, cpu, cuda, found {device!r}")
    on_reference = str(backend).split(":", 1)[0] == "reference"
    if device in (None, "auto") or (on_reference and device == "cpu"):
        return None
    if on_reference:
        raise InputError("--device cuda: the reference backend runs on the CPU (expected auto or cpu), found "
                         "'cuda' (use --backend engine:device=cuda for the GPU)")
    return device


def add_format(p, default_help: str = "rich on a terminal, text otherwise") -> None:
    """``--format text|rich|json`` (and ``--json``, short for ``--format json``)."""
    p.add_argument("--format", choices=FORMATS, default=None,
                   help=f"output: text (plain, for pipes and CI logs), rich (colour tables) or json "
                        f"(default: {default_help})")
    p.add_argument("--json", action="store_true", help="same as --format json")


def output_format(args) -> str:
    """The chosen format: ``--format``, ``json`` for ``--json``, else rich on a terminal and text otherwise.

    Raises:
        InputError: ``--json`` together with another ``--format``.
    """
    from reference.errors import InputError
    fmt = getattr(args, "format", None)
    if getattr(args, "json", False):
        if fmt not in (None, "json"):
            raise InputError(f"--json: expected no --format or --format json with it, found --format {fmt}")
        return "json"
    if fmt:
        return fmt
    return "rich" if sys.stdout.isatty() else "text"


def add_out(p, help: str, kind: str = "file", required: bool = False, metavar: str | None = None) -> None:
    """``--out PATH`` and ``--overwrite`` with the one path rule (:func:`check_out`)."""
    p.add_argument("--out", required=required, default=None, metavar=metavar or ("DIR" if kind == "dir" else "FILE"),
                   help=help)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out; the old results are replaced only when the run completes")


def check_out(path, *, kind: str = "file", overwrite: bool = False, flag: str = "--out",
              stdout_ok: bool = False) -> Path | None:
    """The one rule for every output path, checked before anything runs: an existing target needs
    ``--overwrite`` (and is replaced only when the run completes), the parent directory must exist (nothing
    is created but the target; for a symbolic link, the folder of the link's target, where the output goes:
    :func:`reference.atomic.write_target`), ``-`` means stdout where the format allows it (``stdout_ok``).
    Every output flag of every verb is checked here (``--out``, ``--plot``, ``parity --write-known``). Returns
    the path, or None for ``-``.

    Raises:
        InputError: naming ``flag``: ``-`` where stdout is not allowed, an existing target without
            ``overwrite``, a missing parent, a file where a directory is wanted or the reverse.
    """
    from reference.atomic import check_output_path
    from reference.errors import InputError
    if path is None:
        return None
    if str(path) == "":
        raise InputError(f"{flag}: expected a {'directory' if kind == 'dir' else 'file'} path, found an empty string")
    if str(path) == "-":
        if not stdout_ok:
            raise InputError(f"{flag} -: expected a {'directory' if kind == 'dir' else 'file'} path (this output "
                             f"cannot go to stdout), found '-'")
        return None
    p = Path(path)
    if p.is_symlink() and _link_loops(p):   # no target to write through to
        raise InputError(f"{flag} {str(path)!r}: expected a symbolic link that leads to a path, found a loop of "
                         f"symbolic links")
    if kind == "dir" and p.is_dir() and not overwrite and any(p.iterdir()):
        raise InputError(f"{flag} {str(path)!r}: expected a new or empty directory, found a non-empty one "
                         f"(pass --overwrite)")
    check_output_path(p, kind, overwrite=overwrite, flag=flag)
    from reference.atomic import write_target
    # a symlink is written through to its target (write_target): the target's folder must exist, as a plain
    # path's must (a dangling link into /nonexist never creates /nonexist)
    real = write_target(p)
    parent = Path(os.path.abspath(real)).parent
    if not real.exists() and not parent.is_dir():
        found = "a file" if parent.exists() else "nothing"
        via = f" (the folder of the symbolic link's target {str(real)!r})" if real != p else ""
        raise InputError(f"{flag} {str(path)!r}: expected an existing parent directory {str(parent)!r}{via}, found "
                         f"{found}")
    return p


def _link_loops(p: Path) -> bool:
    """Whether the symbolic link ``p`` is part of a loop of links (ELOOP)."""
    import errno
    try:
        os.stat(p)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def add_traceback(p, top: bool = False, failures: str | None = None) -> None:
    """``--traceback``: full stack traces of errors on stderr (``top``: the main parser's; a subcommand's leaves
    the main parser's value alone unless given). ``failures``: where the verb keeps the traces of backend
    failures it reports as a verdict (ERROR), which this then prints too (None: the verb has no such verdict)."""
    text = ("print the full stack trace of an error" if failures is None else
            f"print full stack traces of an error and of each backend failure (ERROR); {failures}")
    p.add_argument("--traceback", action="store_true", default=False if top else argparse.SUPPRESS, help=text)


def safe_text(s: str) -> str:
    """``s`` with control characters (ESC, BEL, backspace, C1 controls, ...) shown as ``\\xNN`` escapes, tab
    and newline kept: text from a random or hostile model cannot move the cursor, recolour or clear the
    terminal or a CI log."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch in "\n\t" or not (o < 0x20 or o == 0x7F or 0x80 <= o < 0xA0):
            out.append(ch)
        else:
            out.append(f"\\x{o:02x}")
    return "".join(out)


def _host_tag() -> str:
    """This host's name as it appears in a staging directory's name (letters and digits, others as '_')."""
    import socket
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def _stage_owner() -> str:
    """``<host>-<pid>``: who a staging directory belongs to (its name carries it, :func:`remove_stale_stages`)."""
    return f"{_host_tag()}-{os.getpid()}"


def remove_stale_stages(where, prefix: str) -> list[Path]:
    """Remove the staging directories ``<prefix><host>-<pid>-XXXX`` in ``where`` left by a run of this host
    whose process is gone (killed by a signal no handler sees: SIGKILL, or an outside engine aborting the
    process, e.g. llama.cpp's GGML_ASSERT). A directory of another host, of a live process or of another
    name is left alone. Returns the paths removed (best effort: an unremovable one is skipped).
    """
    import shutil
    host = _host_tag()
    removed = []
    try:
        names = os.listdir(where)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix + host + "-"):
            continue
        pid = name[len(prefix) + len(host) + 1:].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        path = Path(where) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def staged_dir(out, entries: tuple[str, ...]):
    """A context manager for an output directory ``out`` whose ``entries`` (``report.json``, ``taps``) a run
    writes: it yields a staging directory next to (or inside) ``out``; when the block completes, the staged
    entries replace the old ones in one step with SIGINT/SIGTERM/SIGHUP held (an old entry the run did not
    write again is removed: a new report never sits next to stale archives); other files in ``out`` are left
    alone. When the block raises or is interrupted, the staging directory is removed and ``out`` is as it
    was: the old results or the new ones, never a mix, never a temp folder. A process killed outright (SIGKILL,
    an outside engine aborting it) cannot remove its staging directory: the next run on ``out`` does
    (:func:`remove_stale_stages`; the directory's name carries its host and process id).

    Raises:
        OutputWriteError: the staging directory cannot be created (full or read-only disk).
    """
    import contextlib
    import shutil
    import tempfile

    from reference.atomic import apply_umask_modes, signals_deferred, write_failed, write_target

    @contextlib.contextmanager
    def cm():
        final = write_target(out)   # a symbolic link is written through: a dangling one gets its target made
        existed = final.is_dir()
        where = final if existed else Path(os.path.abspath(final)).parent
        prefix = ".partial-" if existed else f".{final.name}.partial-"
        remove_stale_stages(where, prefix)
        try:
            stage = Path(tempfile.mkdtemp(dir=where, prefix=f"{prefix}{_stage_owner()}-"))
        except OSError as e:
            raise write_failed(final, e) from None
        try:
            yield stage
            apply_umask_modes(stage)
            with signals_deferred():
                if not existed:
                    os.rename(stage, final)   # the whole directory appears at once
                else:
                    for name in entries:
                        cur, new = final / name, stage / name
                        if cur.exists() or cur.is_symlink():
                            os.replace(cur, stage / f".old-{name}")
                        if new.exists():
                            os.replace(new, cur)
        finally:
            if stage.exists():
                shutil.rmtree(stage, ignore_errors=True)
    return cm()


def replace_paths(doc, old: str, new: str):
    """``doc`` (JSON-like) with ``old`` replaced by ``new`` in every string (paths written under a staging
    directory, reported at their final place)."""
    if isinstance(doc, str):
        return doc.replace(old, new)
    if isinstance(doc, dict):
        return {k: replace_paths(v, old, new) for k, v in doc.items()}
    if isinstance(doc, list):
        return [replace_paths(v, old, new) for v in doc]
    return doc


def check_distinct_outputs(*outputs) -> None:
    """Two outputs of one command must be apart: each ``(flag, path)`` -- or ``(flag, path, "dir")`` for a folder
    the command writes whole, which also claims every path inside it -- (None or ``-`` skipped) is compared,
    spelling and symbolic links resolved, with the others, so that one result never silently replaces another
    (``kl --out F --plot F``; ``parity --write-known DIR/report.json --out DIR``, or a baseline inside the tap
    archives' folder ``DIR/taps``, which the run replaces). Checked before anything runs.

    Raises:
        InputError: naming both flags and the file or folder they share.
    """
    from reference.errors import InputError
    seen = {}
    for flag, path, *kind in outputs:
        if path is None or str(path) == "-":
            continue
        real, is_dir = os.path.realpath(path), kind == ["dir"]
        for other_real, (other, other_path, other_dir) in seen.items():
            if real == other_real:
                raise InputError(f"{flag} {str(path)!r}: expected a file apart from {other} {str(other_path)!r}, "
                                 f"found the same file {real!r} (one output would replace the other)")
            if other_dir and real.startswith(other_real + os.sep):
                folder_flag, folder, inner = other, other_path, path
            elif is_dir and other_real.startswith(real + os.sep):
                folder_flag, folder, inner = flag, path, other_path
            else:
                continue
            raise InputError(f"{flag} {str(path)!r}: expected a path outside the folder {folder_flag} writes whole, "
                             f"{str(folder)!r}, found {str(inner)!r} inside it")
        seen[real] = (flag, path, is_dir)


def publish_files(files: dict) -> None:
    """Write several output files together: each ``{path: bytes}`` to a temp file beside it, then all renamed
    into place with SIGINT/SIGTERM/SIGHUP held, so an interrupted run leaves every old file or every new one.

    Raises:
        OutputWriteError: a write failed (full or read-only disk); nothing is left behind.
    """
    import contextlib
    import tempfile

    from reference.atomic import current_umask, signals_deferred, write_failed
    temps = []
    try:
        from reference.atomic import write_target
        for path, data in files.items():
            path = write_target(path)
            try:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
                temps.append((tmp, path))
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o666 & ~current_umask())
            except OSError as e:
                raise write_failed(path, e) from None
        with signals_deferred():
            for tmp, path in temps:
                os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
