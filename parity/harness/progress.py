"""Progress of a long run on stderr: a tqdm bar on a terminal, plain lines otherwise (CI logs, pipes).

``progress_mode(no_progress, stream)`` is the one rule the verbs use: ``"bar"`` when the stream is a terminal,
``"lines"`` when it is not, ``None`` with ``--no-progress``. ``progress_bar(total, desc, mode)`` gives a tqdm-like
object (``update(n)``, ``set_postfix_str(s)``, ``close()``) for the mode; ``True`` is taken as ``"bar"`` and a
false value as no progress (a disabled bar), so library callers keep their booleans.

A :class:`LineProgress` writes one line per finished step (``desc: [done/total] finished LABEL, elapsed``) and,
while one step runs long, a ``still running`` line every :data:`HEARTBEAT_S` seconds from a daemon thread, so a
log that goes quiet for minutes always says where the run is.
"""
from __future__ import annotations

import sys
import threading
import time

#: seconds between two lines while a step runs (a quiet CI log still shows the run is alive, and where)
HEARTBEAT_S = 10.0


def progress_mode(no_progress: bool, stream=None) -> str | None:
    """``None`` with ``--no-progress``; else ``"bar"`` when ``stream`` (default stderr) is a terminal, ``"lines"``
    when it is not."""
    if no_progress:
        return None
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        tty = False
    return "bar" if tty else "lines"


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LineProgress:
    """Plain progress lines on ``file`` (see the module docstring). tqdm-like: ``update(n)`` counts ``n`` steps
    finished (the label last set by ``set_postfix_str``), ``close()`` stops the heartbeat.

    Args:
        total: steps expected (cases). desc: the line's prefix (``parity``, ``kl``). file: the stream (stderr).
        every: seconds between heartbeat lines while a step runs (0: none). clock: a monotonic clock (tests).
    """

    def __init__(self, total: int, desc: str, file=None, every: float = HEARTBEAT_S, clock=time.monotonic):
        self.total, self.desc, self.file = int(total), desc, file if file is not None else sys.stderr
        self.n, self.label, self.clock, self.every = 0, "", clock, float(every)
        self.t0 = self.last = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.every > 0:
            self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._thread.start()

    def _write(self, text: str) -> None:
        with self._lock:
            now = self.clock()
            self.last = now
            try:
                print(f"{self.desc}: [{self.n}/{self.total}] {text}, elapsed {_clock(now - self.t0)}",
                      file=self.file, flush=True)
            except (ValueError, OSError):   # the stream was closed under us: progress is never worth a crash
                pass

    def _beat(self) -> None:
        while not self._stop.wait(self.every / 2):
            if self.clock() - self.last >= self.every:
                self._write(f"still running {self.label or '(setting up)'}")

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        """The step now running (named in the next line)."""
        self.label = str(s)

    def update(self, n: int = 1) -> None:
        """``n`` more steps finished: one line naming the step (none for ``n`` = 0: nothing finished)."""
        if not int(n):
            return
        self.n += int(n)
        self._write(f"finished {self.label}" if self.label else "finished")

    def close(self) -> None:
        """Stop the heartbeat thread (no more lines)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class SubProgress:
    """One part of a run counted on the run's own progress object: ``update(n)`` advances ``parent`` by ``n``
    steps and ``set_postfix_str(s)`` names the step ``PREFIX/s`` there; ``close()`` leaves the parent running.
    Handed as the ``mode`` of :func:`progress_bar`, it is returned as is, so a job with its own bar (the KL
    harness: one step per prompt) counts its steps as cases of the enclosing run. ``n``: the steps it counted
    (the owner tops the parent up to the part's total when the job stopped early).

    Args:
        parent: the run's progress object (:class:`LineProgress`, a tqdm bar, another SubProgress).
        prefix: the part's name in the parent's step labels (``kl``).
    """

    def __init__(self, parent, prefix: str):
        self.parent, self.prefix, self.n = parent, str(prefix), 0

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        """The step now running, named ``PREFIX/s`` on the parent."""
        self.parent.set_postfix_str(f"{self.prefix}/{s}" if self.prefix else str(s))

    def update(self, n: int = 1) -> None:
        """``n`` more steps finished, counted on the parent."""
        self.n += int(n)
        self.parent.update(n)

    def close(self) -> None:
        """Nothing to stop: the parent is closed by its owner."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress_bar(total: int, desc: str, mode, file=None):
    """A tqdm-like progress object for ``mode`` (``"bar"`` / ``True``: a tqdm bar on ``file``; ``"lines"``: a
    :class:`LineProgress`; a :class:`SubProgress`: itself, its steps counted on the enclosing run's bar; a false
    value: a disabled tqdm bar that prints nothing)."""
    if isinstance(mode, SubProgress):
        return mode
    file = sys.stderr if file is None else file
    if mode == "lines":
        return LineProgress(total, desc, file=file)
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="case", disable=not mode, leave=False, file=file)
