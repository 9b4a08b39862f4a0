"""The generation path is judged, and unsupported operations are skipped (docs/parity.md, "The generation
path" and the self-consistency skips).

* the kl row judges the generation path -- ``prefill_last`` against the truth's last prompt row (the prefill
  thresholds) and ``decode_greedy``'s tokens against the truth's argmax along their own continuation (a
  disagreement inside the kl row's near-tie band is no failure): a backend whose ``prefill_last`` or
  ``decode_greedy`` is wrong (PrefillLastWrong / DecodeGreedyWrong below) fails ``qwen4exp parity``;
* a self-consistency case needing an operation the backend declares unsupported (verify, rollback) is
  skipped with its reason, never called (an ERROR row would be a false FAIL).

The test backends wrap the reference by composition, as an outside plug-in backend would.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from parity.cli import main
from parity.harness.kl import KLThresholds, generation_paths, top1_flips
from parity_fakes import _Wrap, reference_capabilities
from reference.paths import bundled_model

MODEL = bundled_model("tiny")


class Wrap(_Wrap):
    """The reference by composition (tests/parity_fakes.py ``_Wrap``, rows unchanged), with only ``prefill`` /
    ``decode`` / ``forward_tokens`` of the protocol (no ``prefill_last`` / ``decode_greedy`` of its own: the base
    class's defaults); declares what the reference does but determinism, batch invariance and perturb, passes
    its last logits and dense logits through."""

    name = "wrap"
    capabilities = reference_capabilities("deterministic", "batch_invariant", "perturb")
    passthrough = ("last_logits", "dense_logits")


class PrefillLastWrong(Wrap):
    """prefill_last (the generation path: only the last row) returns the row reversed (the tester's)."""

    def prefill_last(self, h, ids):
        return np.array(self.ref.prefill_last(h, ids), copy=True)[::-1].copy()


class DecodeGreedyWrong(Wrap):
    """decode_greedy returns the argmin instead of the argmax (the tester's)."""

    def decode_greedy(self, hs, ids):
        return np.argmin(self.ref.decode(hs, ids), axis=-1).astype(np.int64)


class DecodeGreedyRight(Wrap):
    """A correct generation path of its own: prefill_last and a device-style decode_greedy (argmax)."""

    def prefill_last(self, h, ids):
        return self.ref.prefill_last(h, ids)

    def decode_greedy(self, hs, ids):
        return np.argmax(self.ref.decode(hs, ids), axis=-1).astype(np.int64)


class DecodeGreedyBatchSwap(DecodeGreedyRight):
    """decode_greedy returns the tokens of a batch of two or more in reversed order (a batch-row bug only the
    batched generation path shows: decode() itself is right)."""

    def decode_greedy(self, hs, ids):
        out = super().decode_greedy(hs, ids)
        return out[::-1].copy() if len(hs) >= 2 else out


def _kl_row(capsys, cls):
    rc = main(["parity", str(MODEL), "--backend", f"{__name__}:{cls.__name__}", "--scenario", "kl", "--level", "ci",
               "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    return rc, doc, doc["scenarios"][0]


@pytest.mark.parametrize("cls,op", [(PrefillLastWrong, "prefill_last"), (DecodeGreedyWrong, "decode_greedy"),
                                    (DecodeGreedyBatchSwap, "decode_greedy")])
def test_wrong_generation_path_fails_located_at_the_operation(capsys, cls, op):
    rc, doc, row = _kl_row(capsys, cls)
    assert rc == 1 and row["status"] == "fail", row
    assert f": {op} (the generation path)" in row["first_divergence"], row["first_divergence"]
    assert row["failures"][0]["root_cause"]["operation"] == f"kl {op}"
    faults = row["failures"][0]["generation"]["faults"]
    assert faults and all(f["op"] == op for f in faults)
    if op == "prefill_last":   # at the last prompt position, which the prefill() rows judged equal
        assert all(f["position"] == len_ - 1 for f, len_ in
                   zip(faults, [p for p in row["failures"][0]["per_prompt_positions"]]))
        # the row's judged error column covers the generation path's rows too (a FAIL never shows a passing
        # figure beside its limit)
        assert row["worst_logit_err_rel"] > row["thresholds"]["tol_rel"], (row["worst_logit_err_rel"],
                                                                           row["thresholds"])


@pytest.mark.parametrize("cls", [Wrap, DecodeGreedyRight])
def test_correct_generation_path_passes(capsys, cls):
    """Positive control: the protocol defaults (Wrap: prefill_last = prefill()[-1], decode_greedy = argmax of
    decode()) and a backend's own correct ones pass, every prompt's last row and greedy token judged."""
    rc, doc, row = _kl_row(capsys, cls)
    assert rc == 0 and row["status"] == "pass", row
    rep = main(["kl", str(MODEL), "--b", f"{__name__}:{cls.__name__}", "--json", "--no-progress"])
    kl = json.loads(capsys.readouterr().out)
    assert rep == 0 and kl["generation"]["ok"]
    n = len(kl["greedy"])
    assert kl["generation"]["prefill_last_rows"] == n
    # 8 greedy tokens: 7 decode_greedy steps per prompt, here equal to decode()'s own argmax continuation
    assert kl["generation"]["decode_greedy_as_decode"] + kl["generation"]["decode_greedy_tokens"] == 7 * n


# ---------------------------------------------------------------- the near-tie band, on synthetic logits
class _Fixed:
    """A 'backend' whose every position has the same logits row ``row`` (one_shot / prefill / decode)."""

    name, precision = "fixed", "float32"
    capabilities = {"batched_decode": True}

    def __init__(self, row, pick=None):
        self.row, self.pick = np.asarray(row, np.float32), pick
        self.config = None

    def logits(self, ids):
        return np.tile(self.row, (len(ids), 1))

    def new_sequence(self):
        return object()

    def free(self, h):
        pass

    def prefill(self, h, ids, chunk_size=None):
        return self.logits(ids)

    def decode_greedy(self, hs, ids):
        return np.full(len(hs), self.pick if self.pick is not None else int(np.argmax(self.row)), np.int64)


def _th(tol_rel):
    return KLThresholds(tol_rel=tol_rel, floor_rel=tol_rel / 8, multiple=8.0)


@pytest.mark.parametrize("gap_in_tols,ok", [(1.5, True), (2.5, False)])
def test_decode_greedy_disagreement_judged_by_the_near_tie_band(gap_in_tols, ok):
    """A decode_greedy token other than the truth's argmax fails only outside the band 2 x tol x scale: the
    truth's top-2 gap at 1.5 tol (inside, a tie flip) passes; at 2.5 tol (outside) it fails."""
    V = 16
    base = np.linspace(-1.0, 0.0, V)
    th = _th(1e-3)
    scale = float(np.std(base))
    row = base.copy()
    row[3] = row[-1] - gap_in_tols * th.tol_rel * scale   # token 3 is the runner-up, gap_in_tols tol below
    truth = _Fixed(row)
    b = _Fixed(row, pick=3)
    gen = generation_paths(truth, b, [[1, 2, 3]], [truth.row], th, greedy_tokens=3)
    assert gen["ok"] is ok, gen
    if not ok:
        f = gen["faults"][0]
        assert f["op"] == "decode_greedy" and f["position"] == 3 and "near-tie" in f["detail"]
    # the same rule the kl row applies to logits rows (one implementation)
    gap = row[-1] - row[3]
    assert bool(top1_flips(np.array([False]), np.array([gap]), np.array([np.std(row)]), th)[0]) is (not ok)


def test_generation_paths_wrong_shape_is_a_fault_not_an_exception():
    V = 8
    row = np.arange(V, dtype=np.float32)
    truth = _Fixed(row)

    class Short(_Fixed):
        def prefill(self, h, ids, chunk_size=None):
            return self.logits(ids)[:, :-1]

    gen = generation_paths(truth, Short(row), [[1, 2]], [row], _th(1e-3), greedy_tokens=3)
    assert not gen["ok"] and gen["faults"][0]["op"] == "prefill_last" and "shape" in gen["faults"][0]["detail"]


@pytest.mark.parametrize("declared,largest", [(True, 5), ({"status": "limited", "max_tokens": 2}, 2), (False, 1)])
def test_decode_greedy_batches_as_declared(declared, largest):
    """The prompts' greedy steps are batched like generation's, never beyond the declared batched_decode."""
    row = np.arange(8, dtype=np.float32)
    seen = []

    class Counting(_Fixed):
        capabilities = {"batched_decode": declared}

        def decode_greedy(self, hs, ids):
            seen.append(len(hs))
            return super().decode_greedy(hs, ids)

    gen = generation_paths(_Fixed(row), Counting(row), [[1, 2]] * 5, [row] * 5, _th(1e-3), greedy_tokens=3)
    assert gen["ok"] and max(seen) == largest and sum(seen) == 2 * 5


# ---------------------------------------------------------------- 5: self-consistency skips unsupported operations
class NoVerify(Wrap):
    """A correct engine without speculative verify / rollback: declares them unsupported and raises in them
    (the tester's mybe:NoVerify)."""

    @classmethod
    def open(cls, model_path, **opts):
        self = super().open(model_path, **opts)
        self.capabilities = {**self.capabilities, "rollback": False, "verify": False}
        return self

    def forward_tokens(self, h, ids):
        raise NotImplementedError("no verify")

    def rollback(self, h, n):
        raise NotImplementedError("no rollback")


class NoVerifyUndeclared(NoVerify):
    """Negative control: the same backend declaring verify / rollback supported -- the cases run and ERROR."""

    @classmethod
    def open(cls, model_path, **opts):
        self = super().open(model_path, **opts)
        self.capabilities = {**self.capabilities, "rollback": True, "verify": True}
        return self


class NoVerifyBatchSwap(NoVerify):
    """Negative control: verify unsupported AND a batched decode returning its rows reversed -- the cases
    that still run must fail."""

    def decode(self, hs, ids):
        out = np.asarray(super().decode(hs, ids))
        return out[::-1].copy() if len(hs) >= 2 else out


def _self_consistency(capsys, cls):
    rc = main(["parity", str(MODEL), "--backend", f"{__name__}:{cls.__name__}", "--scenario", "self-consistency",
               "--level", "ci", "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    return rc, doc["scenarios"][0]


def test_self_consistency_skips_verify_and_rollback_declared_unsupported(capsys):
    rc, row = _self_consistency(capsys, NoVerify)
    assert rc == 0 and row["status"] == "pass", row
    skipped = {s["case"].split("/")[1]: s["reason"] for s in row["skips"]}
    assert "verify unsupported" in skipped["verify_rows_vs_decode_rows"]
    spec = next(v for k, v in skipped.items() if k.startswith("speculative_vs_plain_greedy"))
    assert "verify unsupported" in spec and "rollback unsupported" in spec
    assert row["cases"] >= 2   # batch invariance (decode, ragged prefill) still judged


@pytest.mark.parametrize("cls,status", [(NoVerifyUndeclared, "error"), (NoVerifyBatchSwap, "fail")])
def test_self_consistency_skip_hides_nothing(capsys, cls, status):
    rc, row = _self_consistency(capsys, cls)
    assert rc == 1 and row["status"] == status, row


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_engine_cuda_generation_path_passes(capsys, precision):
    """The CUDA engine's own generation path (``Engine.prefill(last_only=True)``, ``decode_greedy`` with its
    device argmax and CUDA graphs) judged by the kl row: PASS, every prompt's last row and greedy token judged."""
    pytest.importorskip("cupy", reason="cupy not installed")
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU")
    rc = main(["kl", str(MODEL), "--b", f"engine:device=cuda,precision={precision}", "--json", "--no-progress"])
    kl = json.loads(capsys.readouterr().out)
    assert kl["generation"]["ok"], kl["generation"]["faults"]
    # float32: PASS; bf16: PASS or INCONCLUSIVE (a store floor may be too coarse on tiny), never FAIL
    assert rc == 0 if precision == "float32" else rc in (0, 3), kl["reason"]
    n = len(kl["greedy"])
    assert kl["generation"]["prefill_last_rows"] == n
    assert kl["generation"]["decode_greedy_as_decode"] + kl["generation"]["decode_greedy_tokens"] == 7 * n
