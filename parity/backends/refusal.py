"""An outside engine refusing a valid checkpoint: the engine's defect, not the user's.

Kept apart from :class:`parity.backends.base.BackendError` (a usage error, exit 2): when llama.cpp's
converter or loader rejects a checkpoint the reference runs, the verdict is REFUSED (exit 1) and the
report carries the engine's own message, so the defect is never mistaken for bad input.
"""
from __future__ import annotations


class EngineRefused(RuntimeError):
    """The engine under test refused a valid checkpoint.

    Attributes:
        engine: e.g. 'llama.cpp 0.3.36'.
        stage: 'converter' | 'loader' | 'server' -- where the refusal happened.
        message: the engine's own message, verbatim (last line of its traceback / log).
        offer: a hint naming a function-preserving re-parameterisation that gets past it, or ''.
    """

    exit_code = 1  # a verdict about the engine (REFUSED), not a usage error

    def __init__(self, engine: str, stage: str, message: str, offer: str = ""):
        self.engine, self.stage, self.message, self.offer = engine, stage, message.strip(), offer
        text = f"{engine} {stage} refused the checkpoint: {self.message}"
        if offer:
            text += f" ({offer})"
        super().__init__(text)

    def verdict(self) -> str:
        """The refusal as a verdict cell: ``REFUSED by ENGINE STAGE: message[; offer]`` (parity's open row, kl)."""
        return f"REFUSED by {self.engine} {self.stage}: {self.message}" + (f"; {self.offer}" if self.offer else "")

    def to_json(self) -> dict:
        """The refusal as a report field."""
        return {"engine": self.engine, "stage": self.stage, "message": self.message, "offer": self.offer}
