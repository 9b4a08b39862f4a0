"""Speculative generation with the checkpoint's MTP head: ``--speculative mtp:k=N`` (:func:`parse_speculative`),
the acceptance rule for point-mass drafts (:func:`speculative_accept`) and the draft / verify / rollback loop
(:func:`generate_speculative`)."""
from __future__ import annotations

import re
import time
from typing import Callable, Sequence

import numpy as np

from parity.generate.generator import GenerationResult, Generator, StreamDecoder
from parity.generate.sampling import Sampler, SamplingParams
from reference.errors import InputError

__all__ = ["parse_speculative", "speculative_accept", "generate_speculative"]


def parse_speculative(text: str) -> int:
    """``--speculative mtp:k=N`` -> ``N`` (drafts per round, 1..16).

    Raises:
        InputError: naming the flag, the expected form and what was found.
    """
    m = re.fullmatch(r"\s*mtp\s*:\s*k\s*=\s*(\d+)\s*", str(text))
    if not m:
        raise InputError(f"--speculative: expected mtp:k=N (N drafts per round from the checkpoint's MTP head), "
                         f"found {text!r}")
    k = int(m.group(1))
    if not 1 <= k <= 16:
        raise InputError(f"--speculative: expected k in 1..16, found {k}")
    return k


def speculative_accept(p_rows: np.ndarray, drafts, rng) -> tuple[int, list[int]]:
    """The speculative-sampling acceptance rule (Leviathan et al. 2023; Chen et al. 2023) for drafts drawn
    from a point mass (the MTP head's argmax: ``q = onehot(d)``): draft ``d_j`` is kept with probability
    ``min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j)``; at the first rejection the token is drawn from the residual
    ``max(p_j - q_j, 0)`` normalised (``p_j`` without ``d_j``); when all ``k`` are kept a bonus token is drawn
    from ``p_k``. Every emitted token is then distributed exactly as sampling from the target.

    Args:
        p_rows: ``[k+1, V]`` the target's sampling distributions after the token before each draft.
        drafts: ``[k]`` ids; rng: a ``numpy.random.Generator``.
    Returns:
        ``(accepted, tokens)``: ``tokens`` = the kept drafts plus one drawn token (``accepted + 1`` ids).
    """
    out = []
    for j, d in enumerate(int(t) for t in drafts):
        p = np.asarray(p_rows[j], np.float64)
        if rng.random() < p[d]:
            out.append(d)
            continue
        r = p.copy()
        r[d] = 0.0
        tot = r.sum()
        r = r / tot if tot > 0 else p  # tot == 0 only when p(d) == 1, where rejection has probability 0
        out.append(int(rng.choice(r.size, p=r)))
        return j, out
    p = np.asarray(p_rows[len(out)], np.float64)
    out.append(int(rng.choice(p.size, p=p)))
    return len(out) - 1, out


def generate_speculative(gen: Generator, prompt_ids: Sequence[int], params: SamplingParams, k: int,
                         on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generation with MTP drafts on ``gen``'s language model (``draft`` / ``verify_greedy`` or the verify
    logits / ``rollback``): per round ``k`` drafts, one width-``k+1`` verify, the accepted prefix plus one
    token from the trunk kept, the rest rolled back. Greedy: the longest prefix matching the trunk's argmax
    (the tokens and streamed text are those of plain greedy decoding). Sampling: the speculative-sampling rule
    (:func:`speculative_accept`), the same distribution as plain sampling (not the same draws: the random
    stream is consumed differently). ``result.extra['speculative']`` holds the rounds, drafted and accepted
    counts and the rule.

    Raises:
        InputError: the model has no MTP head; bad prompt. SamplingError: bad sampling parameters.
    """
    params.validate()
    lm = gen.lm
    if not getattr(lm, "has_mtp", False):
        raise InputError("--speculative mtp: expected a checkpoint with an MTP head (mtp.* tensors, e.g. the "
                         "bundled tiny-mtp), found none")
    gen.check_prompt(prompt_ids)
    stream = StreamDecoder(gen.tok)
    out, texts, stop = [], [], None
    rounds = drafted = accepted = 0
    t0 = time.perf_counter()
    h, logits = lm.start(np.asarray(prompt_ids, dtype=np.int64))
    prefill_s = time.perf_counter() - t0
    pos = len(prompt_ids)  # the position of the last emitted token

    def emit(tid):
        nonlocal stop, pos
        out.append(int(tid))
        if tid in gen.eos:
            stop = "eos"
            return
        piece = stream.push(int(tid))
        if piece:
            texts.append(piece)
            if on_text:
                on_text(piece)
        if len(out) >= params.max_new_tokens:
            stop = "length"
        elif pos + 1 >= lm.max_context:
            stop = "context"

    sampler = Sampler(params)
    t1 = time.perf_counter()
    try:
        emit(sampler(logits))
        while stop is None:
            kk = int(min(k, params.max_new_tokens - len(out), lm.max_context - pos - 1))
            if kk < 1:  # no room for a draft: one plain step
                nxt = sampler(lm.step([h], np.array([out[-1]]))[0])
                pos += 1
                emit(nxt)
                continue
            drafts = lm.draft(h, out[-1], kk)
            feed = np.concatenate([[out[-1]], drafts])
            if params.greedy:
                greedy = lm.verify_greedy(h, feed)
                acc = 0
                while acc < kk and int(greedy[acc]) == int(drafts[acc]):
                    acc += 1
                new = [int(d) for d in drafts[:acc]] + [int(greedy[acc])]
            else:
                vl = lm.verify_logits(h, feed)
                acc, new = speculative_accept(np.stack([sampler.probs(r) for r in vl]), drafts, sampler.rng)
            lm.rollback(h, kk - acc)
            rounds, drafted, accepted = rounds + 1, drafted + kk, accepted + acc
            for t in new:
                pos += 1
                emit(t)
                if stop is not None:
                    break
        decode_s = time.perf_counter() - t1
    finally:
        try:
            lm.close(h)
        except Exception:
            pass
    tail = stream.flush()
    if tail:
        texts.append(tail)
        if on_text:
            on_text(tail)
    res = GenerationResult(list(map(int, prompt_ids)), out, "".join(texts), stop, prefill_s, decode_s)
    res.extra["speculative"] = {"method": "mtp", "k": int(k), "rounds": rounds, "drafted": drafted,
                                "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else None,
                                "rule": "greedy (longest matching prefix)" if params.greedy else
                                "speculative sampling (point-mass drafts)"}
    return res
