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
from reference.session import check_ids, check_length

__all__ = ["DEFAULT_PROMPTS", "load_prompts", "prompt_items"]

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "default.json"


ID_PROMPT_LENGTHS = (17, 33, 48, 64)  # no tokenizer: seeded token-id prompts of these lengths (cover GDN chunk 64)


def _id_prompts(items, vocab_size: int) -> list[list[int]]:
    """The bundled set's token-id items plus seeded random token-id prompts, for a checkpoint without a
    tokenizer (a note on stderr says so): the harness still runs, on ids instead of text."""
    import sys

    import numpy as np
    out = [[int(x) for x in it] for it in items if isinstance(it, list) and it and max(it) < vocab_size]
    rng = np.random.default_rng(0)  # fixed: the same prompts on every run
    out += [[int(x) for x in rng.integers(0, vocab_size, n)] for n in ID_PROMPT_LENGTHS]
    print(f"note: the checkpoint has no tokenizer.json; the KL harness uses {len(out)} token-id prompts (seeded) "
          f"instead of the bundled texts (pass --prompts FILE with token-id lists to choose them)", file=sys.stderr)
    return out


def prompt_items(text: str, where) -> list:
    """The items of a prompt file's ``text`` (the one ``--prompts`` format of every verb): a non-empty JSON list
    whose items are texts or lists of integer token ids, in order (texts checked to be text, not tokenized).

    Args:
        text: the file's content (decoded UTF-8); where: the file, as error messages name it.
    Returns:
        list of ``str`` | ``list[int]``.
    Raises:
        InputError: not JSON, not a non-empty list, or an item that is neither a text nor an id list (naming
            ``--prompts FILE``, the item and what was found).
    """
    from reference.textio import check_text
    if not text.strip():   # an empty file or an empty pipe: say so, not a JSON parser's 'Expecting value'
        raise InputError(f"--prompts {where}: expected a JSON list of texts or token-id lists, found "
                         f"{'nothing' if not text else 'only whitespace'} (an empty input)")
    try:
        items = json.loads(text)
    except ValueError as e:
        raise InputError(f"--prompts {where}: expected a JSON list of texts or token-id lists, found text that is "
                         f"not JSON ({e})") from None
    if not isinstance(items, list) or not items:
        raise InputError(f"--prompts {where}: expected a non-empty JSON list, found {type(items).__name__}"
                         + (" (empty)" if isinstance(items, list) else ""))
    for n, it in enumerate(items):
        if isinstance(it, str):
            check_text(it, f"--prompts {where}: item {n}")  # a lone surrogate ("\ud800") is not text
        elif not isinstance(it, list):
            raise InputError(f"--prompts {where}: item {n}: expected a text or a list of integer token ids, found "
                             f"{type(it).__name__}")
        else:
            bad = next((j for j, x in enumerate(it) if not isinstance(x, int) or isinstance(x, bool)), None)
            if bad is not None:   # name the element, as the out-of-range check does
                raise InputError(f"--prompts {where}: item {n}: expected integer token ids, found "
                                 f"{it[bad]!r} ({type(it[bad]).__name__}) at index {bad}")
    return items


def load_prompts(path, model_dir, vocab_size: int, max_positions: int | None = None) -> list[list[int]]:
    """Read a prompt file (default: the bundled set) into token-id lists.

    Args:
        path: JSON file, or None for :data:`DEFAULT_PROMPTS`.
        model_dir: checkpoint directory (its ``tokenizer.json`` tokenizes text items).
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_positions: the config's ``max_position_embeddings``: a longer prompt is refused here, before
            anything runs (the harness would otherwise run on for minutes); None: no length check.
    Returns:
        list of ``[T]`` int lists (T >= 1).
    Raises:
        InputError: unreadable file, not a JSON list, an item that is neither text nor an id list, an
            empty prompt, an out-of-range id, or text items without a tokenizer.
    """
    p = Path(path) if path is not None else DEFAULT_PROMPTS
    from reference.textio import read_utf8
    text = read_utf8(p, f"--prompts {p}", "JSON file")
    items = prompt_items(text, p)
    tok = None
    out = []
    for n, it in enumerate(items):
        if isinstance(it, str):
            if tok is None:
                from reference.tokenizer import TokenizerMissingError, load_tokenizer
                try:
                    tok = load_tokenizer(model_dir)
                except TokenizerMissingError as e:
                    if path is not None:
                        raise InputError(f"--prompts {p}: item {n} is text, which needs the checkpoint's tokenizer "
                                         f"({e}); give token-id lists instead (e.g. [[1, 2, 3], [4, 5]])") from None
                    return _id_prompts(items, vocab_size)
            ids = tok.encode(it).ids
        else:
            ids = list(it)
        if not ids:
            raise InputError(f"--prompts {p}: item {n}: expected at least one token, found an empty prompt")
        if max_positions is not None:
            check_length(len(ids), max_positions, f"--prompts {p}: item {n}")
        out.append(check_ids(ids, vocab_size, f"--prompts {p}: item {n}").tolist())
    return out
