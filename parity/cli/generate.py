"""``qwen4exp generate``: sample text from the reference or the engine (streamed), single or batched."""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    """Add the ``generate`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser(
        "generate", help="generate text (streamed) on the engine, the reference or an outside backend",
        description="Generate text with the engine, the reference or an outside module:Class backend. The chat template is the checkpoint's own "
                    "(chat_template.jinja / tokenizer_config.json) where present, else a built-in ChatML rendering; "
                    "thinking is on by default as in the official template. Sampling defaults come from "
                    "generation_config.json. The default model is the bundled 'tiny' (random weights: noise).")
    from parity.cli.common import add_backend, add_model, add_traceback
    add_model(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", metavar="FILE",
                     help="several prompts run as one batch: the JSON list every verb reads (texts or token-id "
                          "lists), or one per line, or JSON lines with 'prompt' or 'messages'")
    p.add_argument("--chat", action="store_true", help="wrap prompt(s) as a user turn with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--no-thinking", action="store_true", help="chat: end the prompt with an empty think block")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generation limit (default 64 or generation_config)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus threshold in (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-p/top-k)")
    add_backend(p, "engine", what="the backend that generates")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="deprecated: --backend engine:device=cpu|cuda")
    p.add_argument("--precision", default=None,
                   help="deprecated: --backend engine:precision=bf16|float32 (bf16 = BF16 weights with float32 "
                        "accumulation, equal to float32 on a checkpoint stored in BF16) or reference:dtype=float64")
    p.add_argument("--speculative", metavar="mtp:k=N", default=None,
                   help="speculative decoding with the checkpoint's MTP head: N drafts per round, verified in one "
                        "step (greedy: same text as plain greedy; sampling: the speculative-sampling rule)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (also off when stderr is not a terminal)")
    from parity.cli.common import add_format
    add_format(p, default_help="text; json prints one object (text, token ids, timings); text and rich both "
                               "stream the plain text")
    add_traceback(p)
    p.set_defaults(func=run)


def _json_kind(v) -> str:
    """A JSON value's type as a user reads it, with a short excerpt: ``a number (42)``."""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
    return kind if v is None else f"{kind} ({json.dumps(v, ensure_ascii=False)[:40]})"


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(msgs: list, where: str) -> None:
    """Validate a chat ``messages`` list before any template sees it: a non-empty list of objects, each
    with a ``role`` string (system, developer, user, assistant, tool) and a ``content`` that is a string or
    a list of parts (strings, or objects whose ``type`` is text - with a ``text`` string -, image,
    image_url or video). An assistant message carrying ``tool_calls`` may have no/null content; a tool
    message's content may be any JSON value but a boolean or null.

    Raises:
        InputError: naming ``where`` (``--prompts FILE:LINE``), the message index and the field.
    """
    from reference.errors import InputError
    if not msgs:
        raise InputError(f"{where}: 'messages': expected a non-empty list of messages, found an empty list")
    for i, m in enumerate(msgs):
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise InputError(f"{at}: expected an object with 'role' and 'content', found {_json_kind(m)}")
        role = m.get("role")
        if not isinstance(role, str):
            raise InputError(f"{at}.role: expected a string ({', '.join(_ROLES)}), found "
                             f"{'no role' if 'role' not in m else _json_kind(role)}")
        if role not in _ROLES:
            raise InputError(f"{at}.role: expected one of {', '.join(_ROLES)}, found {_json_kind(role)}")
        if "content" not in m or m["content"] is None:
            if role == "assistant" and m.get("tool_calls"):
                continue
            raise InputError(f"{at}.content: expected a string or a list of parts, found "
                             f"{'no content' if 'content' not in m else 'null'}")
        c = m["content"]
        if isinstance(c, str) or (role == "tool" and not isinstance(c, bool)):
            continue  # a tool result may be any JSON value (the built-in rendering writes it as JSON)
        if not isinstance(c, list):
            raise InputError(f"{at}.content: expected a string or a list of parts, found {_json_kind(c)}")
        for j, part in enumerate(c):
            if isinstance(part, str):
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind == "text":
                raise InputError(f"{at}.content[{j}].text: expected a string, found "
                                 f"{'no text' if 'text' not in part else _json_kind(part['text'])}")
            if kind in ("image", "image_url", "video"):
                continue
            raise InputError(f"{at}.content[{j}]: expected a string or an object of type text/image/video, "
                             f"found {_json_kind(part)}")


def _read_prompts(path: str, with_lines: bool = False):
    """The prompts of a ``--prompts`` file: the JSON list every verb reads (texts or token-id lists,
    :func:`parity.prompts.prompt_items`), else plain-text lines (strings) or JSON lines with a ``prompt``
    string or a ``messages`` list (validated, :func:`_check_messages`). With ``with_lines`` returns
    ``(prompts, places)``: line numbers, or ``"item N"`` for a JSON list.

    Raises:
        InputError: naming ``FILE:LINE`` and the field.
    """
    from reference.errors import InputError
    from reference.textio import read_utf8
    text = read_utf8(path, f"--prompts {path}")
    if text.lstrip().startswith("["):
        try:
            listed = isinstance(json.loads(text), list)
        except ValueError:
            listed = False   # plain text that happens to start with '[': one prompt per line
        if listed:   # the --prompts format of every verb (parity.prompts.prompt_items): texts or token-id lists
            from parity.prompts import prompt_items
            items = prompt_items(text, path)
            return (items, [f"item {n}" for n in range(len(items))]) if with_lines else items
    lines = text.splitlines()
    out, nums = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"--prompts {path}:{n}: expected a JSON object or plain text, found invalid "
                                 f"JSON ({e})") from None
            from reference.textio import check_strings
            check_strings(obj, f"--prompts {path}:{n}")  # lone surrogates ("\\ud800") are not text
            if not isinstance(obj, dict):
                raise InputError(f"--prompts {path}:{n}: expected a JSON object with 'prompt' or 'messages', found "
                                 f"{_json_kind(obj)}")
            if isinstance(obj.get("messages"), list):
                _check_messages(obj["messages"], f"--prompts {path}:{n}")
                out.append(obj["messages"])
            elif isinstance(obj.get("prompt"), str):
                out.append(obj["prompt"])
            elif "messages" in obj:
                raise InputError(f"--prompts {path}:{n}: 'messages': expected a list of messages, found "
                                 f"{_json_kind(obj['messages'])}")
            elif "prompt" in obj:
                raise InputError(f"--prompts {path}:{n}: 'prompt': expected a string, found "
                                 f"{_json_kind(obj['prompt'])}")
            else:
                raise InputError(f"--prompts {path}:{n}: expected a 'prompt' string or a 'messages' list, found "
                                 f"neither (keys {sorted(obj)})")
        else:
            out.append(line)
        nums.append(n)
    if not out:
        raise InputError(f"--prompts {path}: expected at least one prompt, found none")
    return (out, nums) if with_lines else out


def run(args: argparse.Namespace) -> int:
    """Run ``qwen4exp generate``: tokenize the prompt(s) (optionally through the chat template),
    generate with the chosen backend (streamed for one prompt) and print the text, or one JSON object with
    ``--json``. Returns 0.

    Raises:
        InputError: a precision the backend does not support, or bad sampling defaults in generation_config.json.
    """
    from parity import generate as G
    from reference.paths import bundled_model, resolve_model

    from parity.harness.logits import check_precision
    from reference.errors import InputError, UserError

    from parity.cli.common import backend_spec, legacy_device, safe_text
    from parity.cli.common import output_format
    args.json = output_format(args) == "json"
    model_dir = resolve_model(args.model)
    from parity.backends import backend_class, parse_backend_spec
    parsed = parse_backend_spec(args.backend)
    name, plugin = parsed.name, parsed.plugin
    if plugin:  # an outside engine: driven through the same Backend protocol (BackendLM), its options in its spec
        for flag, v in (("--precision", args.precision), ("--device", args.device)):
            if v is not None:
                raise InputError(f"{flag} {v}: expected no {flag} with an outside backend (give its options in "
                                 f"--backend module:Class:key=value), found --backend {args.backend!r}")
    if plugin or name not in ("reference", "engine"):
        # any backend that decodes (the official model, llama.cpp, module:Class): unknown names and unimportable
        # classes are said before tokenizing anything
        from parity.backends.base import Backend
        cls = backend_class(args.backend)[0]
        if not plugin:
            plugin = True   # opened from its spec as is, like an outside engine
            for flag, v in (("--precision", args.precision), ("--device", args.device)):
                if v is not None:
                    raise InputError(f"{flag} {v}: expected no {flag} with --backend {name} (give its options in "
                                     f"--backend {name}:key=value), found --backend {args.backend!r}")
        from parity.backends.base import capabilities_of
        if getattr(cls, "decode", None) is Backend.decode or capabilities_of(cls).get("sequences", True) is False:
            raise InputError(f"--backend {args.backend!r}: expected a backend that decodes sequences (reference, "
                             f"engine, transformers, llama.cpp or module:Class), found {cls.__name__}, which "
                             + ("declares no sequences (top-k logprobs only)"
                                if capabilities_of(cls).get("sequences", True) is False else "does not implement decode"))
    if plugin:
        pass
    elif args.precision is not None:
        allowed = ("float32", "float64") if name == "reference" else ("float32", "bf16")
        if name == "reference":
            check_precision("reference", args.precision)
        if args.precision not in allowed:
            raise InputError(f"--precision {args.precision}: expected one of {', '.join(allowed)} for the "
                             f"{name} backend")
    legacy = {} if plugin else {"--device": legacy_device(args.device, name),
                                ("--dtype" if name == "reference" else "--precision"): args.precision}
    sp = backend_spec(args, legacy=legacy)
    backend = str(sp) if plugin else sp.name
    device = sp.options.get("device", "auto") if not plugin else "auto"
    precision = None if plugin else sp.options.get("dtype" if backend == "reference" else "precision")
    if backend == "reference" and precision == "float32":
        precision = None

    tok = G.load_tokenizer(model_dir)
    gen_cfg = G.load_generation_config(model_dir)
    kw = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    kw.update(G.sampling_defaults(gen_cfg))
    try:  # the checkpoint's own defaults: a bad value names generation_config.json
        G.SamplingParams(seed=0, **kw).validate()
    except UserError as e:
        raise InputError(f"{model_dir / 'generation_config.json'}: {e}") from None
    for name in ("temperature", "top_p", "top_k", "max_new_tokens"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
            if name in ("temperature", "top_p", "top_k"):
                kw["do_sample"] = True
    if args.greedy:
        kw["do_sample"] = False
    try:
        params = G.SamplingParams(seed=args.seed, **kw).validate()
    except UserError as e:  # name the flag the user typed, not the field
        msg = str(e)
        for field, flag in (("max_new_tokens", "--max-new-tokens"), ("temperature", "--temperature"),
                            ("top_p", "--top-p"), ("top_k", "--top-k"), ("seed", "--seed")):
            if msg.startswith(field + ":"):
                msg = flag + msg[len(field):]
                break
        raise InputError(msg) from None

    k_spec = G.parse_speculative(args.speculative) if args.speculative is not None else None
    if args.prompt is not None:
        raw, where = [args.prompt], ["--prompt"]
    else:
        raw, where = _read_prompts(args.prompts, with_lines=True)
        where = [f"--prompts {args.prompts}:{n}" if isinstance(n, int) else f"--prompts {args.prompts}: {n}"
                 for n in where]
    from reference.config import load_config
    from reference.session import check_ids, check_length
    cfg = load_config(model_dir)
    texts, template_source, given = [], None, {}
    for k, (item, at) in enumerate(zip(raw, where)):
        if isinstance(item, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            # token ids (the JSON list format): used as given, checked before the model loads
            if args.chat:
                raise InputError(f"{at}: expected a text with --chat (the chat template wraps text), found token ids")
            if not item:
                raise InputError(f"{at}: expected at least one token, found an empty prompt")
            check_length(len(item), cfg.max_position_embeddings, at)
            given[k] = check_ids(item, cfg.vocab_size, at).tolist()
            texts.append(None)
            continue
        if args.chat or isinstance(item, list):
            msgs = item if isinstance(item, list) else (
                ([{"role": "system", "content": args.system}] if args.system else []) +
                [{"role": "user", "content": item}])
            try:
                text, template_source = G.render_chat(msgs, model_dir=model_dir,
                                                      enable_thinking=not args.no_thinking)
            except UserError as e:
                raise InputError(f"{at}: {e}") from None
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # a template tripping on a value
                raise InputError(f"{at}: the chat template could not render these messages ({type(e).__name__}: "
                                 f"{e})") from None
            texts.append(text)
        else:
            texts.append(item)
    prompts = [given[k] if k in given else tok.encode(t, add_special_tokens=False).ids for k, t in enumerate(texts)]
    for ids, at in zip(prompts, where):   # input checked before the model loads
        if not ids:
            raise InputError(f"{at}: expected at least one token, found an empty prompt")
        check_length(len(ids), cfg.max_position_embeddings, at)
    if args.no_thinking and template_source is None:
        print("note: --no-thinking has no effect without --chat (no chat template is applied)", file=sys.stderr)
    if args.system and template_source is None:
        print("note: --system has no effect without --chat (no chat template is applied)", file=sys.stderr)

    lm = G.open_lm(model_dir, backend=backend, device=device, precision=precision, max_seqs=len(prompts))
    if k_spec is not None and not getattr(lm, "has_mtp", False):
        raise InputError(f"--speculative mtp: expected a checkpoint with an MTP head (mtp.* tensors, e.g. the bundled "
                         f"tiny-mtp), found none in {model_dir}")
    if backend == "engine" and precision == "bf16":
        from reference.checkpoint import Checkpoint
        check_precision("engine", "bf16", Checkpoint.open(model_dir))
    if model_dir.resolve() == bundled_model("tiny").resolve():
        print(G.NOISE_NOTE, file=sys.stderr)
    eos = G.eos_ids_from(gen_cfg, lm.config.eos_token_ids, vocab_size=lm.config.vocab_size)
    gen = G.Generator(lm, tok, eos)
    single = len(prompts) == 1
    stream = single and not args.json

    streamed = []

    def on_text(i, piece):
        sys.stdout.write(safe_text(piece))  # a random model's ESC / control bytes must not drive the terminal
        sys.stdout.flush()
        streamed.append(bool(piece))

    try:
        if k_spec is not None:  # MTP drafts, one prompt after another
            results = [G.generate_speculative(gen, p, params, k_spec,
                                              on_text=(lambda s: on_text(0, s)) if stream else None)
                       for p in prompts]
        else:
            results = gen.generate_batch(prompts, params, on_text=on_text if stream else None,
                                         progress=not args.json and not args.no_progress and sys.stderr.isatty())
    except BaseException:
        if any(streamed):   # the error (stderr) starts a line of its own, not after the streamed text
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    n_prompt = sum(len(p) for p in prompts)
    prefill_s = sum(r.prefill_s for r in results)
    decode_s = results[0].decode_s
    n_dec = sum(max(len(r.token_ids) - 1, 0) for r in results)
    n_gen = sum(len(r.token_ids) for r in results)
    summary = {"prompts": len(prompts), "prompt_tokens": n_prompt, "generated_tokens": n_gen,
               "prefill_s": prefill_s, "decode_s": decode_s,
               "prompt_tokens_per_s": n_prompt / prefill_s if prefill_s > 0 else None,
               "generation_tokens_per_s": n_dec / decode_s if decode_s > 0 else None}
    if args.json:
        obj = {"model": str(model_dir), "backend": str(sp), "template": template_source,
               "sampling": vars(params), "timings": summary}
        if single:
            obj.update(results[0].to_json())
        else:
            obj["results"] = [r.to_json() for r in results]
        if args.speculative is not None:
            obj["speculative"] = [r.extra.get("speculative") for r in results]
        print(json.dumps(obj, ensure_ascii=False))
        return 0
    if stream:
        sys.stdout.write("\n")
    else:
        for i, r in enumerate(results):
            print(f"--- [{i}] ({r.stop_reason}, {len(r.token_ids)} tokens)")
            print(safe_text(r.text))
    stops = ", ".join(sorted({r.stop_reason for r in results}))
    pt = summary["prompt_tokens_per_s"]
    gt = summary["generation_tokens_per_s"]
    gen_rate = f", {gt:.1f} tok/s" if gt else ""
    print(f"prompt: {n_prompt} tokens, {pt:.1f} tok/s | generation: {n_gen} tokens{gen_rate} "
          f"(stop: {stops}; backend {sp})", file=sys.stderr)
    return 0
