"""Sampling for generation: :class:`SamplingParams` / :class:`Sampler` (greedy, temperature, top-k, top-p in
transformers' warper order, seeded) and the defaults and stop ids of the checkpoint's ``generation_config.json``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from parity.generate.chat import read_json_object
from reference.errors import InputError

__all__ = ["SamplingError", "SamplingParams", "load_generation_config", "sampling_defaults", "eos_ids_from",
           "Sampler"]


class SamplingError(InputError):
    """A sampling value out of range."""


def check_sampleable(logits: np.ndarray, where: str = "") -> None:
    """Refuse logits nothing can be drawn from: a NaN or +inf (argmax would pick the NaN's id; the softmax is
    NaN), or no finite value at all. -inf alone is fine: an id the backend excludes.

    Raises:
        InconclusiveError: naming ``where`` (e.g. 'prompt 0, generated token 3'), the first bad id and value.
    """
    bad = np.isnan(logits) | (logits == np.inf)
    if bad.any() or not np.isfinite(logits).any():
        from reference.errors import EXIT_INCONCLUSIVE, InconclusiveError
        j = int(np.argmax(bad)) if bad.any() else 0
        raise InconclusiveError(
            f"{where + ': ' if where else ''}the logits to sample from: expected finite values (-inf only for "
            f"excluded ids), found {logits[j]} at id {j}; the checkpoint's weights or the backend give NaN/Inf, "
            f"nothing can be generated from them (exit {EXIT_INCONCLUSIVE})")


@dataclass
class SamplingParams:
    """Sampling settings. ``temperature == 0`` or ``do_sample=False`` means greedy (argmax, lowest id
    on ties); ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    do_sample: bool = True
    max_new_tokens: int = 64

    @property
    def greedy(self) -> bool:
        """True when sampling is off (``do_sample`` False) or ``temperature == 0``."""
        return (not self.do_sample) or self.temperature == 0

    def validate(self) -> "SamplingParams":
        """Range checks. Raises SamplingError naming the value, the range and what was found."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature: expected a finite number >= 0 (0 = greedy), found {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise SamplingError(f"top_p: expected a number in (0, 1], found {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise SamplingError(f"top_k: expected an integer >= 0 (0 = off), found {k!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise SamplingError(f"seed: expected an integer >= 0, found {s!r}")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise SamplingError(f"max_new_tokens: expected an integer >= 1, found {n!r}")
        return self


def load_generation_config(model_dir: str | Path) -> dict:
    """``generation_config.json`` as a dict ({} when absent). Its keys are checked where they are used:
    ``do_sample`` by :func:`sampling_defaults`, ``eos_token_id`` by :func:`eos_ids_from`, temperature /
    top_p / top_k / max_new_tokens by :meth:`SamplingParams.validate`.

    Raises:
        InputError: unreadable / non-UTF-8 / non-object file.
    """
    p = Path(model_dir) / "generation_config.json"
    return read_json_object(p, "generation_config.json") if p.is_file() else {}


def _check_eos(e, where: str, vocab_size: int | None = None) -> list[int]:
    """``eos_token_id`` (int or list of ints, each >= 0 and < ``vocab_size`` when given) as a list; else InputError."""
    items = e if isinstance(e, list) else [e]
    ok = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0 for x in items)
    if ok and vocab_size is not None:
        ok = all(x < vocab_size for x in items)
    if not ok:
        rng = f"in [0, vocab_size={vocab_size})" if vocab_size is not None else ">= 0"
        raise InputError(f"{where}: eos_token_id: expected a token id {rng} or a list of them, found {e!r}")
    return [int(x) for x in items]


def sampling_defaults(gen_config: dict) -> dict:
    """SamplingParams keyword defaults from a generation config (only the keys it sets).
    Without ``do_sample: true`` transformers decodes greedily, and so do we.

    Raises:
        InputError: ``do_sample`` set and not a JSON boolean.
    """
    ds = gen_config.get("do_sample", False)
    if ds is None:
        ds = False
    if not isinstance(ds, bool):
        raise InputError(f"generation_config.json: do_sample: expected a JSON boolean (true or false), found {ds!r}")
    out = {"do_sample": ds}
    for k in ("temperature", "top_p", "top_k"):
        if gen_config.get(k) is not None:
            out[k] = gen_config[k]
    if gen_config.get("max_new_tokens") is not None:
        out["max_new_tokens"] = gen_config["max_new_tokens"]
    return out


def eos_ids_from(gen_config: dict, model_eos: Iterable[int] = (), *, vocab_size: int | None = None) -> tuple[int, ...]:
    """Every stop id: ``generation_config.eos_token_id`` (int or list) plus the model config's EOS ids,
    de-duplicated in order.

    Raises:
        InputError: ``eos_token_id`` not an id >= 0 (or < ``vocab_size`` when given) nor a list of them,
            naming generation_config.json and eos_token_id.
    """
    ids = list(model_eos)
    e = gen_config.get("eos_token_id")
    if e is not None:
        ids.extend(_check_eos(e, "generation_config.json", vocab_size))
    return tuple(dict.fromkeys(int(x) for x in ids))


class Sampler:
    """Choose the next token from logits ``[V]`` (float32/float64).

    Order follows transformers' warpers: divide by temperature, keep the top-k logits, keep the
    smallest set of most probable tokens whose probability reaches top-p (at least one), softmax,
    draw with a ``numpy.random.Generator`` seeded by ``seed`` (each sequence of a batch gets its own
    generator with the same seed, so a prompt samples the same alone or in a batch).
    Source: transformers ``TemperatureLogitsWarper``/``TopKLogitsWarper``/``TopPLogitsWarper`` semantics.
    """

    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, where: str = "") -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.p.greedy:
            check_sampleable(logits, where)
            return int(np.argmax(logits))
        probs = self.probs(logits, where)   # checks the logits
        return int(self.rng.choice(probs.size, p=probs))

    def probs(self, logits: np.ndarray, where: str = "") -> np.ndarray:
        """The sampling distribution ``[V]`` float64 after temperature, top-k and top-p (sampling params).

        Raises:
            InconclusiveError: NaN or +inf logits, or none finite (:func:`check_sampleable`).
        """
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        check_sampleable(logits, where)
        x = logits / self.p.temperature
        k = int(self.p.top_k)
        if 0 < k < x.size:
            kth = np.partition(x, -k)[-k]
            x = np.where(x < kth, -np.inf, x)
        if self.p.top_p < 1.0:
            order = np.argsort(-x, kind="stable")
            probs = np.exp(x[order] - x[order[0]])
            probs /= probs.sum()
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, self.p.top_p, side="left")) + 1
            drop = order[keep:]
            x[drop] = -np.inf
        m = np.max(x)
        probs = np.exp(x - m)
        probs /= probs.sum()
        return probs
