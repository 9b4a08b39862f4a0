"""One-line notes on stderr (``note: ...``): facts about the input that change nothing a run computes but that a
user would otherwise not see (a tensor the model ignores, a config value left to its default). Each is printed
at most once per process, however often the same checkpoint is opened (a parity run opens it several times)."""
from __future__ import annotations

import sys

_SEEN: set = set()


def noted(key) -> bool:
    """True when a note with ``key`` was printed in this process (lets a caller skip building its text)."""
    return key in _SEEN


def note_once(key, text: str) -> bool:
    """Print ``note: <text>`` on stderr unless a note with the same ``key`` (any hashable, e.g. the kind of note
    and the checkpoint's resolved path) was printed before in this process. Returns True when it printed."""
    if key in _SEEN:
        return False
    _SEEN.add(key)
    print(f"note: {text}", file=sys.stderr)
    return True
