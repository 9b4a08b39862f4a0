"""The engine's qwen4exp forward, assembled from the engine kernels (engine/kernels/*), over the
engine's serving state (engine/state.py).

One :meth:`EngineModel.forward` runs a *step*: a list of segments, each ``(sequence, new token ids)``.
Prefill and verify pass one segment of ``T`` tokens; decode passes ``B`` segments of one token each
(sequences of different lengths in one batch). Dense work (projections, norms, hyper-connections,
MoE) runs once over all the step's tokens; sequence work (GDN conv/recurrence, QSA, PLE conv/n-grams)
reads and writes each sequence's pages and slab rows.

Weights: BF16 by default, stored on the device as ``uint16`` bit patterns (cupy has no bfloat16);
``precision="float32"`` keeps every BF16 weight in float32 (exact-parity runs). Quantised weights (FP8
block-scaled E4M3 with ``weight_scale_inv``; ModelOpt NVFP4 experts) stay in their stored format on the
device (:class:`engine.kernels.quant.QuantWeight`, ``quantized="stored"``, the default, in both
precisions: the kernels dequantise exactly, as the reference reader does); ``quantized="dequantize"``
dequantises them on load instead (float32 where not BF16-exact). Norm gains, conv kernels, ``A_log`` and
``dt_bias`` stay float32 in both modes. Activations, accumulation and all state are float32.

Sources (modeling_qwen4_exp.py): ``Qwen4ExpTextModel.forward`` (embed, hc_count-fold repeat, layers,
final ``hyper_connection_mixer``), ``Qwen4ExpTextDecoderLayer.forward`` (PLE add, two gated residual
halves), ``Qwen4ExpForCausalLM.forward`` (``lm_head``). The per-block math lives in the kernels.
"""
from __future__ import annotations

import numpy as np

from engine.backend import to_numpy
from engine.kernels import gdn as K_gdn
from engine.kernels import linear as K_lin
from engine.kernels import norms as K_norms
from engine.kernels.dense_common import bf16_bits_to_float32
from engine.ple_table import PLETable
from engine.weights import ModelWeights
from reference import taphook as tap_recorder

__all__ = ["EngineModel", "Segment"]


class Segment:
    """One sequence's part of a step: ``ids`` (host int64 ``[n]``) appended at ``start = seq.length``."""

    __slots__ = ("seq", "ids", "start")

    def __init__(self, seq, ids):
        self.seq = seq
        self.ids = np.asarray(ids, dtype=np.int64)
        self.start = seq.length


class Step:
    """Everything one step needs that is prepared on the host (see :meth:`EngineModel.prepare_step`)."""

    rec = None
    mode = "prefill"
    ids = positions = slabs = None  # host int64
    ids_dev = pos_dev = rows_dev = slabs_dev = None  # device int64
    n_blocks = 1
    emb: dict = {}
    last_rows = None  # host int rows of the final hidden state to project (last_only)
    qsa_select_hook = None  # sel [T, k] -> sel: replaces the QSA selection (the MTP draft-step reuse option)


class SyncCounter:
    """Counts device->host copies/synchronisations the engine makes (the decode-step budget is one: the
    logits; taps add theirs only while a recorder is active)."""

    def __init__(self):
        self.count = 0

    def host(self, a):
        """A host copy of ``a``, counted when ``a`` is a device array."""
        if isinstance(a, np.ndarray):
            return a
        self.count += 1
        return to_numpy(a)


class EngineModel(ModelWeights):
    """Device weights + the forward pass.

    Args:
        ck: a shared checkpoint (``reference.checkpoint.Checkpoint`` or ``DictWeights``).
        xp: numpy (CPU path: NumPy twins) or cupy.
        precision: 'bf16' (BF16 weights, FP32 accumulation/state) or 'float32'.
        ple_placement: 'host' (memory-mapped table, rows gathered per step), 'device' or 'unified' (see
            :mod:`engine.ple_table`; each ``self.ple[i].mode`` names the path in use).
        prefill_gdn_chunk: chunk length of the chunked gated delta rule.
    """

    def __init__(self, ck, xp, precision: str = "bf16", ple_placement: str = "host", prefill_gdn_chunk: int = 64,
                 progress: bool = False, comm=None, mtp: bool = False, quantized: str = "stored"):
        from reference.errors import InputError
        if quantized not in ("stored", "dequantize"):
            raise InputError(f"quantized: expected 'stored' or 'dequantize', found {quantized!r}")
        self.quantized = quantized
        self.ck = ck
        self.config = c = ck.config
        self.xp = xp
        self.precision = precision
        self.gdn_chunk = int(prefill_gdn_chunk)
        self.syncs = SyncCounter()
        self.w: dict[str, object] = {}
        self.kept_float32 = 0
        names = self._weight_names()
        it = names
        if progress:
            from tqdm import tqdm
            it = tqdm(names, desc="upload weights", unit="tensor")
        for name, kind in it:
            self.w[name] = self._load(name, kind)
        self.ep = None  # engine.parallel.ExpertParallel when the routed experts are split over devices
        if comm is None:
            self._load_experts(progress)
        else:  # experts stay on the host (memory-mapped where stored as such) until split over the ranks
            from engine.parallel import ExpertParallel
            xp_dev, self.xp = self.xp, np
            try:
                self._load_experts(progress)
            finally:
                self.xp = xp_dev
            self.ep = ExpertParallel(self, comm)
        #: the MTP head's layer index in ``self.w`` (its weights load as a trunk-shaped ``layers.{L}.*`` layer,
        #: L = num_hidden_layers, so the trunk's layer code runs it), or None without the head
        self.mtp_layer = None
        if mtp:
            self._load_mtp()
        #: the pre-final-mixer multi-stream residual ``[T, hc*H]`` of the latest step (device; the MTP input)
        self.last_residual = None
        self.fused: dict[str, list] = {}
        self.fused_members: set[str] = set()
        if xp is not np:
            self._fuse_weights()
        if self.kept_float32:
            import sys
            print(f"engine: precision bf16: {self.kept_float32} weight matrices are not exactly representable in "
                  f"BF16 (e.g. FP8 dequantised on load) and stay float32", file=sys.stderr)
        from engine.kernels.rope import rope_inv_freq
        self.inv_freq = xp.asarray(rope_inv_freq(c))
        self.ple = {i: PLETable(ck, i, xp, ple_placement) for i in c.ple_layers}
        self.ple_meta = {}
        for i in c.ple_layers:
            lay = c.ple_layout(i)
            self.ple_meta[i] = (np.asarray(lay.multipliers, np.int64), np.asarray(lay.head_vocab_sizes, np.int64),
                                np.asarray(lay.head_offsets, np.int64))

    # ------------------------------------------------------------------ helpers
    def _emit(self, rec, name, value, positions):
        """Emit a tap (host copy, counted) only when a recorder is active and wants ``name``."""
        if rec is not None and rec.wants(name):
            rec.emit(name, self.syncs.host(value), positions=positions)

    def _emit_hc_norm(self, rec, prefix: str, h, positions):
        """The ``<prefix>hc_norm.out`` tap. ``hc_pre`` normalises inside its fused kernel, so the tap is the
        engine's ``rms_norm`` kernel on the same input and weight (computed only while recording): it names a
        wrong gain or eps at the norm; a fault inside the fused kernel alone shows at ``<prefix>out``."""
        name = prefix + "hc_norm.out"
        if rec is not None and rec.wants(name):
            c = self.config
            self._emit(rec, name, K_norms.rms_norm(h, self.w[prefix + "hc_norm.weight"], eps=c.rms_norm_eps,
                                                   group_size=c.hidden_size), positions)

    def _hc_pre(self, prefix: str, h, rec, positions, normed=None):
        """Input side of the hyper-connection ``prefix`` (``layers.{i}.attn_hyper_connection.``) on the
        residual ``h`` [T, hc*H] (``normed``: its grouped norm, when :meth:`_combine` computed it); emits its
        ``.out`` and ``.injection_weights`` taps."""
        c = self.config
        pre = K_norms.hc_pre(h, self.w[prefix + "hc_norm.weight"], self.w[prefix + "input_mix_weight_down.weight"],
                             self.w[prefix + "input_mix_weight_up.weight"], self.w[prefix + "block_inject_weight.weight"],
                             hc_count=c.hc_count, eps=c.rms_norm_eps, down_inject=self.w.get(prefix + "fused_down_inject"),
                             normed=normed)
        self._emit_hc_norm(rec, prefix, h, positions)
        self._emit(rec, prefix + "out", pre.mixed, positions)
        self._emit(rec, prefix + "injection_weights", pre.injection_weights, positions)
        return pre

    def _combine(self, h, out, injection_weights, next_prefix: str | None):
        """``hc_combine`` of a block's output into the residual; on the GPU, when the next op is the hyper-connection
        ``next_prefix``'s input side, also its grouped norm in the same launch (bit-identical). Returns
        ``(h, normed or None)``."""
        if next_prefix is None or self.xp is np:
            return K_norms.hc_combine(h, out, injection_weights), None
        return K_norms.hc_combine_norm(h, out, injection_weights, self.w[next_prefix + "hc_norm.weight"],
                                       eps=self.config.rms_norm_eps)

    def _embed(self, ids_dev):
        W = self.w["embed_tokens.weight"]
        rows = W[ids_dev]
        if rows.dtype == np.uint16:
            return bf16_bits_to_float32(rows)
        return rows.astype(np.float32, copy=False)

    # ------------------------------------------------------------------ forward
    def prepare_host(self, pool, segs: list[Segment], mode: str, rec=None, ple_out: dict | None = None) -> "Step":
        """Host half of a step without any device copy: token ids, positions, slab rows, the PLE n-gram
        hashing (advances each sequence's n-gram context) and, for host-resident tables, the gather of the
        hashed rows (into ``ple_out[i]`` when given: the decode graphs' pinned staging). ``st.emb[i]`` is a
        host float32 array for host tables, a device array for device / unified tables."""
        c = self.config
        st = Step()
        st.rec = rec
        st.mode = mode
        st.ids = np.concatenate([s.ids for s in segs]) if len(segs) > 1 else segs[0].ids
        if mode == "decode" and len(st.ids) == len(segs):  # one token per sequence
            st.positions = np.fromiter((s.start for s in segs), dtype=np.int64, count=len(segs))
            st.slabs = np.fromiter((s.seq.slab for s in segs), dtype=np.int64, count=len(segs))
            st.rows = st.slabs
        else:
            st.positions = np.concatenate([np.arange(s.start, s.start + len(s.ids), dtype=np.int64) for s in segs])
            st.slabs = np.array([s.seq.slab for s in segs], dtype=np.int64)
            st.rows = np.concatenate([np.full(len(s.ids), s.seq.slab, np.int64) for s in segs])
        r = c.indexer_compress_ratio or 1
        st.n_blocks = max(1, int(st.positions.max() + 1) // r)  # host-known: no device sync
        st.emb = {i: self._ple_host(i, pool, segs, st, None if ple_out is None else ple_out.get(i))
                  for i in self.ple}
        return st

    def upload_step(self, st: "Step") -> "Step":
        """Device copies of a host-prepared step (``st.ids_dev``, ``pos_dev``, ``rows_dev``, ``slabs_dev``;
        host PLE rows uploaded through the table's pinned ring)."""
        xp = self.xp
        st.ids_dev = xp.asarray(st.ids)
        st.pos_dev = xp.asarray(st.positions)
        st.rows_dev = xp.asarray(st.rows)
        st.slabs_dev = xp.asarray(st.slabs)
        if xp is not np:
            for i, e in st.emb.items():
                if isinstance(e, np.ndarray):
                    st.emb[i] = self.ple[i]._upload(e)
        return st

    def prepare_step(self, pool, segs: list[Segment], mode: str, rec=None) -> "Step":
        """Host side of a step (never captured in a CUDA graph): :meth:`prepare_host` then
        :meth:`upload_step` (host->device copies only)."""
        return self.upload_step(self.prepare_host(pool, segs, mode, rec))

    def forward(self, pool, segs: list[Segment], mode: str, last_only: bool = False):
        """Run one step and return logits (device array, float32).

        Args:
            pool: the :class:`engine.state.StatePool` (pages for all positions already reserved).
            segs: the step's segments (``mode='decode'``: one token each; else exactly one segment).
            mode: 'prefill', 'decode' or 'verify' (verify fills ``seq.checkpoints`` per position).
            last_only: return only each segment's last row.
        Returns:
            ``[T, V]`` (or ``[len(segs), V]`` with ``last_only``) float32 on the engine's device.
        """
        st = self.prepare_step(pool, segs, mode, tap_recorder.current())
        if last_only:
            st.last_rows = np.cumsum([len(s.ids) for s in segs]) - 1
        return self.run_step(pool, st, segs)

    @property
    def split_layer(self) -> int:
        """First layer whose input needs host data (a host-resident PLE table's gathered rows); the layer
        count when none does. A decode step's "head" (embedding + layers before it) depends only on token
        ids and positions already on the device, so it can run while the host gathers the rows."""
        host = [i for i, t in self.ple.items() if t.mode in ("numpy", "pinned")]
        return min(host) if host else self.config.num_hidden_layers

    def run_step(self, pool, st: "Step", segs, part: str = "all", h=None):
        """Device side of a step: embed, layers, mixer, lm_head. In decode mode it makes no host copy and no
        host->device copy (all inputs are in ``st``), so it can be captured as a CUDA graph.

        Args:
            part: 'all'; 'head' (embedding + layers before :attr:`split_layer`: returns the residual ``h``
                ``[T, hc_count * hidden_size]``); 'tail' (layers from :attr:`split_layer`, mixer, lm_head,
                continuing from ``h``: returns the logits).
        """
        xp, c = self.xp, self.config
        self._pool = pool
        rec, positions, mode = st.rec, st.positions, st.mode
        split = self.split_layer
        if part in ("all", "head"):
            x = self._embed(st.ids_dev)  # [T, H]
            self._emit(rec, "embed_tokens.out", x, positions)
            h = xp.tile(x, (1, c.hc_count))  # [T, hc*H]: streams are copies (official .repeat(1, 1, hc))
            lo = 0
        else:
            lo = split
        hi = split if part == "head" else c.num_hidden_layers
        eps = c.rms_norm_eps
        normed = None  # the next hyper-connection's grouped norm of h, when the combine computed it
        for i in range(lo, hi):
            lt = c.layer_types[i]
            p = f"layers.{i}."
            if i in self.ple:
                h = h + self._ple(i, h, segs, st)
                normed = None
            self._emit(rec, p + "attn_hyper_connection.in", h, positions)
            pre = self._hc_pre(p + "attn_hyper_connection.", h, rec, positions, normed)
            if lt == "linear_attention":
                out = self._gdn(i, pre.mixed, segs, st)
            else:
                out = self._qsa(i, pre.mixed, st, pool)
            h, normed = self._combine(h, out, pre.injection_weights, p + "mlp_hyper_connection.")
            self._emit(rec, p + "attn_hyper_connection.combine", h, positions)
            pre = self._hc_pre(p + "mlp_hyper_connection.", h, rec, positions, normed)
            out = self._moe(i, pre.mixed, rec, positions)
            nxt = f"layers.{i + 1}.attn_hyper_connection." if i + 1 < hi and (i + 1) not in self.ple else None
            h, normed = self._combine(h, out, pre.injection_weights, nxt)
            self._emit(rec, p + "mlp_hyper_connection.combine", h, positions)
        if part == "head":
            return h
        self.last_residual = h
        fin = K_norms.hc_pre(h, self.w["hyper_connection_mixer.hc_norm.weight"],
                             self.w["hyper_connection_mixer.input_mix_weight_down.weight"],
                             self.w["hyper_connection_mixer.input_mix_weight_up.weight"], None,
                             hc_count=c.hc_count, eps=eps)
        final = fin.mixed
        self._emit_hc_norm(rec, "hyper_connection_mixer.", h, positions)
        self._emit(rec, "hyper_connection_mixer.out", final, positions)
        if st.last_rows is not None:
            final = final[xp.asarray(st.last_rows)]
            positions = positions[st.last_rows]
        logits = K_lin.linear(final, self.w["lm_head.weight"])
        self._emit(rec, "logits", logits, positions)
        return logits

    # ------------------------------------------------------------------ GDN
    def _gdn(self, i, x, segs, st):
        """Gated DeltaNet block (``Qwen4ExpTextGatedDeltaNet.forward``) over the step's tokens."""
        xp, c, w = self.xp, self.config, self.w
        rec, positions, mode = st.rec, st.positions, st.mode
        q = f"layers.{i}.linear_attn."
        pool = self._pool
        T = x.shape[0]
        parts = self._fused_linear(x, q + "fused_in_proj")
        if parts is not None:
            qkv, z, b, a = parts
        else:
            qz = self._fused_linear(x, q + "fused_in_proj_qkv_z")
            if qz is not None:
                qkv, z = qz
            else:
                qkv = K_lin.linear(x, w[q + "in_proj_qkv.weight"])
                z = K_lin.linear(x, w[q + "in_proj_z.weight"])
            b = K_lin.linear(x, w[q + "in_proj_b.weight"])
            a = K_lin.linear(x, w[q + "in_proj_a.weight"])
        conv_state = pool.gdn_conv[i]
        rec_state = pool.gdn_rec[i]
        if rec is not None and rec.wants(q + "conv_state"):  # read before the conv updates the state in place
            self._emit(rec, q + "conv_state", self._conv_history(conv_state, qkv, segs, st), positions)
        if mode == "decode":
            slots = st.slabs_dev
            conv = K_gdn.causal_conv_decode(qkv, w[q + "conv1d.weight"], conv_state, slots)
        else:
            seq = segs[0].seq
            ck = seq.checkpoints[f"gdn_conv.{i}"][1:] if mode == "verify" else None
            conv = K_gdn.causal_conv_prefill(qkv, w[q + "conv1d.weight"], conv_state, seq.slab, checkpoints=ck)
        self._emit(rec, q + "conv_out", conv, positions)
        kd, vd = c.linear_key_dim, c.linear_value_dim
        Hk, Hv, Dk, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        qq = conv[:, :kd].reshape(T, Hk, Dk)
        kk = conv[:, kd:2 * kd].reshape(T, Hk, Dk)
        vv = conv[:, 2 * kd:].reshape(T, Hv, Dv)
        if mode == "decode":  # the gates are computed inside the recurrent kernel (one launch)
            core = K_gdn.gated_delta_decode_gates(qq, kk, vv, a, b, w[q + "A_log"], w[q + "dt_bias"], rec_state, slots)
        elif mode == "verify":
            g, beta = K_gdn.gdn_gates(a, b, w[q + "A_log"], w[q + "dt_bias"])
            seq = segs[0].seq
            ck = seq.checkpoints[f"gdn_rec.{i}"][1:]
            core = K_gdn.gated_delta_recurrent(qq, kk, vv, g, beta, rec_state, xp.asarray(np.array([seq.slab])),
                                               cu_seqlens=xp.asarray(np.array([0, T])), checkpoints=ck)
        else:
            g, beta = K_gdn.gdn_gates(a, b, w[q + "A_log"], w[q + "dt_bias"])
            core = K_gdn.gated_delta_prefill(qq, kk, vv, g, beta, rec_state, segs[0].seq.slab, chunk_size=self.gdn_chunk)
        self._emit(rec, q + "core_out", core, positions)
        normed = K_norms.gated_rms_norm(core, z.reshape(T, Hv, Dv), w[q + "norm.weight"], eps=c.rms_norm_eps,
                                        activation=c.output_gate)
        self._emit(rec, q + "norm.out", normed, positions)
        out = K_lin.linear(normed.reshape(T, vd), w[q + "out_proj.weight"])
        self._emit(rec, q + "out", out, positions)
        return out

    def _conv_history(self, conv_state, x, segs, st):
        """Tap ``linear_attn.conv_state`` ``[T, K-1, C]``: the K-1 conv input rows each position reads (the
        carried slab rows, then this step's inputs ``x [T, C]``), before the conv kernel updates the slab."""
        xp = self.xp
        if st.mode == "decode":
            return conv_state[st.slabs_dev].copy()
        S = conv_state.shape[1]
        z = xp.concatenate([conv_state[segs[0].seq.slab], x.astype(conv_state.dtype)], axis=0)
        idx = xp.arange(x.shape[0])[:, None] + xp.arange(S)[None, :]
        return z[idx]

    # ------------------------------------------------------------------ MoE / PLE / QSA (kernels of E-dense / E-seq)
    def _moe(self, i, x, rec, positions):
        """Sparse MoE block (``Qwen4ExpTextSparseMoeBlock.forward``) via :func:`engine.kernels.moe.moe_block`."""
        from engine.kernels import moe as K_moe
        c, w = self.config, self.w
        m = f"layers.{i}.mlp."
        r = K_moe.moe_block(x, w[m + "gate.weight"], w.get(m + "experts.gate_up"), w.get(m + "experts.down"),
                            top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                            shared_gate_proj=w[m + "shared_expert.gate_proj.weight"],
                            shared_up_proj=w[m + "shared_expert.up_proj.weight"],
                            shared_down_proj=w[m + "shared_expert.down_proj.weight"],
                            shared_expert_gate=w[m + "shared_expert_gate.weight"],
                            shared_gate_up=w.get(m + "fused_shared_gate_up"),
                            experts_fn=None if self.ep is None else (lambda *a, **k: self.ep.routed(i, *a, **k)))
        if rec is not None:
            self._emit(rec, m + "gate.router_logits", r.router_logits, positions)
            self._emit(rec, m + "gate.topk_ids", r.topk_ids.astype(np.int64), positions)
            self._emit(rec, m + "gate.topk_weights", r.topk_weights, positions)
            self._emit(rec, m + "out", r.out, positions)
        return r.out

    def _ple_host(self, i, pool, segs, st, out=None):
        """Host half of the PLE layer: hash the n-grams of the new tokens from each sequence's carried
        context (advancing it; verify also records the context after every position), emit the
        ``ngram_ids`` tap and gather the hashed rows of the table.

        Returns: float32 ``[T, ple_embed_dim]``: a host array for host-resident tables (``numpy`` / ``pinned``
        modes; written into ``out`` when given), else a device array. Source:
        ``Qwen4ExpTextNGramEmbedding.forward``."""
        from engine.kernels import ple as K_ple
        q = f"layers.{i}.ple."
        B, Tn = len(segs), len(segs[0].ids)
        ids = np.stack([s.ids for s in segs]) if B > 1 else segs[0].ids.reshape(1, -1)  # [B, Tn] host
        ctx = pool.ple_ctx[i]  # host int64 [max_seqs, n-1]
        if st.mode == "verify":
            hist = np.concatenate([ctx[st.slabs], ids], axis=1)[0]
            ckx = segs[0].seq.checkpoints[f"ple_ctx.{i}"]
            n = ckx.shape[1]
            for j in range(Tn):
                ckx[j + 1] = hist[j + 1:j + 1 + n]
        rows = K_ple.ngram_hash(ids, ctx, st.slabs, self._hash_tables(i), update_context=True)  # [B, Tn, heads]
        rows2 = rows.reshape(B * Tn, -1)
        self._emit(st.rec, q + "ple_embedding.ngram_ids", rows2, st.positions)
        tab = self.ple[i]
        if tab.mode in ("numpy", "pinned"):
            return tab.gather_host(rows2, out=out)
        return tab.gather(rows2)  # [B*Tn, ple_embed_dim] on the device

    def _ple(self, i, h, segs, st):
        """PLE layer output (``Qwen4ExpTextPLELayer.forward``), added to the residual by the caller:
        key/value projections of the gathered n-gram embeddings, the signed-sqrt gate, the dilated conv
        over the carried state. In verify mode the conv state after every position is recorded."""
        from engine.kernels import ple as K_ple
        xp, c, w = self.xp, self.config, self.w
        q = f"layers.{i}.ple."
        pool = self._pool
        rec, positions = st.rec, st.positions
        B, Tn = len(segs), len(segs[0].ids)
        emb = st.emb[i]
        self._emit(rec, q + "ple_embedding.out", emb, positions)
        key = K_lin.linear(emb, w[q + "key_proj.weight"])
        value = K_lin.linear(emb, w[q + "value_proj.weight"])
        pg = K_ple.ple_gate(key, value, h, w[q + "norm_key.weight"], w[q + "norm_query.weight"],
                            w[q + "norm_conv.weight"], hc_count=c.hc_count, eps=c.rms_norm_eps)
        if rec is not None:  # ple_gate normalises inside its kernel: the two input norms by the rms_norm kernel
            for nm, v in (("norm_key", key), ("norm_query", h)):
                if rec.wants(q + nm + ".out"):
                    self._emit(rec, q + nm + ".out", K_norms.rms_norm(v, w[q + nm + ".weight"], eps=c.rms_norm_eps,
                                                                        group_size=c.hidden_size), positions)
        W = h.shape[1]
        conv_slab = pool.ple_conv[i]
        if st.mode == "verify":
            L = conv_slab.shape[1]
            chist = xp.concatenate([conv_slab[int(st.slabs[0])][None], pg.gated_normed.reshape(1, Tn, W)], axis=1)[0]
            ck = segs[0].seq.checkpoints[f"ple_conv.{i}"]
            for j in range(Tn):
                ck[j + 1] = chist[j + 1:j + 1 + L]
        conv = K_ple.ple_conv(pg.gated_normed.reshape(B, Tn, W), conv_slab, st.slabs_dev, w[q + "conv1d.weight"],
                              dilation=c.ngram_size)
        out = pg.gated + conv.reshape(B * Tn, W)
        self._emit(rec, q + "gate", pg.gate, positions)
        self._emit(rec, q + "norm_conv.out", pg.gated_normed, positions)
        self._emit(rec, q + "conv_out", conv.reshape(B * Tn, W), positions)
        self._emit(rec, q + "out", out, positions)
        return out

    def _hash_tables(self, i):
        if not hasattr(self, "_htabs"):
            self._htabs = {}
        if i not in self._htabs:
            from engine.kernels import ple as K_ple
            self._htabs[i] = K_ple.PLEHashTables.from_layout(self.config.ple_layout(i), self.config, np)
        return self._htabs[i]

    def _qsa(self, i, x, st, pool):
        """Indexed sparse attention (``Qwen4ExpTextAttention.forward`` with ``Qwen4ExpTextQSAIndexer``) over
        the paged pools: raw indexer keys, block keys, K and V are written at the tokens' slots first, then
        every query scores the complete blocks visible to it, keeps the canonical top-k plus the tail, and
        attends. Prefill, verify and decode run the same ops (identical selection semantics)."""
        from engine.kernels import qsa as K_qsa
        from engine.kernels.rope import apply_rope
        xp, c, w = self.xp, self.config, self.w
        q = f"layers.{i}.self_attn."
        T = x.shape[0]
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        ih, ihd, r = c.indexer_n_heads, c.indexer_head_dim, c.indexer_compress_ratio
        ps, eps, rd = pool.page_size, c.rms_norm_eps, c.rotary_dim
        rec, positions, pos_dev, rows = st.rec, st.positions, st.pos_dev, st.rows_dev
        # --- indexer: queries, raw keys, block keys, scores, top-k
        parts = self._fused_linear(x, q + "fused_in_proj")
        if parts is not None:
            qk, qg, k_lin, v_lin = parts
        else:
            qk = K_lin.linear(x, w[q + "indexer.index_qk_proj.weight"])
            qg = K_lin.linear(x, w[q + "q_proj.weight"])
            k_lin = K_lin.linear(x, w[q + "k_proj.weight"])
            v_lin = K_lin.linear(x, w[q + "v_proj.weight"])
        # without taps the three head norms + RoPEs run as one kernel (bitwise the same numbers)
        fused_prep = xp is not np and rec is None
        if fused_prep:
            q_idx, qq_p, kk_p = K_qsa.qsa_prep_heads(
                qk, qg, k_lin, w[q + "indexer.q_layernorm.weight"], w[q + "q_norm.weight"], w[q + "k_norm.weight"],
                pos_dev, self.inv_freq, rd, eps, ih, ihd, nh, nkv, hd)
        else:
            q_idx = K_norms.rms_norm(qk[:, :ih * ihd].reshape(T, ih, ihd), w[q + "indexer.q_layernorm.weight"],
                                     eps=eps)
            self._emit(rec, q + "indexer.q_layernorm.out", q_idx, positions)
            q_idx = apply_rope(q_idx, pos_dev, self.inv_freq, rd)

        def attn_qkv():  # attention projections: q/k norms, RoPE; the gate half of q_proj as a strided view
            qg_ = qg.reshape(T, nh, 2 * hd)
            if fused_prep:
                return qg_[:, :, hd:], qq_p, kk_p, v_lin.reshape(T, nkv, hd)
            qq_ = K_norms.rms_norm(xp.ascontiguousarray(qg_[:, :, :hd]), w[q + "q_norm.weight"], eps=eps)
            kk_ = K_norms.rms_norm(k_lin.reshape(T, nkv, hd), w[q + "k_norm.weight"], eps=eps)
            self._emit(rec, q + "q_norm.out", qq_, positions)
            self._emit(rec, q + "k_norm.out", kk_, positions)
            return (qg_[:, :, hd:], apply_rope(qq_, pos_dev, self.inv_freq, rd),
                    apply_rope(kk_, pos_dev, self.inv_freq, rd), v_lin.reshape(T, nkv, hd))

        bk_args = (w[q + "indexer.k_layernorm.weight"], self.inv_freq, rd, r, ps, eps)
        # one launch writes the raw indexer keys, K and V at the slots (decode: and the block keys)
        gate, qq, kk, vv = attn_qkv()
        fuse = st.mode == "decode"  # one token per table row: a block's other raw keys are already pooled
        n_vis = K_qsa.qsa_write_tokens(
            pool.idx_k[i], pool.kv_k[i], pool.kv_v[i], pool.block_tables, rows, pos_dev, qk[:, ih * ihd:], kk,
            vv, ps, block_keys=(pool.blk_k[i], bk_args[0], self.inv_freq, rd, r, eps) if fuse else None)
        if not fuse:
            K_qsa.qsa_block_keys(pool.idx_k[i], pool.blk_k[i], pool.block_tables, rows, pos_dev, *bk_args)
        n_blocks = st.n_blocks
        scores, sel = K_qsa.qsa_select(q_idx, pool.blk_k[i], pool.block_tables, rows, n_vis, n_blocks, r, ps,
                                       c.block_topk)
        if st.qsa_select_hook is not None:
            sel = st.qsa_select_hook(sel)
        if rec is not None:
            if rec.wants(q + "indexer.block_keys"):  # latest complete block's key, read at its last token's slot
                bpos = ((pos_dev + 1) // r) * r - 1
                bslots = K_qsa.token_slots(pool.block_tables, rows, xp.maximum(bpos, 0), ps)
                bk = pool.blk_k[i][bslots] * (bpos >= 0)[:, None].astype(pool.blk_k[i].dtype)
                self._emit(rec, q + "indexer.block_keys", bk, positions)
            self._emit(rec, q + "indexer.block_scores", scores, positions)
            want_b, want_t = rec.wants(q + "indexer.selected_blocks"), rec.wants(q + "indexer.selected_tokens")
            if want_b or want_t:  # one host copy of the selection serves both taps
                sel_h = np.asarray(self.syncs.host(sel)).astype(np.int64)
                if want_b:
                    rec.emit(q + "indexer.selected_blocks", sel_h, positions=positions)
                if want_t:
                    from reference.blocks.qsa import selected_tokens
                    rec.emit(q + "indexer.selected_tokens",
                             selected_tokens(sel_h, np.asarray(self.syncs.host(positions)), r, c.indexer_budget + r - 1),
                             positions=positions)
        # --- sparse attention, sigmoid output gate
        core = K_qsa.qsa_sparse_attention(qq, pool.kv_k[i], pool.kv_v[i], pool.block_tables, rows, n_vis, sel, r, ps,
                                          hd ** -0.5, n_blocks=n_blocks)
        self._emit(rec, q + "core_out", core.reshape(T, nh * hd), positions)
        # core * sigmoid(gate), one fused kernel reading the gate in place: [T, nh, hd] -> [T, nh*hd]
        gated = _sigmoid_gate(xp)(core, gate).reshape(T, nh * hd)
        out = K_lin.linear(gated, w[q + "o_proj.weight"])
        self._emit(rec, q + "out", out, positions)
        return out


    # ------------------------------------------------------------------ the MTP head
    def mtp_step(self, pool, seq, residual, start: int, ids=None, ids_dev=None, hnorm: str = "global",
                 select_hook=None):
        """One MTP step over ``T`` pairs ``(R_q, x_{q+1})`` at head positions ``start .. start+T-1`` of ``seq``
        (writes the head's K/V/indexer caches at those positions' slots, which must be reserved and private).

        The same layer code and kernels as a trunk full-attention layer (the head's layer is loaded as layer
        ``self.mtp_layer``; PLE off), plus the head's fusion (reference: :mod:`reference.blocks.mtp`).

        Args:
            residual: ``[T, hc*H]`` float32 on the device (the trunk's pre-final-mixer residual, or the previous
                draft step's state). ids / ids_dev: ``[T]`` the tokens ``x_{q+1}`` (host or device int64).
            hnorm: ``'global'`` or ``'per_stream'``. select_hook: replaces the head layer's QSA selection.
        Returns:
            ``(draft_logits [T, V], state_out [T, hc*H])`` on the device.
        """
        xp, c, w = self.xp, self.config, self.w
        L = self.mtp_layer
        H, hc, eps = c.hidden_size, c.hc_count, c.rms_norm_eps
        rec = tap_recorder.current()
        st = Step()
        st.rec = _MTPTapNames(rec, L) if rec is not None else None
        T = int(residual.shape[0])
        st.positions = np.arange(start, start + T, dtype=np.int64)
        st.slabs = np.array([seq.slab], np.int64)
        st.rows = np.full(T, seq.slab, np.int64)
        st.ids = None if ids is None else np.asarray(ids, np.int64)
        st.n_blocks = max(1, (start + T) // (c.indexer_compress_ratio or 1))
        st.emb = {}
        st.ids_dev = xp.asarray(st.ids) if ids_dev is None else ids_dev
        st.pos_dev = xp.asarray(st.positions)
        st.rows_dev = xp.asarray(st.rows)
        st.slabs_dev = xp.asarray(st.slabs)
        st.qsa_select_hook = select_hook
        positions = st.positions
        e = K_norms.rms_norm(self._embed(st.ids_dev), w["mtp.pre_fc_norm_embedding.weight"], eps=eps)
        fe = K_lin.linear(e, w["mtp.fc_embedding.weight"])
        hn = K_norms.rms_norm(residual, w["mtp.pre_fc_norm_hidden.weight"], eps=eps,
                              group_size=H if hnorm == "per_stream" else None)
        fh = K_lin.linear(hn.reshape(T * hc, H), w["mtp.fc_hidden.weight"]).reshape(T, hc * H)
        h = (fh.reshape(T, hc, H) + fe[:, None, :]).reshape(T, hc * H)
        self._emit(rec, "mtp.fc_embedding.out", fe, positions)
        self._emit(rec, "mtp.fc_hidden.out", fh, positions)
        p = f"layers.{L}."
        self._emit(st.rec, p + "attn_hyper_connection.in", h, positions)
        pre = self._hc_pre(p + "attn_hyper_connection.", h, st.rec, positions)
        out = self._qsa(L, pre.mixed, st, _MTPPoolView(pool, L))
        h = K_norms.hc_combine(h, out, pre.injection_weights)
        self._emit(st.rec, p + "attn_hyper_connection.combine", h, positions)
        pre = self._hc_pre(p + "mlp_hyper_connection.", h, st.rec, positions)
        out = self._moe(L, pre.mixed, st.rec, positions)
        h = K_norms.hc_combine(h, out, pre.injection_weights)
        self._emit(st.rec, p + "mlp_hyper_connection.combine", h, positions)
        fin = K_norms.hc_pre(h, w["mtp.hyper_connection_mixer.hc_norm.weight"],
                             w["mtp.hyper_connection_mixer.input_mix_weight_down.weight"],
                             w["mtp.hyper_connection_mixer.input_mix_weight_up.weight"], None, hc_count=hc, eps=eps)
        self._emit(rec, "mtp.hyper_connection_mixer.out", fin.mixed, positions)
        logits = K_lin.linear(fin.mixed, w["lm_head.weight"])
        self._emit(rec, "mtp.logits", logits, positions)
        return logits, h


class _MTPPoolView:
    """The pool as the head's layer sees it: the head's own K/V/indexer pools under its layer index, the
    sequence's block table and page size (the head's position q uses the slot of the trunk's position q)."""

    def __init__(self, pool, layer: int):
        m = pool.mtp
        self.kv_k, self.kv_v = {layer: m["kv_k"]}, {layer: m["kv_v"]}
        self.idx_k, self.blk_k = {layer: m["idx_k"]}, {layer: m["blk_k"]}
        self.block_tables, self.page_size = pool.block_tables, pool.page_size


class _MTPTapNames:
    """A recorder proxy naming the head layer's taps ``mtp.layers.0.*`` (the layer code emits ``layers.{L}.*``)."""

    def __init__(self, rec, layer: int):
        self._rec, self._pre = rec, f"layers.{layer}."

    def _name(self, name):
        return "mtp.layers.0." + name[len(self._pre):] if name.startswith(self._pre) else name

    def wants(self, name):
        return self._rec.wants(self._name(name))

    def emit(self, name, value, positions=None, **kw):
        self._rec.emit(self._name(name), value, positions=positions, **kw)


_SIGMOID_GATE = {}


def _sigmoid_gate(xp):
    """``core * (1 / (1 + exp(-gate)))`` elementwise: one cupy ElementwiseKernel (float32), or NumPy."""
    if xp is np:
        return lambda core, gate: core * (1.0 / (1.0 + np.exp(-gate)))
    if "k" not in _SIGMOID_GATE:
        _SIGMOID_GATE["k"] = xp.ElementwiseKernel("float32 core, float32 gate", "float32 out",
                                                  "out = core * (1.0f / (1.0f + expf(-gate)));",
                                                  "qwen4exp_sigmoid_gate")
    return _SIGMOID_GATE["k"]
