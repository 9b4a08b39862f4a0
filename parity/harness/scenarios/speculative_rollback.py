"""Scenario **speculative-rollback**: verify k drafted tokens, accept j of them, roll back the rest.

For every j in 0..k: ``forward_tokens`` (verify) the k drafts, roll back ``k - j``, then decode the
next token. The logits of the verify, the position (KV length) after the rollback, the next logits
and -- when the backend exposes them -- all state arrays (KV, indexer keys, GDN conv/recurrent
state, PLE conv state, n-gram context) must equal a run that never saw the rejected tokens. Drafts
are right (the truth's greedy tokens) and wrong (other tokens); the prompt ends just below the QSA
bound so the drafts cross it; EOS drafts exercise the n-gram reset. Batches of several sequences
verify different k and accept different j, then decode together.
Sources: the cache semantics of modeling_qwen4_exp.py (``Qwen4ExpTextGatedDeltaNet.forward``,
``Qwen4ExpTextPLELayer._short_conv``, ``Qwen4ExpTextNGramEmbedding.forward``, QSA ``update_indexer``).
"""
from __future__ import annotations

import numpy as np

from parity.harness.scenarios.common import Case, CaseSkip, Run, sizes, token_stream

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
    return out
