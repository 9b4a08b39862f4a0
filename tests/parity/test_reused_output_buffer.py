"""A backend may return a view of an output buffer it reuses (llama.cpp's ``llama_get_logits``, a torch engine's
static output tensor): the harness copies each answer when it gets it (parity.backends.base.owned), so such a
CORRECT backend passes, and rows kept across calls are the rows returned then, not the buffer's last contents."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "fixtures" / "tiny"


def test_a_correct_backend_reusing_its_output_buffer_passes():
    from parity.harness.run import run_parity
    rep = run_parity(TINY, "parity_fakes:ReusedOutputBuffer", ["kl", "budget", "self-consistency"], level="ci",
                     progress=False)
    doc = rep.to_json()
    assert rep.exit_code == 0, [(r["scenario"], r["status"], r["first_divergence"]) for r in doc["scenarios"]]


def test_a_padded_vocabulary_is_named_as_the_backends_wrong_shape():
    """Logits [T, V + 64] are the backend's wrong answer: the kl row's ERROR names the shape it returned and the one
    expected, never 'backend raised InputError' (the comparison's own refusal, which the backend never raised)."""
    from parity.harness.run import run_parity
    rep = run_parity(TINY, "parity_fakes:PaddedVocabLogits", ["kl"], level="ci", progress=False)
    row = next(r for r in rep.rows if r.scenario == "kl")
    assert rep.exit_code == 1 and row.status == "error", (row.status, row.first_divergence)
    text = f"{row.first_divergence} {row.detail}"
    assert "InputError" not in text and "backend raised" not in text, text
    assert "returned logits of shape" in text and "576" in text and "512" in text, text
