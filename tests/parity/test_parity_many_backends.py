"""``qwen4exp parity --backend A --backend B``: several backends judged in one process on one set of truth forwards
(parity.harness.run.run_parity_many). The backend-independent work -- the floor's float64 and float32-order
forwards, the KL truth's forward per prompt + continuation, the negative control perturbing the reference, the
suites' truth -- runs once (counted on the reference's one entry point, ``ReferenceModel._run``), each backend keeps
its own verdict, and a faulty backend beside a correct one fails, located, while the correct one passes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fixture_helpers import fixture_dir

FIX = fixture_dir("tiny")
F32 = "engine:device=cpu,precision=float32"
BF16 = "engine:device=cpu,precision=bf16"
FAULT = "parity.suites.faults:SharedExpertDownScaledOneLayer"   # layer 1's shared-expert down_proj x1.02


@pytest.fixture
def prompts(tmp_path):
    from parity.harness.sizes import token_stream
    from reference.config import load_config
    cfg = load_config(FIX)
    p = tmp_path / "prompts.json"
    p.write_text(json.dumps([token_stream(cfg, 7, seed=4100), token_stream(cfg, 13, seed=4101)]))
    return str(p)


@pytest.fixture
def passes(monkeypatch):
    """Every pass of the reference over tokens from an empty state (forwards, prefills): ``(dtype, T)``."""
    from reference.model import ReferenceModel
    seen = []
    real = ReferenceModel._run

    def counted(self, state, ids, logits="all", residual_out=None):
        if state.position == 0:
            seen.append((np.dtype(self.dtype).name, len(ids)))
        return real(self, state, ids, logits, residual_out)
    monkeypatch.setattr(ReferenceModel, "_run", counted)
    monkeypatch.delenv("QWEN4EXP_FLOOR_CACHE", raising=False)
    return seen


def _rows(rep):
    return [{k: v for k, v in r.to_json().items() if k != "seconds"} for r in rep.rows]


def _prime_tie_prompts():
    """The budget suite's tie prompts, searched once per process and model (its own module cache): found before
    the counting starts, so every run below counts alike."""
    from types import SimpleNamespace

    from parity.backends import truth_model
    from parity.harness.scenarios import budget
    from parity.harness.sizes import sizes
    m = truth_model(FIX)
    run = SimpleNamespace(sizes=sizes(m.config), config=m.config, truth=SimpleNamespace(model=m))
    for kind in ("exact", "bf16"):
        budget.tie_prompt(run, kind)


def test_two_backends_share_every_backend_independent_forward(prompts, passes):
    from parity.harness.run import run_parity, run_parity_many
    _prime_tie_prompts()
    passes.clear()
    kw = dict(level="ci", prompts=prompts, progress=False, page_sizes=[16])
    one = run_parity(FIX, F32, ["kl", "budget"], **kw)
    alone = list(passes)
    passes.clear()
    both = run_parity_many(FIX, [F32, BF16], ["kl", "budget"], **kw)
    shared = list(passes)
    passes.clear()
    apart = run_parity_many(FIX, [F32, BF16], ["kl", "budget"], share=False, **kw)
    unshared = list(passes)
    assert one.exit_code == 0 and [r.exit_code for r in both] == [0, 0] == [r.exit_code for r in apart]
    # both engines continue every prompt with the same tokens: nothing of the truth side depends on which one
    kl = [next(r for r in rep.rows if r.scenario == "kl") for rep in both]
    assert kl[0].failures == kl[1].failures == []
    # one backend's forwards, no more: the second backend repeats none of them
    assert sorted(shared) == sorted(alone), (alone, shared)
    # the count discriminates: with sharing switched off, every forward runs once per backend
    assert sorted(unshared) == sorted(alone + alone), (alone, unshared)
    # the first backend's report is what it gets alone (rows, thresholds, floor but its source)
    assert _rows(both[0]) == _rows(one)
    assert both[0].meta["thresholds"] == one.meta["thresholds"]
    assert _rows(both[1]) == _rows(apart[1]) and both[1].backend == BF16 and both[1].meta["precision"] == "bf16"


@pytest.mark.parametrize("order", ["fault second", "fault first"])
def test_a_faulty_backend_fails_located_and_the_other_passes(prompts, order, tmp_path):
    from parity.harness.run import run_parity_many
    specs = [F32, FAULT] if order == "fault second" else [FAULT, F32]
    reps = run_parity_many(FIX, specs, ["kl"], level="ci", prompts=prompts, progress=False,
                           out_dirs=[tmp_path / str(i) for i in range(2)])
    good, bad = (reps[0], reps[1]) if order == "fault second" else (reps[1], reps[0])
    assert good.exit_code == 0 and good.verdict == "pass", [r.to_json() for r in good.rows]
    assert bad.exit_code == 1 and bad.verdict == "fail"
    row = bad.rows[0]
    assert row.status == "fail" and "layers.1.mlp" in row.first_divergence, row.first_divergence
    # the negative control of the faulty backend (a perturbable reference: itself perturbed) is its own
    good_nc = good.rows[0]
    assert good_nc.status == "pass" and not good_nc.failures
    assert (tmp_path / str(specs.index(FAULT)) / "taps").is_dir()
    assert not (tmp_path / str(specs.index(F32)) / "taps").exists()


def test_a_topk_server_among_several_backends_is_refused(prompts, monkeypatch):
    import parity.backends as B
    from parity.harness.run import run_parity_many
    from reference.errors import InputError
    from server_fakes import ReferenceLogprobs, ReferenceTopkServer
    real = B.opener

    def op(spec, model, **kw):
        if spec == "fake-server":
            return lambda: ReferenceTopkServer(ReferenceLogprobs(B.truth_model(model)))
        return real(spec, model, **kw)
    monkeypatch.setattr(B, "opener", op)
    with pytest.raises(InputError, match="top-k server.*judge it in a run of its own"):
        run_parity_many(FIX, [F32, "fake-server"], ["kl"], level="ci", prompts=prompts, progress=False)


def test_cli_two_backends_write_one_report_each_and_exit_with_the_worst(prompts, tmp_path, capsys):
    from parity.cli import main
    out = tmp_path / "out"
    rc = main(["parity", str(FIX), "--backend", F32, "--backend", FAULT, "--scenario", "kl", "--level", "ci",
               "--prompts", prompts, "--out", str(out), "--no-progress", "--format", "text"])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert text.count("\nscenario  ") + text.startswith("scenario  ") == 2 and text.count("legend:") == 1
    assert f"backend 1 of 2: {F32}" in text and f"backend 2 of 2: {FAULT}" in text
    assert "verdict over 2 backends: exit 1 (#1 PASS, #2 FAIL)" in text
    index = json.loads((out / "index.json").read_text())
    assert index["exit_code"] == 1 and [r["verdict"] for r in index["reports"]] == ["pass", "fail"]
    docs = [json.loads((out / r["report"]).read_text()) for r in index["reports"]]
    assert [d["backend"] for d in docs] == [F32, FAULT] and [d["exit_code"] for d in docs] == [0, 1]
    arcs = [a for s in docs[1]["scenarios"] for f in s["failures"] for a in f.get("archives", [])]
    assert arcs and all(a.startswith(str(out / "1" / "taps")) for a in arcs), arcs
    assert not (out / "report.json").exists() and not (out / "0" / "taps").exists()
    # json: the index's fields and every report
    rc = main(["parity", str(FIX), "--backend", F32, "--backend", F32, "--scenario", "kl", "--level", "ci",
               "--prompts", prompts, "--no-progress", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["exit_code"] == 0 and len(doc["backends"]) == 2 and len(doc["reports"]) == 2
    assert [r["report"] for r in doc["reports"]] == [None, None]  # no --out: no report file is named


def test_cli_a_backend_that_cannot_be_opened_among_several_is_exit_2_and_writes_nothing(prompts, tmp_path, capsys):
    from parity.cli import main
    out = tmp_path / "out"
    rc = main(["parity", str(FIX), "--backend", F32, "--backend", "engine:device=cpu,nope=1", "--scenario", "kl",
               "--prompts", prompts, "--out", str(out), "--no-progress"])
    assert rc == 2 and "nope" in capsys.readouterr().err
    assert not out.exists()
    rc = main(["parity", str(FIX), "--backend", F32, "--backend", BF16, "--known", str(tmp_path / "k.json"),
               "--prompts", prompts, "--no-progress"])
    assert rc == 2 and "a baseline is of one backend" in capsys.readouterr().err


def test_worst_exit_code_orders_environment_then_fail_then_inconclusive():
    from parity.harness.report import worst_exit_code
    assert worst_exit_code([0, 3, 1]) == 1 and worst_exit_code([3, 0]) == 3 and worst_exit_code([1, 4]) == 4
    assert worst_exit_code([0, 0]) == 0 and worst_exit_code([]) == 0


def test_cli_a_run_of_one_backend_after_one_of_two_leaves_no_old_index(prompts, tmp_path, capsys):
    # the --out folder holds one run's results: a single-backend run replaces an earlier two-backend run's index and
    # folders, and the reverse
    from parity.cli import main
    out = tmp_path / "out"
    base = ["parity", str(FIX), "--scenario", "kl", "--level", "ci", "--prompts", prompts, "--out", str(out),
            "--no-progress", "--overwrite"]
    assert main([*base, "--backend", F32, "--backend", F32]) == 0
    assert (out / "index.json").is_file() and (out / "1" / "report.json").is_file()
    assert main([*base, "--backend", F32]) == 0
    assert (out / "report.json").is_file() and not (out / "index.json").exists() and not (out / "1").exists()
    assert main([*base, "--backend", F32, "--backend", F32]) == 0
    assert (out / "index.json").is_file() and not (out / "report.json").exists()
    capsys.readouterr()
