"""A --prompts item longer than the model's max_position_embeddings is refused when the file is read (exit 2,
one line naming the file, the item, its length and the limit), by ``parity`` and ``kl`` alike -- before: both
ran on for minutes (the length check of ``logits --ids``, reference.session.check_length, is the one reused)."""
from __future__ import annotations

import json

import pytest

from fixture_helpers import one_line_error
from parity.cli import main
from reference.config import load_config
from reference.paths import bundled_model


def _never(*a, **k):
    pytest.fail("the run started before the prompt file's lengths were checked")


@pytest.mark.parametrize("argv", [["parity", "tiny", "--scenario", "kl", "--no-progress"],
                                  ["kl", "tiny", "--no-progress"]], ids=["parity", "kl"])
def test_prompt_longer_than_max_positions_is_refused(argv, tmp_path, capsys, monkeypatch):
    import parity.harness.run as R
    import parity.harness.scenarios.common as C
    limit = load_config(bundled_model("tiny")).max_position_embeddings
    monkeypatch.setattr(C, "TruthCache", _never)       # parity: the first thing run after the prompts are read
    monkeypatch.setattr(R, "run_kl_command", _never)   # kl: likewise
    f = tmp_path / "plong.json"
    f.write_text(json.dumps([[1, 2, 3], [1] * (limit + 1)]))
    assert main([*argv, "--prompts", str(f)]) == 2
    one_line_error(capsys, str(f), "item 1", f"max_position_embeddings={limit}", str(limit + 1))


def test_prompt_of_exactly_max_positions_is_read(tmp_path):
    """Negative control: exactly max_position_embeddings ids load (the limit is inclusive)."""
    from parity.prompts import load_prompts
    cfg = load_config(bundled_model("tiny"))
    f = tmp_path / "p.json"
    f.write_text(json.dumps([[1] * cfg.max_position_embeddings]))
    ps = load_prompts(f, bundled_model("tiny"), cfg.vocab_size, cfg.max_position_embeddings)
    assert len(ps[0]) == cfg.max_position_embeddings


@pytest.mark.parametrize("item,found", [([1, 2.5, 3], "2.5 (float) at index 1"), ([1, True, 3], "True (bool) at index 1"),
                                        ([1, 2, "3"], "'3' (str) at index 2")])
def test_a_bad_token_id_element_is_named_with_its_index(item, found, tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([[4, 5], item]))
    assert main(["parity", "tiny", "--scenario", "kl", "--no-progress", "--prompts", str(f)]) == 2
    one_line_error(capsys, str(f), "item 1", found)
