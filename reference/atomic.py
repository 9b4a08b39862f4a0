"""Output paths and atomic writes shared by every command and writer.

* :func:`check_output_path` validates an output path *before* any work is done (so a long run never
  ends in a traceback because ``--out`` names a directory, an existing file or an unwritable place).
* :func:`atomic_write_bytes`, :func:`atomic_write_json`, :func:`atomic_save_npy` write a file to a temp
  name in the target directory and rename it into place; :func:`atomic_dir` assembles a directory
  aside and swaps it in. Written files get mode ``0o666 & ~umask`` (directories ``0o777 & ~umask``),
  like an ordinary ``open()`` would, instead of mkstemp's 0600.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from reference.errors import EXIT_ENVIRONMENT, InputError, UserError

__all__ = ["signals_deferred", "OutputWriteError", "WRITE_ERRNOS", "write_failed", "write_failure_reason", "check_output_path", "current_umask", "atomic_write_bytes", "atomic_write_json", "atomic_save_npy",
           "atomic_dir", "swap_in_dir", "apply_umask_modes", "atomic_open"]


#: errno values of a write that failed for the environment's sake (full, read-only or failing disk)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG)
# inside our own writers, numpy's errno-less short-write OSError (None) is one of them too
_WRITE_ERRNOS = (None, *WRITE_ERRNOS)


class OutputWriteError(UserError, OSError):
    """An output that could not be written (a full or read-only disk, an I/O error) -- the environment, not
    the input: the CLI prints it as one line and exits 4 (``exit_code`` = EXIT_ENVIRONMENT), and nothing half-written is left.
    An OSError too, so callers catching OSError around a write still catch it."""

    exit_code = EXIT_ENVIRONMENT


def write_failure_reason(e: BaseException) -> str:
    """Why a write failed, for a message: the OS reason, or (numpy / safetensors short writes carry no
    errno) the error's text with what it most likely is."""
    return getattr(e, "strerror", None) or f"{str(e).strip() or type(e).__name__} (is the disk full?)"


def write_failed(path, e: BaseException) -> OutputWriteError:
    """The :class:`OutputWriteError` for a failed write of ``path``: ``'<path>' could not be written: <why>``."""
    return OutputWriteError(f"output {str(path)!r} could not be written: {write_failure_reason(e)}")


def current_umask() -> int:
    """The process umask (read without changing it for longer than the two calls)."""
    m = os.umask(0o022)
    os.umask(m)
    return m


def _file_mode() -> int:
    return 0o666 & ~current_umask()


def _dir_mode() -> int:
    return 0o777 & ~current_umask()


def check_output_path(path, kind: str = "file", overwrite: bool = True, flag: str = "--out") -> Path:
    """Validate an output path up front; returns it as a :class:`Path`.

    Args:
        path: where the output will be written.
        kind: ``'file'`` (a file will be written at ``path``) or ``'dir'`` (a directory).
        overwrite: whether an existing output may be replaced (for ``'dir'``: whether a non-empty
            existing directory may be written into / replaced).
        flag: the option name used in the message.
    Raises:
        InputError: ``path`` is a directory (kind 'file') or a file (kind 'dir'), exists and
            ``overwrite`` is false, or its parent is not a writable directory (nor creatable). For kind
            ``'dir'`` the parent directory must already exist (only the output directory itself is
            created), so a typo never creates a tree of folders (``--out /nonexist/deep/dir``).
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"check_output_path: kind must be 'file' or 'dir', found {kind!r}")
    p = Path(path)
    if str(path) == "":
        raise InputError(f"{flag}: expected a {'file' if kind == 'file' else 'directory'} path, found ''")
    if kind == "file":
        if p.is_dir():
            raise InputError(f"{flag} {str(path)!r}: expected a file path, found a directory")
        if p.exists() and not overwrite:
            raise InputError(f"{flag} {str(path)!r}: expected a new file, found an existing one (pass --overwrite)")
        if p.exists() and not p.is_file():
            raise InputError(f"{flag} {str(path)!r}: expected a regular file path, found a special file")
    else:
        if p.exists() and not p.is_dir():
            raise InputError(f"{flag} {str(path)!r}: expected a directory, found an existing file")
        if p.is_dir() and not overwrite and any(p.iterdir()):
            raise InputError(f"{flag} {str(path)!r}: expected a new or empty directory, found a non-empty one "
                             f"(pass --overwrite)")
        parent = Path(os.path.abspath(p)).parent
        if not p.exists() and not parent.is_dir():
            if parent.exists():
                raise InputError(f"{flag} {str(path)!r}: expected a path under a directory, found {str(parent)!r} "
                                 f"is a file")
            raise InputError(f"{flag} {str(path)!r}: expected an existing parent directory, found no directory "
                             f"{str(parent)!r} (create it first)")
    # the nearest existing ancestor must be a writable directory (parents are created on write)
    anc = p.parent if kind == "file" or not p.exists() else p
    anc = Path(os.path.abspath(anc))
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"{flag} {str(path)!r}: expected a path under a directory, found {str(anc)!r} is a file")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {str(path)!r}: expected a writable location, found {str(anc)!r} not writable")
    if str(anc).startswith(("/proc", "/sys")):
        raise InputError(f"{flag} {str(path)!r}: expected a location on a normal file system, found {str(anc)!r}")
    return p


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the block runs (main thread; delivered when it ends), so the
    renames that swap finished outputs into place are never split by a catchable signal: an interrupted
    run leaves the old results or the new ones, never a mix."""
    import signal
    import threading
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# signals actually delivered to this process while a command runs (parity.bench.runner.terminate_on_signals
# records them): a KeyboardInterrupt with no SIGINT behind it was raised by code (e.g. a backend), not by the user
_DELIVERED: list[int] = []


def note_signal(signum: int) -> None:
    """Record that signal ``signum`` was delivered (called by the CLI's signal handlers)."""
    _DELIVERED.append(int(signum))


def real_interrupt() -> bool:
    """True when a SIGINT / SIGTERM / SIGHUP was actually delivered since the command started (or no handler
    tracks them: then every KeyboardInterrupt counts as real)."""
    return bool(_DELIVERED) or not _TRACKING


def signal_delivered() -> bool:
    """True when a SIGINT / SIGTERM / SIGHUP was delivered since the last command started (stays True after it
    ended: the process is on its way out)."""
    return bool(_DELIVERED)


_TRACKING: list[bool] = []


@contextlib.contextmanager
def tracking_signals() -> Iterator[None]:
    """While the block runs, :func:`real_interrupt` tells a delivered signal from a raised KeyboardInterrupt."""
    _TRACKING.append(True)
    _DELIVERED.clear()
    try:
        yield
    finally:
        _TRACKING.pop()


def write_target(path) -> Path:
    """Where an output named ``path`` is written: ``path`` itself, or -- when it is a symbolic link -- the
    link's target (resolved), so ``--overwrite`` on a symlinked ``--out`` replaces the target and keeps the
    link (the one rule of every writer here; README "Paths")."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextlib.contextmanager
def atomic_open(path, mode: str = "wb") -> Iterator:
    """Yield an open temp file next to ``path`` (a symlink's target: :func:`write_target`); on success chmod
    it to the umask mode and rename it."""
    path = write_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise write_failed(path, e) from None
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(tmp, _file_mode())
        with signals_deferred():
            os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # full disk (numpy raises errno-less OSErrors), I/O error, ...
            raise write_failed(path, e) from None
        raise


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same directory + rename (mode per umask)."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_json(path, obj, *, indent: int | None = 1, default=None) -> Path:
    """Write ``obj`` as JSON (trailing newline) to ``path`` atomically (mode per umask)."""
    text = json.dumps(obj, indent=indent, default=default) + "\n"
    return atomic_write_bytes(path, text.encode())


def atomic_save_npy(path, arr) -> Path:
    """``np.save`` ``arr`` to ``path`` atomically (mode per umask)."""
    import numpy as np
    with atomic_open(path, "wb") as f:
        np.save(f, arr)
    return Path(path)


def apply_umask_modes(root) -> None:
    """chmod ``root`` and everything under it to the umask modes (dirs 0777&~umask, files 0666&~umask)."""
    root = Path(root)
    dm, fm = _dir_mode(), _file_mode()
    os.chmod(root, dm)
    for p in root.rglob("*"):
        if not p.is_symlink():
            os.chmod(p, dm if p.is_dir() else fm)


@contextlib.contextmanager
def atomic_dir(final, *, prefix: str | None = None) -> Iterator[Path]:
    """Yield a fresh temp directory next to ``final``; on success give it umask modes and swap it in
    place of ``final`` (an existing ``final`` is replaced; a symlink's target: :func:`write_target`). On
    failure the temp directory is removed."""
    final = write_target(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=prefix or f".{final.name}.", suffix=".tmp"))
    except OSError as e:
        raise write_failed(final, e) from None
    try:
        try:
            yield tmp
        except OSError as e:  # a write into the temp directory failed for want of space / I/O
            if getattr(e, "errno", None) in _WRITE_ERRNOS:
                raise write_failed(final, e) from None
            raise
        try:
            swap_in_dir(tmp, final)
        except OSError as e:
            raise write_failed(final, e) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def swap_in_dir(tmp: Path, final: Path) -> None:
    """Give directory ``tmp`` the umask modes and rename it to ``final``; an existing ``final`` is replaced
    (set aside first and put back when the rename fails). Used by :func:`atomic_dir` and by writers that
    build a directory over several calls (tap archives).

    Raises:
        OSError: the rename failed (``final`` is then as before).
    """
    apply_umask_modes(tmp)
    old = None
    # SIGINT / SIGTERM / SIGHUP held from setting the old one aside to removing it: an interrupted run leaves
    # the old directory or the new one, never neither, never the set-aside copy
    with signals_deferred():
        if final.exists():
            old = final.parent / f".{final.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old is not None and not final.exists():
                with contextlib.suppress(OSError):
                    os.replace(old, final)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
