"""The OpenAI-API base of the server backends: a running OpenAI-compatible completions server judged through
its ``/v1/completions`` answers (the :class:`parity.backends.base.TopkServer` protocol).

A server gives no full logits, only per-position top-k logprobs: of the prompt (``echo`` + ``logprobs``)
and of a greedy continuation. So a server backend is not a sequence backend: ``qwen4exp parity`` runs one
``kl-topk`` row with it (parity.harness.topk; the scenarios are skipped, each with its reason).

:class:`OpenAIBackend` speaks the API as OpenAI documents it: the prompt travels as text (the model's
tokenizer decodes the ids; only prompts whose ids survive decode -> encode are sent), the answer echoes the
prompt's tokens as strings with ``top_logprobs`` keyed by token string, mapped back to ids through the
tokenizer, and the echoed strings are checked against the prompt's. Which row the server puts at
``top_logprobs[i]`` -- OpenAI's distribution *of* token i, or the distribution *after* token i -- is measured
from the greedy continuation (the generated token is the argmax of the row it was drawn from) and reported.
A server's own ways live in a subclass in its own file, registered in parity.backends.registry:
``openai`` (parity.backends.llama_cpp_server: llama_cpp.server) and ``vllm`` (parity.backends.vllm: token-id
prompts, ``prompt_logprobs``). A subclass overrides the hooks :meth:`OpenAIBackend.server_tokens` (the ids a
server tokenizes a text into), :attr:`OpenAIBackend.echo_note` and, for another transport,
:meth:`OpenAIBackend.answer` (one request -> the rows per token in the server's convention).

Requests are bounded: ``max_requests`` (default 64) and ``timeout`` seconds each (default 30).

``precision`` (default ``float32``) is what the server computes in, as its operator knows it: ``float32`` judges
it as a float32 engine; ``bf16`` / ``fp16`` / ``fp8`` judge it with the floor of an engine that rounds every
activation store (residual, block inputs/outputs, KV cache) to that format (parity.harness.floor.stores_of),
and its log-probabilities with that format's rounding -- e.g. ``fp16`` for llama.cpp's default F16 KV cache.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path


from reference.errors import InputError
from taps.archive import json_kind

from parity.backends.base import BackendError, EchoMisaligned, TopkServer  # noqa: F401 - EchoMisaligned: its old home


def server_root(url: str) -> str:
    """The server's root URL: ``url`` without trailing slashes and without a final ``/v1`` (OpenAI clients take
    the base URL with it, ``http://HOST:PORT/v1``; this backend adds ``/v1/...`` to every request itself)."""
    u = str(url).rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


class OpenAIBackend(TopkServer):
    """An OpenAI completions-API client (text prompts, echoed token strings); see the module docstring."""

    #: the backend's name in ``name`` (``SCHEME:URL``) and in its messages (a subclass: its registry name)
    scheme = "openai"
    #: what the server is known to do that misaligns an echo, appended to :class:`EchoMisaligned`'s message
    echo_note = ""
    #: the ``precision=`` values a server can be judged at (float64 is the reference's own, no server's)
    PRECISION_CHOICES = ("float32", "bf16", "fp16", "fp8")

    def __init__(self, model_path, cfg, url, model, topk, timeout, max_requests):
        self.model_path, self.config = model_path, cfg
        self.url, self.model, self.topk = server_root(url), model, int(topk)
        self.timeout, self.max_requests = float(timeout), int(max_requests)
        self.requests, self.retokenized = 0, 0
        self.name = f"{self.scheme}:{self.url}"
        self._tok, self._str2id = self.token_strings(model_path, cfg)
        self._mapped = set(self._str2id.values())
        self.convention = None  # 'openai' | 'after-token', measured from the greedy tokens
        self._votes = {"openai": 0, "after-token": 0}

    def token_strings(self, model_path, cfg):
        """``(tokenizer, {decoded single-token string: id})`` the prompts and answers travel through (text).
        Raises InputError: the checkpoint has no ``tokenizer.json``."""
        tok = _tokenizer(model_path, self.scheme)
        return tok, _string_map(tok, cfg.vocab_size)

    @classmethod
    def open(cls, model_path, *, url=None, model=None, topk=20, timeout=30, max_requests=64, precision="float32",
             page_size=None, perturb=None, **opts):
        """Connect (one ``GET /v1/models`` within ``timeout``), then measure the row convention (:meth:`_probe`).

        Raises:
            InputError: no url, a non-http url, a precision outside :data:`PRECISION_CHOICES`, unknown options.
            BackendError: the server does not answer.
        """
        from reference.config import load_config
        if opts:
            raise InputError(f"{cls.scheme} backend options: expected url, model, topk, timeout, max_requests, "
                             f"precision; found {sorted(opts)}")
        if precision not in cls.PRECISION_CHOICES:
            raise InputError(f"{cls.scheme}:precision: expected one of {', '.join(cls.PRECISION_CHOICES)} (what the "
                             f"server computes in), found {precision!r}")
        if not url or not str(url).startswith(("http://", "https://")):
            raise InputError(f"{cls.scheme} backend: expected url=http://HOST:PORT, found "
                             + ("no url= option" if url is None else repr(url)))
        if perturb is not None:
            raise BackendError(f"{cls.scheme} backend: perturb: not supported")
        be = cls(model_path, load_config(model_path), url, model or "", topk, timeout, max_requests)
        be.precision = str(precision)
        doc = be._request("GET", "/v1/models")
        if not be.model:
            data = doc.get("data")
            first = data[0] if isinstance(data, list) and data else {}
            be.model = str(first.get("id", "")) if isinstance(first, dict) else ""
        be._probe()
        return be

    def _probe(self, tries: int = 3):
        """Measure the row convention before judging: short prompts of mappable, sendable ids with 8
        greedy tokens each, until the greedy tokens have voted (at most ``tries`` requests)."""
        good = [i for i in range(self.config.vocab_size) if self.mappable(i)]
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
                doc = json.loads(r.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise BackendError(f"backend {self.name}: {method} {path}: expected a JSON answer within "
                               f"{self.timeout:g} s, found {type(e).__name__}: {e}") from e
        if not isinstance(doc, dict):  # every endpoint answers an object; a list here crashed the readers
            raise BackendError(f"backend {self.name}: {method} {path}: expected a JSON object, found "
                               f"{json_kind(doc)}")
        return doc

    def logprob_row(self, d, where: str) -> dict | None:
        """A ``top_logprobs`` entry checked: None, or ``{key: float}`` from a JSON object whose values are
        log-probabilities (numbers; -inf allowed, NaN and +inf not: no probability is NaN or infinite).

        Raises:
            BackendError: naming ``where``, what was expected and what was found.
        """
        if d is None:
            return None
        if not isinstance(d, dict):
            raise BackendError(f"backend {self.name}: {where}: expected an object {{token: logprob}} or null, "
                               f"found {json_kind(d)}")
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and "logprob" in v:  # vLLM's prompt_logprobs: {id: {"logprob": x, ...}}
                v = v["logprob"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v == float("inf"):
                raise BackendError(f"backend {self.name}: {where}: expected log-probabilities (numbers, -inf "
                                   f"allowed), found {v!r} for {k!r}")
            out[k] = float(v)
        return out

    def sendable(self, ids) -> bool:
        """Whether ``ids`` survive decode -> encode with the model's tokenizer (the API carries text)."""
        text = self._tok.decode(list(ids), skip_special_tokens=False)
        return self._tok.encode(text, add_special_tokens=False).ids == list(ids)

    def mappable(self, token_id) -> bool:
        """Whether ``token_id`` decodes to a string no other id decodes to (so a logprob keyed by that string is
        this id's)."""
        return int(token_id) in self._mapped

    def server_tokens(self, text: str) -> list[int] | None:
        """The ids the server tokenizes ``text`` into, where it says (a tokenize endpoint); None: it does not
        say (the OpenAI API has no such endpoint). Asked only when the echoed strings differ from the prompt's."""
        return None

    def prompt_topk(self, ids, n_new: int = 1):
        """One completions request: ``ids`` with top-k logprobs, plus ``n_new`` greedy tokens.

        Returns ``(rows, greedy, ids)`` as :class:`parity.backends.base.TopkServer` states (``ids``: the ids the
        server ran -- its own tokenization of the text when it differs, from :meth:`server_tokens`):
        ``rows[p]`` = {id: logprob} of the distribution *after* position p (p = 0 .. len(ids)+n_new-2, None
        where the server gave none), ``greedy`` the generated ids.
        Raises:
            InputError: ``ids`` are not :meth:`sendable`.
            BackendError: the server's answer does not hold the prompt's tokens, or no greedy token tells the
                row convention.
            EchoMisaligned: the answer holds the tokens but drops or moves some (a server defect, located).
        """
        ids, greedy, rows = self.answer([int(t) for t in ids], int(n_new))
        return self._rows_after(ids, greedy, rows)

    def answer(self, ids: list[int], n_new: int):
        """One request -> ``(ran, greedy, rows)``: the prompt ids the server ran, the generated ids (None where a
        token maps to no single id) and ``rows[i]`` the server's row at token i of ``ran + greedy`` in its own
        convention ({id: logprob}, None where it gave none). Here: the text prompt, echoed. Raises as
        :meth:`prompt_topk`."""
        if not self.sendable(ids):
            raise InputError(f"{self.scheme} backend: prompt of {len(ids)} ids: expected ids that survive "
                             f"decode -> encode (the completions API carries text), found otherwise")
        text = self._tok.decode(ids, skip_special_tokens=False)
        body = {"model": self.model, "prompt": text, "max_tokens": int(n_new), "temperature": 0, "echo": True,
                "logprobs": self.topk}
        doc = self._request("POST", "/v1/completions", body)
        ch = doc.get("choices")
        if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
            raise BackendError(f"backend {self.name}: POST /v1/completions: expected 'choices' as a list of one "
                               f"or more objects, found {json_kind(ch)}")
        lp = ch[0].get("logprobs") or {}
        toks = (lp.get("tokens") or []) if isinstance(lp, dict) else None
        tops = (lp.get("top_logprobs") or []) if isinstance(lp, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, str) for t in toks) or not isinstance(tops, list):
            raise BackendError(f"backend {self.name}: POST /v1/completions: expected choices[0].logprobs with "
                               f"'tokens' (strings) and 'top_logprobs' (a list), found {str(lp)[:80]!r}")
        if len(tops) != len(toks):  # rows are read by token index: a shorter list would shift or cut them
            raise BackendError(f"backend {self.name}: POST /v1/completions: expected one top_logprobs entry per "
                               f"token ({len(toks)}), found {len(tops)}")
        tops = [self.logprob_row(d, f"choices[0].logprobs.top_logprobs[{i}]") for i, d in enumerate(tops)]
        if len(toks) < len(ids) or "".join(toks[:len(ids)]) != "".join(
                self._tok.decode([t], skip_special_tokens=False) for t in ids).replace("\ufffd", ""):
            # the echoed strings differ (the server's token strings, e.g. byte pieces, or its own tokenization
            # of the text): judge the ids it ran (where it says), counted as retokenized only when those ids
            # differ from the prompt's
            srv = self.server_tokens(text)
            if srv and len(toks) >= len(srv) and srv != ids:
                ids = srv
                self.retokenized += 1
        if len(toks) < len(ids):
            raise BackendError(f"backend {self.name}: expected the echo of the {len(ids)} prompt tokens, found "
                               f"{len(toks)} tokens not matching them (the server tokenized the text differently)")
        p = self._echo_misaligned(toks, ids)
        if p is not None:  # a row dropped or moved: every later row would be judged at the wrong position
            raise EchoMisaligned(
                f"backend {self.name}: expected the echo to hold prompt token {p} ({ids[p]}, "
                f"{self._tok.decode([ids[p]], skip_special_tokens=False)!r}) at echo position {p}, found "
                f"{toks[p]!r}: the server dropped or moved echoed tokens, so its top_logprobs rows cannot be "
                f"attributed to positions" + (f" ({self.echo_note})" if self.echo_note else ""), p)
        greedy = [self._id_of(s) for s in toks[len(ids):]]  # generation may stop early (an end-of-sequence token)
        rows = [None if d is None else {i: float(v) for s, v in d.items() if (i := self._id_of(s)) is not None}
                for d in tops]
        return ids, greedy, rows

    def _rows_after(self, ids, greedy, rows):
        """The rows *after* each position, from the server's rows per token: where does the generated token's
        row sit? OpenAI: ``rows[i]`` is the row token i was drawn from; llama-cpp-python 0.3.36: the row *after*
        token i. Greedy: each generated token is the argmax of its row, so count the matches of both readings
        (over every request so far) and read the rows by the winner."""
        T, n_new = len(ids), len(greedy)

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
            why = ("no greedy token was mappable" if all(g is None for g in greedy) and not any(v.values()) else
                   f"the mappable greedy tokens were the argmax of neither reading's row or of both equally often "
                   f"(votes so far: openai {v['openai']}, after-token {v['after-token']}): the server's greedy "
                   f"tokens do not follow its own top_logprobs")
            raise BackendError(f"backend {self.name}: cannot tell which row top_logprobs[i] is (OpenAI's "
                               f"distribution of token i, or the one after it): {why}")
        after = list(rows[1:]) + [None] if self.convention == "openai" else list(rows)  # openai: after p = rows[p+1]
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


def _tokenizer(model_path, scheme: str = "openai"):
    from tokenizers import Tokenizer
    p = Path(model_path) / "tokenizer.json"
    if not p.is_file():
        raise InputError(f"{scheme} backend: expected {str(p)!r} (prompts travel as text), found nothing there")
    return Tokenizer.from_file(str(p))


def _string_map(tok, vocab) -> dict:
    """Decoded single-token string -> id, for the strings exactly one id decodes to (others are ambiguous:
    their logprob cannot be attributed and counts as unmapped)."""
    seen: dict[str, list[int]] = {}
    for i in range(min(vocab, tok.get_vocab_size())):
        seen.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    return {s: v[0] for s, v in seen.items() if len(v) == 1 and s and "\ufffd" not in s}
