"""Tap recorder: the one hook every producer (reference, engine) calls.

Producers do::

    from taps import recorder
    rec = recorder.current()
    if rec is not None:
        rec.emit("layers.3.self_attn.indexer.selected_blocks", ids, positions=pos, scores=block_scores)

When no recorder is active ``current()`` returns None and nothing is computed or copied.
(Interface fixed here; the full Recorder lives in this module -- see issue 4.)
"""
from __future__ import annotations

import contextvars

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("qwen4exp_tap_recorder", default=None)


def current():
    """The active recorder, or None (the zero-cost check producers make before building a tap)."""
    return _CURRENT.get()
