"""``qwen4exp generate`` reads ``--prompts`` in the one format of every verb (a JSON list of texts or token-id
lists: several prompts, never one literal prompt), refuses a bad file before the model loads (exit 2, one line),
and runs every backend that decodes sequences: the official model (``transformers``) included, a top-k-only
server refused up front."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fixture_helpers import one_line_error
from parity.cli import main
from reference.config import load_config


def _never(*a, **k):
    pytest.fail("the model was opened before the prompts file was checked")


def _generate_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--greedy", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_json_list_file_gives_generate_several_prompts(tiny, tmp_path, capsys):
    from parity.generate import load_tokenizer
    from parity.prompts import load_prompts
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["hello world", [5, 6, 7]]))
    out = _generate_json(capsys, "--prompts", str(f), "--backend", "reference", "--max-new-tokens", "2")
    got = [r["prompt_ids"] for r in out["results"]]
    tok = load_tokenizer(tiny)
    assert got == [tok.encode("hello world", add_special_tokens=False).ids, [5, 6, 7]]
    # the very prompts the harness verbs (parity, kl) read from the same file
    cfg = load_config(tiny)
    assert got == load_prompts(f, tiny, cfg.vocab_size, cfg.max_position_embeddings)
    assert [len(r["token_ids"]) for r in out["results"]] == [2, 2]


@pytest.mark.parametrize("items, needles", [
    ([], ["non-empty JSON list"]),
    (["fine", 5], ["item 1", "a text or a list of integer token ids"]),
    (["fine", [1, True]], ["item 1", "expected integer token ids", "True (bool) at index 1"]),
    ([[]], ["item 0", "empty prompt"]),
    (["fine", ""], ["item 1", "empty prompt"]),
    ([[1, 2], "VOCAB"], ["item 1", "VOCAB"]),
    (["LONG"], ["item 0", "max_position_embeddings=LIMIT"]),
], ids=["empty-list", "number-item", "bool-id", "empty-ids", "empty-text", "id-out-of-vocab", "too-long"])
def test_a_bad_prompts_file_is_refused_before_the_model_loads(tiny, tmp_path, capsys, monkeypatch, items, needles):
    import parity.generate as G
    cfg = load_config(tiny)
    limit, vocab = cfg.max_position_embeddings, cfg.vocab_size
    items = [[1, vocab] if it == "VOCAB" else [1] * (limit + 1) if it == "LONG" else it for it in items]
    needles = [n.replace("VOCAB", str(vocab)).replace("LIMIT", str(limit)) for n in needles]
    monkeypatch.setattr(G, "open_lm", _never)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(items))
    assert main(["generate", "--prompts", str(f), "--backend", "reference", "--max-new-tokens", "1"]) == 2
    one_line_error(capsys, f"--prompts {f}", *needles)


def test_a_backend_without_sequences_is_refused_before_anything_runs(tiny, capsys, monkeypatch):
    # the OpenAI-API backend answers top-k logprobs only: generate says so instead of failing mid-run
    import parity.generate as G
    monkeypatch.setattr(G, "open_lm", _never)
    assert main(["generate", "--backend", "openai:url=http://127.0.0.1:9", "--prompt", "hi",
                 "--max-new-tokens", "1"]) == 2
    one_line_error(capsys, "--backend 'openai:url=http://127.0.0.1:9'", "decodes sequences", "top-k logprobs only")


@pytest.mark.oracle
def test_generate_runs_the_official_model(tiny, tmp_path, capsys):
    """``--backend transformers`` generates, and its greedy tokens are the reference's wherever the reference's
    choice is clear: a top-2 logit margin above 1e-3 of the row's scale, far above the float32 evaluation
    differences between the two (~1e-5 of the scale on the bundled fixtures), so no near tie can flip it."""
    from reference.checkpoint import Checkpoint
    from reference.model import ReferenceModel
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["hello world", [5, 6, 7]]))
    n_new = 4
    out = _generate_json(capsys, "--prompts", str(f), "--backend", "transformers", "--max-new-tokens", str(n_new))
    assert out["backend"] == "transformers"
    ref = ReferenceModel(Checkpoint.open(tiny))
    compared = 0
    for r in out["results"]:
        p, g = r["prompt_ids"], r["token_ids"]
        assert len(g) == n_new or r["stop_reason"] == "eos", r
        logits = np.asarray(ref.forward(p + g[:-1]), np.float64)
        for j, t in enumerate(g):
            row = logits[len(p) - 1 + j]
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] <= 1e-3 * np.abs(row).max():
                break   # a near tie: the two may legitimately differ from here on
            assert int(np.argmax(row)) == t, (p, g, j)
            compared += 1
    assert compared >= 2   # the check compared tokens, not only near ties


def test_every_registered_backend_that_decodes_reaches_the_model(tiny, capsys, monkeypatch):
    """The gate of ``generate`` over the whole registry: each built-in backend whose class decodes sequences is
    handed to the model opener, each that does not is refused before it (exit 2, one line)."""
    import parity.generate as G
    from parity.backends.base import Backend, capabilities_of
    from parity.backends.registry import BACKENDS
    from reference.errors import InputError
    seen = []

    def opened(model_dir, backend, **kw):
        seen.append(str(backend).split(":")[0])
        raise InputError("stopped at the model opener")
    monkeypatch.setattr(G, "open_lm", opened)
    decoding = []
    for name, entry in BACKENDS.items():
        decodes = entry.cls.decode is not Backend.decode and capabilities_of(entry.cls).get("sequences", True)
        assert main(["generate", "--backend", name, "--prompt", "hi", "--max-new-tokens", "1"]) == 2
        line = one_line_error(capsys, "stopped at the model opener" if decodes else "decodes sequences")
        assert (name in seen) == bool(decodes), (name, line)
        decoding += [name] if decodes else []
    # the backends that decode, by name: the official model and llama.cpp among them; the top-k-only server not
    assert {"reference", "engine", "transformers", "llama.cpp"} <= set(decoding) and "openai" not in decoding
