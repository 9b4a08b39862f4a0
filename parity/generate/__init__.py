"""Text generation on the reference or the engine: tokenizer, chat template, sampling, streaming, batch.

Pieces (each usable alone):

* :func:`load_tokenizer` - the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.
* :func:`load_chat_template` / :func:`render_chat` - the checkpoint's own jinja chat template
  (``chat_template.jinja`` or ``tokenizer_config.json``), rendered in a sandboxed jinja2 environment
  the way transformers' ``apply_chat_template`` does; otherwise :func:`render_chatml`, a built-in
  ChatML rendering of the official template's rules (``/work/shared/model-facts.md`` §5).
* :class:`SamplingParams` / :class:`Sampler` - greedy, temperature, top-k, top-p (transformers'
  warper order: temperature, then top-k, then top-p), seeded; defaults from ``generation_config.json``.
* :class:`StreamDecoder` - incremental detokenisation that never emits half of a multi-byte character.
* :class:`Generator` - prefill + decode loop over any :class:`parity.backends.Backend` (opened by
  :func:`parity.backends.open_backend`; :class:`BackendLM` is the thin adapter), single or batched,
  with stop conditions and timings.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from reference.errors import InputError, UserError
from reference.session import check_ids

from reference.tokenizer import TokenizerMissingError, load_tokenizer  # noqa: E402,F401

NOISE_NOTE = "note: the bundled 'tiny' model has random weights, so its output is noise"


class TemplateError(InputError):
    """A chat conversation the template rejects (the official template's ``raise_exception`` sites)."""


class SamplingError(InputError):
    """A sampling value out of range."""


class ContextError(InputError):
    """A prompt that does not fit the context."""


class DeviceUnavailableError(UserError, RuntimeError):
    """A GPU was asked for and none is usable."""


# ----------------------------------------------------------------------------------------------- tokenizer
def _read_json(path: Path, what: str) -> dict:
    from reference.textio import read_utf8
    text = read_utf8(path, what, "JSON file")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InputError(f"{what}: expected a JSON object in {path}, found unreadable content ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{what}: expected a JSON object in {path}, found {type(data).__name__}")
    return data


def load_tokenizer_config(model_dir: str | Path) -> dict:
    """``tokenizer_config.json`` as a dict ({} when absent)."""
    p = Path(model_dir) / "tokenizer_config.json"
    return _read_json(p, "tokenizer_config.json") if p.is_file() else {}


# ----------------------------------------------------------------------------------------------- chat template
def load_chat_template(model_dir: str | Path) -> str | None:
    """The checkpoint's own chat template source, or None when it ships none.

    Looks in ``chat_template.jinja`` first, then ``tokenizer_config.json["chat_template"]`` (a string,
    or a list of ``{"name", "template"}`` entries of which ``default`` is taken) - the places
    transformers reads it from.

    Raises:
        InputError: chat_template.jinja or tokenizer_config.json unreadable or not UTF-8.
    """
    d = Path(model_dir)
    jf = d / "chat_template.jinja"
    if jf.is_file():
        from reference.textio import read_utf8
        return read_utf8(jf, "chat template", "jinja file")
    tc = load_tokenizer_config(d)
    t = tc.get("chat_template")
    if isinstance(t, str) and t.strip():
        return t
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    return None


def _special_tokens_map(tok_config: dict) -> dict:
    out = {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = tok_config.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


def render_jinja_template(template: str, messages: list[dict], *, tools: list | None = None,
                          add_generation_prompt: bool = True, special_tokens: dict | None = None,
                          **kwargs) -> str:
    """Render a checkpoint's chat template the way transformers' ``apply_chat_template`` does.

    Sandboxed jinja2 (``ImmutableSandboxedEnvironment``, ``trim_blocks``/``lstrip_blocks``, the
    ``loopcontrols`` extension), a ``tojson`` filter that keeps non-ASCII text, and the
    ``raise_exception`` / ``strftime_now`` helpers. Extra keyword arguments (``enable_thinking``,
    ``reasoning_effort``, ...) are visible to the template.

    Raises:
        TemplateError: the template called ``raise_exception`` or failed to render.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return time.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        compiled = env.from_string(template)
        ctx = dict(special_tokens or {})
        ctx.update(kwargs)
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **ctx)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template: expected a renderable jinja template, found an error: {e}") from None


def _content_text(content, *, role: str, index: int, allow_images: bool, add_vision_id: bool,
                  counter: list[int]) -> str:
    """Flatten a message's content (a string or a list of typed parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError(f"messages[{index}].content: expected a string or a list of parts, found "
                            f"{type(content).__name__}")
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(part.get("text", ""))
        elif kind in ("image", "image_url") or (isinstance(part, dict) and "image" in part):
            if not allow_images:
                raise TemplateError(f"messages[{index}]: a {role} message cannot contain images")
            counter[0] += 1
            prefix = f"Picture {counter[0]}: " if add_vision_id else ""
            out.append(f"{prefix}<|vision_start|><|image_pad|><|vision_end|>")
        elif kind == "video" or (isinstance(part, dict) and "video" in part):
            if not allow_images:
                raise TemplateError(f"messages[{index}]: a {role} message cannot contain videos")
            out.append("<|vision_start|><|video_pad|><|vision_end|>")
        else:
            raise TemplateError(f"messages[{index}].content: expected parts of type text/image/video, "
                                f"found {part!r}")
    return "".join(out)


def _render_tool_call(call: dict, index: int) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise TemplateError(f"messages[{index}].tool_calls: expected entries with a function name, found {call!r}")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise TemplateError(f"messages[{index}].tool_calls: arguments of {fn['name']!r}: expected a JSON "
                                f"object, found {args!r}") from None
    s = f"<tool_call>\n<function={fn['name']}>\n"
    for k, v in args.items():
        val = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        s += f"<parameter={k}>\n{val}\n</parameter>\n"
    return s + "</function>\n</tool_call>"


TOOLS_PREAMBLE = ("# Tools\n\nYou have access to the following functions:\n\n<tools>")
TOOLS_RULES = ("</tools>\n\nTo call a function, reply in this exact format:\n\n<tool_call>\n<function=NAME>\n"
               "<parameter=ARG>\nvalue\n</parameter>\n</function>\n</tool_call>\n\n"
               "Write string values raw and every other value as JSON. Only call functions listed above.")


def render_chatml(messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = True,
                  enable_thinking: bool = True, preserve_thinking: bool = True, add_vision_id: bool = False,
                  reasoning_effort: str | None = None) -> str:
    """The built-in ChatML rendering, following the official template's rules (model-facts §5).

    Rules: turns are ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the leading run of
    system/developer messages is merged into one system turn (joined by a blank line), with tools
    appended as ``# Tools ... <tools>`` one JSON object per line ``</tools>`` plus calling rules;
    assistant turns keep their reasoning as ``<think>\\n...\\n</think>\\n\\n`` (``preserve_thinking``) and
    write tool calls as ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n
    </function>\\n</tool_call>`` (strings raw, other values JSON); consecutive tool messages become one
    user turn of ``<tool_response>\\n...\\n</tool_response>`` blocks; the generation prompt is
    ``<|im_start|>assistant\\n<think>\\n`` (thinking on, the default) or
    ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` (``enable_thinking=False``).

    Source: the official template's behaviour as described in model-facts §5 [S15]; wording of the
    tool rules is our own. Known gap: the official ``reasoning_effort`` sentences (xhigh, the
    official default, and low) are not reproduced - their full wording is not in the facts - so
    only ``medium`` (which injects nothing) or None is accepted; use the checkpoint's own template
    for the others.

    Raises:
        TemplateError: a system message after the first non-system one, an unknown role, no user
            message, a system message with an image, a malformed message, or an unsupported
            ``reasoning_effort``.
    """
    if reasoning_effort not in (None, "medium"):
        if reasoning_effort in ("xhigh", "high", "low"):
            raise TemplateError(f"reasoning_effort: the built-in ChatML rendering supports only 'medium' (no "
                                f"injected sentence), found {reasoning_effort!r}; use a checkpoint that ships "
                                f"the official chat template")
        raise TemplateError(f"reasoning_effort: expected one of xhigh, high, medium, low, found {reasoning_effort!r}")
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages: expected a non-empty list of {role, content} objects, found "
                            f"{messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TemplateError(f"messages[{i}]: expected an object with a 'role' string, found {m!r}")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise TemplateError(f"messages[{i}].role: expected system, developer, user, assistant or tool, "
                                f"found {m['role']!r}")
    counter = [0]
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys]["role"] in ("system", "developer"):
        n_sys += 1
    sys_parts = [_content_text(m.get("content"), role="system", index=i, allow_images=False,
                               add_vision_id=add_vision_id, counter=counter)
                 for i, m in enumerate(messages[:n_sys])]
    for i, m in enumerate(messages[n_sys:], start=n_sys):
        if m["role"] in ("system", "developer"):
            raise TemplateError(f"messages[{i}]: a {m['role']} message must come before every other message "
                                f"(only a leading run is allowed), found one after a {messages[i - 1]['role']} "
                                f"message")
    if not any(m["role"] == "user" for m in messages):
        raise TemplateError("messages: expected at least one user message (the user query), found none")
    out = []
    system = "\n\n".join(p for p in sys_parts if p)
    if tools:
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        block = f"{TOOLS_PREAMBLE}{lines}\n{TOOLS_RULES}"
        system = f"{system}\n\n{block}" if system else block
    if n_sys or tools:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    i = n_sys
    while i < len(messages):
        m = messages[i]
        role = m["role"]
        if role == "user":
            text = _content_text(m.get("content"), role="user", index=i, allow_images=True,
                                 add_vision_id=add_vision_id, counter=counter)
            out.append(f"<|im_start|>user\n{text}<|im_end|>\n")
            i += 1
        elif role == "assistant":
            text = _content_text(m.get("content"), role="assistant", index=i, allow_images=False,
                                 add_vision_id=add_vision_id, counter=counter)
            reasoning = m.get("reasoning_content")
            if reasoning is None and "</think>" in text:
                reasoning, text = text.split("</think>", 1)
                reasoning = reasoning.replace("<think>", "", 1)
                text = text.lstrip("\n")
            think = ""
            if preserve_thinking and reasoning is not None:
                think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
            body = think + text
            calls = m.get("tool_calls") or []
            if calls:  # calls follow the text after a blank line, or the think block directly
                rendered = "\n".join(_render_tool_call(c, i) for c in calls)
                body += ("\n\n" if text else "") + rendered
            out.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
            i += 1
        else:  # a run of tool results -> one user turn
            blocks = []
            while i < len(messages) and messages[i]["role"] == "tool":
                c = messages[i].get("content")
                c = c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)
                blocks.append(f"<tool_response>\n{c}\n</tool_response>")
                i += 1
            out.append("<|im_start|>user\n" + "\n".join(blocks) + "<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n<think>\n" if enable_thinking
                   else "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    return "".join(out)


def render_chat(messages: list[dict], *, model_dir: str | Path | None = None, template: str | None = None,
                tools: list | None = None, add_generation_prompt: bool = True, enable_thinking: bool = True,
                reasoning_effort: str | None = None) -> tuple[str, str]:
    """Render a conversation: the checkpoint's own template where it has one, else :func:`render_chatml`.

    Returns:
        (text, source) where source is ``"checkpoint"`` or ``"builtin"``.
    Raises:
        TemplateError: see :func:`render_jinja_template` and :func:`render_chatml`.
    """
    if template is None and model_dir is not None:
        template = load_chat_template(model_dir)
    if template is not None:
        specials = _special_tokens_map(load_tokenizer_config(model_dir)) if model_dir is not None else {}
        kw = {"enable_thinking": enable_thinking}
        if reasoning_effort is not None:
            kw["reasoning_effort"] = reasoning_effort
        return render_jinja_template(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     special_tokens=specials, **kw), "checkpoint"
    return render_chatml(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                         enable_thinking=enable_thinking, reasoning_effort=reasoning_effort), "builtin"


# ----------------------------------------------------------------------------------------------- sampling
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
    return _read_json(p, "generation_config.json") if p.is_file() else {}


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

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.p.greedy:
            return int(np.argmax(logits))
        probs = self.probs(logits)
        return int(self.rng.choice(probs.size, p=probs))

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The sampling distribution ``[V]`` float64 after temperature, top-k and top-p (sampling params)."""
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
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
                emit(i, samplers[i](logits))
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
                    nxt = [samplers[i](logits[row]) for row, i in enumerate(active)]
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


def parse_speculative(text: str) -> int:
    """``--speculative mtp:k=N`` -> ``N`` (drafts per round, 1..16).

    Raises:
        InputError: naming the flag, the expected form and what was found.
    """
    import re
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


def generate_speculative(gen: "Generator", prompt_ids: Sequence[int], params: SamplingParams, k: int,
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
