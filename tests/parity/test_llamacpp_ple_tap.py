"""The ``ple_embd`` tap of a GGUF made with the ple-pad re-parameterisation is un-padded back to the checkpoint's
layout, also when that GGUF is given with ``gguf=`` (no re-param list travels with the file): llama.cpp itself is
not needed, the tap sink is fed the node as llama.cpp's eval callback would."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from parity.backends.llamacpp import _TapSink
from reference.config import load_config
from reference.paths import bundled_model

CFG = load_config(bundled_model("tiny"))


def _emit(node, reparams):
    out = []
    be = SimpleNamespace(config=CFG, conversion={"reparams": reparams}, cells=None)
    rec = SimpleNamespace(wants=lambda name: True, emit=lambda name, v, positions: out.append((name, v, positions)))
    sink = _TapSink(be, rec)
    T = node.shape[0]
    sink.begin([(0, 7, p) for p in range(T)])
    sink.nodes = {"ple_embd": [node]}
    sink.end()
    return out


def _padded(T=3, seed=0):
    nh, r = CFG.ngram_heads, CFG.ple_embed_dim // CFG.ngram_heads
    assert CFG.ple_embed_dim < CFG.hidden_size and CFG.hidden_size % nh == 0   # tiny needs the pad
    ours = np.random.default_rng(seed).standard_normal((T, nh, r)).astype(np.float32)
    pad = np.zeros((T, nh, CFG.hidden_size // nh), np.float32)
    pad[:, :, :r] = ours
    return pad.reshape(T, -1), ours.reshape(T, -1)


@pytest.mark.parametrize("reparams", [["ple-pad"], []])
def test_a_ple_padded_ggufs_tap_is_unpadded_with_or_without_the_reparam_list(reparams):
    node, ours = _padded()
    out = _emit(node, reparams)
    name = f"layers.{sorted(CFG.ple_layers)[0]}.ple.ple_embedding.out"
    assert [o[0] for o in out] == [name], out
    np.testing.assert_array_equal(out[0][1], ours)
    np.testing.assert_array_equal(out[0][2], np.arange(node.shape[0]))


def test_a_wide_tap_with_nonzero_padding_columns_is_not_taken_as_padded():
    node, _ = _padded()
    node = node.copy()
    node[1, -1] = 1.0     # not ple-pad's layout: no guess
    assert _emit(node, []) == []
