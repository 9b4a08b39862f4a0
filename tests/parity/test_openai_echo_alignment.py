"""The openai backend refuses a server echo whose token rows are dropped or moved (llama-cpp-python 0.3.36 skips
every echoed token equal to its BOS id, and a GGUF without one gets the default id 11): judging such rows would put
every later divergence at the wrong position, a wrong location. A correctly aligned echo is still accepted."""
from __future__ import annotations

import pytest

from fixture_helpers import FIXTURES
from parity.backends.base import BackendError
from parity.backends.openai import OpenAIBackend
from reference.config import load_config

TINY = FIXTURES / "tiny"


def _backend(answer):
    be = OpenAIBackend(TINY, load_config(TINY), "http://127.0.0.1:1", "m", 5, 1, 10)
    be.convention = "after-token"  # measured by open()'s probe in real use
    be._request = lambda method, path, body=None: answer(path, body)
    return be


def _ids_and_strings(be, n=8):
    ids = [i for i in sorted(set(be._str2id.values())) if be.sendable([i])][:n]
    assert be.sendable(ids) and len(ids) == n
    return ids, [be._tok.decode([i], skip_special_tokens=False) for i in ids]


def _doc(strings, rows):
    return {"choices": [{"logprobs": {"tokens": strings, "top_logprobs": rows}}]}


def test_aligned_echo_is_judged_row_by_row():
    be = _backend(lambda path, body: None)
    ids, strs = _ids_and_strings(be)
    gen = strs[0]
    rows = [{s: -0.1} for s in strs[1:]] + [{gen: -0.1}, {gen: -0.1}]
    be._request = lambda method, path, body=None: _doc(strs + [gen], rows)
    after, greedy, used = be.prompt_topk(ids, n_new=1)
    assert used == ids and greedy == [ids[0]] and len(after) == len(ids)
    assert [max(r, key=r.get) for r in after[:-1]] == ids[1:]  # row p is the distribution after position p


def test_echo_with_a_dropped_token_is_refused_with_its_position():
    be = _backend(lambda path, body: None)
    ids, strs = _ids_and_strings(be)
    drop = 3  # the server skipped prompt token 3 (its BOS id) in the echo: strings and rows shift by one
    gen = [strs[0], strs[1]]
    echo = strs[:drop] + strs[drop + 1:] + gen
    rows = [{s: -0.1} for s in echo[1:]] + [{gen[-1]: -0.1}]

    def answer(path, body):
        if path == "/extras/tokenize":
            return {"tokens": ids}  # the server tokenizes the text as the prompt: not a retokenization
        return _doc(echo, rows)
    be._request = lambda method, path, body=None: answer(path, body)
    with pytest.raises(BackendError, match=rf"prompt token {drop} .*dropped or moved echoed tokens"):
        be.prompt_topk(ids, n_new=2)


def test_kl_topk_row_fails_a_misaligned_echo_at_its_position():
    """Through run_topk: the prompt whose echo drops a token is a failed case at that position (a server defect),
    recorded in echo_misaligned; nothing is judged from its shifted rows."""
    from parity.backends import truth_model
    from parity.harness.topk import run_topk
    be = _backend(lambda path, body: None)
    ids, strs = _ids_and_strings(be)
    drop = 5
    echo = strs[:drop] + strs[drop + 1:] + [strs[0], strs[1]]
    rows = [{s: -0.1} for s in echo[1:]] + [{strs[1]: -0.1}]
    be._request = lambda method, path, body=None: ({"tokens": ids} if path == "/extras/tokenize" else _doc(echo, rows))
    res = run_topk(be, truth_model(TINY), [ids], n_new=2, prefix_reuse=False)
    assert not res["passed"] and res["failed_prompts"] == [0] and res["positions"] == 0
    assert res["first"]["position"] == drop and "dropped or moved" in res["first"]["echo"]
    assert [(m["prompt"], m["position"]) for m in res["echo_misaligned"]] == [(0, drop)]
