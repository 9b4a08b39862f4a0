"""Scenario **speculative-rollback**: verify k drafted tokens, accept j of them, roll back the rest.

For every j in 0..k: ``forward_tokens`` (verify) the k drafts, roll back ``k - j``, then decode the
next token. The logits of the verify, the position (KV length) after the rollback, the next logits
and -- when the backend exposes them -- all state arrays (KV, indexer keys, GDN conv/recurrent
state, PLE conv state, n-gram context) must equal a run that never saw the rejected tokens. Drafts
are right (the truth's greedy tokens) and wrong (other tokens); the prompt ends just below the QSA
bound so the drafts cross it; EOS drafts exercise the n-gram reset. One case rejects every draft (the
rollback undoes a whole verify call) entirely below the bound. Batches of several sequences
verify different k and accept different j, then decode together. A snapshot and a fork taken right
after a rollback must hold the accepted prefix's state.
With an MTP head (config ``mtp_num_hidden_layers`` and the backend's capability ``mtp``) the ``mtp_*`` cases
drive the same machinery with the backend's OWN drafts (``draft(h, next_id, k)``), each compared with the
reference MTP head (:data:`MTP_TRUTH_PROVENANCE`: there is no official MTP implementation) and located at
the first divergent ``mtp.*`` tap: every acceptance count 0..k on one sequence (rejection at every position,
the head rolled back with the trunk), rollback across prefill chunks and a snapshot, and the greedy identity
(speculative greedy with the backend's drafts equals the truth's plain greedy). Every token picked (a draft
against the head's, a speculative greedy token against plain greedy) is judged by the kl row's top-1 rule
(:func:`parity.harness.kl.pick_faults`): a tie at the top broken the other way is tie-equivalent.
Sources: the cache semantics of modeling_qwen4_exp.py (``Qwen4ExpTextGatedDeltaNet.forward``,
``Qwen4ExpTextPLELayer._short_conv``, ``Qwen4ExpTextNGramEmbedding.forward``, QSA ``update_indexer``).
"""
from __future__ import annotations

import numpy as np

from parity.harness.scenarios.common import Case, CaseSkip, Run, sizes, token_stream
from parity.harness.scenarios import long
from parity.harness.scenarios.suite import Suite

NAME = "speculative_rollback"

K = 4  # drafts per verify: > ngram context and crossing a compress block


def greedy_drafts(run: Run, hist: list[int], k: int) -> list[int]:
    """The truth's greedy continuation of ``hist`` (k tokens): 'right' drafts."""
    out: list[int] = []
    for _ in range(k):
        out.append(int(np.argmax(run.truth.logits(hist + out)[-1])))
    return out


def wrong_drafts(run: Run, hist: list[int], k: int, seed: int) -> list[int]:
    """k tokens that differ from the truth's greedy choice at each step ('wrong' drafts)."""
    right = greedy_drafts(run, hist, k)
    ids = token_stream(run.config, k, seed=seed)
    return [t if t != r else (t + 1) % run.sizes.vocab for t, r in zip(ids, right)]


def _prompt_len(s) -> int:
    return max(2, s.bound - 2)


def _draft(run: Run, kind: str, hist: list[int], k: int, seed: int) -> list[int]:
    if kind == "right":
        return greedy_drafts(run, hist, k)
    drafts = wrong_drafts(run, hist, k, seed=seed)
    if kind == "eos" and run.sizes.eos is not None:
        drafts[seed % k] = run.sizes.eos
    return drafts


def cases(config, level: str = "full") -> list[Case]:
    """Speculative cases. ``level='ci'`` cycles the draft kind over j (right, wrong, eos, ...) in one case
    instead of running every kind for every j."""
    s = sizes(config)
    out = []
    plans = ({"all": None} if level == "ci" else {k: k for k in ("right", "wrong", "eos")})
    for tag, fixed in plans.items():
        def accept_each(run: Run, fixed=fixed, tag=tag):
            L = _prompt_len(run.sizes)
            prompt = token_stream(run.config, L, seed=500)
            judged = 0
            for j in range(K + 1):
                kind = fixed or ("right", "wrong", "eos")[j % 3]
                a = run.new(f"{kind}-accept{j}")
                run.prefill(a, prompt)
                drafts = _draft(run, kind, a.hist, K, seed=600 + j)
                run.verify(a, drafts, desc=f"verify {K} {kind} drafts")
                why = run.rollback_refusal(a, K - j, f"accept {j}/{K}, roll back {K - j}")
                if why:  # narrowed: this j is beyond the backend's declared rollback limit, the others still run
                    run.narrow(why)
                    run.free(a)
                    continue
                run.rollback(a, K - j, desc=f"accept {j}/{K}, roll back {K - j}")
                judged += 1
                nxt = token_stream(run.config, 1, seed=800 + j)[0]
                run.decode([a], [nxt], desc=f"decode after accepting {j}/{K} {kind} drafts")
                straight = run.new(f"{kind}-straight{j}")
                run.prefill(straight, a.hist)
                run.compare_state(a, straight, f"state after accepting {j}/{K} {kind} drafts")
                # a second speculative round on the rolled-back state
                d2 = wrong_drafts(run, a.hist, 2, seed=900 + j)
                run.verify(a, d2, desc="second verify round")
                run.rollback(a, 1, desc="second round: accept 1/2")
                run.decode([a], [d2[0]], desc="decode after second round")
                run.free(straight)
                run.free(a)
            if not judged:
                raise CaseSkip("; ".join(run.narrowed))
        out.append(Case(f"accept_each_j_{tag}_drafts", accept_each))

    def batch(run: Run):
        plan = [(_prompt_len(run.sizes), 4, 1), (run.sizes.bound + 3, 3, 3), (5, 2, 0),
                (2 * run.sizes.bound, 4, 2)]
        seqs = []
        for i, (L, k, j) in enumerate(plan):
            sq = run.new(f"batch{i}-len{L}-k{k}-acc{j}")
            run.prefill(sq, token_stream(run.config, L, seed=1000 + i, eos_every=9))
            seqs.append((sq, k, j))
        for rnd in range(2):
            for i, (sq, k, j) in enumerate(seqs):
                drafts = greedy_drafts(run, sq.hist, k) if (i + rnd) % 2 == 0 else \
                    wrong_drafts(run, sq.hist, k, seed=1100 + 10 * rnd + i)
                run.verify(sq, drafts)
                run.rollback(sq, k - j, desc=f"round {rnd}: accept {j}/{k}")
            nxt = token_stream(run.config, len(seqs), seed=1200 + rnd)
            run.decode([sq for sq, _k, _j in seqs], nxt, desc=f"batched decode after round {rnd}")
        for i, (sq, _k, _j) in enumerate(seqs):
            straight = run.new(f"straight{i}")
            run.prefill(straight, sq.hist)
            run.compare_state(sq, straight, f"state of batch seq {i} after two speculative rounds")
            run.free(straight)
    out.append(Case("batch_mixed_accepts", batch, batch=True))

    def whole_call(run: Run):
        # every draft rejected: the rollback undoes a whole forward_tokens call (twice) -- unlike accepting
        # j >= 1 of a verify, which keeps part of the last call. Kept below the QSA bound, so an error of the
        # rollback itself is not masked by an earlier selection difference.
        L = max(2, run.sizes.bound - K - 3)
        a = run.new("reject-all")
        run.prefill(a, token_stream(run.config, L, seed=3200))
        drafts = wrong_drafts(run, a.hist, K, seed=3201)
        run.verify(a, drafts, desc=f"verify {K} wrong drafts")
        why = run.rollback_refusal(a, K, f"reject all {K} drafts")
        if why:
            raise CaseSkip(why)
        run.rollback(a, K, desc=f"reject all {K} drafts: roll back the whole verify call")
        t = token_stream(run.config, 2, seed=3202)
        run.decode([a], [t[0]], desc="decode after rolling back a whole verify call")
        run.verify(a, [t[1]] + drafts[:1], desc="verify 2 more drafts")
        run.rollback(a, 2, desc="reject both: roll back the whole verify call again")
        run.decode([a], [t[1]], desc="decode after the second whole-call rollback")
        straight = run.new("straight")
        run.prefill(straight, a.hist)
        run.compare_state(a, straight, "state after rolling back whole calls")
    out.append(Case("reject_all_drafts_below_bound", whole_call))
    return out + rollback_then_cases(config, level) + mtp_cases(config, level)


# ------------------------------------------------------------------ snapshot / fork after a rollback
def rollback_then_cases(config, level: str = "full") -> list[Case]:
    """A snapshot taken right after a rollback (it must hold the accepted prefix's state, not the rejected
    drafts'), restored elsewhere; a fork right after a rollback, both children diverging."""
    out = []

    def snap_after_rollback(run: Run):
        L = _prompt_len(run.sizes)
        a = run.new("speculating")
        run.prefill(a, token_stream(run.config, L, seed=3000, eos_every=5))
        drafts = wrong_drafts(run, a.hist, K, seed=3001)
        run.verify(a, drafts, desc=f"verify {K} wrong drafts")
        run.rollback(a, K - 1, desc=f"accept 1/{K}")
        snap = run.snapshot(a)
        run.prefill(a, token_stream(run.config, 3, seed=3002), desc="the sequence runs on after the snapshot")
        c = run.new("restored")
        run.restore(c, snap, desc="restore the snapshot taken right after the rollback")
        for t in token_stream(run.config, 2, seed=3003):
            run.decode([c], [t])
        straight = run.new("straight")
        run.prefill(straight, c.hist)
        run.compare_state(c, straight, "state restored from a snapshot taken after a rollback")
    out.append(Case("snapshot_after_rollback", snap_after_rollback))

    def fork_after_rollback(run: Run):
        L = _prompt_len(run.sizes)
        a = run.new("parent")
        run.prefill(a, token_stream(run.config, L, seed=3100, eos_every=6))
        drafts = wrong_drafts(run, a.hist, K, seed=3101)
        run.verify(a, drafts, desc=f"verify {K} wrong drafts")
        run.rollback(a, K - 2, desc=f"accept 2/{K}")
        b = run.fork(a, "child")
        xa, xb = token_stream(run.config, 2, seed=3102), token_stream(run.config, 2, seed=3103)
        run.decode([a, b], [xa[0], xb[0]], desc="parent and child diverge")
        run.decode([b, a], [xb[1], xa[1]])
        for sq in (a, b):
            straight = run.new(f"straight-{sq.label}")
            run.prefill(straight, sq.hist)
            run.compare_state(sq, straight, f"state of the {sq.label} forked after a rollback")
            run.free(straight)
    out.append(Case("fork_after_rollback", fork_after_rollback, needs=("fork",)))
    return out



# ----------------------------------------------------------------------------------------------- MTP drafts
#: where the truth of a draft comes from (reported with every MTP case)
MTP_TRUTH_PROVENANCE = ("reference MTP head (reference/blocks/mtp.py, the vLLM/SGLang dataflow; options hnorm="
                        "global, draft_selection=fresh); no official implementation exists")
MTP_K = 3  # drafts per round (vLLM recipes run MTP3)
MTP_IDENTITY_TOKENS = {"full": 512, "ci": 48}
# tap comparison for locating a draft divergence: float32 paths agree to ~1e-5 of a tap's scale (the draft
# logits' observed 4e-7 relative, through one layer); a wrong grouping, a stale selection or stale state is
# an O(1e-2..1) relative difference. bf16/fp8 paths round at ~4e-3 per op.
MTP_TAP_REL = {"bf16": 5e-2, "fp8": 5e-2}
MTP_TAP_REL_DEFAULT = 1e-3


def has_mtp_config(config) -> bool:
    """True when the config declares an MTP head (``mtp_num_hidden_layers >= 1``, kept in ``config.extra``)."""
    n = (getattr(config, "extra", None) or {}).get("mtp_num_hidden_layers") or 0
    return isinstance(n, int) and n >= 1


def mtp_truth_draft(run: Run, hist: list[int], next_id: int, k: int):
    """The reference head's ``(ids [k], logits [k, V])`` after ``hist`` + ``next_id`` (cached per run)."""
    from reference.session import mtp_draft_from_history
    key = ("mtp", tuple(hist), int(next_id), int(k))
    got = run.scratch.get(key)
    if got is None:
        got = mtp_draft_from_history(run.truth.model, hist, next_id, k)
        run.scratch[key] = got
    return got


def _draft_rows(arch, name: str, k: int):
    """``(rows [k, ...], positions [k])`` of the last ``k`` rows of tap ``name`` (a draft call's steps come last:
    after any catch-up rows), or None when fewer were recorded."""
    if not arch.has(name):
        return None
    pos = np.asarray(arch.positions(name))
    if pos.shape[0] < k:
        return None
    return np.asarray(arch.get(name))[-k:], pos[-k:]


def mtp_locate(run: Run, s, next_id: int, k: int, step: int) -> str:
    """Name the first divergent ``mtp.*`` tap up to draft step ``step``: the backend's repeated draft and the
    reference head recorded with taps; step by step, in forward order, the backend's rows are checked for the
    step's position (``n - 1 + j``: a head holding another number of pairs runs elsewhere) and values (index
    taps exactly, floats to :data:`MTP_TAP_REL` of the truth's scale)."""
    from reference.session import mtp_draft_from_history
    from taps.recorder import Recorder
    from taps import registry
    n = len(s.hist)
    try:
        with run.be.taps(None) as rb:
            run.be.draft(s.h, next_id, k)
        with Recorder(None) as rt:
            mtp_draft_from_history(run.truth.model, s.hist, next_id, k)
    except Exception as e:  # locating is best effort: the failure itself is already established
        return f"mtp draft step {step}: taps not recorded ({type(e).__name__}: {e})"
    a, b = rb.archive(), rt.archive()
    rel = MTP_TAP_REL.get(getattr(run.be, "precision", "float32"), MTP_TAP_REL_DEFAULT)
    for j in range(step + 1):
        p = n - 1 + j
        for name in registry.mtp_tap_names():
            ty = _draft_rows(b, name, k)
            if ty is None:
                continue
            tx = _draft_rows(a, name, k)
            if tx is None:
                return f"mtp draft step {j} (position {p}): tap {name} not recorded by the backend"
            x, px = tx[0][j], int(tx[1][j])
            y = ty[0][j]
            if px != p:
                return (f"mtp draft step {j}: first divergent tap {name} ran at head position {px}, expected {p} "
                        f"(the head holds {px - j} pairs, the sequence {n}: its state was not rolled back)")
            spec = registry.spec_for(name)
            if spec is not None and spec.kind == registry.INDEX:  # a selection: a set of valid ids, any width
                if not registry.index_rows_agree(name, x, y):
                    return (f"mtp draft step {j} (position {p}): first divergent tap {name} "
                            f"({list(registry.selection_ids(x))[:8]} vs truth {list(registry.selection_ids(y))[:8]})")
                continue
            if x.shape != y.shape:
                return f"mtp draft step {j} (position {p}): tap {name} shape {x.shape} != {y.shape}"
            x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
            fin = np.isfinite(y64)
            scale = max(float(np.abs(y64[fin]).max()) if fin.any() else 0.0, 1e-30)
            err = float(np.abs(x64[fin] - y64[fin]).max()) if fin.any() else 0.0
            if not np.array_equal(np.isfinite(x64), fin) or err > rel * scale:
                return (f"mtp draft step {j} (position {p}): first divergent tap {name} (max |diff| {err:.3g}, "
                        f"truth scale {scale:.3g})")
    return f"mtp draft step {step}: logits differ but no mtp.* tap before them does (the lm_head / logits)"


def mtp_check(run: Run, s, next_id: int, k: int, desc: str) -> list[int]:
    """Draft ``k`` tokens with the backend's head after ``s`` + ``next_id``; compare the draft logits with the
    reference head's (KL + top-1 as every scenario check; steps after a near-tie flip are conditioned on
    another token and not compared) and check the sequence's position is unchanged. Returns the backend's
    drafts. Raises CaseFailure located at the first divergent ``mtp.*`` tap."""
    from parity.harness.kl import compare_logits, pick_faults, position_faults, verdict
    op = run._next_op()
    ids, logits = run.be.draft(s.h, next_id, k)
    ids, logits = np.asarray(ids).reshape(-1), np.asarray(logits)
    t_ids, t_logits = mtp_truth_draft(run, s.hist, next_id, k)
    if ids.shape != (k,) or logits.shape != (k, run.sizes.vocab):
        run.fail(op, f"{desc}: seq {s.label}: draft shapes {ids.shape}, {logits.shape}: expected ({k},), "
                     f"({k}, {run.sizes.vocab})", "mtp draft shape", seq=s.label)
    upto = k
    for j in range(k):
        if int(ids[j]) != int(t_ids[j]):
            # the kl row's top-1 rule: a draft differing from the head's inside the near-tie band (an exact or near
            # tie at the top of the truth's draft logits) is tie-equivalent; the steps after it are conditioned on
            # another token and not compared
            if not 0 <= int(ids[j]) < run.sizes.vocab:
                run.fail(op, f"{desc}: seq {s.label}: draft {j} is token id {int(ids[j])}, expected ids in "
                             f"[0, vocab_size {run.sizes.vocab})", "mtp draft token id", seq=s.label)
            bad, best, gap, band = pick_faults(np.asarray(t_logits[j:j + 1]), ids[j:j + 1], run.th)
            if bad[0]:
                run.fail(op, f"{desc}: seq {s.label}: draft {j} is {int(ids[j])}, the reference head's "
                             f"{int(best[0])} (truth logit gap {gap[0]:.3g} > near-tie 2 x tol x scale = "
                             f"{band[0]:.3g}); truth: {MTP_TRUTH_PROVENANCE}",
                         mtp_locate(run, s, next_id, k, j), seq=s.label)
            run.tie_flips += 1
            upto = j + 1
            break
    cmp = compare_logits(np.asarray(t_logits[:upto]), logits[:upto])
    run.checks += 1
    wk = cmp.worst_kl()
    we = float(np.max(cmp.max_abs_err)) if cmp.n else 0.0
    run.worst_kl = max(run.worst_kl, wk) if np.isfinite(wk) else float("inf")
    run.worst_err = max(run.worst_err, we) if np.isfinite(we) else float("inf")
    ok, why = verdict(cmp, run.th, top1=False)
    if not ok:
        bad = position_faults(cmp, run.th)
        j = int(np.argmax(bad)) if bad.any() else 0
        run.fail(op, f"{desc}: seq {s.label}: draft logits vs the reference head: {why} (first at draft step {j}); "
                     f"truth: {MTP_TRUTH_PROVENANCE}", mtp_locate(run, s, next_id, k, j), seq=s.label)
    run._check_position(op, s, desc + " (a draft must not change the sequence)")
    return [int(t) for t in ids]


def _next_greedy(run: Run, hist: list[int]) -> int:
    return int(np.argmax(run.truth.logits(hist)[-1]))


def mtp_cases(config, level: str = "full") -> list[Case]:
    """The cases driven by the backend's own MTP drafts (``needs=('mtp',)``); none without an MTP head."""
    if not has_mtp_config(config):
        return []
    k = MTP_K

    def accept_each(run: Run):
        L = _prompt_len(run.sizes)
        s = run.new("mtp")
        run.prefill(s, token_stream(run.config, L, seed=1500))
        for j in range(k + 1):  # round j accepts j drafts: rejection at every position 0..k
            x = _next_greedy(run, s.hist)
            own = mtp_check(run, s, x, k, f"round {j}: MTP drafts after position {len(s.hist)}")
            right = greedy_drafts(run, s.hist + [x], k)
            drafts = right[:j] + own[j:]  # the backend's own drafts from the first rejected one on
            if j < k and drafts[j] == right[j]:
                drafts[j] = (right[j] + 1) % run.sizes.vocab
            run.verify(s, [x] + drafts, desc=f"round {j}: verify [x] + {k} drafts ({j} right)")
            run.rollback(s, k - j, desc=f"round {j}: accept {j}/{k}, roll back {k - j}")
        x = _next_greedy(run, s.hist)
        mtp_check(run, s, x, k, "MTP drafts after every acceptance count")
        straight = run.new("mtp-straight")
        run.prefill(straight, s.hist)
        mtp_check(run, straight, x, k, "MTP drafts of a run that never saw the rejected drafts")
    out = [Case("mtp_accept_each_j", accept_each, needs=("mtp",))]

    def chunk_snapshot(run: Run):
        r = run.sizes.ratio
        s = run.new("mtp-chunked")
        run.prefill(s, token_stream(run.config, 2 * run.sizes.bound + 1, seed=1600, eos_every=7), chunk_size=r + 1)
        x = _next_greedy(run, s.hist)
        mtp_check(run, s, x, k, f"MTP drafts after a prefill in chunks of {r + 1}")
        snap = run.snapshot(s)
        wrong = wrong_drafts(run, s.hist + [x], k, seed=1601)
        run.verify(s, [x] + wrong, desc="verify wrong drafts")
        run.rollback(s, k, desc="reject every draft (keep x)")
        x2 = _next_greedy(run, s.hist)
        mtp_check(run, s, x2, k, "MTP drafts after rejecting every draft")
        run.decode([s], [x2], desc="decode the trunk's token")
        run.restore(s, snap, desc="restore the snapshot taken before the rejected round")
        mtp_check(run, s, x, k, "MTP drafts after restoring the snapshot")
        t = run.new("mtp-restored")
        run.restore(t, snap, desc="restore the snapshot into another sequence")
        mtp_check(run, t, x, k, "MTP drafts of the restored copy")
    out.append(Case("mtp_rollback_across_chunk_and_snapshot", chunk_snapshot, needs=("mtp",)))

    n_tok = MTP_IDENTITY_TOKENS.get(level, MTP_IDENTITY_TOKENS["full"])

    def identity(run: Run):
        s = run.new("mtp-speculative")
        run.prefill(s, token_stream(run.config, _prompt_len(run.sizes), seed=1700))
        start = len(s.hist)
        x = _next_greedy(run, s.hist)
        while len(s.hist) - start < n_tok:
            kk = min(k, n_tok - (len(s.hist) - start))
            drafts = [int(t) for t in np.asarray(run.be.draft(s.h, x, kk)[0]).reshape(-1)]
            lg = run.verify(s, [x] + drafts, desc=f"speculative round at position {len(s.hist)}")
            acc = 0
            while acc < kk and int(np.argmax(lg[acc])) == drafts[acc]:  # the backend's own acceptance
                acc += 1
            run.rollback(s, kk - acc, desc=f"accept {acc}/{kk}")
            x = int(np.argmax(lg[acc]))
        gen = s.hist[start:]
        # plain greedy along the same history, judged by the kl row's top-1 rule: a token differing from the
        # truth's argmax inside the near-tie band (an exact or near tie at the top) is tie-equivalent
        from parity.harness.kl import pick_faults
        bad, best, gap, band = pick_faults(run.truth.logits(s.hist)[start - 1:-1], gen, run.th)
        run.tie_flips += int(((best != np.asarray(gen)) & ~bad).sum())
        i = int(np.argmax(bad)) if bad.any() else None
        run.check(i is None, "" if i is None else
                  f"speculative greedy with the backend's MTP drafts differs from plain greedy at generated token {i} "
                  f"of {len(gen)} (position {start + i}): token {gen[i]}, the truth's argmax {int(best[i])} with gap "
                  f"{gap[i]:.3g} > near-tie 2 x tol x scale = {band[i]:.3g}", "speculative greedy identity")
    out.append(Case(f"mtp_greedy_identity_{n_tok}", identity, needs=("mtp",)))
    return out


SUITE = Suite(NAME, cases,
              "verify k drafted tokens, accept j, roll back the rest, continue: equal a straight run",
              long_cases=long.speculative_rollback_cases)
