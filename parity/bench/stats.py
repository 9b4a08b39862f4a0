"""Timing statistics and timers for the benchmarks (warm-up excluded by the callers)."""
from __future__ import annotations

import time

import numpy as np


def summarize(samples) -> dict:
    """``{"median", "min", "max", "spread", "n"}`` of positive samples (seconds or rates).

    ``spread`` is ``(max - min) / median`` - the relative range, reported so a reader can judge
    whether two runs differ by more than their noise.
    Raises:
        ValueError: no samples.
    """
    a = np.asarray(list(samples), dtype=np.float64)
    if a.size == 0:
        raise ValueError("summarize: expected at least one sample, found none")
    med = float(np.median(a))
    return {"median": med, "min": float(a.min()), "max": float(a.max()),
            "spread": float((a.max() - a.min()) / med) if med > 0 else None, "n": int(a.size)}


def rate(count: float, seconds_summary: dict) -> dict:
    """Rates (``count / seconds``) from a seconds summary: median rate = count / median seconds;
    min/max swap (the slowest run gives the minimum rate)."""
    m = seconds_summary
    return {"median": count / m["median"], "min": count / m["max"], "max": count / m["min"],
            "spread": m["spread"], "n": m["n"]}


class WallTimer:
    """Wall-clock interval (``time.perf_counter``); for calls that return host results (synchronous)."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


class CupyEventTimer:
    """Device-event interval on the current CUDA stream (cupy): recorded before and after, synchronised
    on the end event only when :attr:`seconds` is read."""

    def __init__(self, cp):
        self.cp = cp

    def __enter__(self):
        self.a, self.b = self.cp.cuda.Event(), self.cp.cuda.Event()
        self.a.record()
        return self

    def __exit__(self, *exc):
        self.b.record()

    @property
    def seconds(self) -> float:
        """Elapsed device time between the two events, in seconds (waits for the end event)."""
        self.b.synchronize()
        return self.cp.cuda.get_elapsed_time(self.a, self.b) / 1e3


class TorchEventTimer:
    """Device-event interval for torch CUDA work (``torch.cuda.Event(enable_timing=True)``)."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        ev = self.torch.cuda.Event
        self.a, self.b = ev(enable_timing=True), ev(enable_timing=True)
        self.a.record()
        return self

    def __exit__(self, *exc):
        self.b.record()

    @property
    def seconds(self) -> float:
        """Elapsed device time between the two events, in seconds (waits for the end event)."""
        self.b.synchronize()
        return self.a.elapsed_time(self.b) / 1e3
