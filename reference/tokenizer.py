"""The checkpoint's tokenizer (``tokenizer.json``, read with the ``tokenizers`` library)."""
from __future__ import annotations

from pathlib import Path

from reference.errors import InputError


class TokenizerMissingError(InputError):
    """The checkpoint has no ``tokenizer.json`` (callers may fall back to token ids)."""


class TokenizerInvalidError(InputError):
    """The checkpoint's ``tokenizer.json`` exists but does not load (never a reason to fall back silently)."""


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer (``<model_dir>/tokenizer.json``) as a ``tokenizers.Tokenizer``.

    Raises:
        TokenizerMissingError: no ``tokenizer.json`` in ``model_dir``.
        TokenizerInvalidError: it is there but cannot be parsed.
    """
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerMissingError(f"tokenizer: expected {path} (a tokenizers JSON file), found no such file; "
                                    f"generation needs the checkpoint's tokenizer")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers error types are not public
        raise TokenizerInvalidError(f"tokenizer: expected a valid tokenizers JSON file at {path}, found one "
                                    f"that does not load ({e})") from None
