"""The plan of a ``qwen4exp bench`` run: which worker jobs measure what, checked before anything runs."""
from __future__ import annotations


def ints(s: str) -> list[int]:
    """A comma-separated list of positive integers (``1,4,16``); an empty item (``1,,2``) is refused.

    Raises:
        InputError: an empty or non-integer item, or an integer < 1.
    """
    from reference.errors import InputError
    items = s.split(",")
    for n, x in enumerate(items):
        if not x.strip():
            raise InputError(f"expected a comma-separated list of integers, found an empty item at item {n} "
                             f"of {s!r}")
    try:
        out = [int(x) for x in items]
    except ValueError:
        raise InputError(f"expected a comma-separated list of integers, found {s!r}") from None
    if not out or any(x < 1 for x in out):
        raise InputError(f"expected positive integers, found {s!r}")
    return out


COLD_NOTE = ("--warmup 0: the timed runs include the first run's JIT compile of the kernels (Numba on the CPU, "
             "CUDA on the GPU), so the rates read far lower than steady state")


def plan(args) -> tuple[list[tuple[str, dict]], dict, dict]:
    """The (run key, worker spec) list, the settings and the checkpoint descriptions for ``args``."""
    from engine.backend import gpu_available
    from parity.bench import synthetic as S
    from reference.checkpoint import Checkpoint
    from reference.errors import InputError
    from reference.paths import resolve_model

    model_pos = getattr(args, "model_pos", None)
    if model_pos is not None:
        if args.synthetic:
            raise InputError(f"MODEL {model_pos!r}: expected either a MODEL or --synthetic, found both")
        if args.model is not None and args.model != model_pos:
            raise InputError(f"MODEL {model_pos!r}: expected either a positional MODEL or --model, found both "
                             f"(--model {args.model!r})")
        args.model = model_pos
    if not args.synthetic:
        for name in ("layers", "vocab"):
            if getattr(args, name) is not None:
                raise InputError(f"--{name}: only applies to --synthetic checkpoints, found it without --synthetic")
    for name in ("budget_s", "timeout_s"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise InputError(f"--{name.replace('_', '-')}: expected a number of seconds > 0, found {v:g}")
    if args.precision is not None and args.precision not in ("bf16", "float32"):
        raise InputError(f"--precision: expected 'bf16' or 'float32' (the engine's precisions), found "
                         f"{args.precision!r}")
    weights = getattr(args, "weights", None)
    if weights and not args.synthetic:
        raise InputError(f"--weights {weights}: only applies to --synthetic weights, found it without --synthetic")
    if weights and (args.backend or "").split(":")[0] != "engine":
        raise InputError(f"--weights {weights}: builds the weights in the engine's memory, expected --backend engine, "
                         f"found {args.backend or 'the default'}")
    if args.synthetic and args.layers is not None and args.layers > S.MAX_LAYERS:
        raise InputError(f"--layers: expected at most {S.MAX_LAYERS} (the real model's num_hidden_layers), found "
                         f"{args.layers}")
    if args.device == "cuda" and not gpu_available():
        from parity.generate import DeviceUnavailableError
        # the option the user gave: --device cuda, or the --backend spec it came from (parity.cli.bench)
        flag = getattr(args, "device_flag", None)
        raise DeviceUnavailableError(f"{flag or '--device cuda'}: a GPU was asked for, expected cupy and a CUDA "
                                     f"device, found none (use "
                                     f"{'--backend engine:device=cpu' if flag else '--device cpu'})")
    backend = args.backend or ("both" if gpu_available() else "reference")
    if backend == "reference":
        for name, default in (("precision", None), ("device", "auto")):
            if getattr(args, name) != default:
                raise InputError(f"--{name}: applies to the engine, found it with backend 'reference' (use --backend "
                                 f"engine or both)")
    dev = args.device
    if dev == "auto":
        dev = "cuda" if gpu_available() else "cpu"
    if dev == "cuda" and backend in ("engine", "both") and not gpu_available():
        from parity.generate import DeviceUnavailableError
        raise DeviceUnavailableError("device 'cuda': a GPU was asked for, expected cupy and a CUDA device, found "
                                     "none (use --device cpu)")
    for name in ("repeats", "layers", "vocab", "decode_tokens"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            raise InputError(f"--{name.replace('_', '-')}: expected an integer >= 1, found {v}")
    if args.warmup < 0:
        raise InputError(f"--warmup: expected an integer >= 0, found {args.warmup}")
    jobs, checkpoints = [], {}
    settings = {"backend": backend, "device": dev, "repeats": args.repeats, "warmup": args.warmup,
                "synthetic": args.synthetic, "peer": not args.no_peer}
    if args.warmup == 0:  # allowed (cold-start timing), but never silently: the first run compiles the kernels
        settings["note"] = COLD_NOTE
    if args.backend is None and backend == "reference":   # the default left the engine out: say why, in the table
        settings["engine_skipped"] = ("no usable GPU (cupy and a CUDA device); the engine's CPU path: --backend "
                                      "both --device cpu (a code-path check, not a speed figure)")

    def model_for(which: str):
        if args.synthetic:
            layers = args.layers or (4 if which == "engine" else 1)
            vocab = args.vocab or (None if which == "engine" else 32768)
            path = S.cached_synthetic(layers, vocab_size=vocab)
            cfg = S.real_width_config(layers, vocab_size=vocab)
            checkpoints[which] = {"path": str(path), "synthetic": True, "layers": layers,
                                  "layer_types": cfg["layer_types"], "ple_layer_ids": cfg["ple_layer_ids"],
                                  "vocab_size": cfg["vocab_size"],
                                  "scaled_down": {"ngram_vocab_size_base": cfg["ngram_vocab_size_base"],
                                                  "real_ngram_vocab_size_base": 20_000_000,
                                                  "vocab_size": None if vocab is None else vocab,
                                                  "real_vocab_size": 248320},
                                  "bytes": S.checkpoint_bytes(cfg)}
            return str(path)
        path = resolve_model(args.model)
        Checkpoint.open(path).validate()  # a bad checkpoint is one clear error here, not a worker traceback
        checkpoints[which] = {"path": str(path), "synthetic": False}
        return str(path)

    real = bool(args.synthetic)
    if backend in ("reference", "both"):
        m = model_for("reference")
        P = args.prompt_lens[0] if args.prompt_lens else (32 if real else 64)  # the reference times one length
        settings["reference_prompt_len"] = P
        D = args.decode_tokens or (4 if real else 16)
        # the reference prefills P then decodes D: checked here, else a length past the model's positions runs
        # (and allocates) in the worker until it fails or the timeout ends it
        from reference.config import load_config
        max_pos = load_config(m).max_position_embeddings
        if P + D > max_pos:
            raise InputError(f"--prompt-lens: expected the reference's prefill length (the first) <= {max_pos - D} "
                             f"(max_position_embeddings={max_pos} minus {D} decode steps), found {P}")
        base = {"model": m, "repeats": args.repeats, "warmup": args.warmup, "budget_s": args.budget_s}
        jobs.append(("reference", dict(base, kind="reference", prompt_len=P, decode_tokens=D)))
        if not args.no_peer:
            jobs.append(("peer_cpu", dict(base, kind="peer", device="cpu", prompt_lens=[P], decode=[[1, P]],
                                          decode_tokens=D)))
    if backend in ("engine", "both"):
        if weights:  # in memory: no file is written, the worker builds the weights
            from reference.config import ModelConfig
            base_rows, note = S.in_memory_ngram_base(weights)
            cfg_d = S.real_width_config(args.layers or 4, vocab_size=args.vocab, ngram_vocab_size_base=base_rows)
            cfg = ModelConfig.from_dict(cfg_d)
            m = None
            checkpoints["engine"] = {"in_memory": weights, "synthetic": True, "layers": cfg.num_hidden_layers,
                                     "layer_types": cfg_d["layer_types"], "ple_layer_ids": cfg_d["ple_layer_ids"],
                                     "vocab_size": cfg.vocab_size, "ple_table": note,
                                     "device_bytes_estimate": S.weights_bytes_estimate(cfg, weights)}
        else:
            m = model_for("engine")
            cfg = Checkpoint.open(m).config
        gpu = dev == "cuda"
        bound = cfg.qsa_bound if cfg.qsa_enabled else 64
        pl = args.prompt_lens or ([512, 4096] if gpu else [32])
        bs = args.batches or ([1, 4, 16] if gpu else [1, 4])
        cs = args.contexts or ([max(8, bound // 2), 2 * bound] if gpu else [max(4, bound // 2), bound + 8])
        D = args.decode_tokens or (8 if gpu else 4)
        _check_positions(cfg.max_position_embeddings, pl, cs, args.warmup, D)
        dec = [[b, c] for c in cs for b in bs]
        base = {"model": m, "repeats": args.repeats, "warmup": args.warmup, "budget_s": args.budget_s,
                "decode_tokens": D}
        jobs.append(("engine", dict(base, kind="engine", device=dev, precision=args.precision, prompt_lens=pl,
                                    decode=dec, progress=gpu,
                                    **({"synthetic": {"config": cfg_d, "weights": weights}} if weights else {}))))
        if not args.no_peer and gpu and not weights:  # in-memory experts: nothing the official model can load
            # the peer decodes at batch 1 only (the goal's comparison); its batched prefill at 16 x 4k
            # tokens would cost more GPU time than the whole engine run
            jobs.append(("peer_gpu", dict(base, kind="peer", device="cuda", prompt_lens=pl,
                                          decode=[d for d in dec if d[0] == 1])))
    if not args.no_extras:
        jobs.append(("extras", {"kind": "extras"}))
    return jobs, settings, checkpoints


# decode warm-up steps the engine takes at least (1 CUDA-graph capture + 2 verified replays, engine/model.py)
_MIN_DECODE_WARMUP = 3


def _check_positions(max_pos: int, prompt_lens: list[int], contexts: list[int], warmup: int, decode: int) -> None:
    """Every prefill length must fit ``max_position_embeddings``; a decode context ``C`` grows to
    ``C + warm-up steps + decode steps`` positions, which must fit too.

    Raises:
        InputError: naming --prompt-lens / --contexts, the limit and the first value beyond it.
    """
    from reference.errors import InputError
    for P in prompt_lens:
        if P > max_pos:
            raise InputError(f"--prompt-lens: expected lengths <= the model's max_position_embeddings={max_pos}, "
                             f"found {P}")
    steps = max(warmup, _MIN_DECODE_WARMUP) + decode
    for C in contexts:
        if C + steps > max_pos:
            raise InputError(f"--contexts: expected contexts <= {max_pos - steps} (max_position_embeddings="
                             f"{max_pos} minus {steps} decode steps), found {C}")


