"""The kl-topk row (parity.harness.topk) cannot pass blind and does not fail a correct server: judged with
servers built on the reference (tests/server_fakes.py; no llama.cpp, no network).

- a correct server (the reference in float64 rounded to float32 logits, float32 log-softmax, as a server
  computes them) PASSes with margin;
- a logit fault of the useful size (parity.harness.kl.USEFUL_FAULT_REL of the logit scale) FAILs every prompt;
- a top-k that holds too little of the truth's probability to resolve that fault (a near-uniform model) is
  INCONCLUSIVE with the reason, also when the server carries the fault (the blind pass this guards against);
- a row that compared nothing (no prompt sendable, or no row given) is INCONCLUSIVE with counts 0/0.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from reference.paths import bundled_model
from server_fakes import ReferenceLogprobs, ReferenceTopkServer

TINY = bundled_model("tiny")
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11], [3, 4, 5, 6], [40, 41, 42, 43, 44], [7, 8, 9]]


@pytest.fixture(scope="module")
def server_model():
    from parity.backends import truth_model
    return truth_model(TINY, dtype=np.float64)


def _row(be, tmp_path):
    """The kl-topk row of ``qwen4exp parity`` (thresholds from the floor measured on tiny) and its report."""
    from parity.harness.report import ParityReport
    from parity.harness.run import topk_report
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS))
    rep = topk_report(ParityReport(backend="fake-server", model=str(TINY)), be, TINY, f)
    return rep.rows[0], rep


def test_correct_server_passes_with_margin(server_model, tmp_path):
    row, rep = _row(ReferenceTopkServer(ReferenceLogprobs(server_model)), tmp_path)
    assert row.scenario == "kl-topk" and (row.status, row.cases, row.failed_cases) == ("pass", 4, 0), row.detail
    assert rep.exit_code == 0
    # every correct float32 server must pass with margin: measured worst KL / limit ~2e-4 on tiny
    res = rep.rows[0]
    assert "worst KL / limit" in res.detail
    assert float(res.detail.split("worst KL / limit ")[1].split(";")[0]) < 0.5, res.detail


def test_fault_of_the_useful_size_fails_every_prompt(server_model, tmp_path):
    from parity.harness.kl import USEFUL_FAULT_REL
    row, rep = _row(ReferenceTopkServer(ReferenceLogprobs(server_model, fault_rel=USEFUL_FAULT_REL)), tmp_path)
    assert (row.status, row.cases, row.failed_cases) == ("fail", 4, 4), (row.status, row.first_divergence)
    assert rep.exit_code == 1
    res = row.failures[0]
    # located at the first position with a row (position 0: the distribution after the first token)
    assert res["first"]["prompt"] == 0 and res["first"]["position"] == 0 and res["first"]["kl"] > res["first"]["bound"]
    # the row could resolve that fault everywhere: a FAIL, not a lack of resolution
    assert res["resolution_rel"] < USEFUL_FAULT_REL, res


def _near_uniform():
    """tiny with lm_head scaled by 1e-4: every next-token row near uniform (its top-20 of 512 ids holds ~4%)."""
    from parity.backends import truth_model
    from parity.backends.base import load_weights
    w = load_weights(TINY, perturb=("lm_head.weight", lambda a: a * 1e-4))
    return truth_model(TINY, weights=w), truth_model(TINY, dtype=np.float64, weights=w)


@pytest.mark.parametrize("fault_multiple", [0.0, 1.0])
def test_too_little_top_k_mass_is_inconclusive_with_the_reason(fault_multiple):
    from parity.harness.kl import USEFUL_FAULT_REL
    from parity.harness.topk import run_topk
    truth, srv = _near_uniform()
    res = run_topk(ReferenceTopkServer(ReferenceLogprobs(srv, fault_rel=fault_multiple * USEFUL_FAULT_REL)),
                   truth, PROMPTS)
    # correct or carrying the useful fault: the lower bound sees too little to tell them apart, never PASS
    assert res["status"] == "inconclusive" and not res["passed"], res
    assert "hold too little of the truth's probability" in res["inconclusive"], res["inconclusive"]
    assert res["resolution_rel"] > USEFUL_FAULT_REL and res["min_mass_truth"] < 0.1, res
    assert res["unresolved_positions"] == res["positions"] > 0, res


def test_too_little_mass_does_not_hide_a_divergence_it_proves():
    """A fault the lower bound proves even from a few percent of the mass (here 30x the useful size) FAILs."""
    from parity.harness.kl import USEFUL_FAULT_REL
    from parity.harness.topk import run_topk
    truth, srv = _near_uniform()
    res = run_topk(ReferenceTopkServer(ReferenceLogprobs(srv, fault_rel=30 * USEFUL_FAULT_REL)), truth, PROMPTS)
    assert res["status"] == "fail" and res["resolution_rel"] > USEFUL_FAULT_REL, res


@pytest.mark.parametrize("how", ["no prompt sendable", "no row given"])
def test_nothing_compared_is_inconclusive_with_zero_cases(server_model, tmp_path, how):
    be = ReferenceTopkServer(ReferenceLogprobs(server_model), sendable=(lambda ids: False) if how.startswith("no p")
                             else None, no_rows=how == "no row given")
    row, rep = _row(be, tmp_path)
    assert (row.status, row.cases, row.failed_cases) == ("inconclusive", 0, 0), (row.status, row.cases)
    assert rep.exit_code == 3
    assert row.first_divergence.startswith("nothing compared"), row.first_divergence
    res = row.failures[0]
    assert res["positions"] == 0
    assert res["skipped_unsendable"] == (4 if how.startswith("no p") else 0) and be.requests == (
        0 if how.startswith("no p") else 6), (res, be.requests)  # 4 prompts + the prefix-reuse pair (half, whole)


class _DropsEchoOfFirstPrompt(ReferenceTopkServer):
    """A server whose echo of the first prompt loses the token at position 3 (llama_cpp.server drops an echoed
    token that equals its default BOS id); the other prompts are answered correctly."""

    def prompt_topk(self, ids, n_new=1):
        from parity.backends.base import EchoMisaligned
        if list(ids) == PROMPTS[0]:
            self.requests += 1
            raise EchoMisaligned("the echo holds no token at position 3", 3)
        return super().prompt_topk(ids, n_new)


def test_an_echo_defect_first_is_a_located_fail_not_an_error(server_model, tmp_path):
    """The first finding of the run is a dropped echo token (a record with no KL bound): the row is a FAIL of the
    server located at that prompt and position, with its own next step -- not the harness's own crash reported
    as 'backend raised'."""
    from parity.harness.report import next_step_lines
    row, rep = _row(_DropsEchoOfFirstPrompt(ReferenceLogprobs(server_model)), tmp_path)
    assert (row.status, row.cases, row.failed_cases) == ("fail", 4, 1), (row.status, row.first_divergence)
    assert "echo drops or moves the token at position 3" in row.first_divergence, row.first_divergence
    assert "backend raised" not in row.first_divergence and rep.exit_code == 1
    lines = next_step_lines(rep)
    assert lines and "kl-topk/prompt 0" in lines[0] and "no tensor taps" in lines[0], lines


def test_a_server_that_raises_is_an_error_row_with_its_traceback(server_model, tmp_path):
    class Raises(ReferenceTopkServer):
        def prompt_topk(self, ids, n_new=1):
            raise RuntimeError("connection reset")
    row, rep = _row(Raises(ReferenceLogprobs(server_model)), tmp_path)
    assert row.status == "error" and "RuntimeError: connection reset" in row.first_divergence
    assert row.traceback and "connection reset" in row.traceback


@pytest.fixture(scope="module")
def fp16_store_model():
    """A correct server that stores every activation (residual, block inputs/outputs, KV cache) in fp16, as
    llama.cpp's default F16 KV cache and fp16 activations do: the reference in float32 with those stores rounded."""
    from parity.backends import truth_model
    from parity.harness.floor import rounder
    m = truth_model(TINY, dtype=np.float32)
    m.store_round = rounder("fp16")
    return m


def test_server_precision_option_judges_a_reduced_precision_server_at_its_own_floor(fp16_store_model, tmp_path):
    """``precision=fp16``: a correct fp16-store server is not failed at its own floor, while judged as float32 it
    FAILs by that rounding alone (the control that the option matters). On tiny the fp16 floor (tol ~1.7e-2 of
    the logit scale, measured) is above the useful fault, so the row cannot vouch for a pass: INCONCLUSIVE with
    the reason, never PASS; a fault above the row's resolution still FAILs (the wider limit does not blind it)."""
    as_f32 = ReferenceTopkServer(ReferenceLogprobs(fp16_store_model))
    row32, _ = _row(as_f32, tmp_path)
    assert row32.status == "fail", row32.detail
    assert "precision=fp16" in row32.detail   # the FAIL names the option that rules the server's precision out
    at_fp16 = ReferenceTopkServer(ReferenceLogprobs(fp16_store_model))
    at_fp16.precision = "fp16"
    row16, rep16 = _row(at_fp16, tmp_path)
    assert row16.status in ("pass", "inconclusive") and row16.failed_cases == 0, row16.detail
    assert "judged at precision fp16" in row16.detail and rep16.meta["floor"]["precision"].startswith("fp16[")
    if row16.status == "inconclusive":
        assert "smallest fault" in row16.detail or "resolve" in row16.detail, row16.detail
    resolved = float(row16.detail.split("smallest fault resolved at every position ")[1].split(" ")[0])
    faulty = ReferenceTopkServer(ReferenceLogprobs(fp16_store_model, fault_rel=2 * resolved))
    faulty.precision = "fp16"
    rowf, _ = _row(faulty, tmp_path)
    assert rowf.status == "fail" and rowf.failed_cases >= 1, rowf.detail


@pytest.mark.parametrize("bad", ["float64", "int8"])
def test_server_precision_option_rejects_values_no_server_computes_in(bad):
    from parity.backends.registry import open_backend
    from reference.errors import InputError
    with pytest.raises(InputError, match=r"precision: expected one of float32, bf16, fp16, fp8.*found"):
        open_backend(f"openai:url=http://127.0.0.1:9,precision={bad}", TINY)


def test_server_run_honours_scenario_and_below_bound(server_model, tmp_path):
    """``--scenario kl`` gives the kl-topk row alone (no skip rows for scenarios not asked for), and
    ``--below-bound`` confines what the server is sent below the QSA bound, as for a sequence backend (each
    prompt plus its continuation at most the bound's visible tokens), saying so in the row; the control: without
    it the longest prompt is sent whole."""
    from parity.harness.report import ParityReport
    from parity.harness.run import confine_kl_prompts, topk_report
    from parity.harness.scenarios.common import sizes
    from parity.harness.topk import GREEDY_TOKENS
    cfg = server_model.config
    bound = sizes(cfg).bound
    long_prompt = [int(t) for t in np.arange(3, 3 + bound + 6) % cfg.vocab_size]
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS + [long_prompt]))

    def sent_lengths(below):
        be = ReferenceTopkServer(ReferenceLogprobs(server_model))
        sent, orig = [], be.prompt_topk
        be.prompt_topk = lambda ids, n_new=1: (sent.append((len(ids), n_new)), orig(ids, n_new))[1]
        rep = topk_report(ParityReport(backend="fake-server", model=str(TINY)), be, TINY, f, ["kl"],
                          below_bound=below)
        return rep, sent

    rep, sent = sent_lengths(True)
    assert [r.scenario for r in rep.rows] == ["kl-topk"], [r.scenario for r in rep.rows]
    assert "confined below the QSA bound" in rep.rows[0].detail
    _, g, _ = confine_kl_prompts(cfg, [long_prompt], GREEDY_TOKENS)
    assert all(n + k - 1 <= bound for n, k in sent), (sent, bound)
    assert rep.meta["smallest_fault_rel"] > 0   # the resolution line's figure, as for a sequence backend
    rep_all, sent_all = sent_lengths(False)
    assert max(n for n, _ in sent_all) == len(long_prompt)
    assert "confined" not in rep_all.rows[0].detail


def test_server_without_url_says_the_option_is_missing():
    from parity.backends.registry import open_backend
    from reference.errors import InputError
    with pytest.raises(InputError, match=r"expected url=http://HOST:PORT, found no url= option"):
        open_backend("openai", TINY)
    with pytest.raises(InputError, match=r"found 'ftp://x'"):   # the control: a url given is quoted as found
        open_backend("openai:url=ftp://x", TINY)


def test_server_url_with_or_without_v1_names_the_same_root():
    from parity.backends.openai import server_root
    for u in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert server_root(u) == "http://h:1", u
    assert server_root("http://h:1/v1x") == "http://h:1/v1x"   # control: only a whole final /v1 segment goes
