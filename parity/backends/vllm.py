"""The ``vllm`` backend: a vLLM-style OpenAI-compatible completions server that takes token-id prompts and
returns ``prompt_logprobs``, judged through the OpenAI-API base (:mod:`parity.backends.openai`).

    --backend vllm:url=http://127.0.0.1:PORT,model=NAME[,topk=K,timeout=S,max_requests=N,precision=P]

One request per prompt: ``prompt`` as the list of token ids (no text round trip, so every prompt is sent and
no tokenizer is needed), ``prompt_logprobs=k`` (vLLM's extension: ``choices[0].prompt_logprobs[i]`` is the
distribution OF prompt token i, ``{"id": {"logprob": x, ...}}``, holding the prompt token itself besides the
top k; entry 0 is null), ``logprobs=k`` with ``return_tokens_as_token_ids`` (generated tokens and their
``top_logprobs`` keys as ``"token_id:N"``) and ``n_new`` greedy tokens. The rows are then OpenAI's convention
(row i: the distribution token i was drawn from); the base still measures it from the greedy tokens. An entry
that does not hold its prompt token, or a ``prompt_token_ids`` other than the ids sent, is an
:class:`parity.backends.base.EchoMisaligned` at that position.

Tested against a fake server on loopback only (tests/parity/test_server_backends.py): no vLLM or SGLang server
can be installed on the machine the tool is developed on (no GPU runtime for them there).
"""
from __future__ import annotations

from reference.errors import InputError
from taps.archive import json_kind

from parity.backends.base import BackendEntry, BackendError, EchoMisaligned
from parity.backends.openai import OpenAIBackend

#: how a vLLM server spells a token with ``return_tokens_as_token_ids``
TOKEN_ID_PREFIX = "token_id:"


class VllmBackend(OpenAIBackend):
    """:class:`parity.backends.openai.OpenAIBackend` speaking token ids: prompts as id lists, rows from
    ``prompt_logprobs`` and ``"token_id:N"`` keys."""

    scheme = "vllm"

    def token_strings(self, model_path, cfg):
        """No tokenizer: prompts and answers carry token ids."""
        return None, {}

    def sendable(self, ids) -> bool:
        """Every list of ids in ``[0, vocab_size)`` is sent as it is."""
        return all(0 <= int(i) < self.config.vocab_size for i in ids)

    def mappable(self, token_id) -> bool:
        """Every id of the vocabulary: the answer names ids, not strings."""
        return 0 <= int(token_id) < self.config.vocab_size

    def answer(self, ids: list[int], n_new: int):
        """One token-id request -> ``(ids, greedy, rows)`` with ``rows[i]`` the distribution OF token i of
        ``ids + greedy`` (see the module docstring).

        Raises:
            InputError: an id outside the vocabulary.
            BackendError: no ``prompt_logprobs`` with one entry per prompt token, or an unreadable entry.
            EchoMisaligned: an entry without its prompt token, or ``prompt_token_ids`` other than ``ids``.
        """
        if not self.sendable(ids):
            raise InputError(f"{self.scheme} backend: prompt of {len(ids)} ids: expected ids in [0, "
                             f"{self.config.vocab_size}), found {[i for i in ids if not self.mappable(i)][:5]}")
        body = {"model": self.model, "prompt": ids, "max_tokens": int(n_new), "temperature": 0,
                "logprobs": self.topk, "prompt_logprobs": self.topk, "return_tokens_as_token_ids": True}
        ch = self._request("POST", "/v1/completions", body).get("choices")
        if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
            raise BackendError(f"backend {self.name}: POST /v1/completions: expected 'choices' as a list of one "
                               f"or more objects, found {json_kind(ch)}")
        ch = ch[0]
        ran = ch.get("prompt_token_ids")  # the ids the server ran, where it says: first, so a drop is located
        if ran is not None and [int(t) for t in ran] != ids:
            p = next((i for i, (a, b) in enumerate(zip(ran, ids)) if int(a) != b), min(len(ran), len(ids)))
            raise EchoMisaligned(f"backend {self.name}: expected prompt_token_ids to be the {len(ids)} ids sent, "
                                 f"found {len(ran)} ids differing at position {p}: its rows cannot be attributed "
                                 f"to positions", p)
        plp = ch.get("prompt_logprobs")
        if not isinstance(plp, list) or len(plp) != len(ids):
            found = f"{len(plp)} entries" if isinstance(plp, list) else repr(plp)[:60]
            raise BackendError(f"backend {self.name}: expected choices[0].prompt_logprobs with one entry per prompt "
                               f"token ({len(ids)}), found {found} (a server without vLLM's prompt_logprobs)")
        rows = []
        for p, d in enumerate(plp):
            if d is None:
                rows.append(None)
                continue
            try:
                row = {int(k): v for k, v in self.logprob_row(d, f"prompt_logprobs[{p}]").items()}
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                raise BackendError(f"backend {self.name}: prompt_logprobs[{p}]: expected {{id: {{'logprob': x}}}}, "
                                   f"found {str(d)[:80]!r} ({type(e).__name__})") from e
            if ids[p] not in row:
                raise EchoMisaligned(f"backend {self.name}: expected prompt_logprobs[{p}] to hold prompt token {p} "
                                     f"({ids[p]}), found ids {sorted(row)[:8]}: its rows cannot be attributed to "
                                     f"positions", p)
            rows.append(row)
        lp = ch.get("logprobs") or {}
        toks = (lp.get("tokens") or []) if isinstance(lp, dict) else None
        tops = (lp.get("top_logprobs") or []) if isinstance(lp, dict) else None
        if not isinstance(toks, list) or not isinstance(tops, list) or len(tops) != len(toks):
            raise BackendError(f"backend {self.name}: POST /v1/completions: expected choices[0].logprobs with "
                               f"'tokens' and one 'top_logprobs' entry per token, found {str(lp)[:80]!r}")
        greedy = [self._id_of(s) for s in toks]
        for j, d in enumerate(tops):
            d = self.logprob_row(d, f"choices[0].logprobs.top_logprobs[{j}]")
            rows.append(None if d is None else {i: v for s, v in d.items() if (i := self._id_of(s)) is not None})
        return ids, greedy, rows

    def _id_of(self, s):
        """``"token_id:N"`` -> N (None for another spelling or an id outside the vocabulary)."""
        s = str(s)
        if not s.startswith(TOKEN_ID_PREFIX) or not s[len(TOKEN_ID_PREFIX):].isdigit():
            return None
        i = int(s[len(TOKEN_ID_PREFIX):])
        return i if self.mappable(i) else None


# a vLLM-style server: token-id prompts, prompt_logprobs (docs/outside-engines.md)
BACKEND = BackendEntry("vllm", VllmBackend,
                       {"url": str, "model": str, "topk": int, "timeout": int, "max_requests": int, "precision": str},
                       help="a running vLLM-style completions server (token-id prompts, prompt_logprobs), "
                            "docs/outside-engines.md")
