"""The qwen4exp CuPy/CUDA engine (NumPy twins on CPU). ``engine.Engine`` is the entry point
(see engine/engine.py); it is imported lazily so that ``import engine.kernels.*`` stays light."""
from __future__ import annotations

__all__ = ["Engine"]


def __getattr__(name):
    if name in ("Engine", "EngineSnapshot", "CapacityError", "StateError"):
        from engine import engine as _engine
        return getattr(_engine, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
