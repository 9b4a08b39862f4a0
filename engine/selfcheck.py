"""Engine parity figures on the bundled fixtures (what ``ci/gpu`` prints and tests/engine/test_engine_gpu.py asserts).

    python3 -m engine.selfcheck [--device cuda|cpu] [--json OUT]

For every fixture (fixtures/*/golden.npz, written by the official implementation):

* ``f32_golden``: float32 engine vs the official logits, max |diff| / max |ref| over every prompt
  (prefill) and every incremental-decode golden;
* ``f32_reference``: float32 engine vs ``reference.model.ReferenceModel.forward`` (same measure);
* ``bf16_kl`` / ``bf16_top1``: BF16 engine vs the official float32 logits: mean KL(ref || engine) per
  position and top-1 agreement;
* ``bf16_tapdiff``: tap-diff of the BF16 engine's taps vs the reference's under the ``bf16`` profile;
* ``greedy64``: tokens of 64 greedy decode steps, float32 engine vs the reference session (count equal
  before the first difference, out of 64);
* ``snapshot``, ``verify``: max relative difference of a restored / verified-and-rolled-back sequence's
  logits vs a straight run;
* ``graphs``: CUDA-graph replays / captures / failures during the greedy run (cuda);
* ``decode_syncs``: device->host copies in one batched decode step (1 = the logits only).

Acceptance limits (:data:`F32_TOL`, :data:`KL_TOL`, :data:`TOP1_MIN`, :data:`SELF_TOL`): f32 <= 1e-4, KL <= 1e-3,
top-1 >= 0.99, greedy 64/64, snapshot/verify <= 1e-5; the measured figures of each GPU run are logged in
docs/performance.md.

MTP head (fixtures with ``golden_mtp.npz``; the truth is the reference head -- no official MTP
implementation exists): ``mtp_f32`` / ``mtp_bf16``: the engine's draft logits (k = 3, both draft-selection
options) vs the goldens, max relative error (<= 1e-4; the fixtures store BF16 weights, read exactly in both
precisions); ``mtp_greedy64``: speculative greedy (k = 3) equal to plain greedy, tokens before the first
difference out of 64.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from reference.paths import FIXTURES

F32_TOL, KL_TOL, TOP1_MIN, SELF_TOL = 1e-4, 1e-3, 0.99, 1e-5


def rel_err(a, b) -> float:
    """``max |a - b| / max(max |b|, 1e-30)`` computed in float64 (a scalar over all elements)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")  # a NaN would compare False against every tolerance (a false pass)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def kl_top1(ref_logits, logits) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(engine)) per position and top-1 agreement."""
    r = np.asarray(ref_logits, np.float64)
    e = np.asarray(logits, np.float64)
    lr = r - r.max(-1, keepdims=True)
    lr = lr - np.log(np.exp(lr).sum(-1, keepdims=True))
    le = e - e.max(-1, keepdims=True)
    le = le - np.log(np.exp(le).sum(-1, keepdims=True))
    kl = (np.exp(lr) * (lr - le)).sum(-1)
    return float(kl.mean()), float((r.argmax(-1) == e.argmax(-1)).mean())


def fixtures() -> list[str]:
    """Names of the bundled fixtures that have a ``golden.npz``, sorted."""
    return sorted(p.parent.name for p in FIXTURES.glob("*/golden.npz"))


def _engine(ck, device, precision, **kw):
    from engine import Engine
    kw.setdefault("page_size", 3)
    kw.setdefault("kv_tokens", 2048)
    return Engine(ck, precision=precision, device=device, **kw)


def fixture_figures(name: str, device: str = "cuda") -> dict:
    """All parity figures of one fixture (see the module docstring)."""
    from reference.checkpoint import Checkpoint
    ck = Checkpoint.open(FIXTURES / name)
    g = np.load(FIXTURES / name / "golden.npz")
    prompts = sorted({k.split("/")[0] for k in g.files if k.endswith("/ids") and not k.startswith("decode/")})
    out: dict = {"fixture": name}
    eng = _engine(ck, device, "float32")
    errs = []
    for p in prompts:
        s = eng.add_sequence()
        errs.append(rel_err(eng.prefill(s, g[f"{p}/ids"]), g[f"{p}/logits"]))
        eng.free(s)
    for d in sorted({k.split("/")[1] for k in g.files if k.startswith("decode/")}):
        n0 = int(g[f"decode/{d}/prefix_len"])
        ids, ref = g[f"{d}/ids"], g[f"decode/{d}/logits"]
        s = eng.add_sequence()
        eng.prefill(s, ids[:n0])
        rows = np.stack([eng.decode([s], [int(t)])[0] for t in ids[n0:n0 + len(ref)]])
        errs.append(rel_err(rows, ref))
        eng.free(s)
    out["f32_golden"] = max(errs)
    try:
        from reference.model import ReferenceModel
        rm = ReferenceModel(ck)
    except ImportError:
        rm = None
    if rm is not None:
        e2 = []
        for p in prompts:
            s = eng.add_sequence()
            e2.append(rel_err(eng.prefill(s, g[f"{p}/ids"]), rm.forward(g[f"{p}/ids"])))
            eng.free(s)
        out["f32_reference"] = max(e2)
        # 64 greedy steps: engine float32 vs the reference session
        ids = g[f"{prompts[0]}/ids"]
        rs = rm.new_session()
        lg = rs.prefill(ids)
        ref_toks = []
        for _ in range(64):
            t = int(np.argmax(lg[-1] if lg.ndim == 2 else lg))
            ref_toks.append(t)
            lg = rs.decode(t)
        s = eng.add_sequence()
        lg = eng.prefill(s, ids)[-1]
        eng_toks = []
        for _ in range(64):
            t = int(np.argmax(lg))
            eng_toks.append(t)
            lg = eng.decode([s], [t])[0]
        eng.free(s)
        if eng.graphs is not None:
            st = eng.graphs.stats
            out["graphs"] = f"{st['replays']} replays/{st['captures']} captures/{st['failed']} failed"
        same = 0
        while same < 64 and eng_toks[same] == ref_toks[same]:
            same += 1
        out["greedy64"] = same
    # snapshot / restore and verify / rollback vs a straight run
    rng = np.random.default_rng(0)
    V = ck.config.vocab_size
    ids = rng.integers(0, V, 40)
    draft = rng.integers(0, V, 5)
    r = eng.add_sequence()
    straight = eng.prefill(r, ids)
    eng.free(r)
    s = eng.add_sequence()
    eng.prefill(s, ids[:19])
    snap = eng.snapshot(s)
    eng.prefill(s, rng.integers(0, V, 9))
    eng.restore(s, snap)
    out["snapshot"] = rel_err(eng.prefill(s, ids[19:]), straight[19:])
    eng.free(s)
    snap.release()
    s = eng.add_sequence()
    eng.prefill(s, ids[:15])
    eng.verify(s, draft)
    eng.rollback(s, 3)
    r = eng.add_sequence()
    st2 = eng.prefill(r, np.concatenate([ids[:15], draft[:2], ids[15:]]))
    out["verify"] = rel_err(eng.prefill(s, ids[15:]), st2[17:])
    eng.free(s)
    eng.free(r)
    # host syncs of one batched decode step
    seqs = [eng.add_sequence() for _ in range(3)]
    for k, q in enumerate(seqs):
        eng.prefill(q, ids[:5 + 7 * k])
    before = eng.host_syncs
    eng.decode(seqs, [1, 2, 3])
    out["decode_syncs"] = eng.host_syncs - before if device == "cuda" else None
    for q in seqs:
        eng.free(q)
    # BF16 mode vs the official float32 logits
    eb = _engine(ck, device, "bf16")
    kls, tops = [], []
    for p in prompts:
        s = eb.add_sequence()
        kl, t1 = kl_top1(g[f"{p}/logits"], eb.prefill(s, g[f"{p}/ids"]))
        kls.append(kl)
        tops.append(t1)
        eb.free(s)
    out["bf16_kl"] = float(np.mean(kls))
    out["bf16_top1"] = float(np.mean(tops))
    # tap-diff: BF16 engine taps vs the reference's under the bf16 profile (longest prompt, chunked)
    if rm is not None:
        from taps.diff import diff_archives
        from taps.recorder import Recorder
        p = max(prompts, key=lambda q: len(g[f"{q}/ids"]))
        with Recorder() as ra:
            rm.forward(g[f"{p}/ids"])
        s = eb.add_sequence()
        with Recorder() as rb:
            eb.prefill(s, g[f"{p}/ids"], chunk_size=7)
        rep = diff_archives(ra.archive(), rb.archive(), "bf16")
        out["bf16_tapdiff"] = "agree" if rep.agree else f"diverged at {rep.first_divergence}"
    return out


def mtp_fixtures() -> list[str]:
    """Names of the bundled fixtures with an MTP head (``golden_mtp.npz``), sorted."""
    return sorted(p.parent.name for p in FIXTURES.glob("*/golden_mtp.npz"))


def mtp_figures(name: str, device: str = "cuda") -> dict:
    """The MTP figures of one fixture (see the module docstring)."""
    from reference.checkpoint import Checkpoint
    ck = Checkpoint.open(FIXTURES / name)
    g = np.load(FIXTURES / name / "golden_mtp.npz")
    out = {"fixture": name}
    for prec in ("float32", "bf16"):
        worst = 0.0
        for opt in ("fresh", "reuse_step0"):
            eng = _engine(ck, device, prec, mtp_draft_selection=opt)
            for p in ("qsa", "chat"):
                ids, n = g[f"{p}/ids"], int(g[f"draft/{p}/n"])
                s = eng.add_sequence()
                eng.prefill(s, ids[:n])
                _, dl = eng.mtp_draft_next(s, int(ids[n]), 3, return_logits=True)
                worst = max(worst, rel_err(dl, g[f"draft/{p}/{opt}/logits"]))
                eng.free(s)
        out["mtp_f32" if prec == "float32" else "mtp_bf16"] = worst
    eng = _engine(ck, device, "float32")
    prompt = g["qsa/ids"]
    s = eng.add_sequence()
    spec = eng.generate_speculative(s, prompt, 64, 3)
    eng.free(s)
    s = eng.add_sequence()
    plain = [int(np.argmax(eng.prefill(s, prompt, last_only=True)))]
    while len(plain) < 64:
        plain.append(int(eng.decode_greedy([s], [plain[-1]])[0]))
    same = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), 64)
    out["mtp_greedy64"] = same
    out["fail"] = [k for k in ("mtp_f32", "mtp_bf16") if out[k] > F32_TOL] + (["mtp_greedy64"] if same < 64 else [])
    return out


def verdict(f: dict) -> list[str]:
    """Names of the failed acceptance figures of one fixture."""
    bad = []
    if f["f32_golden"] > F32_TOL:
        bad.append("f32_golden")
    if f.get("f32_reference", 0) > F32_TOL:
        bad.append("f32_reference")
    if f["bf16_kl"] > KL_TOL:
        bad.append("bf16_kl")
    if f["bf16_top1"] < TOP1_MIN:
        bad.append("bf16_top1")
    if f.get("greedy64", 64) < 64:
        bad.append("greedy64")
    if f["snapshot"] > SELF_TOL:
        bad.append("snapshot")
    if f["verify"] > SELF_TOL:
        bad.append("verify")
    if f.get("decode_syncs") not in (None, 1):
        bad.append("decode_syncs")
    if f.get("bf16_tapdiff", "agree") != "agree":
        bad.append("bf16_tapdiff")
    return bad


def main(argv=None) -> int:
    """Run the engine self-check on every fixture and print one summary row each.

    Args:
        argv: command-line arguments (``--device cuda|cpu``, ``--json FILE`` also writes the rows, atomically).

    Returns:
        0 when every fixture passes, 1 when any fails; a fixture that raises is reported as an error row (FAIL).
    """
    ap = argparse.ArgumentParser(prog="python -m engine.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    rows = []
    t0 = time.time()
    for name in fixtures():
        try:
            f = fixture_figures(name, a.device)
            f["fail"] = verdict(f)
        except Exception as e:  # report and continue: the summary must show every fixture
            f = {"fixture": name, "error": f"{type(e).__name__}: {e}"[:300], "fail": ["error"]}
        rows.append(f)
    if a.json:
        from reference.atomic import atomic_write_json
        atomic_write_json(a.json, rows)
    print(f"engine parity ({a.device}, {time.time() - t0:.1f}s): fixture | f32 vs official | f32 vs reference | "
          f"bf16 KL/pos | bf16 top1 | bf16 tap-diff | greedy64 | snapshot | verify+rollback | decode syncs | CUDA graphs (greedy) | verdict")
    for f in rows:
        if "error" in f:
            print(f"  {f['fixture']}: ERROR {f['error']}")
            continue
        ref = f.get("f32_reference")
        print(f"  {f['fixture']} | {f['f32_golden']:.2e} | {ref if ref is None else format(ref, '.2e')} | "
              f"{f['bf16_kl']:.2e} | {f['bf16_top1']:.3f} | {f.get('bf16_tapdiff')} | {f.get('greedy64')}/64 | {f['snapshot']:.1e} | "
              f"{f['verify']:.1e} | {f.get('decode_syncs')} | {f.get('graphs')} | {'PASS' if not f['fail'] else 'FAIL ' + ','.join(f['fail'])}")
    mrows = []
    for name in mtp_fixtures():
        try:
            mrows.append(mtp_figures(name, a.device))
        except Exception as e:
            mrows.append({"fixture": name, "error": f"{type(e).__name__}: {e}"[:300], "fail": ["error"]})
    if mrows:
        print(f"engine MTP drafts ({a.device}; truth: the reference MTP head, no official implementation): fixture | "
              f"draft logits f32 | bf16 | speculative greedy64 | verdict")
        for f in mrows:
            if "error" in f:
                print(f"  {f['fixture']}: ERROR {f['error']}")
                continue
            print(f"  {f['fixture']} | {f['mtp_f32']:.2e} | {f['mtp_bf16']:.2e} | {f['mtp_greedy64']}/64 | "
                  f"{'PASS' if not f['fail'] else 'FAIL ' + ','.join(f['fail'])}")
    if a.json and mrows:
        from reference.atomic import atomic_write_json
        atomic_write_json(a.json, rows + mrows)
    return 0 if all(not f["fail"] for f in rows + mrows) else 1


if __name__ == "__main__":
    sys.exit(main())
