"""A ``--prompts`` file that is empty (or an empty pipe) is refused saying it is empty, not with a JSON parser's
'Expecting value'; one that is not JSON says so."""
from __future__ import annotations

import pytest

from parity.prompts import prompt_items
from reference.errors import InputError


@pytest.mark.parametrize("text, found", [("", "found nothing (an empty input)"),
                                         ("\n  \n", "found only whitespace (an empty input)")])
def test_an_empty_prompts_file_is_refused_as_empty(text, found):
    with pytest.raises(InputError) as e:
        prompt_items(text, "p.json")
    assert str(e.value) == f"--prompts p.json: expected a JSON list of texts or token-id lists, {found}"


def test_a_prompts_file_that_is_not_json_says_so():
    with pytest.raises(InputError, match=r"^--prompts p\.json: expected a JSON list of texts or token-id lists, "
                                         r"found text that is not JSON \("):
        prompt_items("hello", "p.json")
