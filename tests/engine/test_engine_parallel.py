"""Expert parallelism (engine/parallel.py): the routed experts split over ranks, checked on the CPU through
the stand-in communicator (NumPy "ranks"), on one GPU with logical ranks, and over NCCL where a host has
several GPUs.

Tolerance: the sharded engine sums a token's routed outputs per rank and then over ranks, where the
single-device engine sums them in slot order; in float32 that reassociation moves a logit by a few ulp
of the partial sums (measured below 1e-6 relative on the fixtures). 1e-5 relative is the engine's
self-consistency bound (tests/engine/test_engine_forward.py, same kernels, different summation order);
a dropped rank or a wrong expert offset moves logits by > 1e-2 (the negative controls).
"""
from __future__ import annotations

import numpy as np
import pytest

from fixture_helpers import FIXTURE_NAMES, fixture_dir as fixture_path

TOL_SELF = 1e-5


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _ck(name):
    from reference.checkpoint import Checkpoint
    return Checkpoint.open(str(fixture_path(name)))


def _ids(cfg, n, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=n).tolist()


def test_expert_ranges_cover_every_expert_once():
    from engine.parallel import expert_ranges
    from reference.errors import InputError
    for E in (1, 5, 8, 64, 513):
        for n in range(1, min(E, 9) + 1):
            r = expert_ranges(E, n)
            assert r[0][0] == 0 and r[-1][1] == E and len(r) == n
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [e - s for s, e in r]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(InputError, match="num_experts=4"):
        expert_ranges(4, 5)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_engine_equals_single_engine(name, ranks):
    from engine import Engine
    ck = _ck(name)
    cfg = ck.config
    ids = _ids(cfg, 23, 1)
    one = Engine(ck, precision="float32", device="cpu")
    ep = Engine(ck, precision="float32", device="cpu", devices=ranks)
    assert ep.model.ep is not None and len(ep.model.ep.ranges) == ranks
    assert not any(k.startswith("layers.0.mlp.experts.") for k in ep.model.w)  # experts left rank 0's dict
    s1, s2 = one.add_sequence(), ep.add_sequence()
    a, b = one.prefill(s1, ids[:17]), ep.prefill(s2, ids[:17])
    assert rel_err(b, a) < TOL_SELF
    # decode, verify + rollback, snapshot/restore run through the same sharded MoE
    a, b = one.decode([s1], [ids[17]]), ep.decode([s2], [ids[17]])
    assert rel_err(b, a) < TOL_SELF
    snap1, snap2 = one.snapshot(s1), ep.snapshot(s2)
    a, b = one.verify(s1, ids[18:22]), ep.verify(s2, ids[18:22])
    assert rel_err(b, a) < TOL_SELF
    one.rollback(s1, 2)
    ep.rollback(s2, 2)
    a, b = one.decode([s1], [ids[22]]), ep.decode([s2], [ids[22]])
    assert rel_err(b, a) < TOL_SELF
    one.restore(s1, snap1)
    ep.restore(s2, snap2)
    a, b = one.decode([s1], [ids[20]]), ep.decode([s2], [ids[20]])
    assert rel_err(b, a) < TOL_SELF
    calls = ep.comm.calls
    assert calls["reduce_sum"] > 0 and calls["broadcast"] >= 3 * calls["reduce_sum"]


def test_sharded_engine_matches_the_reference():
    from engine import Engine
    from reference.model import ReferenceModel
    ck = _ck("tiny")
    ids = _ids(ck.config, 19, 2)
    truth = ReferenceModel(ck).forward(ids)
    ep = Engine(ck, precision="float32", device="cpu", devices=2)
    got = ep.prefill(ep.add_sequence(), ids)
    assert rel_err(got, truth) < 1e-4  # the engine's float32 acceptance vs the official goldens


def _faulty_comm(kind):
    """A communicator fault: the reduce forgets the last rank's partial (an expert block lost)."""
    from engine.parallel import LocalComm

    class Faulty(LocalComm):
        def reduce_sum(self, parts):
            if kind == "drop":
                parts = list(parts[:-1]) + [parts[-1] * 0]
            return super().reduce_sum(parts)
    return Faulty


def test_negative_control_a_lost_rank_is_caught_and_located_at_the_moe():
    from engine import Engine
    from engine.parallel import ExpertParallel
    from taps.diff import diff_archives
    from taps.recorder import Recorder
    ck = _ck("tiny")
    ids = _ids(ck.config, 15, 3)
    good = Engine(ck, precision="float32", device="cpu", devices=2)
    bad = Engine(ck, precision="float32", device="cpu", devices=2)
    bad.comm = _faulty_comm("drop")(2)
    bad.model.ep.comm = bad.comm
    assert isinstance(bad.model.ep, ExpertParallel)
    with Recorder(None, meta={"backend": "good", "token_ids": ids}) as ra:
        la = good.prefill(good.add_sequence(), ids)
    with Recorder(None, meta={"backend": "bad", "token_ids": ids}) as rb:
        lb = bad.prefill(bad.add_sequence(), ids)
    assert rel_err(lb, la) > 1e-2
    rep = diff_archives(ra.archive(), rb.archive(), force=True)
    assert rep.first_divergence is not None
    assert rep.first_divergence == "layers.0.mlp.out"


def test_parity_suite_runs_against_the_sharded_engine():
    from parity.backends import opener, truth_model
    from parity.harness.scenarios import run_scenario
    from parity.harness.scenarios.common import TruthCache
    model = str(fixture_path("tiny"))
    truth = TruthCache(truth_model(model))
    results = run_scenario("snapshot_restore", opener("engine-cpu", model, precision="float32", devices=2), truth,
                           level="ci", locate_on_fail=False)
    assert results and all(r.status == "pass" for r in results), [(r.case, r.status, r.failure) for r in results]


def test_devices_argument_is_checked():
    from engine import Engine
    from reference.errors import InputError
    ck = _ck("tiny")
    for bad, what in [([], "at least one"), ("2", "number of ranks"), ([0, -1], "non-negative"), (True, "number")]:
        with pytest.raises(InputError, match=what):
            Engine(ck, precision="float32", device="cpu", devices=bad)
    with pytest.raises(InputError, match="num_experts"):
        Engine(ck, precision="float32", device="cpu", devices=ck.config.num_experts + 1)


@pytest.mark.gpu
def test_sharded_engine_on_one_gpu_with_logical_ranks():
    """Two logical ranks on device 0 (repeated ids -> the stand-in communicator on the GPU): the sharded
    MoE path's device code (sink expert, masked weights, partial sums) against the single-device engine."""
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU / cupy")
    from engine import Engine
    ck = _ck("tiny")
    ids = _ids(ck.config, 21, 4)
    one = Engine(ck, precision="float32", device="cuda")
    ep = Engine(ck, precision="float32", device="cuda", devices=[0, 0])
    s1, s2 = one.add_sequence(), ep.add_sequence()
    assert rel_err(ep.prefill(s2, ids[:16]), one.prefill(s1, ids[:16])) < TOL_SELF
    assert rel_err(ep.decode([s2], [ids[16]]), one.decode([s1], [ids[16]])) < TOL_SELF


@pytest.mark.gpu
def test_sharded_engine_over_nccl_equals_single_gpu():
    """Distinct GPUs: NCCL broadcast/reduce (skips on a host with one GPU)."""
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU / cupy")
    import cupy as cp
    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs, found {n}")
    from engine import Engine
    ck = _ck("tiny")
    ids = _ids(ck.config, 21, 5)
    one = Engine(ck, precision="float32", device="cuda")
    ep = Engine(ck, precision="float32", device="cuda", devices=list(range(min(n, 4))))
    assert type(ep.comm).__name__ == "NcclComm"
    s1, s2 = one.add_sequence(), ep.add_sequence()
    assert rel_err(ep.prefill(s2, ids[:16]), one.prefill(s1, ids[:16])) < TOL_SELF
    assert rel_err(ep.decode([s2], [ids[16]]), one.decode([s1], [ids[16]])) < TOL_SELF
