"""The ``openai`` backend: an OpenAI-compatible completions server, with what llama_cpp.server (llama-cpp-python
0.3.36) does its own way handled, judged through the OpenAI-API base (:mod:`parity.backends.openai`).

    --backend openai:url=http://127.0.0.1:PORT,model=NAME[,topk=K,timeout=S,max_requests=N,precision=P]

llama_cpp.server's ways, each measured on 0.3.36 (docs/outside-engines.md, findings E and G):
- ``top_logprobs[i]`` is the distribution *after* token i (OpenAI's is the one *of* token i): the base measures
  the convention from the greedy tokens, so nothing is assumed here; the run reports ``after-token``.
- it may tokenize the echoed text its own way: its ``/extras/tokenize`` says which ids it ran
  (:meth:`LlamaCppServerBackend.server_tokens`), and those are judged.
- its echo loop skips every prompt token equal to its BOS id (a GGUF without one gets the default id 11), so
  later rows move: caught by the base's echo check, and the message says why (:attr:`echo_note`).
"""
from __future__ import annotations

from parity.backends.base import BackendEntry, BackendError
from parity.backends.openai import OpenAIBackend


class LlamaCppServerBackend(OpenAIBackend):
    """:class:`parity.backends.openai.OpenAIBackend` with llama_cpp.server's tokenize endpoint and its echo note."""

    echo_note = ("llama-cpp-python 0.3.36 skips every echoed token equal to its BOS id; a GGUF without a BOS id "
                 "gets the default 11")

    def server_tokens(self, text: str) -> list[int] | None:
        """The ids llama_cpp.server tokenizes ``text`` into (``POST /extras/tokenize``); None when it does not
        answer with a token list (one request, counted against ``max_requests``)."""
        try:
            return [int(t) for t in self._request("POST", "/extras/tokenize", {"input": text})["tokens"]]
        except (BackendError, KeyError, TypeError, ValueError):
            return None


# an outside engine behind an OpenAI-style HTTP server (docs/outside-engines.md)
BACKEND = BackendEntry("openai", LlamaCppServerBackend,
                       {"url": str, "model": str, "topk": int, "timeout": int, "max_requests": int, "precision": str},
                       help="a running OpenAI-style completions server, docs/outside-engines.md")
