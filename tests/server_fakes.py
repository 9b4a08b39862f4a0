"""Servers that answer top-k logprobs computed from the reference model, as a correct float32 server would, for
the kl-topk row's tests (tests/ is on sys.path): in process (:class:`ReferenceTopkServer`, the TopkServer
protocol) or as a vLLM-style HTTP server on loopback (:func:`serve_vllm`, stdlib http.server)."""
from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from parity.backends.base import TopkServer


def log_softmax_f32(x) -> np.ndarray:
    """Log-probabilities the way a float32 server computes them (llama-cpp-python's ``logits_to_logprobs``:
    max subtracted, exp, sum, log, all in float32)."""
    x = np.asarray(x, np.float32)
    y = x - x.max(-1, keepdims=True)
    return y - np.log(np.exp(y).sum(-1, keepdims=True))


class ReferenceLogprobs:
    """The distributions a correct server gives: the reference model evaluated in float64 and rounded to float32
    logits (another correct float32 evaluation than the truth's float32 forward), float32 log-softmax.

    ``fault_rel``: a logit fault added to every row, ``fault_rel x`` the row's logit scale (std over the
    vocabulary) times a fixed standard-normal direction: a fault of relative size ``fault_rel``.
    """

    def __init__(self, model, fault_rel: float = 0.0, seed: int = 0):
        self.model, self.fault_rel, self.seed = model, float(fault_rel), seed
        self.config = model.config

    def run(self, ids, n_new):
        """``(greedy, lp)``: ``n_new`` greedy ids after ``ids``, and ``lp [T + n_new, V]`` float32 where row i is
        the distribution OF token i of ``ids + greedy`` (row 0: none, NaN)."""
        ids, greedy = [int(t) for t in ids], []
        for _ in range(n_new):
            greedy.append(int(np.argmax(self._logits(ids + greedy)[-1])))
        x = self._logits(ids + greedy)
        lp = np.full((len(ids) + n_new, x.shape[1]), np.nan, np.float32)
        lp[1:] = log_softmax_f32(x[:-1])
        return greedy, lp

    def _logits(self, seq):
        from parity.harness.kl import logit_scale
        x = np.asarray(self.model.forward(seq), np.float64)
        if self.fault_rel:
            d = np.random.default_rng(self.seed).standard_normal(x.shape)
            x = x + self.fault_rel * logit_scale(x)[:, None] * d
        return x.astype(np.float32)


def top(lp_row, k, also=()):
    """{id: logprob} of the k largest of ``lp_row`` (float32 values as Python floats), plus the ids ``also``."""
    ids = list(np.argsort(-lp_row, kind="stable")[:k]) + [i for i in also]
    return {int(i): float(lp_row[i]) for i in ids}


class ReferenceTopkServer(TopkServer):
    """A TopkServer answering from :class:`ReferenceLogprobs` in process. ``topk``: k; ``sendable``: a predicate
    (default: every prompt); ``no_rows``: answer every position without a row (a server that gives none)."""

    convention, max_requests = "openai", 64

    def __init__(self, logprobs: ReferenceLogprobs, topk=20, sendable=None, no_rows=False):
        self.lp, self.topk, self.config = logprobs, int(topk), logprobs.config
        self._sendable, self.no_rows = sendable, no_rows
        self.name = "reference-topk-server"
        self.requests, self.retokenized = 0, 0

    def sendable(self, ids):
        return True if self._sendable is None else bool(self._sendable(ids))

    def mappable(self, token_id):
        return 0 <= int(token_id) < self.config.vocab_size

    def prompt_topk(self, ids, n_new=1):
        self.requests += 1
        greedy, lp = self.lp.run(ids, n_new)
        rows = [None if self.no_rows else top(lp[p], self.topk) for p in range(1, lp.shape[0])]
        return rows, greedy, [int(t) for t in ids]


@contextlib.contextmanager
def serve_vllm(logprobs: ReferenceLogprobs, drop: int | None = None):
    """A vLLM-style completions server on a free loopback port, answering from ``logprobs``; yields
    ``(url, bodies)`` (``bodies``: every completions request body received). ``drop``: the server runs the
    prompt without its token at this position (and says so in ``prompt_token_ids``), a misaligned answer.

    Answers: ``GET /v1/models``; ``POST /v1/completions`` with ``prompt`` a list of ids, ``prompt_logprobs=k``,
    ``logprobs=k``, ``return_tokens_as_token_ids``: ``choices[0].prompt_logprobs[i]`` {str(id): {"logprob",
    "rank", "decoded_token"}} over the top k and prompt token i (entry 0 null), ``prompt_token_ids``, and
    ``logprobs`` (tokens / token_logprobs / top_logprobs keyed ``token_id:N``) for the greedy tokens."""
    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, doc, code=200):
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send({"object": "list", "data": [{"id": "reference", "object": "model"}]})
            self._send({"error": "not found"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                return self._send({"error": "not found"}, 404)
            bodies.append(body)
            ids = [int(t) for t in body["prompt"]]
            if drop is not None and drop < len(ids):
                ids = ids[:drop] + ids[drop + 1:]
            k, kp = int(body.get("logprobs") or 0), int(body.get("prompt_logprobs") or 0)
            greedy, lp = logprobs.run(ids, int(body["max_tokens"]))
            T = len(ids)
            plp = [None] + [{str(i): {"logprob": v, "rank": 1 + int(np.sum(lp[p] > v)), "decoded_token": ""}
                             for i, v in top(lp[p], kp, also=[ids[p]]).items()} for p in range(1, T)]
            gen = [top(lp[T + j], k, also=[g]) for j, g in enumerate(greedy)]
            self._send({"id": "cmpl-0", "object": "text_completion", "model": body.get("model"), "choices": [{
                "index": 0, "text": "", "finish_reason": "length", "prompt_token_ids": ids, "prompt_logprobs": plp,
                "logprobs": {"tokens": [f"token_id:{g}" for g in greedy],
                             "token_logprobs": [float(lp[T + j, g]) for j, g in enumerate(greedy)],
                             "top_logprobs": [{f"token_id:{i}": v for i, v in r.items()} for r in gen],
                             "text_offset": [0] * len(greedy)}}]})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", bodies
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)
