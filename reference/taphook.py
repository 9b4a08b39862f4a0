"""The tap hook every producer (reference, engine, outside adapters) emits through.

The hook is part of the model definition so that the reference can emit taps without importing the
tap machinery above it (``taps.recorder`` builds on this module). A producer does::

    from reference import taphook
    rec = taphook.current()
    if rec is not None:
        rec.emit("layers.3.mlp.out", value, positions=pos)

``current()`` is None unless something (a :class:`taps.recorder.Recorder`, or the reference's own
capture for ``hidden_states`` / ``replay``) is active in this context, so the check costs nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import re

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("qwen4exp_tap_recorder", default=None)

__all__ = ["current", "active", "layer_of", "set_current", "reset_current"]


def current():
    """The active recorder (any object with ``emit(name, value, positions=..., **extra)`` and
    ``wants(name)``), or None."""
    return _CURRENT.get()


def set_current(rec) -> contextvars.Token:
    """Make ``rec`` the active recorder until :func:`reset_current` is called with the returned token."""
    return _CURRENT.set(rec)


def reset_current(token: contextvars.Token) -> None:
    """Undo the :func:`set_current` that returned ``token``."""
    _CURRENT.reset(token)


@contextlib.contextmanager
def active(rec):
    """Context manager: ``rec`` is :func:`current` inside the block, the previous one after it."""
    tok = _CURRENT.set(rec)
    try:
        yield rec
    finally:
        _CURRENT.reset(tok)


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.*)$")


def layer_of(name: str) -> int | None:
    """The 0-based layer index of a ``layers.<i>.*`` tap name, None for other names."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None
