"""The ``openai`` backend: a running OpenAI-compatible server judged through its completions API.

    --backend openai:url=http://127.0.0.1:PORT,model=NAME[,topk=K,timeout=S,max_requests=N]

A server gives no full logits, only per-position top-k logprobs: of the prompt (``echo`` + ``logprobs``)
and of a greedy continuation. So this backend is not a sequence backend: ``qwen4exp parity`` runs one
``kl-topk`` row with it (the scenarios are skipped, each with its reason). Per position the server's
top-k (its tokens mapped back to ids through the model's tokenizer) is compared with the truth's full
distribution coarse-grained to the same k ids plus one "tail" bucket: the KL of that coarse-graining is
a lower bound of the full KL (data-processing inequality), so a failure is a real divergence; the tail
mass is stated. Top-1 is compared on the top-k.

The prompt travels as text (the completions API takes no token ids on llama_cpp.server), so only
prompts whose ids survive decode -> encode are sent, and the server's echoed tokens are checked against
them. Which row the server puts at ``top_logprobs[i]`` -- OpenAI's distribution *of* token i, or the
distribution *after* token i (llama-cpp-python 0.3.36) -- is measured from the greedy continuation
(the generated token is the argmax of the row it was drawn from) and reported.

Requests are bounded: ``max_requests`` (default 64) and ``timeout`` seconds each (default 30).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path


from reference.errors import InputError

from parity.backends.base import BackendEntry, BackendError


class EchoMisaligned(BackendError):
    """The server's echo dropped or moved prompt tokens: its rows cannot be attributed to positions.
    ``position``: the first prompt position whose echoed token is not the prompt's."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = int(position)


class OpenAIBackend:
    """A completions-API client with the harness's top-k comparison; see the module docstring."""

    precision = "float32"
    capabilities = {"page_sizes": None, "batched_decode": False, "perturb": False, "state_arrays": False,
                    "snapshot_file": False, "rollback": False, "snapshot": False, "taps": False,
                    "sequences": False, "topk_only": True}

    def __init__(self, model_path, cfg, url, model, topk, timeout, max_requests):
        self.model_path, self.config = model_path, cfg
        self.url, self.model, self.topk = url.rstrip("/"), model, int(topk)
        self.timeout, self.max_requests = float(timeout), int(max_requests)
        self.requests = 0
        self.name = f"openai:{self.url}"
        self._tok = _tokenizer(model_path)
        self._str2id = _string_map(self._tok, cfg.vocab_size)
        self.convention = None  # 'openai' | 'after-token', measured from the greedy tokens
        self._votes = {"openai": 0, "after-token": 0}

    # the harness checks for these protocol names; this backend is not a sequence backend
    def _no(self, *a, **k):
        raise BackendError(f"backend {self.name}: not a sequence backend (an OpenAI-compatible server gives "
                           f"top-k logprobs only; qwen4exp parity runs its kl-topk row)")
    new_sequence = prefill = decode = forward_tokens = rollback = snapshot = restore = position = free = _no

    @classmethod
    def open(cls, model_path, *, url=None, model=None, topk=20, timeout=30, max_requests=64, page_size=None,
             perturb=None, **opts):
        """Connect (one ``GET /v1/models`` within ``timeout``).

        Raises:
            InputError: no url, a non-http url, unknown options. BackendError: the server does not answer.
        """
        from reference.config import load_config
        if opts:
            raise InputError(f"openai backend options: expected url, model, topk, timeout, max_requests; found {sorted(opts)}")
        if not url or not str(url).startswith(("http://", "https://")):
            raise InputError(f"openai backend: expected url=http://HOST:PORT, found {url!r}")
        if perturb is not None:
            raise BackendError("openai backend: perturb: not supported")
        be = cls(model_path, load_config(model_path), url, model or "", topk, timeout, max_requests)
        doc = be._request("GET", "/v1/models")
        if not be.model:
            data = doc.get("data") or [{}]
            be.model = data[0].get("id", "")
        be._probe()
        return be

    def _probe(self, tries: int = 3):
        """Measure the row convention before judging: short prompts of mappable, sendable ids with 8
        greedy tokens each, until the greedy tokens have voted (at most ``tries`` requests)."""
        good = sorted(set(self._str2id.values()))
        for t in range(tries):
            ids = good[t * 7:(t + 1) * 7]
            if len(ids) < 2 or not self.sendable(ids):
                continue
            try:
                self.prompt_topk(ids, n_new=8)
            except BackendError:
                continue
            if self.convention is not None:
                return

    def _request(self, method, path, body=None) -> dict:
        if self.requests >= self.max_requests:
            raise BackendError(f"backend {self.name}: expected at most {self.max_requests} requests "
                               f"(max_requests=), found one more needed")
        self.requests += 1
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise BackendError(f"backend {self.name}: {method} {path}: expected a JSON answer within "
                               f"{self.timeout:g} s, found {type(e).__name__}: {e}") from e

    def sendable(self, ids) -> bool:
        """Whether ``ids`` survive decode -> encode with the model's tokenizer (the API carries text)."""
        text = self._tok.decode(list(ids), skip_special_tokens=False)
        return self._tok.encode(text, add_special_tokens=False).ids == list(ids)

    def prompt_topk(self, ids, n_new: int = 1):
        """One completions request: ``ids`` echoed with top-k logprobs, plus ``n_new`` greedy tokens.

        Returns ``(rows, greedy, ids)`` (``ids``: the ids the server ran -- its own tokenization of the
        text when it differs, from ``/extras/tokenize``): ``rows[p]`` = {id: logprob} of the distribution *after* position p
        (p = 0 .. len(ids)+n_new-2, None where the server gave none), ``greedy`` the generated ids.
        Raises:
            InputError: ``ids`` do not survive the text round trip.
            BackendError: the server's answer does not echo the prompt's tokens.
            EchoMisaligned: the echo holds the tokens but drops or moves some (a server defect, located).
        """
        ids = [int(t) for t in ids]
        if not self.sendable(ids):
            raise InputError(f"openai backend: prompt of {len(ids)} ids: expected ids that survive "
                             f"decode -> encode (the completions API carries text), found otherwise")
        text = self._tok.decode(ids, skip_special_tokens=False)
        body = {"model": self.model, "prompt": text, "max_tokens": int(n_new), "temperature": 0, "echo": True,
                "logprobs": self.topk}
        doc = self._request("POST", "/v1/completions", body)
        lp = (doc.get("choices") or [{}])[0].get("logprobs") or {}
        toks, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
        if len(toks) < len(ids) or "".join(toks[:len(ids)]) != "".join(
                self._tok.decode([t], skip_special_tokens=False) for t in ids).replace("\ufffd", ""):
            # the echoed strings differ (the server's token strings, e.g. byte pieces, or its own tokenization
            # of the text): judge the ids it ran (its /extras/tokenize); counted as retokenized only when
            # those ids differ from the prompt's
            try:
                srv = [int(t) for t in self._request("POST", "/extras/tokenize", {"input": text})["tokens"]]
            except (BackendError, KeyError, TypeError, ValueError):
                srv = None
            if srv and len(toks) >= len(srv) and srv != ids:
                ids = srv
                self.retokenized = getattr(self, "retokenized", 0) + 1
        if len(toks) < len(ids):
            raise BackendError(f"backend {self.name}: expected the echo of the {len(ids)} prompt tokens, found "
                               f"{len(toks)} tokens not matching them (the server tokenized the text differently)")
        p = self._echo_misaligned(toks, ids)
        if p is not None:  # a row dropped or moved: every later row would be judged at the wrong position
            raise EchoMisaligned(
                f"backend {self.name}: expected the echo to hold prompt token {p} ({ids[p]}, "
                f"{self._tok.decode([ids[p]], skip_special_tokens=False)!r}) at echo position {p}, found "
                f"{toks[p]!r}: the server dropped or moved echoed tokens, so its top_logprobs rows cannot be "
                f"attributed to positions (llama-cpp-python 0.3.36 skips every echoed token equal to its BOS id; a "
                f"GGUF without a BOS id gets the default 11)", p)
        n_new = len(toks) - len(ids)  # generation may stop early (an end-of-sequence token)
        greedy = [self._id_of(s) for s in toks[len(ids):]]
        rows = [None if d is None else {i: float(v) for s, v in d.items() if (i := self._id_of(s)) is not None}
                for d in tops]
        # where does the generated token's row sit? OpenAI: top_logprobs[i] is the row token i was drawn
        # from; llama-cpp-python 0.3.36: the row *after* token i. Greedy: each generated token is the
        # argmax of its row, so count the matches of both readings (over every request so far)
        T = len(ids)

        def best(r):
            return max(r, key=r.get) if r else None
        for j, g in enumerate(greedy):
            if g is None:
                continue
            if T + j < len(rows) and best(rows[T + j]) == g:
                self._votes["openai"] += 1
            if best(rows[T + j - 1]) == g:
                self._votes["after-token"] += 1
        v = self._votes
        if v["after-token"] != v["openai"]:
            self.convention = "after-token" if v["after-token"] > v["openai"] else "openai"
        if self.convention is None:
            raise BackendError(f"backend {self.name}: cannot tell which row top_logprobs[i] is (OpenAI's "
                               f"distribution of token i, or the one after it): no greedy token was mappable")
        if self.convention == "openai":  # row after position p = top_logprobs[p + 1]
            after = rows[1:] + [None]
        else:
            after = rows
        return after[:T + n_new - 1], greedy, ids

    def _echo_misaligned(self, toks, ids) -> int | None:
        """The first prompt position whose echoed token string is not that prompt token's, or None.

        Tokens whose string is a partial UTF-8 piece (U+FFFD on either side, or an empty server string) cannot be
        compared and are passed over; every other echoed string must equal the token's own decoding.
        """
        for p, t in enumerate(ids):
            want, got = self._tok.decode([int(t)], skip_special_tokens=False), toks[p]
            if not got or "\ufffd" in want or "\ufffd" in got:
                continue
            if got != want:
                return p
        return None

    def _id_of(self, s):
        return self._str2id.get(s)

    def close(self):
        """Nothing to release (the server is not ours)."""


def _tokenizer(model_path):
    from tokenizers import Tokenizer
    p = Path(model_path) / "tokenizer.json"
    if not p.is_file():
        raise InputError(f"openai backend: expected {str(p)!r} (prompts travel as text), found nothing there")
    return Tokenizer.from_file(str(p))


def _string_map(tok, vocab) -> dict:
    """Decoded single-token string -> id, for the strings exactly one id decodes to (others are ambiguous:
    their logprob cannot be attributed and counts as unmapped)."""
    seen: dict[str, list[int]] = {}
    for i in range(min(vocab, tok.get_vocab_size())):
        seen.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    return {s: v[0] for s, v in seen.items() if len(v) == 1 and s and "\ufffd" not in s}


# an outside engine behind an OpenAI-style HTTP server (docs/outside-engines.md)
BACKEND = BackendEntry("openai", OpenAIBackend,
                       {"url": str, "model": str, "topk": int, "timeout": int, "max_requests": int},
                       help="a running OpenAI-style completions server, docs/outside-engines.md")
