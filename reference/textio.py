"""Reading small text files (configs, indexes, prompts, templates) with one clear error for bytes that are
not UTF-8 or a file that cannot be read."""
from __future__ import annotations

from pathlib import Path

from reference.errors import InputError

__all__ = ["read_utf8", "check_text", "check_strings"]


def read_utf8(path, what: str, kind: str = "text file", error: type = InputError) -> str:
    """The text of ``path``.

    Args:
        path: the file. what: the thing named first in an error (``'--prompts'``, ``'chat template'``).
        kind: what the file should be, for the message (``'JSON file'``, ``'jinja file'``).
        error: the :class:`reference.errors.UserError` subclass raised.
    Raises:
        ``error``: bytes that are not UTF-8 (with the reason and byte offset), or an unreadable file.
    """
    p = Path("/dev/stdin") if str(path) == "-" else Path(path)  # '-', /dev/stdin and <(...) pipes are read too
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what}: expected a UTF-8 {kind} at {p}, found bytes that are not UTF-8 ({e.reason} at byte "
                    f"{e.start})") from None
    except OSError as e:
        raise error(f"{what}: expected a readable {kind} at {p}, found it unreadable ({e.strerror or e})") from None


def check_text(s: str, what: str, error: type = InputError) -> str:
    """``s`` if it is valid Unicode text (encodable as UTF-8), else one clear error.

    Python hands command-line bytes that are not UTF-8 over as surrogate escapes (U+DC80..U+DCFF) and
    JSON may spell lone surrogates (``"\\ud800"``); neither is text, and either would crash a tokenizer or a
    terminal later. Args: ``what`` names the argument (``'--prompt'``, ``'--prompts FILE: item 3'``).

    Raises:
        ``error``: naming ``what``, the offending byte or code point and its byte offset in the UTF-8 text.
    """
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError as e:
        offset = len(s[:e.start].encode("utf-8"))
        ch = ord(s[e.start])
        if 0xDC80 <= ch <= 0xDCFF:   # an undecodable byte of the command line (surrogateescape)
            found = f"the byte 0x{ch - 0xDC00:02x}, which is not UTF-8, at byte offset {offset}"
        else:
            found = f"a lone surrogate U+{ch:04X} at byte offset {offset}"
        raise error(f"{what}: expected UTF-8 text, found {found}") from None


def check_strings(value, what: str, error: type = InputError) -> None:
    """:func:`check_text` on every string inside a JSON-like value (dict keys and values, list items).

    Raises:
        ``error``: naming ``what`` and the path to the string (``messages[0].content``).
    """
    def walk(v, where):
        if isinstance(v, str):
            check_text(v, where, error)
        elif isinstance(v, dict):
            for k, x in v.items():
                check_text(str(k), f"{where} (a key)", error)
                walk(x, f"{where}.{k}")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{where}[{i}]")
    walk(value, what)
