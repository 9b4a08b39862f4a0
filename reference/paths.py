"""Where the bundled fixtures live."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "fixtures"


def bundled_model(name: str = "tiny") -> Path:
    """Path of a bundled fixture checkpoint (``fixtures/<name>``); ``tiny`` is the default model."""
    return FIXTURES / name


def resolve_model(model: str | None) -> Path:
    """A MODEL argument: a checkpoint directory, a bundled fixture name, or None for ``tiny``."""
    if model is None:
        return bundled_model("tiny")
    p = Path(model)
    if p.exists():
        return p
    if (FIXTURES / model).is_dir():
        return FIXTURES / model
    from reference.errors import InputError
    raise InputError(f"model {model!r}: expected a checkpoint directory or a bundled fixture name "
                     f"({', '.join(sorted(d.name for d in FIXTURES.iterdir() if (d / 'config.json').exists())) or 'none built'}), found neither")
