"""The Backend protocol adapters and the --backend resolver."""
from __future__ import annotations

import numpy as np
import pytest

from parity.backends import (BackendError, EngineBackend, ReferenceBackend, backend_class, open_backend)
from reference.errors import InputError, UserError

FIX = "fixtures/tiny"


def test_names_resolve():
    assert backend_class("reference")[0] is ReferenceBackend
    assert backend_class("reference-f64")[1]["dtype"] == np.float64
    assert backend_class("engine-cpu") == (EngineBackend, {"device": "cpu"})
    cls, _ = backend_class("parity.suites.faults:BudgetOffByOne")
    assert issubclass(cls, ReferenceBackend)


@pytest.mark.parametrize("spec,err,match", [
    ("nonsense", InputError, "expected one of"),
    ("no_such_module_xyz:Cls", BackendError, "cannot import"),
    ("parity.harness.kl:NoSuchClass", BackendError, "expected a backend class .NoSuchClass. in module"),
    ("parity.harness.kl:verdict", BackendError, "open"),
    (":Cls", InputError, "module:Class"),
])
def test_bad_backend_specs_are_one_clear_error(spec, err, match):
    with pytest.raises(err, match=match):
        backend_class(spec)


def test_engine_cuda_without_gpu_is_a_user_error(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_NO_GPU", "1")
    from engine.backend import cupy_or_none
    cupy_or_none.cache_clear()
    try:
        with pytest.raises(UserError, match="cuda"):
            open_backend("engine-cuda", FIX)
    finally:
        cupy_or_none.cache_clear()


def test_reference_backend_operations_match_the_truth():
    be = open_backend("reference", FIX)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    truth = be.logits(ids)
    a, b = be.new_sequence(), be.new_sequence()
    la = be.prefill(a, ids[:10], chunk_size=3)
    be.prefill(b, ids[:5])
    d = be.decode([a, b], [ids[10], ids[5]])
    v = be.forward_tokens(a, ids[11:13])
    assert be.position(a) == 13 and be.position(b) == 6
    # float32 incremental vs full forward: accumulation-order noise only (~1e-6 of the logit scale)
    tol = 1e-4 * np.abs(truth).max()
    assert np.allclose(la, truth[:10], atol=tol) and np.allclose(d[0], truth[10], atol=tol)
    assert np.allclose(v, truth[11:13], atol=tol)
    be.rollback(a, 2)
    assert be.position(a) == 11
    s = be.snapshot(a)
    c = be.new_sequence()
    be.restore(c, s)
    assert be.position(c) == 11
    assert set(be.state_arrays(c)) == set(be.state_arrays(a))


def test_reference_backend_bad_input():
    be = open_backend("reference", FIX)
    h = be.new_sequence()
    with pytest.raises(InputError, match="token ids in"):
        be.prefill(h, [1, 2, 10**6])
    with pytest.raises(InputError, match="one token per sequence"):
        be.decode([h], [1, 2])
    be.free(h)
    with pytest.raises(BackendError, match="live handle"):
        be.prefill(h, [1])
    with pytest.raises(InputError, match="options"):
        open_backend("reference", FIX, bogus=1)


def test_perturb_option_changes_logits_and_unknown_tensor_is_refused():
    from reference.errors import CheckpointError
    base = open_backend("reference", FIX)
    pert = open_backend("reference", FIX, perturb=("lm_head.weight", lambda w: w * 1.5))
    ids = [3, 4, 5]
    assert not np.allclose(base.logits(ids), pert.logits(ids))
    with pytest.raises(CheckpointError, match="perturb"):
        open_backend("reference", FIX, perturb=("no.such.tensor", lambda w: w))


def test_engine_cpu_backend_opens_and_agrees():
    pytest.importorskip("engine.engine", reason="engine not importable")
    be = open_backend("engine-cpu", FIX, page_size=5)
    ref = open_backend("reference", FIX)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    # engine float32 (CPU) vs the float32 reference: accumulation order only
    assert np.allclose(be.logits(ids), ref.logits(ids), atol=1e-4 * np.abs(ref.logits(ids)).max())
    assert be.precision == "float32" and be.name == "engine-cpu"


def test_engine_state_arrays_match_after_rollback_and_flag_a_stale_state():
    pytest.importorskip("engine.engine", reason="engine not importable")
    from parity.harness.scenarios.common import token_stream
    be = open_backend("engine-cpu", FIX, page_size=5)  # 5 does not divide the compress ratio 4
    if not be.capabilities.get("state_arrays"):
        pytest.fail("engine-cpu: expected state_arrays support (engine/state.py layout)")
    ids = token_stream(be.config, 20, seed=3, eos_every=7)
    a = be.new_sequence()
    be.prefill(a, ids[:15])
    be.forward_tokens(a, ids[15:19])
    be.rollback(a, 2)
    b, c = be.new_sequence(), be.new_sequence()
    be.prefill(b, ids[:17])
    be.prefill(c, ids[:18])  # one token more: a stale state
    sa, sb, sc = be.state_arrays(a), be.state_arrays(b), be.state_arrays(c)
    kinds = {k.split(".")[0] + "." + k.split(".")[2] for k in sa}
    assert {"gdn.conv", "gdn.recurrent", "ple.conv", "ple.context", "qsa.k", "qsa.index_keys",
            "qsa.block_keys"} <= kinds
    for k in sa:  # float32 verify+rollback vs prefill: accumulation order only (see Run.compare_state)
        assert sa[k].shape == sb[k].shape and np.allclose(sa[k], sb[k], atol=1e-4 * max(1.0, np.abs(sb[k]).max()))
    stale = [k for k in sa if sa[k].shape != sc[k].shape or not np.allclose(sa[k], sc[k], atol=1e-3)]
    assert any(k.startswith("gdn.") for k in stale) and any(k.startswith("qsa.") for k in stale)


class DuckBackend:
    """An outside engine implementing the protocol by duck typing only (no Backend base class, no
    capabilities, no logits helper): what a team plugs in with --backend module:Class."""

    def __init__(self, model):
        self.model, self.config, self.s, self.n = model, model.config, {}, 0

    @classmethod
    def open(cls, model_path, **opts):
        from parity.backends import truth_model
        return cls(truth_model(model_path))

    def new_sequence(self):
        self.n += 1
        self.s[self.n] = self.model.new_session()
        return self.n

    def free(self, h):
        self.s.pop(h, None)

    def prefill(self, h, ids, chunk_size=None):
        return self.s[h].prefill(ids, chunk_size=chunk_size)

    def decode(self, hs, ids):
        return np.stack([self.s[h].decode(t) for h, t in zip(hs, ids)])

    def forward_tokens(self, h, ids):
        return self.s[h].forward_tokens(ids)

    def rollback(self, h, n):
        self.s[h].rollback(n)

    def snapshot(self, h):
        return self.s[h].snapshot()

    def restore(self, h, snap):
        self.s[h].restore(snap)

    def position(self, h):
        return self.s[h].position


def test_duck_typed_outside_backend_runs_kl_and_a_scenario():
    from parity.backends import opener
    from parity.harness.kl import run_kl
    from parity.harness.scenarios import run_scenario
    from parity.harness.scenarios.common import TruthCache
    from parity.backends import truth_model
    be = open_backend("tests.parity.test_parity_backend:DuckBackend", FIX)
    assert be.precision == "float32"
    ref = open_backend("reference", FIX)
    rep = run_kl(ref, be, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], greedy_tokens=2, progress=False)
    assert rep.passed and rep.controls["determinism"]["ok"]
    res = run_scenario("speculative_rollback", opener("tests.parity.test_parity_backend:DuckBackend", FIX),
                       TruthCache(truth_model(FIX)), level="ci", only=["batch_mixed_accepts"])
    assert [r.status for r in res] == ["pass"], [(r.failure, r.divergence) for r in res]


def test_backend_missing_a_protocol_method_is_refused():
    with pytest.raises(BackendError, match="protocol"):
        open_backend("tests.parity.test_parity_backend:HalfBackend", FIX)


class HalfBackend:
    """Opens, but lacks most of the protocol (a half-finished plug-in)."""

    def __init__(self, config):
        self.config = config

    @classmethod
    def open(cls, model_path, **opts):
        from reference.config import load_config
        return cls(load_config(model_path))


def test_a_dead_handle_is_one_clear_error_naming_it():
    """Freed, never issued and unhashable handles: BackendError naming the backend and the handle; handles are
    never reused (a freed handle cannot alias a new sequence)."""
    be = open_backend("reference", FIX)
    h = be.new_sequence()
    be.prefill(h, [1, 2, 3])
    be.free(h)
    for bad in (h, 12345, [h]):
        with pytest.raises(BackendError, match=r"backend reference: sequence handle .*expected a live handle"):
            be.decode([bad], [4])
    assert be.new_sequence() != h
    be.free(h)  # freeing again is a no-op
