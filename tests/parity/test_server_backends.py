"""Server backends: the top-k protocol (parity.backends.base.TopkServer), the OpenAI-API base
(parity.backends.openai), its llama_cpp.server subclass (``--backend openai``) and the vLLM-style sibling
(``--backend vllm``: token-id prompts, ``prompt_logprobs``).

The vLLM-style backend is judged against a fake vLLM server on loopback (stdlib http.server,
tests/server_fakes.serve_vllm) answering logprobs computed from the reference: no real vLLM or SGLang
server can be installed here. The real llama_cpp.server runs in tests/parity/test_llamacpp.py."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from parity.backends import open_backend, registry, truth_model
from parity.backends.base import EchoMisaligned, TopkServer
from reference.paths import bundled_model
from server_fakes import ReferenceLogprobs, serve_vllm

TINY = bundled_model("tiny")
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11], [3, 4, 5, 6], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def server_model():
    return truth_model(TINY, dtype=np.float64)


def test_server_backends_are_registered_siblings_of_the_openai_base():
    from parity.backends.llama_cpp_server import LlamaCppServerBackend
    from parity.backends.openai import OpenAIBackend
    from parity.backends.vllm import VllmBackend
    assert registry.backend_class("openai:url=http://x")[0] is LlamaCppServerBackend  # the spelling as before
    assert registry.backend_class("vllm:url=http://x")[0] is VllmBackend
    for cls in (LlamaCppServerBackend, VllmBackend):
        assert issubclass(cls, OpenAIBackend) and issubclass(cls, TopkServer)
        assert cls.capabilities["topk_only"]
    assert registry.BACKEND_OPTIONS["vllm"] == registry.BACKEND_OPTIONS["openai"]


def _private_reads(tree, var="be") -> list[str]:
    return sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == var and n.attr.startswith("_")})


def test_the_kl_topk_row_reads_only_the_public_protocol():
    src = (REPO / "parity" / "harness" / "topk.py").read_text(encoding="utf-8")
    assert _private_reads(ast.parse(src)) == []
    members = {n.attr for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == "be"}
    # every member it reads is one the protocol declares
    assert members <= set(dir(TopkServer)), members - set(dir(TopkServer))
    # negative control: the scan sees a private read
    assert _private_reads(ast.parse("ok = set(be._str2id.values())")) == ["_str2id"]


def test_llama_cpp_server_asks_its_tokenize_endpoint_and_the_base_does_not():
    from parity.backends.llama_cpp_server import LlamaCppServerBackend
    from parity.backends.openai import OpenAIBackend
    from reference.config import load_config
    calls = []
    for cls in (OpenAIBackend, LlamaCppServerBackend):
        be = cls(TINY, load_config(TINY), "http://127.0.0.1:1", "m", 5, 1, 10)
        be._request = lambda method, path, body=None: calls.append((method, path, body)) or {"tokens": [1, 2]}
        calls.clear()
        got = be.server_tokens("ab")
        if cls is OpenAIBackend:
            assert got is None and calls == []  # the OpenAI API has no tokenize endpoint
        else:
            assert got == [1, 2] and calls == [("POST", "/extras/tokenize", {"input": "ab"})]
            assert "BOS id" in be.echo_note


def _run(url, model=TINY, **kw):
    from parity.harness.topk import run_topk
    be = open_backend(f"vllm:url={url},topk=20", model)
    return be, run_topk(be, truth_model(model), PROMPTS, **kw)


def test_vllm_style_server_sends_token_ids_and_passes_a_correct_server(server_model):
    with serve_vllm(ReferenceLogprobs(server_model)) as (url, bodies):
        be, res = _run(url)
    assert res["status"] == "pass" and res["prompts"] == 3 and res["skipped_unsendable"] == 0, res
    assert res["worst_kl_over_bound"] < 0.5, res  # a correct float32 server passes with margin (measured ~2e-4)
    assert be.convention == "openai" and be.name == f"vllm:{url}" and be.retokenized == 0
    # the prompt travelled as ids, with vLLM's fields (no text, no echo)
    b = bodies[-1]
    assert b["prompt"] == PROMPTS[-1] and b["prompt_logprobs"] == 20 and b["logprobs"] == 20, b
    assert b["return_tokens_as_token_ids"] is True and "echo" not in b
    # every prompt position and every greedy one was judged: 9 + 3 + 4 rows from the prompts, +4 greedy each,
    # and the prefix-reuse pair (5 + 4 rows, 10 + 4 rows)
    assert res["positions"] == (9 + 4) + (3 + 4) + (4 + 4) + (4 + 4) + (9 + 4), res["positions"]


def test_vllm_style_server_with_a_fault_of_the_useful_size_fails(server_model):
    from parity.harness.kl import USEFUL_FAULT_REL
    with serve_vllm(ReferenceLogprobs(server_model, fault_rel=USEFUL_FAULT_REL)) as (url, _):
        _, res = _run(url)
    assert res["status"] == "fail" and sorted(res["failed_prompts"]) == [0, 1, 2], res
    assert res["first"]["prompt"] == 0 and res["first"]["position"] == 0, res["first"]


def test_vllm_style_server_that_drops_a_prompt_token_fails_at_that_position(server_model):
    with serve_vllm(ReferenceLogprobs(server_model), drop=2) as (url, _):
        be = open_backend(f"vllm:url={url}", TINY)
        with pytest.raises(EchoMisaligned, match="prompt_token_ids .* differing at position 2"):
            be.prompt_topk(PROMPTS[0], n_new=1)
        from parity.harness.topk import run_topk
        res = run_topk(be, truth_model(TINY), PROMPTS[:1], prefix_reuse=False)
    assert res["status"] == "fail" and res["positions"] == 0, res  # nothing judged from the shifted rows
    assert [(m["prompt"], m["position"]) for m in res["echo_misaligned"]] == [(0, 2)]


def test_vllm_style_row_without_its_prompt_token_is_misaligned():
    from parity.backends.vllm import VllmBackend
    from reference.config import load_config
    be = VllmBackend(TINY, load_config(TINY), "http://127.0.0.1:1", "m", 5, 1, 10)
    ids = [5, 6, 7]
    rows = [None, {"6": {"logprob": -0.1}}, {"9": {"logprob": -0.2}}]   # entry 2 holds 9, not prompt token 7
    be._request = lambda method, path, body=None: {"choices": [{"prompt_logprobs": rows, "logprobs": {
        "tokens": ["token_id:1"], "top_logprobs": [{"token_id:1": -0.1}]}}]}
    with pytest.raises(EchoMisaligned, match=r"prompt_logprobs\[2\] to hold prompt token 2 \(7\)") as ei:
        be.prompt_topk(ids, n_new=1)
    assert ei.value.position == 2
    # control: with the prompt token in its row the same answer reads row by row (after p = row of p + 1)
    rows[2] = {"7": {"logprob": -0.2}, "9": {"logprob": -3.0}}
    be.convention = None
    after, greedy, ran = be.prompt_topk(ids, n_new=1)
    assert ran == ids and greedy == [1] and after == [{6: -0.1}, {7: -0.2, 9: -3.0}, {1: -0.1}]
    assert be.convention == "openai"


def test_vllm_style_server_without_prompt_logprobs_is_a_clear_error():
    from parity.backends.base import BackendError
    from parity.backends.vllm import VllmBackend
    from reference.config import load_config
    be = VllmBackend(TINY, load_config(TINY), "http://127.0.0.1:1", "m", 5, 1, 10)
    be._request = lambda method, path, body=None: {"choices": [{"logprobs": {"tokens": [], "top_logprobs": []}}]}
    with pytest.raises(BackendError, match="expected choices\\[0\\].prompt_logprobs with one entry per prompt token"):
        be.prompt_topk([5, 6, 7], n_new=1)


def test_vllm_style_server_through_qwen4exp_parity(server_model, tmp_path):
    """The whole verb: one kl-topk row judged with the measured thresholds, the scenarios skipped."""
    from parity.harness.run import run_parity
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS))
    with serve_vllm(ReferenceLogprobs(server_model)) as (url, _):
        rep = run_parity(TINY, f"vllm:url={url}", ["kl"], prompts=f, level="ci", progress=False)
    assert rep.rows[0].scenario == "kl-topk" and rep.rows[0].status == "pass" and rep.exit_code == 0, rep.rows[0]
    assert rep.rows[0].cases == 3 and all(r.status == "skip" for r in rep.rows[1:])


def test_a_server_declares_no_sequence_operation(server_model, tmp_path):
    """A server has no sequences: every operation (verify, fork, batched_prefill included, which the sequence
    protocol's defaults would call supported) reads unsupported with that reason, in the report too."""
    from parity.backends.base import OPERATIONS, capability_table
    from parity.backends.llama_cpp_server import LlamaCppServerBackend
    from parity.backends.vllm import VllmBackend
    for cls in (LlamaCppServerBackend, VllmBackend):
        table = capability_table(cls)
        assert set(table) == set(OPERATIONS)
        for op, decl in table.items():
            assert decl["status"] == "unsupported" and "no sequences" in decl["limit"], (cls, op, decl)
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS[:1]))
    from parity.harness.run import run_parity
    with serve_vllm(ReferenceLogprobs(server_model)) as (url, _):
        rep = run_parity(TINY, f"vllm:url={url}", ["kl"], prompts=f, level="ci", progress=False)
    caps = rep.meta["capabilities"]
    assert caps["sequences"] is False
    for op in ("verify", "fork", "batched_prefill"):
        assert caps[op]["status"] == "unsupported" and "no sequences" in caps[op]["limit"], (op, caps[op])


def test_malformed_server_answers_are_one_clear_backend_error(monkeypatch):
    """A server answering JSON of the wrong shape or with values no log-probability has (NaN, +inf, a string)
    is a BackendError naming the field, what was expected and what was found (a case ERROR, exit 1), for both
    server backends -- not an AttributeError / IndexError / ValueError that `parity` reported as a backend that
    "cannot be opened" (exit 2), nor NaN logprobs judged as a KL of nan."""
    import io
    import urllib.request

    from parity.backends.base import BackendError
    from parity.backends.llama_cpp_server import LlamaCppServerBackend
    from parity.backends.vllm import VllmBackend
    from reference.config import load_config
    cfg = load_config(TINY)
    be = LlamaCppServerBackend(TINY, cfg, "http://127.0.0.1:1", "m", 5, 1, 10)
    ids = [i for i in range(cfg.vocab_size) if be.mappable(i)][:3]
    assert be.sendable(ids)
    toks = [be._tok.decode([i], skip_special_tokens=False) for i in ids] + [be._tok.decode([ids[0]])]
    good_tops = [None, {toks[1]: -0.1}, {toks[2]: -0.1}, {toks[0]: -0.1}]  # the greedy token: argmax of row 3

    def answer(tops=good_tops, lp=None, doc=None):
        d = doc if doc is not None else {"choices": [{"logprobs": lp if lp is not None else
                                                      {"tokens": toks, "top_logprobs": tops}}]}
        be._request = lambda method, path, body=None: d
        be.convention = None
        be._votes = {"openai": 0, "after-token": 0}
        return be.prompt_topk(ids, n_new=1)

    cases = [
        (dict(doc={"choices": "nope"}), "expected 'choices' as a list of one or more objects, found a string"),
        (dict(doc={"choices": []}), "expected 'choices' as a list"),
        (dict(lp={"tokens": "abc", "top_logprobs": []}), "expected choices[0].logprobs with 'tokens'"),
        (dict(tops=good_tops[:2]), "expected one top_logprobs entry per token (4), found 2"),
        (dict(tops=[None, [1, 2]] + good_tops[2:]), "top_logprobs[1]: expected an object {token: logprob} or null"),
        (dict(tops=[None, {toks[0]: "x"}] + good_tops[2:]), "top_logprobs[1]: expected log-probabilities"),
        (dict(tops=[None, {toks[0]: None}] + good_tops[2:]), "found None"),
        (dict(tops=[None, {toks[0]: float("nan")}] + good_tops[2:]), "found nan"),
        (dict(tops=[None, {toks[0]: float("inf")}] + good_tops[2:]), "found inf"),
    ]
    for kw, needle in cases:
        with pytest.raises(BackendError) as e:
            answer(**kw)
        assert needle in str(e.value), (kw, str(e.value))
    answer(tops=[None, {toks[0]: float("-inf")}] + good_tops[2:])  # negative control: -inf is a probability 0

    vb = VllmBackend(TINY, cfg, "http://127.0.0.1:1", "m", 5, 1, 10)
    plp = [None, {"6": {"logprob": -0.1}}, {"7": {"logprob": float("nan")}}]
    vb._request = lambda method, path, body=None: {"choices": [{"prompt_logprobs": plp, "logprobs": {
        "tokens": ["token_id:1"], "top_logprobs": [{"token_id:1": -0.1}]}}]}
    with pytest.raises(BackendError, match=r"prompt_logprobs\[2\]: expected log-probabilities .* found nan"):
        vb.prompt_topk([5, 6, 7], n_new=1)
    vb._request = lambda method, path, body=None: {"choices": [{"prompt_logprobs": plp[:2] + [{"7": -0.2}],
                                                                "logprobs": {"tokens": ["token_id:1"],
                                                                             "top_logprobs": []}}]}
    with pytest.raises(BackendError, match="one 'top_logprobs' entry per token"):
        vb.prompt_topk([5, 6, 7], n_new=1)

    class Resp(io.BytesIO):  # the transport: a JSON list where an object is due
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout=None: Resp(b"[1, 2]"))
    be2 = LlamaCppServerBackend(TINY, cfg, "http://127.0.0.1:1", "m", 5, 1, 10)
    with pytest.raises(BackendError, match=r"GET /v1/models: expected a JSON object, found a list"):
        be2._request("GET", "/v1/models")


def test_row_convention_error_says_why_it_cannot_be_told():
    """When mappable greedy tokens match neither reading of the rows (a server whose greedy tokens do not follow
    its own top_logprobs), the error says so -- not "no greedy token was mappable", which sends the user after
    the tokenizer. With no mappable greedy token, that is what it says (negative control)."""
    from parity.backends.base import BackendError
    from parity.backends.llama_cpp_server import LlamaCppServerBackend
    from reference.config import load_config
    cfg = load_config(TINY)
    be = LlamaCppServerBackend(TINY, cfg, "http://127.0.0.1:1", "m", 5, 1, 10)
    ids = [i for i in range(cfg.vocab_size) if be.mappable(i)][:4]
    s = [be._tok.decode([i], skip_special_tokens=False) for i in ids]
    # greedy token ids[3]; rows 2 and 3 (the two readings) have ids[1] / ids[2] on top: neither matches
    be._request = lambda method, path, body=None: {"choices": [{"logprobs": {
        "tokens": s[:3] + [s[3]], "top_logprobs": [None, {s[0]: -0.1}, {s[1]: -0.1}, {s[2]: -0.1}]}}]}
    with pytest.raises(BackendError, match="argmax of neither reading's row") as e:
        be.prompt_topk(ids[:3], n_new=1)
    assert "no greedy token was mappable" not in str(e.value)
    be._votes = {"openai": 0, "after-token": 0}
    be._request = lambda method, path, body=None: {"choices": [{"logprobs": {
        "tokens": s[:3] + ["\u0000not-a-token"], "top_logprobs": [None, {s[0]: -0.1}, {s[1]: -0.1}, {s[2]: -0.1}]}}]}
    with pytest.raises(BackendError, match="no greedy token was mappable"):
        be.prompt_topk(ids[:3], n_new=1)
