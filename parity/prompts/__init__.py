"""Prompt sets of the KL harness.

A prompt file is a JSON list whose items are either texts (tokenized with the checkpoint's
``tokenizer.json``) or lists of token ids. ``default.json`` is the bundled set: short texts of
different kinds (prose, code, a document boundary with the EOS token that resets the PLE n-gram
history, a chat turn) and one id list (ids < 512 so it fits every fixture).
"""
from __future__ import annotations

import json
from pathlib import Path

from reference.errors import InputError
from reference.session import check_ids

__all__ = ["DEFAULT_PROMPTS", "load_prompts"]

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "default.json"


def load_prompts(path, model_dir, vocab_size: int) -> list[list[int]]:
    """Read a prompt file (default: the bundled set) into token-id lists.

    Args:
        path: JSON file, or None for :data:`DEFAULT_PROMPTS`.
        model_dir: checkpoint directory (its ``tokenizer.json`` tokenizes text items).
        vocab_size: ids must lie in ``[0, vocab_size)``.
    Returns:
        list of ``[T]`` int lists (T >= 1).
    Raises:
        InputError: unreadable file, not a JSON list, an item that is neither text nor an id list, an
            empty prompt, an out-of-range id, or text items without a tokenizer.
    """
    p = Path(path) if path is not None else DEFAULT_PROMPTS
    from reference.textio import read_utf8
    text = read_utf8(p, f"--prompts {p}", "JSON file")
    try:
        items = json.loads(text)
    except ValueError as e:
        raise InputError(f"--prompts {p}: expected a JSON list of texts or token-id lists, found unreadable "
                         f"content ({e})") from None
    if not isinstance(items, list) or not items:
        raise InputError(f"--prompts {p}: expected a non-empty JSON list, found {type(items).__name__}"
                         + (" (empty)" if isinstance(items, list) else ""))
    tok = None
    out = []
    for n, it in enumerate(items):
        if isinstance(it, str):
            if tok is None:
                from reference.tokenizer import load_tokenizer
                tok = load_tokenizer(model_dir)
            ids = tok.encode(it).ids
        elif isinstance(it, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in it):
            ids = list(it)
        else:
            raise InputError(f"--prompts {p}: item {n}: expected a text or a list of integer token ids, found "
                             f"{type(it).__name__}")
        if not ids:
            raise InputError(f"--prompts {p}: item {n}: expected at least one token, found an empty prompt")
        out.append(check_ids(ids, vocab_size, f"--prompts {p}: item {n}").tolist())
    return out
