"""One parser for token-id files (``--ids FILE`` of ``qwen4exp logits``, ``taps record``, ...).

Accepted forms: a 1-D ``.npy`` array of integers (a 0-d or 2-D array is refused, never flattened), a JSON list of integers (or an
object ``{"ids": [...]}`` / ``{"token_ids": [...]}``), or integers separated by whitespace and/or
commas (``1 2 3``, ``1,2,3``). An empty item (``1,,2``) is an error naming its position.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from reference.errors import InputError
from reference.session import check_ids

__all__ = ["read_ids_file", "IDS_FILE_HELP"]

IDS_FILE_HELP = ("a FILE holding token ids: a .npy integer array, a JSON list (or {\"ids\": [...]}), "
                 "or integers separated by whitespace or commas")


def read_ids_file(path, vocab_size: int | None = None, flag: str = "--ids") -> np.ndarray:
    """Token ids from the file ``path`` (see the module docstring for the forms).

    Args:
        vocab_size: when given, every id must lie in ``[0, vocab_size)``; otherwise in ``[0, 2^63)``.
    Returns:
        ``[T]`` int64, T >= 1.
    Raises:
        InputError: missing/unreadable file, non-integer content, a .npy array that is not 1-D, an empty
            item, no ids, or an id out of range (naming the first bad value and its index).
    """
    p = Path("/dev/stdin") if str(path) == "-" else Path(path)
    if not p.exists() or p.is_dir():  # a regular file, or a pipe / /dev/stdin / <(...)
        raise InputError(f"{flag} {str(path)!r}: expected a file of token ids, found "
                         f"{'a directory' if p.is_dir() else 'no such file'}")
    if p.suffix == ".npy":
        try:
            with open(p, "rb") as fh:  # a pipe too (np.load of a path needs a seekable file)
                import io
                arr = np.load(io.BytesIO(fh.read()), allow_pickle=False)
        except (OSError, ValueError) as e:
            # numpy's own text for bytes that are no .npy array talks of pickles and unsafe loading: not said here
            why = ("bytes that are not a .npy array" if "pickle" in str(e) or "magic" in str(e).lower() else str(e))
            raise InputError(f"{flag} {str(path)!r}: expected a readable .npy array, found {why}") from None
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{flag} {str(path)!r}: expected an integer .npy array, found dtype {arr.dtype}")
        if arr.ndim != 1:
            raise InputError(f"{flag} {str(path)!r}: expected a 1-D .npy array of token ids [T], found a "
                             f"{arr.ndim}-D array of shape {list(arr.shape)}")
        ids = [int(x) for x in arr]
    else:
        from reference.textio import read_utf8
        text = read_utf8(p, f"{flag} {str(path)!r}", "text file of token ids")
        s = text.strip()
        if not s:
            raise InputError(f"{flag} {str(path)!r}: expected at least one token id, found an empty file")
        if s[0] in "[{":
            try:
                v = json.loads(s)
            except ValueError as e:
                raise InputError(f"{flag} {str(path)!r}: expected a JSON list of integers, found unparsable JSON "
                                 f"({e})") from None
            if isinstance(v, dict) and not ("ids" in v or "token_ids" in v):
                raise InputError(f"{flag} {str(path)!r}: expected a JSON list of integers or an object with key "
                                 f"'ids' / 'token_ids', found an object with keys {sorted(v)[:8]}")
            ids = v.get("ids", v.get("token_ids")) if isinstance(v, dict) else v
            if not isinstance(ids, list):
                raise InputError(f"{flag} {str(path)!r}: expected a list of integers, found a JSON "
                                 f"{type(ids).__name__}")
            bad = next((n for n, x in enumerate(ids) if not isinstance(x, int) or isinstance(x, bool)), None)
            if bad is not None:
                raise InputError(f"{flag} {str(path)!r}: expected a list of integers, found {ids[bad]!r} at item {bad}")
        else:
            ids = []
            # items are separated by commas (optionally with whitespace) or by whitespace alone
            for n, item in enumerate(re.split(r"\s*,\s*|\s+", s)):
                if item == "":
                    raise InputError(f"{flag} {str(path)!r}: expected an integer at item {n}, found an empty item "
                                     f"(two separators in a row)")
                try:
                    ids.append(int(item))
                except ValueError:
                    raise InputError(f"{flag} {str(path)!r}: expected integer token ids, found unparsable item "
                                     f"{item[:40]!r} at item {n}") from None
    if not ids:
        raise InputError(f"{flag} {str(path)!r}: expected at least one token id, found an empty list")
    return check_ids(ids, vocab_size, f"{flag} {str(path)!r}")
