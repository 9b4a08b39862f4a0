"""The re-parameterisation a llama.cpp refusal offers, and options that contradict each other: a hint a user
can follow as written, and a contradiction refused before anything runs. Needs no llama-cpp-python: the offer
is computed from the refusal's message and the checkpoint, the option check comes before llama.cpp is looked for."""
from __future__ import annotations

import re

from reference.paths import bundled_model

from parity.backends import gguf_convert as gc

TOKENIZER_MSG = "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()"
PLE_KEY_MSG = ("check_tensor_dims: tensor 'blk.1.ple_key.weight' has wrong shape; expected     64,    256, "
               "got     32,    256,      1,      1")


def _offered(offer: str) -> list[str]:
    m = re.match(r"llama\.cpp:reparam=(\S+) ", offer)
    assert m, offer
    return m.group(1).split("+")


def test_the_offer_keeps_the_reparameterisations_already_in_use():
    """tiny with reparam=tokenizer-label is refused by the loader (ple_key shape): the offer must keep
    tokenizer-label, else following it (reparam=ple-pad) is refused by the converter, whose offer drops ple-pad."""
    tiny = bundled_model("tiny")
    assert _offered(gc.offer_for(PLE_KEY_MSG, tiny, ["tokenizer-label"])) == ["tokenizer-label", "ple-pad"]
    assert _offered(gc.offer_for(TOKENIZER_MSG, tiny, ["ple-pad"])) == ["tokenizer-label", "ple-pad"]
    # nothing in use: the one re-parameterisation that gets past this refusal
    assert _offered(gc.offer_for(TOKENIZER_MSG, tiny, [])) == ["tokenizer-label"]
    # the offered spelling is one the option parser accepts, in its canonical order
    assert gc.parse_reparams("+".join(_offered(gc.offer_for(PLE_KEY_MSG, tiny, ["tokenizer-label"]))), tiny) \
        == ["tokenizer-label", "ple-pad"]


def test_no_offer_when_the_fix_is_already_in_use():
    tiny = bundled_model("tiny")
    assert gc.offer_for(PLE_KEY_MSG, tiny, ["tokenizer-label", "ple-pad"]).startswith("no function-preserving")
