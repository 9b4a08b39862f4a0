"""Engine CUDA path's taps vs the reference's (every registry tap produced, bf16 and float32 profiles):
``python ci/tools/taps_cuda_check.py`` on the device machine; prints one line per precision, exit 1 on a gap."""
import sys

import numpy as np

from engine import Engine
from reference.checkpoint import Checkpoint
from reference.model import ReferenceModel
from reference.paths import FIXTURES
from taps.diff import diff_archives
from taps.recorder import Recorder
from taps.registry import tap_names

ck = Checkpoint.open(FIXTURES / "tiny")
ids = np.load(FIXTURES / "tiny" / "golden.npz")["qsa/ids"]
with Recorder() as rec:
    ReferenceModel(ck).forward(ids)
ref = rec.archive()
rc = 0
for precision, profile in (("float32", "fp32"), ("bf16", "bf16")):
    eng = Engine(ck, precision=precision, device="cuda", kv_tokens=256, page_size=3)
    with Recorder() as rec:
        s = eng.add_sequence()
        eng.prefill(s, ids[:-3], chunk_size=7)
        eng.decode([s], ids[-3:-2])
        eng.verify(s, ids[-2:])
    rep = diff_archives(ref, rec.archive(), profile)
    compared = {r.name for r in rep.results if r.status in ("agree", "flip")}
    missing = sorted(set(tap_names(ck.config)) - compared)
    ok = rep.agree and not missing
    rc |= not ok
    print(f"TAPS-CUDA {precision}: agree={rep.agree} first={rep.first_divergence} compared={len(compared)}/"
          f"{len(tap_names(ck.config))} missing={missing[:6]}")
sys.exit(rc)
