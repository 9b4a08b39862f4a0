"""Chat rendering for generation: the checkpoint's own jinja chat template (``chat_template.jinja`` or
``tokenizer_config.json``), rendered in a sandboxed jinja2 environment the way transformers'
``apply_chat_template`` does, else :func:`render_chatml`, a built-in ChatML rendering of the official template's
rules (``/work/shared/model-facts.md`` §5)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from reference.errors import InputError

__all__ = ["TemplateError", "read_json_object", "load_tokenizer_config", "load_chat_template", "render_jinja_template",
           "render_chatml", "render_chat", "TOOLS_PREAMBLE", "TOOLS_RULES"]


class TemplateError(InputError):
    """A chat conversation the template rejects (the official template's ``raise_exception`` sites)."""


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path`` (a checkpoint side file named ``what``).

    Raises:
        InputError: unreadable, not UTF-8, not JSON, or not an object.
    """
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
    return read_json_object(p, "tokenizer_config.json") if p.is_file() else {}


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
