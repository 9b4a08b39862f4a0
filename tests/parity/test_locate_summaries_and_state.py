"""Locating: one-line summaries list the taps only one side recorded; compare_state names the first
stale array in dataflow order; the kl row's locating replays on the instance that ran every prompt."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.backends import open_backend, truth_model, ReferenceBackend
from parity.harness.kl import thresholds_for
from parity.harness.scenarios.common import CaseFailure, Run, TruthCache
from parity.harness.scenarios.locate import diff_archives, locate_one_shot

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "fixtures" / "tiny"


def _record(model, ids, include=None):
    from taps.recorder import Recorder
    with Recorder(None, include=include) as rec:
        model.forward(ids)
    return rec.archive()


def test_summary_lists_missing_and_extra_taps():
    m = truth_model(TINY)
    ids = list(range(1, 14))
    truth = _record(m, ids, include=["embed_tokens.out", "layers.0.*", "layers.1.ple.*"])
    backend = _record(m, ids, include=["embed_tokens.out", "layers.0.*", "logits"])  # no PLE taps, an extra one
    line = diff_archives(truth, backend, "float32")
    assert "all recorded taps agree" in line
    assert "missing in the backend: layers.1.ple.ple_embedding.ngram_ids" in line and "more)" in line
    assert "extra in the backend (not in the truth): logits" in line
    same = diff_archives(truth, truth, "float32")
    assert "missing" not in same and "extra" not in same  # negative control: nothing one-sided, nothing said


def test_compare_state_walks_dataflow_order_not_name_order():
    be = open_backend("reference", TINY)
    run = Run(be, TruthCache(truth_model(TINY)), thresholds_for("float32"))
    ids = list(range(1, 15))
    a, b = run.new("a"), run.new("b")
    run.prefill(a, ids)
    run.prefill(b, ids)
    st = be._sess(b.h).state
    st.gdn[3].conv[0, 0] += 1.0       # layer 3 ...
    st.qsa[2].k.data[0, 0, 0] += 1.0  # ... and, upstream of it, layer 2 ('qsa' sorts after 'gdn' by name)
    with pytest.raises(CaseFailure, match=r"state qsa\.2\.k "):
        run.compare_state(a, b, "two stale arrays")
    run.close()


class LeaksAcrossRequests(ReferenceBackend):
    """Every one-shot request after the first sees logits of every 7th token shifted by a leftover from the
    previous one."""

    def logits(self, ids):
        out = np.array(super().logits(ids), copy=True)
        n = getattr(self, "_served", 0)
        self._served = n + 1
        if n:  # on every 7th token: a leftover that changes the distribution (a uniform shift would not)
            out[:, ::7] += 0.5
        return out


def test_kl_locate_replays_on_the_used_instance():
    truth = truth_model(TINY)
    used = LeaksAcrossRequests.open(TINY)
    used.logits([1, 2, 3])  # the history: one earlier request
    line, _ = locate_one_shot(used, truth, [4, 5, 6, 7])
    assert "returned logits" in line, line
    fresh, _ = locate_one_shot(LeaksAcrossRequests.open(TINY), truth, [4, 5, 6, 7])
    assert "agree" in fresh and "returned logits" not in fresh  # a fresh instance hides the leak


def test_run_kl_command_hands_back_the_instance_it_ran():
    from parity.harness.run import run_kl_command
    rep = run_kl_command(TINY, "reference", "reference", [[1, 2, 3, 4, 5]], greedy_tokens=0, progress=False)
    assert isinstance(rep.backend, ReferenceBackend)
