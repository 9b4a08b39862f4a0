"""Outside-engine report rows: the kl-topk row counts one case per prompt; report.json carries the backend
spec as given and the command that reproduces the run (outside-engine checker, tool defects 6 and 7).

The top-k server here is a fake built on the reference (no network): it answers each prompt with the
reference's own top-k logprobs, except on the prompts it is told to corrupt, where the top-1 is swapped."""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from parity.backends.base import TopkServer
from reference.paths import bundled_model

TINY = bundled_model("tiny")


class FakeTopkServer(TopkServer):
    """A server backend (parity.backends.base.TopkServer, the protocol parity.harness.topk.run_topk reads)."""

    topk, convention, max_requests = 5, "openai", 64

    def __init__(self, bad_prompts=()):
        from parity.backends import truth_model
        self.truth = truth_model(TINY)
        self.config = self.truth.config
        self.bad = {tuple(p) for p in bad_prompts}
        self.requests, self.retokenized = 0, 0

    def sendable(self, ids):
        return True

    def mappable(self, token_id):
        return 0 <= int(token_id) < self.config.vocab_size

    def prompt_topk(self, ids, n_new=1):
        self.requests += 1
        ids = list(ids)
        greedy = []
        for _ in range(n_new):
            greedy.append(int(np.argmax(self.truth.forward(ids + greedy)[-1])))
        lg = self.truth.forward(ids + greedy)[: len(ids) + n_new - 1].astype(np.float64)
        lp = lg - np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True)) - lg.max(1, keepdims=True)
        rows = []
        for p in range(lp.shape[0]):
            top = np.argsort(-lp[p])[: self.topk]
            r = {int(i): float(lp[p, i]) for i in top}
            if tuple(ids) in self.bad and p == 1:  # a wrong top-1 (and a KL far over any threshold)
                a, b = int(top[0]), int(top[1])
                r[a], r[b] = r[b] - 5.0, r[a]
            rows.append(r)
        return rows, greedy, ids


def _row(bad_idx, prompts, tmp_path):
    from parity.harness.report import ParityReport
    from parity.harness.run import topk_report
    be = FakeTopkServer([prompts[i] for i in bad_idx])
    f = tmp_path / f"prompts-{len(bad_idx)}.json"
    f.write_text(json.dumps(prompts))
    rep = topk_report(ParityReport(backend="openai:url=fake", model=str(TINY)), be, TINY, f)
    return rep.rows[0]


PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11], [3, 4, 5, 6], [40, 41, 42, 43, 44], [7, 8, 9]]


def test_kl_topk_row_counts_each_failing_prompt(tmp_path):
    """All four prompts failing -> 4 failed cases of 4 (not 1, i.e. '3/4 passed')."""
    row = _row([0, 1, 2, 3], PROMPTS, tmp_path)
    assert row.status == "fail" and (row.cases, row.failed_cases) == (4, 4), (row.cases, row.failed_cases)
    # the prefix-reuse pattern re-sends prompt 0: a prompt is still one case
    assert row.failures[0]["failed_prompts"] == [0, 1, 2, 3]


def test_kl_topk_row_counts_some_failing_and_none(tmp_path):
    row = _row([1, 3], PROMPTS, tmp_path)
    assert (row.status, row.cases, row.failed_cases) == ("fail", 4, 2)
    ok = _row([], PROMPTS, tmp_path)  # negative control: the fake server is exact -> every prompt passes
    assert (ok.status, ok.cases, ok.failed_cases) == ("pass", 4, 0)


def test_report_json_carries_the_spec_given_and_a_reproduce_command(tmp_path, capsys):
    """The verdict line and report.json name the backend with its options (re-running it reproduces the
    verdict); ``reproduce`` is the command line, shell-quoted, that re-runs it: run as printed, it succeeds
    with the same verdict although its --out now holds the first run's results."""
    from parity.cli import main
    out = tmp_path / "o u t"   # a space: the reproduce command must quote it
    argv = ["parity", "tiny", "--backend", "reference:dtype=float64", "--scenario", "kl", "--no-progress",
            "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "report.json").read_text())
    assert doc["backend"] == "reference:dtype=float64"
    assert "backend reference:dtype=float64" in capsys.readouterr().out
    assert shlex.split(doc["reproduce"]) == ["qwen4exp", *argv, "--overwrite"]  # its --out holds this run now
    capsys.readouterr()
    assert main(shlex.split(doc["reproduce"])[1:]) == 0  # the command runs as printed, with the same verdict
    assert json.loads((out / "report.json").read_text())["verdict"] == doc["verdict"]
    assert main(argv) == 2  # negative control: the argv as given, without --overwrite, is refused
    # negative control: a backend with no options is named as typed, without options made up
    from parity.harness.run import run_parity
    assert run_parity(TINY, "reference", ["budget"], level="ci", progress=False).backend == "reference"


@pytest.mark.parametrize("given,shown", [("engine-cpu", "engine:device=cpu"), ("reference", "reference")])
def test_backend_spelling_keeps_options(given, shown):
    from parity.harness.run import backend_label
    assert backend_label(given) == shown


def test_pre_tokenizer_label_follows_the_tokenizer(tmp_path):
    """reparam tokenizer-label picks the llama.cpp label whose rules are the checkpoint's pre-tokenizer:
    gpt-2 for a plain ByteLevel (the fixtures), qwen35 for the Qwen3.5 Split; none for another, and then the
    re-parameterisation is refused rather than given a label that tokenizes differently."""
    from parity.backends import gguf_convert as gc
    from parity.backends.base import BackendError
    assert gc.pre_tokenizer_label(TINY) == "gpt-2"
    qwen = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": gc.QWEN35_SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    for name, pt, want in (("qwen", qwen, "qwen35"), ("meta", {"type": "Metaspace", "replacement": "_"}, None),
                           ("noregex", {"type": "ByteLevel", "use_regex": False}, None)):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pt}))
        assert gc.pre_tokenizer_label(d) == want, name
    (tmp_path / "meta" / "config.json").write_text((TINY / "config.json").read_text())
    with pytest.raises(BackendError, match="tokenizer-label.*pre-tokenizer"):
        gc.parse_reparams("tokenizer-label", tmp_path / "meta")


def test_function_check_of_a_quantised_checkpoint_is_the_reference(tmp_path):
    """The reparameterisation check runs the reference, not transformers' loader, on a quantised checkpoint (the
    loader dequantises FP8 to bf16 and prints pages of warnings); it still catches a changed function."""
    import shutil

    from parity.backends import gguf_convert as gc
    fp8 = bundled_model("tiny-fp8")
    same = gc.check_same_function(fp8, fp8)
    assert same["ok"] and same["by"].startswith("reference (a quantised checkpoint"), same
    # negative control: a copy whose norms' eps is changed (config.json) computes another function
    dst = tmp_path / "fp8"
    shutil.copytree(fp8, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (dst / "config.json").write_text(json.dumps(cfg))
    assert not gc.check_same_function(fp8, dst)["ok"]


def _whole_call_case(cfg):
    from parity.harness.scenarios import cases_for
    return next(c for c in cases_for("speculative_rollback", cfg, "ci") if c.name == "reject_all_drafts_below_bound")


def test_reject_all_drafts_case_catches_a_whole_call_rollback_error():
    """The speculative-rollback case that rejects every draft (a rollback of a whole verify call, below the
    QSA bound) passes on the reference and FAILs, at the decode after that rollback, on the reference with
    llama.cpp's defect D injected (each GDN recurrent state left one token too early)."""
    from parity.backends import truth_model
    from parity.backends.reference import ReferenceBackend
    from parity.harness.scenarios.common import TruthCache
    from parity.harness.scenarios.runner import run_case

    class WholeCallRollbackOneTokenEarly(ReferenceBackend):
        def forward_tokens(self, h, ids):
            self.__dict__.setdefault("_k", {})[h] = len(ids)
            return super().forward_tokens(h, ids)

        def rollback(self, h, n):
            whole = bool(n) and n == self.__dict__.get("_k", {}).get(h)
            super().rollback(h, n)
            if whole:
                sess = self._sess(h)
                early = self.model.new_session()
                early.prefill(list(sess.tokens)[:-1])
                for i, g in sess.state.gdn.items():
                    g.recurrent = early.state.gdn[i].recurrent.copy()

    truth = TruthCache(truth_model(TINY))
    good = ReferenceBackend.open(TINY)
    case = _whole_call_case(good.config)
    assert run_case("speculative_rollback", case, good, truth).status == "pass"
    bad = run_case("speculative_rollback", case, WholeCallRollbackOneTokenEarly.open(TINY), truth)
    assert bad.status == "fail" and "after rolling back a whole verify call" in bad.failure, bad
