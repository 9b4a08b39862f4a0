"""The measurements, each run in its own worker process (``python -m parity.bench.measure SPEC``) so
that peak resident memory is per measurement and a crash or hang of one cannot take the others down.

Kinds (``spec["kind"]``):

* ``reference`` - the NumPy/Numba reference on the CPU: prefill and decode tokens/s, peak RSS.
* ``peer`` - the official implementation (transformers ``Qwen4ExpForCausalLM``, eager attention) on
  the CPU (float32, same numerics as the reference) or the GPU (bfloat16, like the engine), same
  weights loaded with ``from_pretrained``: prefill and decode tokens/s (batched decode on the GPU).
* ``engine`` - the engine (CuPy on the GPU, NumPy twins on the CPU): prefill tokens/s per prompt length,
  decode tokens/s per (batch, context), host syncs per decode step (the engine's own counter), bytes
  of weights and state touched per decoded token (an estimate from the shapes, see
  :func:`decode_bytes`), the HBM bandwidth measured in the same process (a large device-to-device
  copy) and the achieved fraction of it.
* ``extras`` - the checkpoint n-gram gather rows/s and tap-diff MB/s (CPU, small sizes).

Every kind prints exactly one JSON object as its last stdout line; progress goes to stderr. Warm-up
runs are excluded from the statistics; medians of repeated runs with their spread are reported.
A peer that cannot run returns ``{"unavailable": "<reason>"}`` instead of failing the bench.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

from parity.bench.stats import rate, summarize


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _ids(rng, n: int, vocab: int, avoid=()) -> np.ndarray:
    ids = rng.integers(0, vocab, size=n, dtype=np.int64)
    for a in avoid:  # keep EOS out: it resets the PLE n-gram history, which real prompts rarely do
        ids[ids == a] = (a + 1) % vocab
    return ids


def _partial(spec: dict, out: dict) -> None:
    """Save what is measured so far (atomically) where the parent can read it after a timeout."""
    path = spec.get("partial_path")
    if not path:
        return
    from reference.atomic import atomic_write_json
    atomic_write_json(path, out, indent=None, default=float)


class _Deadline:
    def __init__(self, budget_s):
        self.end = None if not budget_s else time.monotonic() + float(budget_s)

    def over(self) -> bool:
        """True once the budget given at construction has passed (never when there was none)."""
        return self.end is not None and time.monotonic() > self.end


# --------------------------------------------------------------------------------------------- reference
def run_reference(spec: dict) -> dict:
    """Reference on the CPU. spec: model, prompt_len, decode_tokens, repeats, warmup, dtype."""
    from parity.backends import open_backend

    t0 = time.perf_counter()
    be = open_backend("reference:dtype=float64" if spec.get("dtype") == "float64" else "reference", spec["model"])
    cfg = be.config
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(spec.get("seed", 0))
    P, D = int(spec["prompt_len"]), int(spec["decode_tokens"])
    prompt = _ids(rng, P, cfg.vocab_size, cfg.eos_token_ids)
    pre, dec = [], []
    runs = int(spec.get("warmup", 1)) + int(spec["repeats"])
    for r in range(runs):
        h = be.new_sequence()
        t = time.perf_counter()
        logits = be.prefill_last(h, prompt)
        pt = time.perf_counter() - t
        tok = int(np.argmax(logits))
        steps = []
        for _ in range(D):
            t = time.perf_counter()
            logits = be.decode([h], [tok])[0]
            steps.append(time.perf_counter() - t)
            tok = int(np.argmax(logits))
        be.free(h)
        _log(f"reference run {r + 1}/{runs}: prefill {P / pt:.1f} tok/s, decode {D / sum(steps):.2f} tok/s")
        if r >= int(spec.get("warmup", 1)):
            pre.append(pt)
            dec.append(sum(steps) / D)
    return {"kind": "reference", "device": "cpu", "dtype": spec.get("dtype", "float32"), "load_s": load_s,
            "prompt_len": P, "decode_tokens": D,
            "prefill_tokens_per_s": rate(P, summarize(pre)), "decode_tokens_per_s": rate(1, summarize(dec)),
            "peak_rss_bytes": _peak_rss(), "threads": os.cpu_count()}


# --------------------------------------------------------------------------------------------- peer
def _peer_import():
    """(torch, Qwen4ExpForCausalLM) or raise RuntimeError('<reason>')."""
    try:
        import transformers
    except Exception as e:
        raise RuntimeError(f"transformers not importable ({type(e).__name__}: {e})") from None
    try:
        import torch
    except Exception as e:
        raise RuntimeError(f"torch not importable ({type(e).__name__}: {e})") from None
    try:
        from transformers import Qwen4ExpForCausalLM
    except Exception:
        raise RuntimeError(f"transformers {transformers.__version__} has no qwen4_exp (needs >= 5.23; "
                           f"ci/gpu_bench.sh installs a wheel from .whl/)") from None
    return torch, Qwen4ExpForCausalLM


def run_peer(spec: dict) -> dict:
    """The official implementation's eager forward. spec: model, device, prompt_lens, decode (list of
    [batch, context]), decode_tokens, repeats, warmup, budget_s."""
    try:
        torch, cls = _peer_import()
    except RuntimeError as e:
        return {"kind": "peer", "unavailable": str(e)}
    import transformers

    from parity.bench.stats import TorchEventTimer, WallTimer
    dev = spec.get("device", "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        return {"kind": "peer", "unavailable": "torch sees no CUDA device"}
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    deadline = _Deadline(spec.get("budget_s"))
    t0 = time.perf_counter()
    try:
        model = cls.from_pretrained(spec["model"], dtype=dtype, attn_implementation="eager",
                                    device_map=dev if dev == "cuda" else None)
    except Exception as e:
        return {"kind": "peer", "unavailable": f"from_pretrained failed: {type(e).__name__}: {e}"}
    model.eval()
    load_s = time.perf_counter() - t0
    cfg = model.config
    V = cfg.vocab_size
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    rng = np.random.default_rng(spec.get("seed", 0))
    timer = (lambda: TorchEventTimer(torch)) if dev == "cuda" else WallTimer
    warm, reps = int(spec.get("warmup", 1)), int(spec["repeats"])
    out = {"kind": "peer", "device": dev, "dtype": str(dtype).replace("torch.", ""), "load_s": load_s,
           "attn_implementation": "eager",
           "experts_implementation": str(getattr(cfg, "_experts_implementation_internal", None)
                                         or getattr(cfg, "_experts_implementation", None)),
           "transformers": transformers.__version__, "torch": torch.__version__, "prefill": [], "decode": []}
    _partial(spec, out)

    try:
        _peer_measure(torch, model, spec, out, rng, V, eos, timer, warm, reps, deadline, dev)
    except Exception as e:  # a peer that loads but cannot run its forward degrades, it does not fail the bench
        out["unavailable"] = f"official forward failed: {type(e).__name__}: {e}"
    if dev == "cuda":
        out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
    out["peak_rss_bytes"] = _peak_rss()
    return out


def _peer_measure(torch, model, spec, out, rng, V, eos, timer, warm, reps, deadline, dev):
    def cache_of(o):
        return getattr(o, "cache", None) if getattr(o, "cache", None) is not None else getattr(o, "past_key_values", None)

    with torch.inference_mode():
        for P in spec.get("prompt_lens", []):
            if deadline.over():
                out["prefill"].append({"prompt_len": P, "skipped": "time budget"})
                continue
            ids = torch.as_tensor(_ids(rng, P, V, eos))[None].to(dev)
            ts = []
            for r in range(warm + reps):
                with timer() as t:
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)
                if r >= warm:
                    ts.append(t.seconds)
            out["prefill"].append({"prompt_len": P, "tokens_per_s": rate(P, summarize(ts))})
            _partial(spec, out)
            _log(f"peer prefill {P}: {P / np.median(ts):.1f} tok/s")
        D = int(spec.get("decode_tokens", 8))
        for B, C in spec.get("decode", []):
            if deadline.over():
                out["decode"].append({"batch": B, "context": C, "skipped": "time budget"})
                continue
            ids = torch.as_tensor(np.stack([_ids(rng, C, V, eos) for _ in range(B)])).to(dev)
            o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = cache_of(o)
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for s in range(warm + D):
                with timer() as t:
                    o = model(input_ids=tok, cache=cache, use_cache=True)
                cache = cache_of(o)
                tok = o.logits[:, -1].argmax(-1, keepdim=True)
                if s >= warm:
                    steps.append(t.seconds)
            del cache, o
            if dev == "cuda":
                torch.cuda.empty_cache()
            out["decode"].append({"batch": B, "context": C, "tokens_per_s": rate(B, summarize(steps)),
                                  "step_s": summarize(steps)})
            _partial(spec, out)
            _log(f"peer decode B={B} C={C}: {B / np.median(steps):.2f} tok/s")


# --------------------------------------------------------------------------------------------- engine
def decode_bytes(cfg, weight_itemsize: int, kv_itemsize: int, batch: int, context: int,
                 weight_shapes: dict, device_weights: dict | None = None) -> dict:
    """Estimated bytes one decode step of ``batch`` sequences at ``context`` tokens moves.

    weights: every non-expert weight once per step (``weight_shapes``: canonical name -> shape, the
    checkpoint's), the expected number of distinct routed experts per layer
    (``E * (1 - (1 - k/E) ** batch)``, uniform routing) x their three projections, ``batch`` embedding
    rows and PLE table rows; state per sequence: GDN recurrent state (FP32, read and written) and
    conv states, per QSA layer the compressed block keys (``context / compress_ratio`` x
    ``indexer_head_dim``) and the K/V of the selected tokens (``min(context, qsa_bound)``).
    ``device_weights`` (:func:`engine_weight_bytes`) replaces the shapes x itemsize estimate of the weights by
    the bytes the engine's device arrays hold (stored formats, scales and float32 weights included).
    Returns ``{"weights", "state_read", "state_written", "total", "per_token"}`` (bytes).
    """
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    dense = 0
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * weight_itemsize
    for name, shape in weight_shapes.items():
        n = int(np.prod(shape))
        if ".mlp.experts." in name or "ngram_embedding" in name or name == "embed_tokens.weight":
            continue
        dense += n * weight_itemsize
    row_bytes = cfg.hidden_size * weight_itemsize
    if device_weights is not None:
        dense, per_expert, row_bytes = (device_weights["dense"], device_weights["per_expert"],
                                        device_weights["embed_row"])
    n_layers = cfg.num_hidden_layers
    experts = n_layers * E * (1 - (1 - k / E) ** batch) * per_expert
    rows = batch * row_bytes
    if cfg.ple_layer_ids:
        rows += batch * len(cfg.ple_layer_ids) * cfg.ngram_heads * (cfg.ple_embed_dim // cfg.ngram_heads) * 2
    weights = dense + experts + rows
    st_r = st_w = 0
    for lt in cfg.layer_types:
        if lt == "linear_attention":
            rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
            conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * 4
            st_r += rec + conv
            st_w += rec + conv
        else:
            blocks = context // cfg.indexer_compress_ratio if cfg.qsa_enabled else 0
            sel = min(context, cfg.qsa_bound) if cfg.qsa_enabled else context
            st_r += (blocks * (cfg.indexer_head_dim or 0) + sel * 2 * cfg.num_key_value_heads * cfg.head_dim) * kv_itemsize
            st_w += (2 * cfg.num_key_value_heads * cfg.head_dim + 2 * (cfg.indexer_head_dim or 0)) * kv_itemsize
    st_r *= batch
    st_w *= batch
    total = weights + st_r + st_w
    return {"weights": int(weights), "state_read": int(st_r), "state_written": int(st_w), "total": int(total),
            "per_token": total / batch}


def hbm_bandwidth(cp, nbytes: int = 2 << 30, repeats: int = 5) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second), median of ``repeats`` after a
    warm-up copy, timed with CUDA events."""
    from parity.bench.stats import CupyEventTimer
    a = cp.empty(nbytes // 8, dtype=cp.uint64)
    b = cp.empty_like(a)
    nbytes = a.nbytes

    def copy():  # cudaMemcpyAsync device-to-device (kind 3) on the current stream
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, cp.cuda.get_current_stream().ptr)

    copy()
    ts = []
    for _ in range(repeats):
        with CupyEventTimer(cp) as t:
            copy()
        ts.append(t.seconds)
    s = summarize(ts)
    return {"bytes_per_s": 2 * nbytes / s["median"], "copy_bytes": nbytes, "seconds": s}


def engine_weight_bytes(model) -> dict:
    """Bytes of an :class:`engine.model.EngineModel`'s device weights a decode step can read:
    ``{'dense': every non-expert weight but the embedding (fused stacks once), 'per_expert': one routed
    expert's gate + up + down (stored format, scales included), 'embed_row': one embedding row}``."""
    members = {n for spans in model.fused.values() for n, _, _ in spans}
    dense = sum(int(a.nbytes) for k, a in model.w.items()
                if k not in members and ".mlp.experts." not in k and k != "embed_tokens.weight")
    c = model.config
    gu, dn = model.w["layers.0.mlp.experts.gate_up"], model.w["layers.0.mlp.experts.down"]
    emb = model.w["embed_tokens.weight"]
    return {"dense": int(dense), "per_expert": (int(gu.nbytes) + int(dn.nbytes)) / c.num_experts,
            "embed_row": int(emb.nbytes) // int(emb.shape[0])}


def flops_per_token(cfg, context: int) -> dict:
    """Floating-point operations of one token at ``context`` tokens, from the shapes (2 per multiply-add):
    ``matmul`` (every projection but the embedding gather, the ``k`` routed experts and the shared expert),
    ``attention`` (per QSA layer the indexer scores over ``context / compress_ratio`` blocks and QK + PV over
    ``min(context, qsa_bound)`` tokens; per GDN layer ~3 state passes of ``heads x dk x dv``)."""
    from reference.checkpoint import expected_shapes
    mm = 0
    for name, shape in expected_shapes(cfg).items():
        if len(shape) != 2 or ".mlp.experts." in name or "ngram_embedding" in name or name == "embed_tokens.weight":
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        mm += 2 * shape[0] * shape[1]
    mm += cfg.num_hidden_layers * cfg.num_experts_per_tok * 2 * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    att = 0
    for lt in cfg.layer_types:
        if lt == "linear_attention":
            att += 2 * 3 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        else:
            sel = min(context, cfg.qsa_bound) if cfg.qsa_enabled else context
            blocks = context // (cfg.indexer_compress_ratio or 1) if cfg.qsa_enabled else 0
            att += 2 * 2 * cfg.num_attention_heads * cfg.head_dim * sel
            att += 2 * (cfg.indexer_n_heads or 0) * (cfg.indexer_head_dim or 0) * blocks
    return {"matmul": int(mm), "attention": int(att), "total": int(mm + att)}


def dense_matmul_rate(xp, n: int = 8192, repeats: int = 5) -> dict:
    """The measured dense BF16 matmul rate (FLOP/s) of this GPU: torch ``bfloat16`` ``n x n x n`` matmul
    (cuBLAS, tensor cores) when torch sees the device, else cupy ``float16`` (same tensor-core rate on
    Hopper); median of ``repeats`` after a warm-up, CUDA events."""
    from parity.bench.stats import CupyEventTimer
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no CUDA in torch")
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ts = []
        for r in range(repeats + 1):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(a, b)
            e1.record()
            e1.synchronize()
            if r:
                ts.append(e0.elapsed_time(e1) / 1e3)
        how = "torch bfloat16 matmul"
        del a, b
        torch.cuda.empty_cache()
    except Exception:
        a = xp.random.standard_normal((n, n)).astype(xp.float16)
        b = xp.random.standard_normal((n, n)).astype(xp.float16)
        ts = []
        for r in range(repeats + 1):
            with CupyEventTimer(xp) as t:
                xp.matmul(a, b)
            if r:
                ts.append(t.seconds)
        how = "cupy float16 matmul (BF16 rate equal on Hopper)"
        del a, b
    s = summarize(ts)
    return {"flop_per_s": 2 * n ** 3 / s["median"], "n": n, "how": how, "seconds": s}


def _free_device(xp) -> None:
    import gc
    gc.collect()
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
        xp.get_default_pinned_memory_pool().free_all_blocks()


def run_engine(spec: dict) -> dict:
    """The engine. spec: model (a checkpoint path) or synthetic ``{"config": flat config dict, "weights":
    'bf16' | 'fp8' | 'nvfp4'}`` (random weights in memory, :class:`parity.bench.synthetic.SyntheticWeights`),
    device, precision, prompt_lens, decode ([[batch, context], ...]), decode_tokens, repeats, warmup, budget_s.

    In-memory weights that do not fit the device (estimate + 8 GiB of working memory against the free device
    memory; ``synthetic.free_bytes`` / ``working_bytes`` override both, for tests) are measured at one and two
    periods instead; the result then holds both (``periods``), the
    per-period marginal step cost and the projection to the asked depth (``projected`` rows, flagged)."""
    from engine.backend import get_xp

    syn = spec.get("synthetic")
    if not syn:
        return _measure_engine(None, spec)
    from parity.bench import synthetic as S
    from reference.config import ModelConfig
    xp = get_xp(spec.get("device", "cpu"))
    cfg_d, fmt = syn["config"], syn["weights"]
    cfg = ModelConfig.from_dict(cfg_d)
    est = S.weights_bytes_estimate(cfg, fmt)
    free = int(xp.cuda.runtime.memGetInfo()[0]) if xp is not np else None
    free = syn.get("free_bytes", free)  # tests: pretend a smaller device
    need = est["total"] + int(syn.get("working_bytes", 8 << 30))
    if free is None or need <= free or cfg.num_hidden_layers <= 8:
        out = _measure_engine(S.SyntheticWeights(cfg_d, fmt), spec)
        out.update(weights_format=fmt, fits=True, weights_estimate=est)
        return out
    _log(f"engine: {fmt} weights at {cfg.num_hidden_layers} layers need ~{need / 2**30:.0f} GiB, "
         f"{free / 2**30:.0f} GiB free: measuring 4 and 8 layers and projecting")
    periods = {}
    for L in (4, 8):
        d = dict(cfg_d, num_hidden_layers=L, layer_types=cfg_d["layer_types"][:L])
        periods[L] = _measure_engine(S.SyntheticWeights(d, fmt), dict(spec, partial_path=None))
        _free_device(xp)
    L = cfg.num_hidden_layers
    out = {"kind": "engine", "device": spec.get("device"), "weights_format": fmt, "fits": False,
           "weights_estimate": est, "free_device_bytes": free,
           "not_fitting": f"{fmt} weights at {L} layers need ~{need / 1e9:.0f} GB with working memory, the device "
                          f"has {free / 1e9:.0f} GB free: one and two periods measured, {L} layers projected"}
    out.update(project_periods(periods, cfg))
    return out


def project_periods(periods: dict, cfg) -> dict:
    """Project one-period (4 layers) and two-period (8 layers) engine results to ``cfg``'s depth: per
    setting, the marginal period cost ``m8 - m4`` (step seconds, bytes) and ``step(L) = m4 + (L/4 - 1) *
    (m8 - m4)``; prefill likewise on the prompt's seconds. Rows carry ``projected: True`` and the projection's
    range: ``step(L) = (2 - L/4) m4 + (L/4 - 1) m8`` multiplies each measurement's own spread (its median +- half
    its relative range) by up to ``L/4 - 1`` (11 at 48 layers), so ``tokens_per_s`` carries ``range [lo, hi]``
    from those extremes and ``spread`` = ``(hi - lo) / median`` (None and ``range [lo, None]`` when the extremes
    allow a step of zero or less: the measurements cannot bound it; the JSON's ``null``). Returns the fields of
    an engine result (``periods``, ``hbm``, ``matmul``, ``gpu``, ``precision``, ``prefill``, ``decode``)."""
    L = cfg.num_hidden_layers
    out = {"periods": periods, "hbm": periods[4].get("hbm"), "matmul": periods[4].get("matmul"),
           "gpu": periods[4].get("gpu"), "precision": periods[4].get("precision"), "prefill": [], "decode": []}
    k = (L - 4) / 4  # periods beyond the first
    for r4 in periods[4]["decode"]:
        r8 = next((r for r in periods[8]["decode"] if r.get("batch") == r4.get("batch")
                   and r.get("context") == r4.get("context") and "skipped" not in r), None)
        if "skipped" in r4 or r8 is None:
            continue
        m4, m8 = r4["step_s"]["median"], r8["step_s"]["median"]
        step = m4 + k * (m8 - m4)
        rate = _projected_rate(r4["batch"], step, (m4, r4["step_s"].get("spread")),
                               (m8, r8["step_s"].get("spread")), k)
        b4, b8 = r4["bytes_per_step"], r8["bytes_per_step"]
        nbytes = b4 + k * (b8 - b4)
        row = {"batch": r4["batch"], "context": r4["context"], "projected": True,
               "period_marginal_s": m8 - m4, "period_marginal_bytes": b8 - b4,
               "tokens_per_s": rate, "step_s": {"median": step},
               "bytes_per_step": nbytes, "bytes_per_token": nbytes / r4["batch"],
               "host_syncs_per_step": r4.get("host_syncs_per_step")}
        if out.get("hbm"):
            row["hbm_fraction"] = (nbytes / step) / out["hbm"]["bytes_per_s"]
            row["period_marginal_hbm_fraction"] = ((b8 - b4) / (m8 - m4)) / out["hbm"]["bytes_per_s"] \
                if m8 > m4 else None
        out["decode"].append(row)
    for p4 in periods[4]["prefill"]:
        p8 = next((p for p in periods[8]["prefill"] if p.get("prompt_len") == p4.get("prompt_len")
                   and "skipped" not in p), None)
        if "skipped" in p4 or p8 is None:
            continue
        P = p4["prompt_len"]
        t4, t8 = P / p4["tokens_per_s"]["median"], P / p8["tokens_per_s"]["median"]
        t = t4 + k * (t8 - t4)
        row = {"prompt_len": P, "projected": True, "period_marginal_s": t8 - t4,
               "tokens_per_s": _projected_rate(P, t, (t4, p4["tokens_per_s"].get("spread")),
                                               (t8, p8["tokens_per_s"].get("spread")), k)}
        fl = flops_per_token(cfg, P // 2)["total"]
        row["flop_per_token"] = fl
        if out.get("matmul"):
            row["matmul_fraction"] = (fl * P / t) / out["matmul"]["flop_per_s"]
        out["prefill"].append(row)
    return out


def _projected_rate(n: float, t: float, a: tuple, b: tuple, k: float) -> dict:
    """``{median: n / t, range: [lo, hi], spread}`` of a projected ``t = (1 - k) ta + k tb`` (seconds for ``n``
    tokens), ``a`` / ``b`` = ``(median seconds, spread)`` of the one- and two-period measurements (spread: the
    relative range ``(max - min) / median``, None = unknown, taken as 0): the extremes of ``t`` over
    ``ta (1 +- sa/2)``, ``tb (1 +- sb/2)`` (:func:`project_periods`)."""
    (ta, sa), (tb, sb) = a, b
    ha, hb = (sa or 0.0) / 2, (sb or 0.0) / 2
    t_lo = (1 - k) * ta * (1 + ha) + k * tb * (1 - hb)   # k >= 1: the first term's weight is <= 0
    t_hi = (1 - k) * ta * (1 - ha) + k * tb * (1 + hb)
    out = {"median": n / t}
    if t_lo > 0 and t > 0:
        out["range"] = [n / t_hi, n / t_lo]
        out["spread"] = (n / t_lo - n / t_hi) / (n / t)
    else:
        out["range"] = [n / t_hi if t_hi > 0 else 0.0, None]   # None: no upper bound
        out["spread"] = None
    return out


def _measure_engine(ck, spec: dict) -> dict:
    """The engine's measurements over the weights ``ck`` (None: the checkpoint at ``spec['model']``; see
    :func:`run_engine`)."""
    from engine.backend import get_xp
    from parity.backends import open_backend
    from parity.bench.stats import CupyEventTimer, WallTimer

    dev = spec.get("device", "cpu")
    xp = get_xp(dev)  # raises the engine's DeviceError when cuda is asked for and absent
    prec = spec.get("precision") or ("bf16" if dev == "cuda" else "float32")
    deadline = _Deadline(spec.get("budget_s"))
    pl = list(spec.get("prompt_lens", []))
    dc = [tuple(x) for x in spec.get("decode", [])]
    D = int(spec.get("decode_tokens", 8))
    warm, reps = int(spec.get("warmup", 1)), int(spec["repeats"])
    max_b = max([b for b, _ in dc] + [1])
    max_c = max([c for _, c in dc] + pl + [1])
    kv_tokens = 2 * max_c + (max_b + 2) * (warm + D + 16) + 64
    t0 = time.perf_counter()
    be = open_backend(f"engine-{dev}", spec.get("model") or "in-memory synthetic weights", weights=ck,
                      precision=prec, max_seqs=max_b + 2, kv_tokens=kv_tokens, progress=bool(spec.get("progress")))
    # what is measured is the engine's own serving API (fork, pipelined greedy steps, sync counter)
    eng, ck, cfg = be.eng, be.eng.ck, be.config
    load_s = time.perf_counter() - t0
    timer = (lambda: CupyEventTimer(xp)) if dev == "cuda" else WallTimer
    rng = np.random.default_rng(spec.get("seed", 0))
    V = cfg.vocab_size
    out = {"kind": "engine", "device": dev, "precision": prec, "load_s": load_s, "limits": eng.describe_limits(),
           "weight_bytes_on_device": int(eng.limits.get("weight_bytes", 0)), "prefill": [], "decode": []}
    if dev == "cuda":
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        out["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        out["hbm"] = hbm_bandwidth(xp, int(spec.get("copy_bytes", 2 << 30)))
        _log(f"engine: HBM copy bandwidth {out['hbm']['bytes_per_s'] / 1e12:.2f} TB/s")
        from engine.kernels import gemm_tc
        # which prefill GEMMs ran (A/B: QWEN4EXP_TC_PREFILL=0 gives the float32-FMA kernels)
        out["tc_prefill"] = {"enabled": bool(gemm_tc.TC_ENABLED and gemm_tc.available()),
                             "min_rows": gemm_tc.TC_MIN_ROWS, "moe_tile_rows": gemm_tc.MOE_TILE_ROWS, "moe_max_pad": gemm_tc.MOE_MAX_PAD,
                             "k_chunk": gemm_tc.K_CHUNK}
        _log(f"engine: tensor-core prefill GEMMs {'on' if out['tc_prefill']['enabled'] else 'off'}")
        if spec.get("matmul_rate", True):
            out["matmul"] = dense_matmul_rate(xp)
            _log(f"engine: dense BF16 matmul {out['matmul']['flop_per_s'] / 1e12:.0f} TFLOP/s ({out['matmul']['how']})")
    wb = engine_weight_bytes(eng.model)
    out["weight_bytes_read"] = wb
    _partial(spec, out)
    for P in pl:
        if deadline.over():
            out["prefill"].append({"prompt_len": P, "skipped": "time budget"})
            continue
        ids = _ids(rng, P, V, cfg.eos_token_ids)
        ts = []
        for r in range(warm + reps):
            seq = eng.add_sequence()
            try:
                with timer() as t:
                    eng.prefill(seq, ids, last_only=True)
            finally:
                eng.free(seq)
            if r >= warm:
                ts.append(t.seconds)
        row = {"prompt_len": P, "tokens_per_s": rate(P, summarize(ts)),
               "flop_per_token": flops_per_token(cfg, P // 2)["total"]}  # mean context of a prompt: P / 2
        if "matmul" in out:
            row["matmul_fraction"] = row["flop_per_token"] * P / float(np.median(ts)) / out["matmul"]["flop_per_s"]
        out["prefill"].append(row)
        _partial(spec, out)
        _log(f"engine prefill {P}: {P / np.median(ts):.1f} tok/s")
    kv_isz = int(getattr(eng.pool, "kv_dtype", np.dtype(np.float32)).itemsize)
    for B, C in dc:
        if deadline.over():
            out["decode"].append({"batch": B, "context": C, "skipped": "time budget"})
            continue
        base = eng.add_sequence()
        eng.prefill(base, _ids(rng, C, V, cfg.eos_token_ids), last_only=True)
        seqs = [eng.fork(base) for _ in range(B)]
        eng.free(base)
        toks = _ids(rng, B, V, cfg.eos_token_ids)
        steps, syncs = [], []
        # decode warm-up also covers the CUDA-graph capture step and the graph's verified replays (each
        # checked against an eager step with extra device->host copies): timing or counting them would
        # measure the one-off check, not the steady-state step
        graphs = getattr(eng, "graphs", None)
        warm_d = max(warm, 1 + int(getattr(graphs, "verify_replays", 0))) if graphs is not None else warm
        try:
            # greedy steps, pipelined once the batch's graphs are steady (Engine.decode_greedy_steps); each
            # step's duration is taken between device events at the ends of consecutive steps
            if warm_d:
                toks = eng.decode_greedy_steps(seqs, toks, warm_d)[-1]
            h0 = eng.host_syncs
            eng.decode_greedy_steps(seqs, toks, D, step_times=steps)
            syncs = [0.0] * warm_d + [(eng.host_syncs - h0) / D] * D
        finally:
            for q in seqs:
                eng.free(q)
        st = summarize(steps)
        nb = decode_bytes(cfg, 0, kv_isz, B, C, {}, device_weights=wb)
        row = {"batch": B, "context": C, "above_qsa_bound": bool(cfg.qsa_enabled and C > cfg.qsa_bound),
               "tokens_per_s": rate(B, st), "step_s": st,
               "host_syncs_per_step": float(np.mean(syncs[warm_d:])) if len(syncs) > warm_d else None,
               "bytes_per_step": nb["total"], "bytes_per_token": nb["per_token"], "bytes": nb,
               "flop_per_token": flops_per_token(cfg, C)["total"]}
        if "hbm" in out:
            row["hbm_fraction"] = (nb["total"] / st["median"]) / out["hbm"]["bytes_per_s"]
        out["decode"].append(row)
        _partial(spec, out)
        _log(f"engine decode B={B} C={C}: {B / st['median']:.2f} tok/s, syncs/step {row['host_syncs_per_step']}"
             + (f", {100 * row['hbm_fraction']:.1f}% of HBM" if "hbm_fraction" in row else ""))
    out["host_syncs_note"] = ("engine counter (Engine.host_syncs): device->host copies per decode call; the "
                              "returned token ids are one of them")
    out["decode_step"] = ("Engine.decode_greedy: host half (ids, positions, n-gram hash, PLE row gather) + "
                          "device step + argmax on the device + copy of B token ids")
    out["peak_rss_bytes"] = _peak_rss()
    if dev == "cuda":
        out["peak_device_bytes"] = int(xp.get_default_memory_pool().total_bytes())
    return out


# --------------------------------------------------------------------------------------------- extras
def run_extras(spec: dict) -> dict:
    """Checkpoint n-gram gather rows/s and tap-diff MB/s where those modules offer their bench hooks."""
    out = {"kind": "extras"}
    try:
        from reference.bench_ngram import bench_ngram_gather
        r = bench_ngram_gather(int(spec.get("table_bytes", 64 << 20)), n_gathers=int(spec.get("gathers", 20)),
                               rows_per_gather=int(spec.get("rows_per_gather", 1024)))
        out["ngram_gather"] = {k: r[k] for k in ("rows_per_s", "table_bytes", "rows", "seconds")}
    except Exception as e:
        out["ngram_gather"] = {"unavailable": f"{type(e).__name__}: {e}"}
    try:
        import tempfile
        from pathlib import Path

        from taps.archive import Archive
        from taps.diff import bench_diff
        from taps.recorder import Recorder
        from taps.synthetic import fake_forward, tiny_config
        cfg = tiny_config()
        ids = np.arange(int(spec.get("diff_positions", 256))) % cfg.vocab_size
        with tempfile.TemporaryDirectory() as td:
            paths = []
            for name, fault in (("a", None), ("b", {"tap": "layers.2.mlp.out", "position": 7, "scale": 1e-3})):
                p = Path(td) / name
                with Recorder(p):
                    try:
                        fake_forward(cfg, ids, seed=1, fault=fault)
                    except Exception:
                        fake_forward(cfg, ids, seed=1)
                paths.append(Archive.open(p))
            out["tap_diff_mb_per_s"] = bench_diff(paths[0], paths[1], repeat=2)
    except Exception as e:
        out["tap_diff_mb_per_s"] = None
        out["tap_diff_unavailable"] = f"{type(e).__name__}: {e}"
    return out


def run_selftest(spec: dict) -> dict:
    """Harness check (tests): record one partial result, then sleep ``spec["sleep"]`` seconds."""
    out = {"kind": "selftest", "decode": [{"batch": 1, "context": 1, "tokens_per_s": rate(1, summarize([0.5]))}]}
    _partial(spec, out)
    time.sleep(float(spec.get("sleep", 0)))
    out["finished"] = True
    return out


KINDS = {"reference": run_reference, "peer": run_peer, "engine": run_engine, "extras": run_extras,
         "selftest": run_selftest}


def main(argv=None) -> int:
    """Worker entry point: run the measurement ``KINDS[spec["kind"]]`` for the JSON spec in ``argv[0]``
    and print its result (with ``spec`` added) as one JSON line on stdout.

    Returns:
        2 for an unknown kind, else 0; an exception inside the measurement is reported in the JSON
        (``error``, ``user_error``) with its traceback on stderr.
    """
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    fn = KINDS.get(spec.get("kind"))
    if fn is None:
        print(json.dumps({"error": f"unknown kind {spec.get('kind')!r}"}))
        return 2
    try:
        res = fn(spec)
    except Exception as e:
        from reference.errors import UserError
        res = {"kind": spec.get("kind"), "error": f"{type(e).__name__}: {e}", "user_error": isinstance(e, UserError)}
        import traceback
        traceback.print_exc()
    res["spec"] = spec
    print(json.dumps(res, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
