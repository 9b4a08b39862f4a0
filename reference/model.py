"""The reference qwen4exp text model (``Qwen4ExpForCausalLM``) over a weights object.

``ReferenceModel(weights, dtype=np.float32)`` where ``weights`` offers the ``reference.checkpoint.Checkpoint``
interface (``config``, ``get``, ``has``, ``expert``, ``ngram_rows``; ``names``/``shape``/``get_raw`` optional).
Canonical tensor names carry no ``model.`` prefix (docs/design.md).

Dataflow per call (source: modeling_qwen4_exp.py ``Qwen4ExpTextModel.forward``,
``Qwen4ExpTextDecoderLayer.forward``, ``Qwen4ExpForCausalLM.forward``): embed -> repeat to ``hc_count`` streams
-> per layer: (+PLE) -> attention hyper-connection -> GDN or QSA -> inject -> MLP hyper-connection -> MoE
-> inject; then ``hyper_connection_mixer`` -> ``lm_head``.

Every computation runs in ``dtype`` (float32 default, float64 on request) through the same code.
In float32, stored BF16 matrices (routed experts, every projection, the lm_head) are multiplied from their stored bits (``reference.blocks.linear``): a product of a few rows
reads the 2-byte weight through the checkpoint's memory map instead of a 4-byte upcast copy; only the
float32 summation order differs from multiplying the upcast weight.
Taps are emitted at every block boundary through ``reference.taphook.current()`` (nothing is built when no
recorder is active).
"""
from __future__ import annotations

import os

import numpy as np

from reference.blocks.gdn import conv_history, gdn_block
from reference.blocks.hyper_connection import hc_combine, hyper_connection
from reference.blocks.linear import FUSED_MAX_ROWS, BF16Matrix, linear
from reference.blocks.moe import moe_block
from reference.blocks.mtp import check_mtp_options, mtp_fuse
from reference.checkpoint import MTP_LAYER
from reference.blocks.ple import ple_block
from reference.blocks.qsa import attention_project, indexer_project, indexer_select, pool_block_keys, qsa_attention
from reference.blocks.norms import sigmoid
from reference.blocks.rope import inv_freq, rope_cos_sin
from reference.taphook import layer_of
from reference.errors import InputError
from reference.numba_kernels import bf16_matmul_t, bf16_upcast, ngram_hash_rows
from reference.order import blocked_matmul_t, current as current_order
from reference.session import Session, SessionState, check_ids
from reference import taphook as _taphook

__all__ = ["ReferenceModel"]


def _pfx(i) -> str:
    """Canonical tensor/tap prefix of decoder layer ``i``; ``"mtp"`` is the MTP head's layer (``mtp.layers.0.``)."""
    return "mtp.layers.0." if i == MTP_LAYER else f"layers.{i}."

def _auto_cache_bytes() -> int:
    """The default weight-cache budget of one model: an eighth of the host's memory, at least 2 GiB (a floor
    measurement holds three models; the real-width period's float32 upcasts are ~10 GB, each forward re-reading
    them costs ~4 s on 16 cores)."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        phys = 0
    return max(2 << 30, phys // 8)


_AUTO_CACHE_BYTES = _auto_cache_bytes()


class _Capture:
    """A minimal private recorder (hidden states, replay): keeps every emitted tap, concatenated over calls."""

    def __init__(self, names=None):
        self.names = names
        self.values: dict[str, list] = {}

    def emit(self, name, value, positions=None, **_):
        """Keep a copy of ``value`` under ``name`` when no filter is set or ``name`` is in it; ``positions``
        and other keywords are ignored."""
        if self.names is None or name in self.names:
            self.values.setdefault(name, []).append(np.array(value, copy=True))

    def result(self) -> dict:
        """Every kept tap: ``{name: array}``, the copies of several emits concatenated along axis 0."""
        return {k: (np.concatenate(v, axis=0) if len(v) > 1 else v[0]) for k, v in self.values.items()}


def _taps_kw(taps) -> dict:
    """``{'taps': taps}`` only while recording: a block called without it keeps its plain signature (tests
    patch blocks with plain-signature stand-ins)."""
    return {} if taps is None else {"taps": taps}


def latest_block_keys(block_keys: np.ndarray, pos: np.ndarray, r: int) -> np.ndarray:
    """The tap ``layers.{i}.self_attn.indexer.block_keys``: for each absolute position ``p`` the pooled,
    normed, rotated key of the latest complete block visible to it (block ``(p + 1) // r - 1``), zeros
    while no block is complete. ``block_keys [NB, D]`` -> ``[T, D]``. A stale, zeroed or mis-pooled block key
    differs here before it moves a score."""
    b = (np.asarray(pos, dtype=np.int64) + 1) // r - 1
    out = np.zeros((len(b), block_keys.shape[1]), dtype=block_keys.dtype)
    ok = (b >= 0) & (b < block_keys.shape[0])
    out[ok] = block_keys[b[ok]]
    return out


class ReferenceModel:
    """The NumPy/Numba ground truth for one checkpoint.

    Args:
        weights: a ``Checkpoint`` / ``DictWeights``-like object.
        dtype: ``np.float32`` (default) or ``np.float64``.
        cache_weights: keep upcast weights (and used experts) in memory: ``True`` all, ``False`` none (every
            step reads through the reader's memory maps), ``None`` (default) up to ``cache_bytes`` -- all of a
            small model; for the real checkpoint the first weights touched, the rest read on demand.
        cache_bytes: the byte budget of ``cache_weights=None`` (default an eighth of the host's memory, at
            least 2 GiB). What is cached never changes a result: every product takes the same path with or
            without it.
        progress: show a per-layer progress bar (tqdm) inside long steps; ``None`` = for real-width models
            (``hidden_size >= 1024``) on steps of 64 tokens or more.
    Raises:
        InputError: unsupported dtype.
    """

    def __init__(self, weights, dtype=np.float32, cache_weights: bool | None = None, progress: bool | None = None,
                 cache_bytes: int = _AUTO_CACHE_BYTES):
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise InputError(f"dtype: expected float32 or float64, found {dt}")
        self.weights = weights
        self.config = weights.config
        self.dtype = dt.type
        cfg = self.config
        self._inv_freq = inv_freq(cfg.rope_theta, cfg.rotary_dim, self.dtype)
        self._cache_budget = {True: None, False: 0, None: int(cache_bytes)}[cache_weights]
        self._cache_on = cache_weights is True or (cache_weights is None and self._estimate_bytes() < cache_bytes)
        self._cached_bytes = 0
        self.progress = progress
        self._cache: dict = {}
        self._expert_cache: dict = {}
        self._upcast_cache: dict = {}
        self._expert_raw: dict = {}
        self._raw_views: dict = {}
        #: diagnostic hook ``(layer, positions [T], block_scores [T, NB], selected [T, block_topk]) -> selected``:
        #: replaces the QSA block selection (e.g. with another implementation's, to compare past a tie).
        self.selection_hook = None
        #: diagnostic hook ``(layer, positions [T], router_probs [T, E], topk_ids [T, k]) -> topk_ids``: replaces
        #: the MoE expert selection (e.g. to force another implementation's pick inside a tie set).
        self.expert_hook = None
        #: storage-rounding hook ``(kind, array) -> array`` applied where an engine stores activations:
        #: ``'residual'`` (the hc_count-stream residual after the embedding, each PLE add and each combine),
        #: ``'block_io'`` (each block's input from its hyper-connection and its output), ``'kv'`` (attention keys and
        #: values and the raw indexer keys as they enter the caches). None (default): nothing is rounded. Used by
        #: ``parity.harness.floor`` to measure the noise of a correct reduced-precision engine.
        self.store_round = None

    # ------------------------------------------------------------------ weights
    def _estimate_bytes(self) -> int:
        names = getattr(self.weights, "names", None)
        shape = getattr(self.weights, "shape", None)
        if names is None or shape is None:
            return 0
        total = 0
        for n in names():
            if ".mlp.experts." in n or "ngram_embedding" in n:
                continue
            total += int(np.prod(shape(n))) * np.dtype(self.dtype).itemsize
        return total

    def _keep(self, nbytes: int) -> bool:
        b = self._cache_budget
        if b is None or self._cached_bytes + nbytes <= b:
            self._cached_bytes += nbytes
            return True
        return False

    def w(self, name: str) -> np.ndarray:
        """Weight ``name`` upcast to the compute dtype (kept in memory within the cache budget)."""
        a = self._cache.get(name)
        if a is None:
            a = np.asarray(self.weights.get(name, dtype=self.dtype), dtype=self.dtype)
            if self._keep(a.nbytes):
                self._cache[name] = a
        return a

    def _w_opt(self, name: str):
        return self.w(name) if self.weights.has(name) else None

    def _bf16_raw(self, name: str):
        """The stored BF16 ``[O, K]`` tensor ``name`` (memory-mapped) when products may read its bits: float32
        compute and a weights object with ``get_raw``/``dtype``; else None."""
        w = self.weights
        if self.dtype is not np.float32 or not hasattr(w, "get_raw") or not hasattr(w, "dtype"):
            return None
        if name in self._raw_views:
            return self._raw_views[name]
        raw = w.get_raw(name) if w.dtype(name) == "BF16" else None
        if raw is not None and raw.ndim < 2:
            raw = None
        self._raw_views[name] = raw  # a view of the memory map (or None): no data is held
        return raw

    def m(self, name: str):
        """Weight ``name`` as an operand of :func:`reference.blocks.linear.linear`: a :class:`BF16Matrix` over
        its stored bits (float32 compute, stored BF16; products of many rows use :meth:`w`'s cached upcast),
        else :meth:`w`."""
        raw = self._bf16_raw(name)
        if raw is None or raw.ndim != 2:
            return self.w(name)
        return BF16Matrix(raw, upcast=lambda dt, n=name: self.w(n))

    def _expert_bits(self, layer, e: int):
        """``(gate [I, H], up [I, H], down [H, I])`` stored BF16 views of a routed expert (memory-mapped; nothing
        read yet), or None when the float32 bits path does not apply (then :meth:`_expert` upcasts)."""
        if self.dtype is not np.float32 or not hasattr(self.weights, "get_raw"):
            return None
        m = _pfx(layer) + "mlp.experts."
        if self.weights.has(f"{m}{e}.gate_proj.weight"):
            got = tuple(self._bf16_raw(f"{m}{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            return None if any(g is None for g in got) else got
        lay = self._expert_raw.get(layer)
        if lay is None:
            lay = ()
            if self.weights.has(m + "gate_up_proj") and self.weights.has(m + "down_proj"):
                gu, dn = self._bf16_raw(m + "gate_up_proj"), self._bf16_raw(m + "down_proj")
                if gu is not None and dn is not None and gu.ndim == 3 and dn.ndim == 3:
                    lay = (gu, dn)
            self._expert_raw[layer] = lay
        if not lay:
            return None
        gu, dn = lay
        I = gu.shape[1] // 2
        return gu[e, :I], gu[e, I:], dn[e]

    def _expert(self, layer: int, e: int):
        key = (layer, e)
        got = self._expert_cache.get(key)
        if got is None:
            bits = self._expert_bits(layer, e)
            if bits is not None:  # products of many rows use the upcast: kept within the cache budget
                return tuple(BF16Matrix(b, upcast=lambda dt, k=(layer, e, i), b=b: self._expert_upcast(k, b, dt))
                             for i, b in enumerate(bits))
            got = tuple(np.asarray(a, dtype=self.dtype) for a in self.weights.expert(layer, e, dtype=self.dtype))
            if self._keep(sum(a.nbytes for a in got)):
                self._expert_cache[key] = got
        return got

    def _expert_upcast(self, key, raw: np.ndarray, dtype) -> np.ndarray:
        """The upcast of one stored BF16 expert matrix ``raw`` (``key`` = layer, expert, part), kept in memory
        within the cache budget."""
        key = (*key, np.dtype(dtype).str)
        a = self._upcast_cache.get(key)
        if a is None:
            a = bf16_upcast(raw, dtype)
            if self._keep(a.nbytes):
                self._upcast_cache[key] = a
        return a

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        name = "embed_tokens.weight"
        if name in self._cache:
            return self._cache[name][ids]
        if self._cache_on or not hasattr(self.weights, "get_raw"):
            return self.w(name)[ids]
        return np.asarray(self.weights.get_raw(name)[ids], dtype=self.dtype)

    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        name = "lm_head.weight"
        if not self.weights.has(name):
            if not self.config.tie_word_embeddings:
                from reference.errors import CheckpointError
                raise CheckpointError("lm_head.weight: expected in the checkpoint (tie_word_embeddings is false), "
                                      "found nothing")
            name = "embed_tokens.weight"
        blk = current_order().linear_block
        if blk and h.dtype == np.float32:   # an alternative evaluation order (reference.order)
            return blocked_matmul_t(h, self.w(name), blk)
        # the path is chosen by the rows and the stored format alone, never by what the weight cache holds: the
        # same float32 forward gives the same bits whatever ran before it (an alternative order caches the upcast)
        if h.shape[0] <= FUSED_MAX_ROWS:
            raw = self._bf16_raw(name)
            if raw is not None and raw.ndim == 2:
                return bf16_matmul_t(h, raw)
        if not hasattr(self.weights, "get_raw"):
            return h @ self.w(name).T
        cached = self._cache.get(name)
        if cached is None and self._cache_on:
            cached = self.w(name)
        raw = self.weights.get_raw(name) if cached is None else cached
        out = np.empty((h.shape[0], raw.shape[0]), dtype=self.dtype)
        step = 16384   # vocabulary rows per product: the upcast of one chunk at a time when nothing is cached
        for s in range(0, raw.shape[0], step):
            chunk = raw[s:s + step]
            w = bf16_upcast(chunk, self.dtype) if chunk.dtype.name == "bfloat16" else np.asarray(chunk, self.dtype)
            out[:, s:s + step] = h @ w.T
        return out

    def _hc_w(self, prefix: str, combine: bool = True):
        return (self.w(prefix + ".hc_norm.weight"), self.m(prefix + ".input_mix_weight_down.weight"),
                self.m(prefix + ".input_mix_weight_up.weight"),
                self.m(prefix + ".block_inject_weight.weight") if combine else None)

    def _gdn_w(self, i: int) -> dict:
        p = f"layers.{i}.linear_attn."
        d = {n: self.m(p + n + ".weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
        d["norm"] = self.w(p + "norm.weight")
        conv = self.w(p + "conv1d.weight")
        d["conv1d"] = conv.reshape(conv.shape[0], conv.shape[-1])
        d["A_log"] = self.w(p + "A_log")
        d["dt_bias"] = self.w(p + "dt_bias")
        return d

    def _attn_w(self, i) -> dict:
        p = _pfx(i) + "self_attn."
        d = {}
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            d[n + ".weight"] = self.m(p + n + ".weight")
            b = self._w_opt(p + n + ".bias")
            if b is not None:
                d[n + ".bias"] = b
        d["q_norm"] = self.w(p + "q_norm.weight")
        d["k_norm"] = self.w(p + "k_norm.weight")
        d["index_qk_proj"] = self.m(p + "indexer.index_qk_proj.weight")
        d["q_layernorm"] = self.w(p + "indexer.q_layernorm.weight")
        d["k_layernorm"] = self.w(p + "indexer.k_layernorm.weight")
        return d

    def _ple_w(self, i: int) -> dict:
        p = f"layers.{i}.ple."
        conv = self.w(p + "conv1d.weight")
        return {"key_proj": self.m(p + "key_proj.weight"), "value_proj": self.m(p + "value_proj.weight"),
                "norm_key": self.w(p + "norm_key.weight"), "norm_query": self.w(p + "norm_query.weight"),
                "norm_conv": self.w(p + "norm_conv.weight"), "conv1d": conv.reshape(conv.shape[0], conv.shape[-1])}

    def _moe_w(self, i) -> dict:
        p = _pfx(i) + "mlp."
        return {"gate": self.m(p + "gate.weight"), "shared_gate": self.m(p + "shared_expert.gate_proj.weight"),
                "shared_up": self.m(p + "shared_expert.up_proj.weight"),
                "shared_down": self.m(p + "shared_expert.down_proj.weight"),
                "shared_expert_gate": self.w(p + "shared_expert_gate.weight")}

    # ------------------------------------------------------------------ rope
    def cos_sin(self, positions: np.ndarray):
        """RoPE tables ``[T, rotary_dim]`` for absolute int positions ``[T]`` (text: all mrope rows equal)."""
        return rope_cos_sin(np.asarray(positions, dtype=np.int64), self._inv_freq, self.config.mrope_section)

    # ------------------------------------------------------------------ module steps (also used by replay)
    def _st(self, kind: str, a: np.ndarray) -> np.ndarray:
        """``a`` rounded as an engine would store it (:attr:`store_round`), else ``a`` itself."""
        f = self.store_round
        return a if f is None else np.asarray(f(kind, a), dtype=a.dtype)

    def _ple_step(self, i, st, x, ids, pos, rec):
        cfg = self.config
        lay = cfg.ple_layout(i)
        rows = ngram_hash_rows(st.context, ids, cfg.ple_eos_token_id, lay.multipliers, lay.head_vocab_sizes,
                               lay.head_offsets, cfg.heads_per_ngram)
        emb = np.asarray(self.weights.ngram_rows(i, rows), dtype=self.dtype).reshape(len(ids), -1)
        taps = {} if rec is not None else None
        out, gate, new_conv = ple_block(x, emb, self._ple_w(i), st.conv, cfg.hc_count, cfg.hidden_size,
                                        cfg.ngram_size, cfg.rms_norm_eps, **_taps_kw(taps))
        out = self._st("block_io", out)
        ctx = np.concatenate([st.context, ids])[-(cfg.ngram_size - 1):]
        if rec is not None:
            p = f"layers.{i}.ple."
            rec.emit(p + "ple_embedding.ngram_ids", rows, positions=pos)
            rec.emit(p + "ple_embedding.out", emb, positions=pos)
            rec.emit(p + "norm_key.out", taps["norm_key"], positions=pos)
            rec.emit(p + "norm_query.out", taps["norm_query"], positions=pos)
            rec.emit(p + "gate", gate, positions=pos)
            rec.emit(p + "norm_conv.out", taps["norm_conv"], positions=pos)
            rec.emit(p + "conv_out", taps["conv_out"], positions=pos)
            rec.emit(p + "out", out, positions=pos)
        return self._st("residual", x + out), (new_conv, ctx)

    def _hc_step(self, prefix, x, pos, rec, combine=True):
        cfg = self.config
        taps = {} if rec is not None else None
        mixed, inj = hyper_connection(x, *self._hc_w(prefix, combine), cfg.hc_count, cfg.hidden_size,
                                      cfg.rms_norm_eps, **_taps_kw(taps))
        mixed = self._st("block_io", mixed)
        if rec is not None:
            rec.emit(prefix + ".hc_norm.out", taps["hc_norm"], positions=pos)
            rec.emit(prefix + ".out", mixed, positions=pos)
            if inj is not None:
                rec.emit(prefix + ".injection_weights", inj, positions=pos)
        return mixed, inj

    def _gdn_step(self, i, st, x, pos, rec, mode="auto"):
        out, taps, conv, recur = gdn_block(x, self._gdn_w(i), st.conv, st.recurrent, self.config, mode)
        out = self._st("block_io", out)
        if rec is not None:
            p = f"layers.{i}.linear_attn."
            if rec.wants(p + "conv_state") if hasattr(rec, "wants") else True:
                rec.emit(p + "conv_state", conv_history(st.conv, taps["conv_in"]), positions=pos)
            rec.emit(p + "conv_out", taps["conv_out"], positions=pos)
            rec.emit(p + "core_out", taps["core_out"], positions=pos)
            rec.emit(p + "norm.out", taps["norm"], positions=pos)
            rec.emit(p + "out", out, positions=pos)
        return out, (conv, recur)

    def _qsa_step(self, i, st, x, pos, cos, sin, rec, reuse=None, sel_out=None):
        """QSA block; appends to the layer's caches (the caller truncates them back on failure).

        ``i``: a trunk layer index or ``"mtp"`` (the MTP head's layer). ``reuse``: ``(selected [block_topk],
        n_complete)`` of an earlier query whose block selection every query of this call reuses (the MTP
        ``draft_selection='reuse_step0'`` option; tokens from that query's tail start onwards stay visible).
        ``sel_out``: a dict that receives the last query's ``(selected, n_complete)``."""
        cfg = self.config
        w = self._attn_w(i)
        r = cfg.indexer_compress_ratio
        taps = {} if rec is not None else None
        q_idx, raw = indexer_project(x, w, cos, sin, cfg, **_taps_kw(taps))
        keys = st.index_keys.append(self._st("kv", raw))
        L = keys.shape[0]
        nb_old, nb_new = st.block_keys.n, L // r
        if nb_new > nb_old:
            st.block_keys.append(pool_block_keys(keys, nb_old, nb_new, w["k_layernorm"], self.cos_sin, cfg))
        scores, sel, n_complete = indexer_select(q_idx, st.block_keys.data[:nb_new], pos, cfg)
        if self.selection_hook is not None:
            sel = np.asarray(self.selection_hook(i, pos, scores, sel), dtype=np.int64)
        if reuse is not None:
            sel = np.repeat(np.asarray(reuse[0], np.int64)[None], len(pos), axis=0)
            n_complete = np.full(len(pos), int(reuse[1]), dtype=n_complete.dtype)
        if sel_out is not None:
            sel_out["selection"] = (sel[-1].copy(), int(n_complete[-1]))
        q, gate, k, v = attention_project(x, w, cos, sin, cfg, **_taps_kw(taps))
        K = st.k.append(self._st("kv", k))
        V = st.v.append(self._st("kv", v))
        core = qsa_attention(q, K, V, sel, pos, n_complete, r, cfg.head_dim ** -0.5)
        out = linear(core * sigmoid(gate), w["o_proj.weight"])
        if "o_proj.bias" in w:
            out = out + w["o_proj.bias"]
        out = self._st("block_io", out)
        if rec is not None:
            p = _pfx(i) + "self_attn."
            if scores.shape[1] == 0:  # no complete block yet: one -inf column (the engine's width rule)
                scores = np.full((len(pos), 1), -np.inf, dtype=scores.dtype)
            rec.emit(p + "indexer.q_layernorm.out", taps["q_layernorm"], positions=pos)
            rec.emit(p + "indexer.block_keys", latest_block_keys(st.block_keys.data, pos, r), positions=pos)
            rec.emit(p + "indexer.block_scores", scores, positions=pos)
            rec.emit(p + "indexer.selected_blocks", sel, positions=pos)
            if getattr(rec, "wants", lambda n: True)(p + "indexer.selected_tokens"):  # registry (forward) order
                from reference.blocks.qsa import selected_tokens
                rec.emit(p + "indexer.selected_tokens",
                         selected_tokens(sel, pos, r, cfg.qsa_bound), positions=pos)
            rec.emit(p + "q_norm.out", taps["q_norm"], positions=pos)
            rec.emit(p + "k_norm.out", taps["k_norm"], positions=pos)
            rec.emit(p + "core_out", core, positions=pos)
            rec.emit(p + "out", out, positions=pos)
        return out

    def _moe_step(self, i, x, pos, rec):
        hook = None if self.expert_hook is None else (lambda probs, ids: self.expert_hook(i, pos, probs, ids))
        out, logits, ids, wts = moe_block(x, self._moe_w(i), lambda e: self._expert(i, e), self.config,
                                          select_hook=hook)
        out = self._st("block_io", out)
        if rec is not None:
            p = _pfx(i) + "mlp."
            rec.emit(p + "gate.router_logits", logits, positions=pos)
            rec.emit(p + "gate.topk_ids", ids, positions=pos)
            rec.emit(p + "gate.topk_weights", wts, positions=pos)
            rec.emit(p + "out", out, positions=pos)
        return out

    # ------------------------------------------------------------------ the step
    def _run(self, state: SessionState, ids: np.ndarray, logits: str = "all", residual_out: list | None = None):
        """Consume ``ids`` ``[T]`` from ``state``; commit the new state only on success.

        Args:
            logits: ``'all'`` -> ``[T, V]``, ``'last'`` -> ``[1, V]``, ``'none'`` -> None.
            residual_out: a list that receives the pre-final-mixer multi-stream residual ``[T, hc*H]`` (the MTP
                head's input ``R``).
        """
        cfg = self.config
        rec = _taphook.current()
        T = len(ids)
        p0 = state.position
        pos = np.arange(p0, p0 + T, dtype=np.int64)
        cos, sin = self.cos_sin(pos)
        qsa_len = {i: s.k.n for i, s in state.qsa.items()}
        pending = {}
        try:
            e = self._embed(ids)
            if rec is not None:
                rec.emit("embed_tokens.out", e, positions=pos)
            x = self._st("residual", np.tile(e, (1, cfg.hc_count)))
            show = self.progress if self.progress is not None else (cfg.hidden_size >= 1024 and T >= 64)
            from tqdm.auto import tqdm
            for i, lt in tqdm(list(enumerate(cfg.layer_types)), desc=f"reference step ({T} tokens)", unit="layer",
                              disable=not show, leave=False):
                if i in state.ple:
                    x, pending[("ple", i)] = self._ple_step(i, state.ple[i], x, ids, pos, rec)
                pre = f"layers.{i}."
                if rec is not None:
                    rec.emit(pre + "attn_hyper_connection.in", x, positions=pos)
                mixed, inj = self._hc_step(pre + "attn_hyper_connection", x, pos, rec)
                if lt == "linear_attention":
                    out, pending[("gdn", i)] = self._gdn_step(i, state.gdn[i], mixed, pos, rec)
                else:
                    out = self._qsa_step(i, state.qsa[i], mixed, pos, cos, sin, rec)
                x = self._st("residual", hc_combine(x, out, inj))
                if rec is not None:
                    rec.emit(pre + "attn_hyper_connection.combine", x, positions=pos)
                mixed, inj = self._hc_step(pre + "mlp_hyper_connection", x, pos, rec)
                out = self._moe_step(i, mixed, pos, rec)
                x = self._st("residual", hc_combine(x, out, inj))
                if rec is not None:
                    rec.emit(pre + "mlp_hyper_connection.combine", x, positions=pos)
            if residual_out is not None:
                residual_out.append(x)
            h, _ = self._hc_step("hyper_connection_mixer", x, pos, rec, combine=False)
            result = None
            if logits != "none":
                hh, pp = (h[-1:], pos[-1:]) if logits == "last" else (h, pos)
                result = self._lm_head(hh)
                if rec is not None:
                    rec.emit("logits", result, positions=pp)
        except BaseException:
            for i, n in qsa_len.items():
                state.qsa[i].truncate(n, cfg.indexer_compress_ratio)
            raise
        for (kind, i), val in pending.items():
            if kind == "ple":
                state.ple[i].conv, state.ple[i].context = val
            else:
                state.gdn[i].conv, state.gdn[i].recurrent = val
        state.position = p0 + T
        return result

    # ------------------------------------------------------------------ the MTP head
    def has_mtp(self) -> bool:
        """True when the weights carry the MTP head (``mtp.*``; see :mod:`reference.blocks.mtp`)."""
        has = getattr(self.weights, "has_mtp", None)
        return bool(has()) if has is not None else self.weights.has("mtp.fc_hidden.weight")

    def _mtp_fuse_w(self) -> dict:
        p = "mtp."
        return {"pre_fc_norm_embedding": self.w(p + "pre_fc_norm_embedding.weight"),
                "pre_fc_norm_hidden": self.w(p + "pre_fc_norm_hidden.weight"),
                "fc_embedding": self.m(p + "fc_embedding.weight"), "fc_hidden": self.m(p + "fc_hidden.weight")}

    def _mtp_run(self, mst, residual: np.ndarray, next_ids: np.ndarray, hnorm: str = "global", reuse=None,
                 sel_out=None):
        """One MTP step over ``T`` pairs ``(R_q, x_{q+1})`` at positions ``mst.position ..`` (appends to the head's
        QSA caches; truncated back on failure; the caller commits ``mst.position``).

        Returns:
            ``(draft_logits [T, V], state_out [T, hc*H])``: the logits predict ``x_{q+2}``; ``state_out`` is the
            pre-mixer multi-stream state (the next draft step's ``R``).
        Source: :mod:`reference.blocks.mtp` (vLLM/SGLang dataflow; no official implementation).
        """
        cfg = self.config
        rec = _taphook.current()
        T = len(next_ids)
        p0 = mst.position
        pos = np.arange(p0, p0 + T, dtype=np.int64)
        cos, sin = self.cos_sin(pos)
        n0 = mst.qsa.k.n
        try:
            x, taps = mtp_fuse(np.asarray(residual, dtype=self.dtype), self._embed(next_ids), self._mtp_fuse_w(),
                               cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps, hnorm)
            if rec is not None:
                rec.emit("mtp.fc_embedding.out", taps["fc_embedding.out"], positions=pos)
                rec.emit("mtp.fc_hidden.out", taps["fc_hidden.out"], positions=pos)
                rec.emit("mtp.layers.0.attn_hyper_connection.in", x, positions=pos)
            pre = "mtp.layers.0."
            mixed, inj = self._hc_step(pre + "attn_hyper_connection", x, pos, rec)
            out = self._qsa_step(MTP_LAYER, mst.qsa, mixed, pos, cos, sin, rec, reuse=reuse, sel_out=sel_out)
            x = hc_combine(x, out, inj)
            if rec is not None:
                rec.emit(pre + "attn_hyper_connection.combine", x, positions=pos)
            mixed, inj = self._hc_step(pre + "mlp_hyper_connection", x, pos, rec)
            out = self._moe_step(MTP_LAYER, mixed, pos, rec)
            x = hc_combine(x, out, inj)
            if rec is not None:
                rec.emit(pre + "mlp_hyper_connection.combine", x, positions=pos)
            h, _ = self._hc_step("mtp.hyper_connection_mixer", x, pos, rec, combine=False)
            logits = self._lm_head(h)
            if rec is not None:
                rec.emit("mtp.logits", logits, positions=pos)
        except BaseException:
            mst.qsa.truncate(n0, cfg.indexer_compress_ratio)
            raise
        return logits, x

    def new_mtp_session(self, hnorm: str = "global", draft_selection: str = "fresh"):
        """A fresh :class:`~reference.session.MTPSession` (the MTP head's own state) at position 0.

        Args:
            hnorm, draft_selection: the options of :mod:`reference.blocks.mtp` (defaults: the majority of the
                public ports).
        Raises:
            InputError: unknown option. CheckpointError: no (or a partial) MTP head in the weights.
        """
        from reference.errors import CheckpointError
        from reference.session import MTPSession
        check_mtp_options(hnorm, draft_selection)
        if not self.has_mtp():
            raise CheckpointError("MTP head: expected mtp.* tensors (mtp.fc_hidden.weight ...) in the checkpoint, "
                                  "found none")
        return MTPSession(self, hnorm=hnorm, draft_selection=draft_selection)

    def mtp_forward(self, residual, next_ids, hnorm: str = "global") -> tuple[np.ndarray, np.ndarray]:
        """The MTP head over ``T`` pairs from an empty head state (the truth for pairs at positions ``0..T-1``).

        Args:
            residual: ``[T, hc*H]`` the trunk's pre-final-mixer residual at positions ``0..T-1``.
            next_ids: ``[T]`` the tokens at positions ``1..T``.
        Returns:
            ``(draft_logits [T, V], state_out [T, hc*H])`` in the model dtype.
        Raises:
            InputError: bad ids, mis-shaped residual, unknown option. CheckpointError: no MTP head.
        """
        ids = check_ids(next_ids, self.config.vocab_size, "mtp next ids")
        ms = self.new_mtp_session(hnorm=hnorm)
        return ms.step(residual, ids)

    # ------------------------------------------------------------------ public API
    def new_session(self) -> Session:
        """A fresh :class:`~reference.session.Session` at position 0."""
        return Session(self)

    def forward(self, ids) -> np.ndarray:
        """One full forward from an empty state (the truth): logits ``[T, vocab_size]`` in the model dtype.

        Raises:
            InputError: empty or out-of-range ids.
        """
        ids = check_ids(ids, self.config.vocab_size)
        return self._run(SessionState.empty(self.config, self.dtype), ids, "all")

    def hidden_states(self, ids) -> dict:
        """Per-layer outputs of one full forward.

        Returns:
            ``{"embed": [T, H], "layers": [L arrays [T, hc*H]] (decoder layer outputs), "final": [T, H]
            (hyper_connection_mixer output), "logits": [T, V]}``.
        """
        cfg = self.config
        names = {"embed_tokens.out", "hyper_connection_mixer.out", "logits"} | {
            f"layers.{i}.mlp_hyper_connection.combine" for i in range(cfg.num_hidden_layers)}
        cap = _Capture(names)
        tok = _taphook.set_current(cap)
        try:
            self.forward(ids)
        finally:
            _taphook.reset_current(tok)
        r = cap.result()
        return {"embed": r["embed_tokens.out"], "final": r["hyper_connection_mixer.out"], "logits": r["logits"],
                "layers": [r[f"layers.{i}.mlp_hyper_connection.combine"] for i in range(cfg.num_hidden_layers)]}

    # ------------------------------------------------------------------ replay (tap-diff --replay)
    def _prev_residual(self, i: int) -> str:
        return "embed_tokens.out" if i == 0 else f"layers.{i - 1}.mlp_hyper_connection.combine"

    def replay_inputs(self, tap_name: str) -> list[str]:
        """The recorded taps :meth:`replay` needs to re-run the module producing ``tap_name``.

        Raises:
            InputError: unknown tap name or layer.
        """
        cfg = self.config
        if tap_name == "embed_tokens.out":
            return []
        if tap_name in ("hyper_connection_mixer.out", "hyper_connection_mixer.hc_norm.out"):
            return [f"layers.{cfg.num_hidden_layers - 1}.mlp_hyper_connection.combine"]
        if tap_name == "logits":
            return ["hyper_connection_mixer.out"]
        i = layer_of(tap_name)
        if i is None:
            raise InputError(f"replay: unknown tap {tap_name!r} (see taps/registry.py)")
        if not 0 <= i < cfg.num_hidden_layers:
            raise InputError(f"replay: tap {tap_name!r}: layer out of range [0, {cfg.num_hidden_layers})")
        lt = cfg.layer_types[i]
        rest = tap_name[len(f"layers.{i}."):]
        # the name's block decides the layer kind it needs (names themselves are checked against
        # taps.registry by the callers; an unknown suffix falls through to "no replay rule")
        if rest.startswith("ple.") and i not in cfg.ple_layers:
            raise InputError(f"replay: tap {tap_name!r}: layer {i} has no PLE")
        need_lt = ("linear_attention" if rest.startswith("linear_attn.") else
                   "indexed_attention" if rest.startswith("self_attn.") else None)
        if need_lt is not None and need_lt != lt:
            raise InputError(f"replay: tap {tap_name!r}: layer {i} is {lt}")
        mixer = "linear_attn" if lt == "linear_attention" else "self_attn"
        if rest.startswith("ple.") or rest == "attn_hyper_connection.in":
            return [self._prev_residual(i)]
        if rest in ("attn_hyper_connection.out", "attn_hyper_connection.injection_weights",
                    "attn_hyper_connection.hc_norm.out"):
            return [f"layers.{i}.attn_hyper_connection.in"]
        if rest.startswith(("linear_attn.", "self_attn.")):
            return [f"layers.{i}.attn_hyper_connection.out"]
        if rest == "attn_hyper_connection.combine":
            return [f"layers.{i}.attn_hyper_connection.in", f"layers.{i}.{mixer}.out"]
        if rest in ("mlp_hyper_connection.out", "mlp_hyper_connection.injection_weights",
                    "mlp_hyper_connection.hc_norm.out"):
            return [f"layers.{i}.attn_hyper_connection.combine"]
        if rest.startswith("mlp."):
            return [f"layers.{i}.mlp_hyper_connection.out"]
        if rest == "mlp_hyper_connection.combine":
            return [f"layers.{i}.attn_hyper_connection.combine", f"layers.{i}.mlp.out"]
        raise InputError(f"replay: unknown tap {tap_name!r} (no replay rule; see taps/registry.py)")

    def replay(self, tap_name: str, inputs: dict, token_ids) -> dict:
        """Re-run only the module producing ``tap_name`` over positions ``0..T-1`` from an empty state.

        Args:
            inputs: ``{name: array [T, ...]}`` for every name in :meth:`replay_inputs` (recorded taps).
            token_ids: ``[T]`` the tokens (used by the embedding and PLE).
        Returns:
            every tap the re-run module emits (``{name: array}``), including ``tap_name``.
        Raises:
            InputError: missing or mis-shaped inputs, bad ids, unknown tap.
        """
        cfg = self.config
        need = self.replay_inputs(tap_name)
        ids = check_ids(token_ids, cfg.vocab_size)
        T = len(ids)
        arrs = {}
        for n in need:
            if n not in inputs:
                raise InputError(f"replay {tap_name}: missing input tap {n!r} (needs {need})")
            a = np.asarray(inputs[n], dtype=self.dtype)
            if a.shape[0] != T:
                raise InputError(f"replay {tap_name}: input {n!r} has {a.shape[0]} positions, expected {T} "
                                 f"(one per token id)")
            arrs[n] = a
        pos = np.arange(T, dtype=np.int64)
        cos, sin = self.cos_sin(pos)
        state = SessionState.empty(cfg, self.dtype)
        cap = _Capture()
        tok = _taphook.set_current(cap)
        try:
            if tap_name == "embed_tokens.out":
                cap.emit("embed_tokens.out", self._embed(ids))
            elif tap_name in ("hyper_connection_mixer.out", "hyper_connection_mixer.hc_norm.out"):
                self._hc_step("hyper_connection_mixer", arrs[need[0]], pos, cap, combine=False)
            elif tap_name == "logits":
                cap.emit("logits", self._lm_head(arrs[need[0]]))
            else:
                i = layer_of(tap_name)
                rest = tap_name[len(f"layers.{i}."):]
                pre = f"layers.{i}."
                if rest.startswith("ple.") or rest == "attn_hyper_connection.in":
                    x = arrs[need[0]]
                    if x.shape[1] == cfg.hidden_size:
                        x = np.tile(x, (1, cfg.hc_count))
                    if i in state.ple:
                        x, _ = self._ple_step(i, state.ple[i], x, ids, pos, cap)
                    cap.emit(pre + "attn_hyper_connection.in", x)
                elif rest.startswith("attn_hyper_connection.") and rest != "attn_hyper_connection.combine":
                    self._hc_step(pre + "attn_hyper_connection", arrs[need[0]], pos, cap)
                elif rest.startswith("linear_attn."):
                    self._gdn_step(i, state.gdn[i], arrs[need[0]], pos, cap)
                elif rest.startswith("self_attn."):
                    self._qsa_step(i, state.qsa[i], arrs[need[0]], pos, cos, sin, cap)
                elif rest.startswith("mlp_hyper_connection.") and rest != "mlp_hyper_connection.combine":
                    self._hc_step(pre + "mlp_hyper_connection", arrs[need[0]], pos, cap)
                elif rest.startswith("mlp."):
                    self._moe_step(i, arrs[need[0]], pos, cap)
                else:  # the two combines
                    half = "attn" if rest.startswith("attn") else "mlp"
                    x = arrs[need[0]]
                    _, inj = self._hc_step(pre + f"{half}_hyper_connection", x, pos, _Capture(set()))
                    cap.emit(pre + f"{half}_hyper_connection.combine", hc_combine(x, arrs[need[1]], inj))
        finally:
            _taphook.reset_current(tok)
        return cap.result()
