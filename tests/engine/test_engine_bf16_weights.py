"""BF16 mode never re-quantises weights the checkpoint stores in another format.

tiny-fp8 stores block-scaled FP8 weights; dequantised, they are not BF16-exact. By default the engine keeps
them in their stored format (``quantized="stored"``, tests/engine/test_engine_quant.py); with
``quantized="dequantize"`` the BF16 engine keeps them float32, so its taps agree with the float32 reference
under the bf16 profile. Negative control: an engine that rounds them to BF16 (what the first version did) is
flagged by the same tap-diff.
"""
import numpy as np
import pytest

from engine import Engine
from engine.kernels.dense_common import bf16_bits_to_float32, to_bf16_bits
from reference.checkpoint import Checkpoint
from reference.model import ReferenceModel
from reference.paths import bundled_model
from taps.diff import diff_archives
from taps.recorder import Recorder


def _diff(monkeypatch=None, requantise=False, quantized="dequantize"):
    ck = Checkpoint.open(bundled_model("tiny-fp8"))
    g = np.load(bundled_model("tiny-fp8") / "golden.npz")
    prompts = sorted({k.split("/")[0] for k in g.files if k.endswith("/ids") and not k.startswith("decode/")})
    ids = g[f"{max(prompts, key=lambda q: len(g[f'{q}/ids']))}/ids"]
    if requantise:
        import engine.model as em

        def rounding_dev_mat(self, a):  # the fault: round every matrix to BF16
            return self.xp.asarray(to_bf16_bits(np.ascontiguousarray(a, dtype=np.float32)))
        monkeypatch.setattr(em.DeviceModel if hasattr(em, "DeviceModel") else _model_class(em), "_dev_mat",
                            rounding_dev_mat)
    eng = Engine(ck, precision="bf16", device="cpu", quantized=quantized)
    with Recorder() as ra:
        ReferenceModel(ck).forward(ids)
    s = eng.add_sequence()
    with Recorder() as rb:
        eng.prefill(s, ids, chunk_size=7)
    return eng, diff_archives(ra.archive(), rb.archive(), "bf16")


def _model_class(em):
    return next(v for v in vars(em).values() if isinstance(v, type) and "_dev_mat" in vars(v))


def test_bf16_mode_keeps_fp8_weights_exact():
    eng, rep = _diff()
    assert rep.agree, rep.first_divergence
    assert any(getattr(m, "kept_float32", 0) > 0 for m in vars(eng).values()), "no matrix was kept float32"


def test_stored_fp8_weights_agree_under_the_bf16_profile():
    eng, rep = _diff(quantized="stored")
    assert rep.agree, rep.first_divergence
    assert eng.model.kept_float32 == 0  # nothing dequantised on load


def test_requantising_fp8_weights_to_bf16_is_flagged(monkeypatch):
    _, rep = _diff(monkeypatch, requantise=True)
    assert not rep.agree
    assert rep.first_divergence.startswith("layers.")


def test_bf16_exact_weights_still_upload_as_bf16_bits():
    ck = Checkpoint.open(bundled_model("tiny"))
    eng = Engine(ck, precision="bf16", device="cpu")
    model = next(m for m in vars(eng).values() if hasattr(m, "w") and hasattr(m, "kept_float32"))
    assert model.kept_float32 == 0
    assert model.w["layers.0.linear_attn.in_proj_qkv.weight"].dtype == np.uint16
    a = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert not np.array_equal(bf16_bits_to_float32(to_bf16_bits(a)), a)  # the exactness check can fail
