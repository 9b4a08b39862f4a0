"""Scenario **snapshot-restore**: snapshots are deep, independent and complete.

Cases: snapshot at p, run other sequences (and the same one onwards), restore, continue == straight
run; restore into a fresh handle, twice (the snapshot must not be consumed or aliased); a shared
prefix reused by a second request with several, exactly one, or no prompt tokens left to prefill; a
snapshot written to disk and read back (:mod:`parity.backends.snapshot_file`: versioned; a snapshot of another
model or format version is refused); restoring a snapshot that lacks PLE or indexer state is refused;
a batch of sequences restored at different positions decoding together; verify and rollback right
after a restore; the held logits of the restored position in a full prefix hit (none left to prefill);
fork, then both children diverge. Snapshot positions sit at the QSA bound, inside a compress block and at
the PLE conv window.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from parity.harness.scenarios.common import Case, Run, sizes, token_stream
from parity.harness.scenarios import long
from parity.harness.scenarios.suite import Suite

NAME = "snapshot_restore"


def snap_points(config) -> dict[str, int]:
    """Snapshot positions by name: at the QSA bound, inside a compress block (``2 * ratio + 1``) and at
    the PLE conv window (at least 1)."""
    s = sizes(config)
    return {"at-bound": s.bound, "inside-block": 2 * s.ratio + 1, "ple-window": max(1, s.ple_window)}


def cases(config, level: str = "full") -> list[Case]:
    """The snapshot-restore cases for ``config`` (see the module docstring). ``level`` is not used."""
    s = sizes(config)
    out = []
    for tag, p in snap_points(config).items():
        def restore_same(run: Run, p=p):
            ids = token_stream(run.config, p + 6, seed=1300 + p, eos_every=7)
            side, other, dec = (token_stream(run.config, 5, seed=1400), token_stream(run.config, p + 3, seed=1500),
                                token_stream(run.config, 2, seed=1600))
            run.plan(ids, ids[:p] + side + dec[:1], other + dec[1:])
            a = run.new("a")
            run.prefill(a, ids[:p])
            snap = run.snapshot(a)
            # the same sequence runs on with other tokens, another sequence runs meanwhile
            run.prefill(a, side)
            b = run.new("other")
            run.prefill(b, other)
            run.decode([a, b], dec)
            run.restore(a, snap, desc=f"restore the snapshot at {p} into the advanced sequence")
            for t in ids[p:p + 3]:
                run.decode([a], [t])
            run.prefill(a, ids[p + 3:p + 6], desc="prefill after restore")
        out.append(Case(f"restore_same_handle_{tag}_{p}", restore_same))

    def fresh_twice(run: Run):
        p = s.bound + 1
        ids = token_stream(run.config, p + 4, seed=1700)
        run.plan(ids[:p + 1], ids[:p] + [ids[p], ids[p + 2]], ids[:p] + [ids[p + 1], ids[p + 2]])
        a = run.new("a")
        run.prefill(a, ids[:p])
        snap = run.snapshot(a)
        for k in range(2):
            c = run.new(f"fresh{k}")
            run.restore(c, snap, desc=f"restore into fresh handle #{k}")
            run.decode([c], [ids[p + k]])
            run.decode([c], [ids[p + 2]])
        run.decode([a], [ids[p]], desc="source sequence still continues")
    out.append(Case("restore_fresh_handle_twice", fresh_twice))

    for left in ("several", "one", "none"):
        def prefix(run: Run, left=left):
            P = token_stream(run.config, s.bound + 2, seed=1800)
            rest = {"several": token_stream(run.config, s.ratio + 2, seed=1802),
                    "one": token_stream(run.config, 1, seed=1803), "none": []}[left]
            d1, d2 = token_stream(run.config, 1, seed=1804), token_stream(run.config, 2, seed=1805)
            run.plan(P + token_stream(run.config, 3, seed=1801) + d2[1:], P + rest + d1 + d2[:1])
            a = run.new("request1")
            run.prefill(a, P + token_stream(run.config, 3, seed=1801))
            shared = run.new("prefix-owner")
            run.prefill(shared, P)
            snap = run.snapshot(shared)
            r2 = run.new("request2")
            run.restore(r2, snap, desc="prefix cache hit")
            if left == "several":
                run.prefill(r2, rest, desc="prefill the rest")
            elif left == "one":
                run.prefill(r2, rest, desc="prefill the one prompt token left")
            run.decode([r2], d1, desc=f"first decode ({left} left)")
            run.decode([r2, a], d2)
        out.append(Case(f"shared_prefix_hit_{left}_left", prefix))

    def file_roundtrip(run: Run):
        from parity.backends import snapshot_file as sf
        p = s.bound + s.ratio
        ids = token_stream(run.config, p + 3, seed=1900, eos_every=5)
        run.plan(ids)
        a = run.new("a")
        run.prefill(a, ids[:p])
        snap = run.snapshot(a)
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "a.qsnap"
            sf.save_snapshot(f, snap.obj, run.be, position=p)
            back = sf.load_snapshot(f, run.be)
            c = run.new("from-file")
            run.restore(c, type(snap)(back, list(snap.hist)), desc="restore from file")
            for t in ids[p:]:
                run.decode([c], [t])
            meta = json.loads((f / "meta.json").read_text())
            # another format version
            g = Path(d) / "v.qsnap"
            sf.save_snapshot(g, snap.obj, run.be, position=p)
            m = json.loads((g / "meta.json").read_text()); m["format_version"] = sf.FORMAT_VERSION + 1
            (g / "meta.json").write_text(json.dumps(m))
            run.expect_refusal(lambda: sf.load_snapshot(g, run.be), "loading a snapshot of another format version")
            # another model
            h = Path(d) / "m.qsnap"
            sf.save_snapshot(h, snap.obj, run.be, position=p)
            m = json.loads((h / "meta.json").read_text()); m["model"]["config_hash"] = "0" * 16
            (h / "meta.json").write_text(json.dumps(m))
            run.expect_refusal(lambda: sf.load_snapshot(h, run.be), "loading a snapshot of another model")
            # a file lacking PLE / indexer state
            for kind in sorted({"ple.conv", "ple.ngram_context", "qsa.indexer_keys"} & sf.required_kinds(run.config)):
                k = Path(d) / f"strip-{kind}.qsnap"
                sf.save_snapshot(k, sf.strip_kind(snap.obj, kind), run.be, position=p)
                run.expect_refusal(lambda k=k: sf.load_snapshot(k, run.be),
                                   f"loading a snapshot file lacking {kind} state")
            run.check(set(meta["kinds"]) >= sf.required_kinds(run.config),
                      f"snapshot file kinds {meta['kinds']}: expected all of {sorted(sf.required_kinds(run.config))}",
                      "snapshot file: state kinds missing")
    out.append(Case("snapshot_file_roundtrip", file_roundtrip, needs=("snapshot_file",)))

    def refuse_partial(run: Run):
        from parity.backends import snapshot_file as sf
        p = s.bound + 1
        a = run.new("a")
        run.prefill(a, token_stream(run.config, p, seed=2000))
        snap = run.snapshot(a)
        for kind in sorted({"ple.conv", "ple.ngram_context", "qsa.indexer_keys"} & sf.required_kinds(run.config)):
            bad = sf.strip_kind(snap.obj, kind)
            c = run.new(f"partial-{kind}")
            run.expect_refusal(lambda c=c, bad=bad: run.be.restore(c.h, bad),
                               f"restoring a snapshot lacking {kind} state")
    out.append(Case("refuse_snapshot_lacking_ple_or_indexer", refuse_partial, needs=("snapshot_file",)))

    def batch(run: Run):
        pts = sorted(set(snap_points(run.config).values()) | {s.bound + 2})
        seqs, snaps, conts = [], [], []
        for i, p in enumerate(pts):
            ids = token_stream(run.config, p + 3, seed=2100 + i, eos_every=6)
            run.plan(ids)
            sq = run.new(f"batch{i}-at{p}")
            run.prefill(sq, ids[:p])
            snaps.append(run.snapshot(sq))
            run.prefill(sq, token_stream(run.config, 4, seed=2200 + i))
            seqs.append(sq)
            conts.append(ids[p:])
        for sq, sn in zip(seqs, snaps):
            run.restore(sq, sn)
        for step in range(3):
            run.decode(seqs, [c[step] for c in conts], desc=f"batched decode after restores, step {step}")
    out.append(Case("batch_restore_different_positions", batch, batch=True))
    return out + more_cases(config, level)


# ------------------------------------------------------------------ combinations
def more_cases(config, level: str = "full") -> list[Case]:
    """Verify and rollback right after a restore; the held logits of the restored position when a prefix hit
    leaves none of the prompt to prefill; fork then diverge both children."""
    s = sizes(config)
    out = []

    def verify_after_restore(run: Run):
        from parity.harness.scenarios.speculative_rollback import wrong_drafts
        p = s.bound - 1
        ids = token_stream(run.config, p, seed=2300, eos_every=6)
        a = run.new("prefix")
        run.prefill(a, ids)
        snap = run.snapshot(a)
        c = run.new("restored")
        run.restore(c, snap, desc="restore, then speculate")
        for rnd, (k, j) in enumerate(((4, 1), (3, 0), (2, 2))):
            drafts = wrong_drafts(run, c.hist, k, seed=2400 + rnd)
            run.verify(c, drafts, desc=f"verify {k} drafts on the restored sequence (round {rnd})")
            run.rollback(c, k - j, desc=f"round {rnd}: accept {j}/{k} after a restore")
            nxt = token_stream(run.config, 1, seed=2500 + rnd)[0]
            run.decode([c], [nxt], desc=f"decode after the rollback of round {rnd}")
            straight = run.new(f"straight{rnd}")
            run.prefill(straight, c.hist)
            run.compare_state(c, straight, f"state after verify/rollback on a restored sequence (round {rnd})")
            run.free(straight)
    out.append(Case("verify_and_rollback_after_restore", verify_after_restore))

    def none_left(run: Run):
        P = token_stream(run.config, s.bound + 2, seed=2600, eos_every=7)
        d = token_stream(run.config, 2, seed=2601)
        run.plan(P + d)
        owner = run.new("prefix-owner")
        run.prefill(owner, P)
        snap = run.snapshot(owner)
        run.decode([owner], d[:1], desc="the owner moves on after the snapshot")
        r2 = run.new("request2")
        run.restore(r2, snap, desc="prefix cache hit covering the whole prompt")
        run.check_last_logits(r2, "the restored position's logits (none of the prompt left to prefill)")
        run.decode([r2], d[:1], desc="first decode after a full hit")
        run.decode([r2, owner], [d[1], d[1]])
    out.append(Case("shared_prefix_hit_none_left_restored_logits", none_left, needs=("last_logits",)))

    def fork_diverge(run: Run):
        p = s.bound + 1
        ids = token_stream(run.config, p, seed=2700, eos_every=5)
        xa, xb = token_stream(run.config, 3, seed=2701), token_stream(run.config, 3, seed=2702)
        a = run.new("parent")
        run.prefill(a, ids)
        b = run.fork(a, "child")
        run.decode([a, b], [xa[0], xb[0]], desc="parent and child decode different tokens in one batch")
        run.prefill(a, xa[1:], desc="parent prefills on")
        run.prefill(b, xb[1:], desc="child prefills on")
        for sq in (a, b):
            straight = run.new(f"straight-{sq.label}")
            run.prefill(straight, sq.hist)
            run.compare_state(sq, straight, f"state of the {sq.label} after fork and divergence")
            run.free(straight)
    out.append(Case("fork_then_diverge_both", fork_diverge, needs=("fork",)))
    return out


SUITE = Suite(NAME, cases,
              "snapshots are deep, independent and complete: restore, continue, equal a straight run",
              long_cases=long.snapshot_restore_cases)
