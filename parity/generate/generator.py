"""The generation loop: :class:`Generator` (prefill + decode over any :class:`parity.backends.Backend`, single or
batched, with stop conditions, streaming and timings), :class:`BackendLM` (the thin adapter) opened by
:func:`open_lm`, and :class:`StreamDecoder` (incremental detokenisation)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from parity.generate.sampling import Sampler, SamplingParams
from reference.errors import InputError, UserError
from reference.session import check_ids

__all__ = ["NOISE_NOTE", "ContextError", "DeviceUnavailableError", "StreamDecoder", "BackendLM", "open_lm",
           "GenerationResult", "Generator", "first_divergence"]

NOISE_NOTE = "note: the bundled 'tiny' model has random weights, so its output is noise"


class ContextError(InputError):
    """A prompt that does not fit the context."""


class DeviceUnavailableError(UserError, RuntimeError):
    """A GPU was asked for and none is usable."""


# ----------------------------------------------------------------------------------------------- streaming
class StreamDecoder:
    """Incremental detokenisation: :meth:`push` one id, get the text it completes (possibly "").

    Text is emitted only once it no longer ends in an incomplete UTF-8 sequence (decoded as U+FFFD),
    so the concatenated pieces equal ``tokenizer.decode(all_ids)``. Work per push is bounded: only the
    ids since the last emitted boundary are re-decoded.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one token id; returns the newly completed text ("" while the tail decodes to an incomplete
        character, U+FFFD)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end: emitted as decoded)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


# ----------------------------------------------------------------------------------------------- models
class BackendLM:
    """The generator's view of a :class:`parity.backends.Backend` (the one model protocol): a thin adapter
    that starts a sequence on a prompt, decodes the live sequences as one batch and frees them.

    Attributes:
        backend: the wrapped backend; config, vocab_size: its model's; max_context: the positions a
            sequence may hold (the backend's ``max_positions`` when it has one, else the config's
            ``max_position_embeddings``); step_greedy: None when the backend has no ``decode_greedy``.
    """

    def __init__(self, backend, max_context: int | None = None):
        self.backend = backend
        self.config = backend.config
        self.vocab_size = int(self.config.vocab_size)
        lim = max_context or getattr(backend, "max_positions", None)
        self.max_context = int(lim or self.config.max_position_embeddings)
        if getattr(backend, "decode_greedy", None) is None:
            self.step_greedy = None

    def start(self, prompt_ids):
        """A new sequence prefilled with ``prompt_ids`` (int64); returns ``(handle, logits [V])`` of the last
        prompt position (``Backend.prefill_last`` when the backend has it: no ``[T, V]`` logits kept). The
        sequence is freed when the prefill raises."""
        be = self.backend
        h = be.new_sequence()
        try:
            from parity.backends.base import prefill_last_of
            logits = prefill_last_of(be, h, prompt_ids)
        except BaseException:
            be.free(h)
            raise
        return h, logits.reshape(-1)

    def step(self, handles, token_ids):
        """Decode ``token_ids[i]`` on ``handles[i]`` as one batch (``Backend.decode``); returns logits ``[B, V]``."""
        return np.asarray(self.backend.decode(list(handles), [int(t) for t in token_ids]))

    def step_greedy(self, handles, token_ids):
        """Greedy :meth:`step`: the argmax of each row taken on the backend's device (``decode_greedy``,
        first maximum as ``np.argmax``); returns int64 ``[B]`` next tokens."""
        return np.asarray(self.backend.decode_greedy(list(handles), [int(t) for t in token_ids]))

    def close(self, handle):
        """Free the sequence ``handle``."""
        self.backend.free(handle)

    @property
    def has_mtp(self) -> bool:
        """True when the backend drafts with the checkpoint's MTP head (capability ``mtp``)."""
        from parity.backends import capabilities_of
        return bool(capabilities_of(self.backend).get("mtp"))

    def draft(self, handle, next_id: int, k: int) -> np.ndarray:
        """The backend's ``k`` MTP drafts after ``handle`` and ``next_id`` (``Backend.draft``): int64 ``[k]``."""
        return np.asarray(self.backend.draft(handle, int(next_id), int(k))[0], np.int64).reshape(-1)

    def verify_greedy(self, handle, ids) -> np.ndarray:
        """One width-``len(ids)`` verify step; the greedy token after each position (int64): the backend's
        ``verify_greedy`` (argmax on its device) when it has one, else the argmax of ``forward_tokens``."""
        ids = [int(t) for t in ids]
        fn = getattr(self.backend, "verify_greedy", None)
        if fn is not None:
            return np.asarray(fn(handle, ids), np.int64).reshape(-1)
        return np.argmax(np.asarray(self.backend.forward_tokens(handle, ids)), axis=-1).astype(np.int64)

    def verify_logits(self, handle, ids) -> np.ndarray:
        """One width-``len(ids)`` verify step (``Backend.forward_tokens``): logits ``[len(ids), V]``."""
        return np.asarray(self.backend.forward_tokens(handle, [int(t) for t in ids]))

    def rollback(self, handle, n: int) -> None:
        """Forget the last ``n`` tokens of the latest verify (``Backend.rollback``: trunk and MTP head)."""
        self.backend.rollback(handle, int(n))


def open_lm(model_dir: str | Path, backend: str = "reference", device: str = "auto", precision: str | None = None,
            max_seqs: int = 8) -> BackendLM:
    """Open ``backend`` ('reference', 'engine', or any other ``--backend`` spec -- 'transformers', 'llama.cpp',
    ``module:Class[:key=value,...]`` -- opened as is) on the checkpoint through
    :func:`parity.backends.open_backend` and wrap it as a :class:`BackendLM`.

    ``device`` applies to the engine: 'cuda', 'cpu' or 'auto' (cuda when a GPU is usable); ``precision``:
    'float64' selects the reference's float64, the engine's precision otherwise (default bf16 on cuda,
    float32 on cpu); ``max_seqs`` is the engine's live-sequence capacity (the batch size, at least 8).
    Raises:
        DeviceUnavailableError: device 'cuda' asked for and no GPU/cupy usable.
        InputError: unknown backend or device; the opener's errors.
    """
    from parity.backends import open_backend, parse_backend_spec

    if backend not in ("reference", "engine"):
        # any other backend (transformers, llama.cpp, module:Class) from its spec as is; an unknown name is the
        # registry's InputError
        parse_backend_spec(str(backend))
        return BackendLM(open_backend(str(backend), model_dir))
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"device: expected auto, cpu or cuda, found {device!r}")
    if device == "cuda" or (backend == "engine" and device == "auto"):
        from engine.backend import gpu_available
        if device == "cuda" and not gpu_available():
            raise DeviceUnavailableError("device 'cuda': a GPU was asked for, expected cupy and a CUDA device, "
                                         "found none (use --device cpu)")
        if device == "auto":
            device = "cuda" if gpu_available() else "cpu"
        if backend == "reference" and device == "cuda":
            raise InputError("device 'cuda': the reference runs on the CPU only; use --backend engine for the GPU")
    if backend == "reference":
        return BackendLM(open_backend("reference:dtype=float64" if precision == "float64" else "reference", model_dir))
    prec = precision or ("bf16" if device == "cuda" else "float32")
    return BackendLM(open_backend(f"engine-{device}", model_dir, precision=prec, max_seqs=max(8, int(max_seqs))))


# ----------------------------------------------------------------------------------------------- generation
@dataclass
class GenerationResult:
    """One sequence's output. ``stop_reason`` is 'eos', 'length' (max_new_tokens) or 'context'."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: str
    prefill_s: float
    decode_s: float
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tokens_per_s(self) -> float:
        """Prompt tokens per prefill second (inf when ``prefill_s`` is 0)."""
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def generation_tokens_per_s(self) -> float:
        """Generated tokens after the first (those that needed a decode step) per decode second."""
        n = max(len(self.token_ids) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else float("nan")

    def to_json(self) -> dict:
        """The result as a JSON-ready dict: text, ids, stop reason and timings (seconds, tokens, rates;
        non-finite rates as None)."""
        return {"text": self.text, "prompt_ids": self.prompt_ids, "token_ids": self.token_ids,
                "stop_reason": self.stop_reason,
                "timings": {"prefill_s": self.prefill_s, "decode_s": self.decode_s,
                            "prompt_tokens": len(self.prompt_ids), "generated_tokens": len(self.token_ids),
                            "prompt_tokens_per_s": _finite(self.prompt_tokens_per_s),
                            "generation_tokens_per_s": _finite(self.generation_tokens_per_s)}}


def _finite(x: float):
    return x if math.isfinite(x) else None


class Generator:
    """Prefill + decode loop over a backend with stop conditions and streaming.

    ``lm``: a :class:`parity.backends.Backend` (wrapped in a :class:`BackendLM`) or a :class:`BackendLM`.
    ``eos_ids``: stop ids (the stop token itself is kept in ``token_ids`` but not in ``text``).
    """

    def __init__(self, lm, tokenizer, eos_ids: Sequence[int] = ()):
        self.lm = lm if isinstance(lm, BackendLM) else BackendLM(lm)
        self.tok = tokenizer
        self.eos = frozenset(int(e) for e in eos_ids)

    def check_prompt(self, prompt_ids: Sequence[int], index: int | None = None) -> None:
        """Raises ContextError when the prompt leaves no room for one generated token, InputError when
        it is empty or holds ids outside the vocabulary."""
        where = "prompt" if index is None else f"prompt {index}"
        n = len(prompt_ids)
        if n == 0:
            raise InputError(f"{where}: expected at least one token, found an empty prompt")
        if n >= self.lm.max_context:
            raise ContextError(f"{where}: expected fewer than {self.lm.max_context} tokens (the context, leaving "
                               f"room for one generated token), found {n}")
        check_ids(prompt_ids, self.lm.vocab_size, where)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Generate for one prompt; ``on_text`` receives each streamed text piece."""
        return self.generate_batch([prompt_ids], params, on_text=(lambda i, s: on_text(s)) if on_text else None)[0]

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       on_text: Callable[[int, str], None] | None = None, progress: bool = False
                       ) -> list[GenerationResult]:
        """Generate for several prompts: each prefilled alone, then all unfinished sequences decoded
        together one token per step (``BackendLM.step``: ``Backend.decode``). ``on_text(i, piece)`` streams."""
        params.validate()
        for i, p in enumerate(prompts):
            self.check_prompt(p, None if len(prompts) == 1 else i)
        B = len(prompts)
        samplers = [Sampler(params) for _ in range(B)]
        streams = [StreamDecoder(self.tok) for _ in range(B)]
        handles, out, prefill_s, stop = [], [[] for _ in range(B)], [0.0] * B, [None] * B
        pos = [len(p) for p in prompts]  # position of each sequence's last emitted token
        texts = [[] for _ in range(B)]

        def emit(i, tid):
            out[i].append(tid)
            if tid in self.eos:
                stop[i] = "eos"
                return
            piece = streams[i].push(tid)
            if piece:
                texts[i].append(piece)
                if on_text:
                    on_text(i, piece)
            if len(out[i]) >= params.max_new_tokens:
                stop[i] = "length"
            elif pos[i] + 1 >= self.lm.max_context:  # the next token would not fit the context
                stop[i] = "context"

        bar = None
        try:
            for i, p in enumerate(prompts):
                t0 = time.perf_counter()
                h, logits = self.lm.start(np.asarray(p, dtype=np.int64))
                prefill_s[i] = time.perf_counter() - t0
                handles.append(h)
                emit(i, samplers[i](logits, _where(i, B, 0)))
            if progress and B > 1:
                from tqdm import tqdm
                bar = tqdm(total=B * params.max_new_tokens, desc="decode", unit="tok", leave=False)
            t0 = time.perf_counter()
            while True:
                active = [i for i in range(B) if stop[i] is None]
                if not active:
                    break
                hs, last = [handles[i] for i in active], np.array([out[i][-1] for i in active])
                step_greedy = getattr(self.lm, "step_greedy", None)
                if params.greedy and step_greedy is not None:  # argmax on the model's device: no logits copy
                    nxt = [int(t) for t in step_greedy(hs, last)]
                else:
                    logits = self.lm.step(hs, last)
                    nxt = [samplers[i](logits[row], _where(i, B, len(out[i]))) for row, i in enumerate(active)]
                for row, i in enumerate(active):
                    pos[i] += 1
                    emit(i, nxt[row])
                if bar is not None:
                    bar.update(len(active))
            decode_s = time.perf_counter() - t0
        finally:
            if bar is not None:
                bar.close()
            for h in handles:
                try:
                    self.lm.close(h)
                except Exception:
                    pass
        results = []
        for i in range(B):
            tail = streams[i].flush()
            if tail:
                texts[i].append(tail)
                if on_text:
                    on_text(i, tail)
            results.append(GenerationResult(list(map(int, prompts[i])), out[i], "".join(texts[i]), stop[i],
                                            prefill_s[i], decode_s))
        return results


def _where(i: int, n: int, token: int) -> str:
    """Which draw an error is about: 'generated token 3', with 'prompt i, ' when several prompts run."""
    return (f"prompt {i}, " if n > 1 else "") + f"generated token {token}"


def first_divergence(a: Sequence[GenerationResult], b: Sequence[GenerationResult]) -> tuple[int, int] | None:
    """Where two runs over the same prompts first disagree: ``(sequence index, generated-token index)``,
    or None when every sequence produced the same ids and stop reason. A different number of sequences
    is reported at sequence ``min(len(a), len(b))``, token 0."""
    for s, (x, y) in enumerate(zip(a, b)):
        for t, (u, v) in enumerate(zip(x.token_ids, y.token_ids)):
            if u != v:
                return s, t
        if len(x.token_ids) != len(y.token_ids) or x.stop_reason != y.stop_reason:
            return s, min(len(x.token_ids), len(y.token_ids))
    if len(a) != len(b):
        return min(len(a), len(b)), 0
    return None
