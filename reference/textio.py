"""Reading small text files (configs, indexes, prompts, templates) with one clear error for bytes that are
not UTF-8 or a file that cannot be read."""
from __future__ import annotations

from pathlib import Path

from reference.errors import InputError

__all__ = ["read_utf8"]


def read_utf8(path, what: str, kind: str = "text file", error: type = InputError) -> str:
    """The text of ``path``.

    Args:
        path: the file. what: the thing named first in an error (``'--prompts'``, ``'chat template'``).
        kind: what the file should be, for the message (``'JSON file'``, ``'jinja file'``).
        error: the :class:`reference.errors.UserError` subclass raised.
    Raises:
        ``error``: bytes that are not UTF-8 (with the reason and byte offset), or an unreadable file.
    """
    p = Path(path)
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what}: expected a UTF-8 {kind} at {p}, found bytes that are not UTF-8 ({e.reason} at byte "
                    f"{e.start})") from None
    except OSError as e:
        raise error(f"{what}: expected a readable {kind} at {p}, found it unreadable ({e.strerror or e})") from None
