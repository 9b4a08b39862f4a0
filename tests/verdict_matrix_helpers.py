"""The verdict matrix (tests/parity/test_verdict_matrix.py, docs/parity.md "Verdict matrix"): models unlike
``tiny`` x backends (correct and faulty), each cell judged by the harness end to end.

Models are built at test time from seeded random weights (rounded to BF16, so the engine's bf16 mode stores
exactly these weights), with chosen configs: small and large logit scales, one indexer head (many exact
zero ties at the QSA cut), hc_count 2 and 3, PLE on every layer, a list of EOS ids. Backends: the engine's
CPU path in float32 and bf16 (correct; on CUDA too: the GPU cells), a store-rounding bf16 engine (the
reference rounding every activation store to BF16: correct by construction), the official implementation
(transformers; CPU, and CUDA in the GPU cells), a correct backend breaking exact ties by the higher index
(without taps: judged by the tie search; with them: judged by its selection taps), and
faults of small effect: a QSA pick outside the tie set, indexer scores in BF16, a stale GDN recurrent
state, the hyper-connection mean rounded to BF16, verify in FP16, batched decode rounding its residual
stream to BF16, and one weight fault per block (embedding, PLE, hyper-connection, GDN, QSA, MoE, final
mixer, LM head) sized to move the logits by ~3e-3 of max |logit|. A BF16-KV engine (``bf16-kv``: the reference
with its KV cache in BF16, activations float32) and the hook faults on it (``kv+<fault>``) or on the all-BF16
store engine (``stores+<fault>``) judge the faults against a reduced-precision floor and its near-tie band.

A cell's verdict: the KL harness (prefill + greedy decode, controls) plus two scenario cases (verify 4
drafts then decode; a batched decode of 3 sequences) under the same measured thresholds.
"""
from __future__ import annotations

import functools

import numpy as np

from parity.harness.floor import STORE_KINDS
from reference.checkpoint import DictWeights
from reference.config import ModelConfig
from reference_helpers import random_weights, tiny_config_dict

#: model name -> (config overrides, lm_head scale). Sizes stay tiny (hidden 32): each cell runs in ~1 s.
MODELS = {
    # max |logit| ~0.2, near-uniform over 1024 tokens (the false PASS), hc_count 3, EOS list
    "small-scale": (dict(vocab_size=1024, hc_count=3, eos_token_id=[7, 9]), 0.1),
    # max |logit| ~30
    "large-scale": (dict(hc_count=2), 12.0),
    # one indexer head: relu-summed scores are exactly 0 for most blocks -> exact ties at the cut
    "one-head": (dict(indexer_n_heads=1), 1.0),
    # PLE on every GDN layer (1-based ids; PLE needs linear_attention layers), hc_count 3
    "ple-all-hc3": (dict(ple_layer_ids=[1, 2, 3], hc_count=3), 1.0),
    # a wide QSA budget (16 of up to 45 blocks): candidates crowd the cut, so BF16-rounded scores flip picks
    "wide-budget": (dict(indexer_budget=64), 1.0),
}
PROMPT_LENGTHS = (64, 23)   # bound = 8 + 4 - 1 = 11: most positions are past it (sparse selection, cuts)
LONG_PROMPTS = {"wide-budget": (180, 23)}   # bound 67: the sparse regime needs longer prompts
GREEDY = 4
FAULT_REL = 3e-3            # weight faults move the logits by ~this fraction of max |logit| (1e-3..1e-2)


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@functools.lru_cache(maxsize=None)
def model(name: str):
    """``(config dict, DictWeights)`` of matrix model ``name`` (BF16-exact weights; lm_head scaled)."""
    over, lm = MODELS[name]
    d = tiny_config_dict(**over)
    cfg = ModelConfig.from_dict(d)
    w = random_weights(cfg, seed=sorted(MODELS).index(name) + 11)
    arrays = {n: _bf16(w.get(n, dtype=np.float32) * (lm if n == "lm_head.weight" else 1.0)) for n in w.names()}
    return d, DictWeights(cfg, arrays)


def prompts(name: str) -> list[list[int]]:
    """The cell's KL prompts (seeded; EOS ids avoided except where the stream puts them)."""
    from parity.harness.scenarios.common import token_stream
    _, w = model(name)
    return [token_stream(w.config, n, seed=100 + n, eos_every=9) for n in LONG_PROMPTS.get(name, PROMPT_LENGTHS)]


# ----------------------------------------------------------------------------------------------- backends
def _ref(w, **kw):
    from parity.backends.reference import ReferenceBackend
    return ReferenceBackend.open(None, weights=w, **kw)


class _Hooked:
    """A reference backend whose model is altered by ``setup(model)``; float32 stores unless declared."""

    def __new__(cls, w, setup, name, precision="float32", stores=None, **kw):
        be = _ref(w, **kw)
        setup(be.model)
        be.name, be.precision = name, precision
        be.capabilities = {**be.capabilities, "stores": {} if stores is None else stores}
        return be


def _topk_rows(scores, n_complete, k):
    from reference.numba_kernels import block_topk_select
    return block_topk_select(np.ascontiguousarray(scores), np.asarray(n_complete, np.int64), k)


def _tie_outside(model):
    """At the first position past the bound whose cut is not tied, keep the WORST visible block instead of
    the k-th best: a pick outside every tie set (one position, one layer: a small, local fault)."""
    cfg = model.config
    done = {"pos": None}

    def hook(layer, pos, scores, sel):
        sel = np.array(sel)
        n = (np.asarray(pos) + 1) // cfg.indexer_compress_ratio
        for t in range(sel.shape[0]):
            if n[t] <= cfg.block_topk + 1:
                continue
            row = scores[t, :n[t]]
            order = np.argsort(-row, kind="stable")
            kth, nxt, worst = row[order[cfg.block_topk - 1]], row[order[cfg.block_topk]], order[-1]
            if kth - nxt <= 1e-3 * np.max(np.abs(row)) or row[worst] == kth:
                continue
            if done["pos"] in (None, int(pos[t])):
                done["pos"] = int(pos[t])
                sel[t, cfg.block_topk - 1] = worst
                sel[t] = np.sort(sel[t])
        return sel
    model.selection_hook = hook


def swap_at_margin(lo: float, hi: float, done: dict | None = None):
    """A ``selection_hook`` setup: at the first position (first QSA call that shows one) with a visible, unkept
    block whose margin below the k-th kept block is in ``[lo, hi]`` of the layer's largest |score| (over the
    rows of the call: a prefill sees the whole layer), keep that block instead of the k-th. ``done`` (a dict)
    receives ``{"pos", "layer", "block", "out", "margin"}`` of the swap (every later call repeats it there). Inside the tie band (``hi`` well under it) the
    pick is tie-equivalent; beyond it (``lo`` well over it) it is a pick outside the tie set."""
    done = {} if done is None else done

    def setup(model):
        cfg = model.config

        def hook(layer, pos, scores, sel):
            sel = np.array(sel)
            if done:   # every later forward (taps, decode) makes the same swap at the same cut
                for t, p in enumerate(np.asarray(pos)):
                    if layer == done["layer"] and int(p) == done["pos"]:
                        sel[t] = np.sort([done["block"] if x == done["out"] else int(x) for x in sel[t]])
                return sel
            sc = np.asarray(scores, np.float64)
            fin = np.isfinite(sc)
            scale = float(np.max(np.abs(sc[fin]))) if fin.any() else 0.0
            n = (np.asarray(pos) + 1) // cfg.indexer_compress_ratio
            for t in range(sel.shape[0]):
                if n[t] <= cfg.block_topk or scale <= 0:
                    continue
                row = sc[t, :n[t]]
                order = np.argsort(-row, kind="stable")
                kth = row[order[cfg.block_topk - 1]]
                for b in order[cfg.block_topk:]:
                    m = (kth - row[b]) / scale
                    if lo <= m <= hi:
                        r = [int(b) if x == order[cfg.block_topk - 1] else int(x) for x in sel[t]]
                        sel[t] = np.sort(r)
                        done.update(pos=int(pos[t]), layer=int(layer), block=int(b), out=int(order[cfg.block_topk - 1]),
                                    margin=float(m))
                        return sel
            return sel
        model.selection_hook = hook
    return setup


def _reverse_ties(model):
    """Break exact ties at the QSA cut by the HIGHER block index (the canonical rule takes the lower): a valid
    resolution, as the official implementation's torch.topk on CPU is."""
    cfg = model.config

    def hook(layer, pos, scores, sel):
        n = (np.asarray(pos) + 1) // cfg.indexer_compress_ratio
        flipped = np.ascontiguousarray(scores[:, ::-1])
        out = _topk_rows(flipped, np.full(len(pos), scores.shape[1]), cfg.block_topk)
        nb = scores.shape[1]
        res = np.where(out >= 0, nb - 1 - out, -1)
        # only the visible blocks count: a query sees n[t] blocks, the rest are -inf (never preferred)
        return np.where(np.arange(cfg.block_topk)[None, :] < np.minimum(n, cfg.block_topk)[:, None], res, -1)
    model.selection_hook = hook


def _no_taps(be):
    """The backend without selection taps (its taps() refuses), so only the resolution search can judge it."""
    from parity.backends.base import BackendError

    def taps(*a, **k):
        raise BackendError(f"backend {be.name}: no taps")
    be.taps = taps
    return be


def _bf16_scores(be):
    """Indexer block scores computed in BF16 (bug R06): queries and block keys rounded to BF16 and the score
    rounded to BF16 before the top-k; flips picks near (not at) ties."""
    import reference.model as rm
    from reference.blocks import qsa

    def select(q, block_keys, positions, cfg):
        scores, _, n = qsa.indexer_select(_bf16(q), _bf16(block_keys), positions, cfg)
        scores = _bf16(scores).astype(q.dtype)
        return scores, _topk_rows(scores, n, cfg.block_topk), n

    def wrap(fn):
        def call(*a, **k):
            rm.indexer_select = select
            try:
                return fn(*a, **k)
            finally:
                rm.indexer_select = qsa.indexer_select
        return call
    for op in ("prefill", "decode", "forward_tokens", "logits"):
        setattr(be, op, wrap(getattr(be, op)))
    return be


def _hc_mean_bf16(model):
    """The hyper-connection stream mean in BF16 (bug R13): the block input rounded and scaled by bf16(1/hc)."""
    import types
    hc = model.config.hc_count
    inv = float(_bf16(np.float32(1.0 / hc)))
    orig = model._hc_step

    def step(self, prefix, x, pos, rec, combine=True):
        mixed, inj = orig(prefix, x, pos, rec, combine)
        return _bf16(mixed * np.float32(inv * hc)).astype(mixed.dtype), inj
    model._hc_step = types.MethodType(step, model)


def _also_round(model, extra):
    """A ``store_round`` hook applying the model's own (the backend's declared stores, or none) and then ``extra``."""
    base = model.store_round
    if base is None:
        return extra
    return lambda kind, a: extra(kind, base(kind, a))


def _verify_fp16(be):
    """forward_tokens (verify) with every activation store rounded to FP16; other paths as declared."""
    from parity.harness.floor import rounder
    orig = be.forward_tokens

    def fwd(h, ids):
        own = be.model.store_round
        be.model.store_round = _also_round(be.model, rounder("fp16"))
        try:
            return orig(h, ids)
        finally:
            be.model.store_round = own
    be.forward_tokens = fwd
    return be


def _batched_bf16(be):
    """A batched decode (B > 1) rounds the residual stream (every layer's input) to BF16."""
    from parity.harness.floor import rounder
    orig = be.decode

    def dec(hs, ids):
        own = be.model.store_round
        if len(hs) > 1:
            be.model.store_round = _also_round(be.model, rounder({"residual": "bf16"}))
        try:
            return orig(hs, ids)
        finally:
            be.model.store_round = own
    be.decode = dec
    return be


def _stale_state(be, layer: int = 0, at_step: int = 2):
    """Decode step ``at_step`` of each sequence loses its layer-``layer`` GDN recurrent-state update (the state
    stays one token stale); the error enters there and surfaces in later positions."""
    orig = be.decode
    steps = {}

    def dec(hs, ids):
        saved = {}
        for h in hs:
            steps[h] = steps.get(h, 0) + 1
            if steps[h] == at_step:
                saved[h] = be._sess(h).state.gdn[layer].recurrent.copy()
        out = orig(hs, ids)
        for h, r in saved.items():
            be._sess(h).state.gdn[layer].recurrent = r
        return out
    be.decode = dec
    return be


#: one weight per block (the fault of that block): tensor name per block kind on the tiny layout
BLOCK_FAULTS = {
    "embed": "embed_tokens.weight",
    "ple": "layers.0.ple.value_proj.weight",
    "hc": "layers.1.attn_hyper_connection.block_inject_weight.weight",
    "gdn": "layers.0.linear_attn.out_proj.weight",
    "qsa": "layers.3.self_attn.o_proj.weight",
    "moe": "layers.2.mlp.shared_expert.down_proj.weight",
    "mixer": "hyper_connection_mixer.input_mix_weight_up.weight",
    "lm_head": "lm_head.weight",
}


def _weight_fault(w, tensor: str, rel: float = FAULT_REL, seed: int = 5):
    """``w`` with ``tensor`` perturbed by eps * rms * N(0,1), eps sized (linear response, measured on the first
    prompt) so that the logits move by ``rel`` of max |logit|."""
    from reference.model import ReferenceModel
    from parity.harness.floor import forced_logits, logged_logits
    name = next(n for n, (o, s) in MODELS.items() if model(n)[1] is w)
    ids = prompts(name)[0]
    base, log = logged_logits(ReferenceModel(w), ids)
    x = w.get(tensor, dtype=np.float32)
    noise = np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32) * float(np.sqrt(np.mean(x * x)))
    # the continuous response (selections held): a probe that flips a selection would mis-size the fault
    probe = forced_logits(ReferenceModel(w.with_override(tensor, x + 1e-3 * noise)), ids, log)
    eff = float(np.max(np.abs(probe - base))) / 1e-3
    eps = rel * float(np.max(np.abs(base))) / max(eff, 1e-30)
    return w.with_override(tensor, (x + eps * noise).astype(np.float32))


def _official(d, w, device: str = "cpu"):
    """The official Qwen4ExpForCausalLM (transformers, float32, eager) on ``w`` as a recompute backend, on
    ``device`` ('cpu' or 'cuda': torch's CUDA kernels, its CUDA top-k included). On CUDA, TF32 is turned off
    for matmuls and cuDNN convolutions: TF32 keeps 10 mantissa bits, so a TF32 run is a reduced-precision
    engine, not the float32 yardstick this cell judges."""
    import torch
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    from parity.backends.base import Backend
    tcfg = Qwen4ExpTextConfig(**{k: v for k, v in d.items() if k != "model_type"})
    tcfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = Qwen4ExpForCausalLM(tcfg).eval()   # filled on the CPU, then moved (the buffers move with it)
    sd = dict(m.named_parameters())   # buffers (n-gram multipliers ...) are derived from the config
    from reference.checkpoint import canonical_name
    with torch.no_grad():
        for k, v in sd.items():
            src = canonical_name(k)
            if not w.has(src):
                raise KeyError(f"official: no weight for {k}")
            v.copy_(torch.from_numpy(np.asarray(w.get(src, dtype=np.float32)).reshape(v.shape)))
    m = m.to(device)

    class Official(Backend):
        name = f"official-{device}"
        precision = "float32"
        capabilities = {"page_sizes": None, "batched_decode": True, "perturb": False, "state_arrays": False,
                        "snapshot_file": False, "stores": {}}

        def __init__(self):
            self.config = w.config
            self.hist = {}
            self.n = 0

        def _fwd(self, ids):
            with torch.no_grad():
                x = torch.as_tensor(np.asarray(ids, np.int64), device=device)[None]
                return m(x, use_cache=False).logits[0].float().cpu().numpy()

        def new_sequence(self):
            self.n += 1
            self.hist[self.n] = []
            return self.n

        def free(self, h):
            self.hist.pop(h, None)

        def prefill(self, h, ids, chunk_size=None):
            self.hist[h] += [int(t) for t in ids]
            return self._fwd(self.hist[h])[-len(ids):]

        def decode(self, hs, ids):
            return np.stack([self.prefill(h, [t])[0] for h, t in zip(hs, ids)])

        def forward_tokens(self, h, ids):
            return self.prefill(h, ids)

        def rollback(self, h, n):
            if n:
                del self.hist[h][-n:]

        def position(self, h):
            return len(self.hist[h])

        def snapshot(self, h):
            return list(self.hist[h])

        def restore(self, h, snap):
            self.hist[h] = list(snap)
    return Official()


#: the declared stores a hook fault can sit on: ``<base>+<fault>`` is that fault in an engine storing these in
#: BF16 (``kv``: a BF16 KV cache with float32 activations, as llama.cpp-style engines keep them; ``stores``: every
#: store kind of parity.harness.floor.STORE_KINDS)
STORE_SETS = {"kv": (("kv", "bf16"),), "stores": tuple((k, "bf16") for k in sorted(STORE_KINDS))}
#: the faults that are hooks (they layer on any declared stores); -> the precision they declare on float32 stores
HOOK_FAULTS = {"tie-outside": "float32", "bf16-scores": "bf16", "hc-mean-bf16": "bf16", "verify-fp16": "bf16",
               "batched-bf16": "bf16", "stale-state": "float32"}


def _hook_fault(fault, w, name: str, stores: dict):
    """Hook fault ``fault`` (a key of :data:`HOOK_FAULTS`, or None: no fault) on a reference backend that rounds
    (and declares) ``stores``."""
    from parity.harness.floor import rounder

    def setup(m):
        if stores:
            m.store_round = rounder(stores)
        {"tie-outside": _tie_outside, "hc-mean-bf16": _hc_mean_bf16}.get(fault, lambda _m: None)(m)
    be = _Hooked(w, setup, name, "bf16" if stores else HOOK_FAULTS[fault], stores)
    wrap = {"bf16-scores": _bf16_scores, "verify-fp16": _verify_fp16, "batched-bf16": _batched_bf16,
            "stale-state": _stale_state}.get(fault)
    return wrap(be) if wrap else be


def backend(kind: str, name: str):
    """Open backend ``kind`` (see :data:`BACKENDS`) on matrix model ``name``."""
    from parity.backends.engine import EngineBackend
    d, w = model(name)
    if kind in ("float32", "bf16", "cuda-float32", "cuda-bf16"):   # the engine: one path, the device its option
        dev = "cuda" if kind.startswith("cuda-") else "cpu"
        return EngineBackend.open(None, weights=w, device=dev, precision=kind.split("-")[-1])
    if kind in ("bf16-stores", "bf16-kv"):   # correct by construction: the reference rounding its declared stores
        return _hook_fault(None, w, kind, dict(STORE_SETS["stores" if kind == "bf16-stores" else "kv"]))
    if kind in ("official", "official-cuda"):
        return _official(d, w, "cuda" if kind == "official-cuda" else "cpu")
    if kind == "reverse-ties":
        return _no_taps(_Hooked(w, _reverse_ties, kind))
    if kind == "reverse-ties-taps":   # the same, with selection taps (as the official backend has): judged by them
        return _Hooked(w, _reverse_ties, kind)
    if kind in HOOK_FAULTS:
        return _hook_fault(kind, w, kind, {})
    if "+" in kind and kind.split("+", 1)[1] in HOOK_FAULTS:
        base, fault = kind.split("+", 1)
        return _hook_fault(fault, w, kind, dict(STORE_SETS[base]))
    if kind.startswith("fault-"):
        be = _ref(_weight_fault(w, BLOCK_FAULTS[kind[len("fault-"):]]))
        be.name = kind
        be.capabilities = {**be.capabilities, "stores": {}}
        return be
    raise KeyError(kind)


#: the GPU cells (tests/parity/test_verdict_matrix.py, marked gpu; their CPU twins are float32, bf16, official)
GPU_BACKENDS = ("cuda-float32", "cuda-bf16", "official-cuda")


def gpu_skip_reason(kind: str) -> str | None:
    """Why GPU cell ``kind`` cannot run here (None: it can): cupy / a CUDA device for the engine, torch with
    CUDA for the official model."""
    if kind.startswith("cuda-"):
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "cupy not installed"
        from engine.backend import gpu_available
        return None if gpu_available() else "no CUDA device visible to cupy"
    try:
        import torch
    except ImportError:
        return "torch not installed"
    try:
        import transformers.models.qwen4_exp  # noqa: F401
    except ImportError:
        return "transformers with qwen4_exp not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


BACKENDS = ("float32", "bf16", "bf16-stores", "bf16-kv", "official", "reverse-ties", "reverse-ties-taps",
            *HOOK_FAULTS, *(f"fault-{b}" for b in BLOCK_FAULTS), "kv+tie-outside", "kv+hc-mean-bf16",
            "kv+verify-fp16", "kv+batched-bf16", "kv+stale-state", "kv+bf16-scores", "stores+tie-outside")


# ----------------------------------------------------------------------------------------------- judging
def _cases():
    from parity.harness.scenarios.common import Case, token_stream

    def verify_then_decode(run):
        cfg = run.config
        ids = token_stream(cfg, 20, seed=7)
        s = run.new("v")
        run.prefill(s, ids[:14])
        run.verify(s, ids[14:18])
        run.rollback(s, 2)
        run.decode([s], [ids[16]])
        run.decode([s], [ids[17]])

    def batched_decode(run):
        cfg = run.config
        seqs = [run.new(f"b{i}") for i in range(3)]
        streams = [token_stream(cfg, 16, seed=30 + i) for i in range(3)]
        for s, st in zip(seqs, streams):
            run.plan(st)
            run.prefill(s, st[:12 + seqs.index(s)])
        for step in range(2):
            run.decode(seqs, [st[12 + i + step] for i, st in enumerate(streams)])
    return [Case("verify_then_decode", verify_then_decode), Case("batched_decode", batched_decode, batch=True)]


@functools.lru_cache(maxsize=None)
def floor_of(name: str, stores_key: tuple):
    """The floor of matrix model ``name`` for the stores ``stores_key`` (cached: shared by every backend); a floor
    too coarse for a useful fault carries its per-store-kind breakdown, as parity.harness.floor.thresholds_for_run
    measures it."""
    from parity.harness.floor import floor_breakdown, floor_prompts, measure_floor, unresolvable
    from parity.harness.kl import thresholds_for
    _, w = model(name)
    fps = floor_prompts(w.config, prompts(name))
    fl = measure_floor(w, fps, dict(stores_key))
    if unresolvable(thresholds_for("bf16" if stores_key else "float32", fl)):
        fl = floor_breakdown(w, fps, fl)
    return fl


@functools.lru_cache(maxsize=None)
def thresholds_of(name: str, precision: str, stores_key: tuple):
    """The run's thresholds for a backend of ``precision`` and stores on model ``name``, with the tap-diff
    profile measured on the model (parity.harness.floor.with_tap_profile), as run_parity builds them."""
    from parity.harness.floor import with_tap_profile
    from parity.harness.kl import thresholds_for
    _, w = model(name)
    th = thresholds_for(precision, floor_of(name, stores_key))
    return with_tap_profile(th, w, prompts(name)[0], dict(stores_key))


#: the official implementation recomputes a full forward per step with a Python loop per query in its indexer:
#: its cells use one short prompt (23 tokens; on wide-budget a 90-token prefix past its bound) to stay ~10 s
OFFICIAL_PROMPTS = {"wide-budget": lambda p: [p[0][:90]]}


def judge(kind: str, name: str, locate: bool = False) -> dict:
    """Judge backend ``kind`` on model ``name``: ``{"verdict", "kl": KLReport, "cases": [CaseResult], ...}``
    (``locate``: locate failing cases by tap-diff too)."""
    from parity.harness.floor import stores_of, unresolvable
    from parity.harness.kl import FAIL, INCONCLUSIVE, PASS, run_kl
    from parity.harness.scenarios.common import TruthCache
    from parity.harness.scenarios.runner import run_case
    _, w = model(name)
    b = backend(kind, name)
    a = _ref(w)
    key = tuple(sorted(stores_of(b).items()))
    fl = floor_of(name, key)
    th = thresholds_of(name, b.precision, key)

    def perturbed(scale=1.0):
        from parity.harness.run import perturbation
        return _ref(w, perturb=("layers.0.linear_attn.out_proj.weight", perturbation(scale=scale)))
    ps = prompts(name)
    if kind.startswith("official"):
        ps = OFFICIAL_PROMPTS.get(name, lambda p: p[1:])(ps)
    rep = run_kl(a, b, ps, greedy_tokens=GREEDY, floor=fl, perturbed_b=perturbed, progress=False, thresholds=th)
    truth = TruthCache(a.model)
    cases = [run_case("matrix", c, b, truth, thresholds=th, locate_on_fail=locate) for c in _cases()]
    statuses = [rep.status] + [{"pass": PASS, "fail": FAIL, "error": FAIL}.get(c.status, PASS) for c in cases]
    coarse = unresolvable(th, fl) is not None
    if FAIL in statuses:
        v = FAIL
    elif INCONCLUSIVE in statuses or coarse:
        v = INCONCLUSIVE
    else:
        v = PASS
    return {"verdict": v, "kl": rep, "cases": cases, "thresholds": th, "floor": fl}
