"""``qwen4exp generate --speculative mtp:k=N``: the same text and ids as plain greedy decoding on both
backends, the acceptance statistics in --json, one-line refusals for sampling, a checkpoint without a head
and a malformed option."""
from __future__ import annotations

import json

import pytest

from fixture_helpers import one_line_error
from parity import generate as G
from parity.cli import main
from reference.errors import InputError


def _run(capsys, *argv):
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("backend", ["engine", "reference"])
def test_speculative_streams_the_same_text_as_plain_greedy(capsys, backend):
    base = ["tiny-mtp", "--prompt", "The lighthouse keeper", "--greedy", "--max-new-tokens", "40", "--backend",
            backend] + (["--device", "cpu"] if backend == "engine" else [])
    rc, plain, _ = _run(capsys, *base)
    assert rc == 0
    rc2, spec, _ = _run(capsys, *base, "--speculative", "mtp:k=3")
    assert rc2 == 0 and spec == plain and plain.strip()
    rc3, js, _ = _run(capsys, *base, "--speculative", "mtp:k=2", "--json")
    d = json.loads(js)
    rc4, js_plain, _ = _run(capsys, *base, "--json")
    assert d["token_ids"] == json.loads(js_plain)["token_ids"] and len(d["token_ids"]) == 40
    st = d["speculative"][0]
    assert st["method"] == "mtp" and st["k"] == 2 and st["rounds"] >= 1
    assert 0 <= st["accepted"] <= st["drafted"] and st["drafted"] <= 2 * st["rounds"]


def test_parse_speculative():
    assert G.parse_speculative("mtp:k=4") == 4 and G.parse_speculative(" mtp : k = 1 ") == 1
    for bad in ("eagle", "mtp", "mtp:k=0", "mtp:k=99", "mtp:n=3"):
        with pytest.raises(InputError, match="--speculative"):
            G.parse_speculative(bad)


@pytest.mark.parametrize("argv,needles", [
    (["tiny", "--prompt", "x", "--greedy", "--speculative", "mtp:k=3"], ["--speculative", "MTP head"]),
    (["tiny-mtp", "--prompt", "x", "--greedy", "--speculative", "draft:k=3"], ["--speculative", "mtp:k=N"]),
])
def test_speculative_refusals_are_one_line(capsys, argv, needles):
    rc = main(["generate", *argv, "--backend", "engine:device=cpu"])
    assert rc == 2
    one_line_error(capsys, *needles)


def test_speculative_sampling_rule_samples_the_target_distribution():
    """speculative_accept with point-mass drafts emits its first token distributed as p_0 exactly, whatever
    the draft (likely or not). Monte Carlo with a fixed seed: 40000 draws, binomial sd <= 0.0025 per token;
    tolerance 0.012 (~5 sd). Negative control: always keeping the draft is caught (its frequency is 1, not p)."""
    import numpy as np
    rng = np.random.default_rng(1234)
    V = 6
    p_rows = rng.dirichlet(np.ones(V), size=3)
    N = 40000
    for d0 in (int(np.argmax(p_rows[0])), int(np.argmin(p_rows[0]))):
        draws = np.random.default_rng(7)
        first = np.zeros(V)
        acc = 0
        for _ in range(N):
            a, toks = G.speculative_accept(p_rows, [d0, 2], draws)
            first[toks[0]] += 1
            acc += a > 0
            assert len(toks) == a + 1
        assert np.abs(first / N - p_rows[0]).max() < 0.012, (d0, first / N, p_rows[0])
        assert abs(acc / N - p_rows[0][d0]) < 0.012  # acceptance probability of a point-mass draft: p(d)
    wrong = np.zeros(V)
    wrong[d0] = N  # the always-accept rule's first-token histogram
    assert np.abs(wrong / N - p_rows[0]).max() > 0.5


def test_speculative_sampling_runs_and_reports_the_rule(capsys):
    rc, js, _ = _run(capsys, "tiny-mtp", "--prompt", "The lighthouse", "--temperature", "0.8", "--top-k", "20",
                     "--max-new-tokens", "24", "--speculative", "mtp:k=3", "--json", "--device", "cpu")
    assert rc == 0
    d = json.loads(js)
    assert len(d["token_ids"]) == 24 and d["speculative"][0]["rule"].startswith("speculative sampling")
