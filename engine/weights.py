"""The engine's device weights: which checkpoint tensors a model needs, how each is stored on the device (BF16
bits, float32, or the stored FP8 / NVFP4 format), the routed-expert stacks, the MTP head's layer, and the stacking
of projections that read one input into one matrix (one GEMV launch instead of several).

:class:`ModelWeights` is the loading half of :class:`engine.model.EngineModel` (which inherits it; the forward
half is in engine/model.py). The storage rules are described in engine/model.py's module docstring.
"""
from __future__ import annotations

import numpy as np

from engine.kernels import linear as K_lin
from engine.kernels.dense_common import bf16_bits_to_float32, to_bf16_bits
from engine.kernels.quant import QuantWeight, fp8_from_stored, nvfp4_from_stored, stack_experts, stack_rows

__all__ = ["ModelWeights"]


class ModelWeights:
    """Weight loading and fusion of :class:`engine.model.EngineModel` (a base class: its methods read the model's
    ``ck``, ``config``, ``xp``, ``precision``, ``quantized`` and fill ``w``, ``fused``, ``fused_members``,
    ``kept_float32``)."""

    def _weight_names(self):
        """(canonical name, 'mat' | 'vec') for every dense tensor the forward reads (experts apart)."""
        c = self.config
        out = [("embed_tokens.weight", "mat"), ("lm_head.weight", "mat")]
        for hcn in ("hyper_connection_mixer",):
            out += [(f"{hcn}.hc_norm.weight", "vec"), (f"{hcn}.input_mix_weight_down.weight", "mat"),
                    (f"{hcn}.input_mix_weight_up.weight", "mat")]
        for i, lt in enumerate(c.layer_types):
            out += self._layer_weight_names(i, lt)
        return out

    def _layer_weight_names(self, i, lt):
        """(name, kind) of decoder layer ``i`` of type ``lt`` (experts apart)."""
        c = self.config
        out = []
        p = f"layers.{i}."
        for hcn in ("attn_hyper_connection", "mlp_hyper_connection"):
            out += [(p + hcn + ".hc_norm.weight", "vec"), (p + hcn + ".input_mix_weight_down.weight", "mat"),
                    (p + hcn + ".input_mix_weight_up.weight", "mat"), (p + hcn + ".block_inject_weight.weight", "mat")]
        if lt == "linear_attention":
            q = p + "linear_attn."
            out += [(q + "in_proj_qkv.weight", "mat"), (q + "in_proj_z.weight", "mat"), (q + "in_proj_b.weight", "mat"),
                    (q + "in_proj_a.weight", "mat"), (q + "out_proj.weight", "mat"), (q + "conv1d.weight", "conv"),
                    (q + "A_log", "vec"), (q + "dt_bias", "vec"), (q + "norm.weight", "vec")]
        else:
            q = p + "self_attn."
            out += [(q + "q_proj.weight", "mat"), (q + "k_proj.weight", "mat"), (q + "v_proj.weight", "mat"),
                    (q + "o_proj.weight", "mat"), (q + "q_norm.weight", "vec"), (q + "k_norm.weight", "vec"),
                    (q + "indexer.index_qk_proj.weight", "mat"), (q + "indexer.q_layernorm.weight", "vec"),
                    (q + "indexer.k_layernorm.weight", "vec")]
        m = p + "mlp."
        out += [(m + "gate.weight", "f32mat"), (m + "shared_expert.gate_proj.weight", "mat"),
                (m + "shared_expert.up_proj.weight", "mat"), (m + "shared_expert.down_proj.weight", "mat"),
                (m + "shared_expert_gate.weight", "mat")]
        if i in c.ple_layers:
            q = p + "ple."
            out += [(q + "key_proj.weight", "mat"), (q + "value_proj.weight", "mat"), (q + "norm_key.weight", "vec"),
                    (q + "norm_query.weight", "vec"), (q + "norm_conv.weight", "vec"), (q + "conv1d.weight", "conv")]
        return out

    def _fuse_weights(self) -> None:
        """Stack the projections that read the same input into one device matrix each (one GEMV launch
        instead of several in a decode step), and replace each weight by its row view of the stack (no
        second copy): GDN ``in_proj_{qkv,z,b,a}``, QSA ``indexer.index_qk_proj`` + ``{q,k,v}_proj``,
        hyper-connection ``input_mix_weight_down`` + ``block_inject_weight``, shared expert
        ``gate_proj`` + ``up_proj``; where the GDN group mixes formats (FP8 release: ``qkv`` and ``z`` FP8,
        ``b`` and ``a`` BF16), ``in_proj_qkv`` + ``in_proj_z`` alone. Quantised members stack when all are of one
        format and their scale blocks allow row views (:func:`engine.kernels.quant.stack_rows`,
        :meth:`QuantWeight.rows`). A group whose matrices differ in dtype (a BF16 and a kept-float32 weight)
        stays separate. ``self.fused[key]`` lists ``(name, first row, end row)``."""
        xp, c = self.xp, self.config
        groups = []
        layers = list(enumerate(c.layer_types))
        if self.mtp_layer is not None:
            layers.append((self.mtp_layer, "indexed_attention"))
        for i, lt in layers:
            p = f"layers.{i}."
            for hcn in ("attn_hyper_connection", "mlp_hyper_connection"):
                groups.append((p + hcn + ".fused_down_inject",
                               [p + hcn + ".input_mix_weight_down.weight", p + hcn + ".block_inject_weight.weight"]))
            if lt == "linear_attention":
                q = p + "linear_attn."
                groups.append((q + "fused_in_proj", [q + "in_proj_qkv.weight", q + "in_proj_z.weight",
                                                     q + "in_proj_b.weight", q + "in_proj_a.weight"]))
            else:
                q = p + "self_attn."
                groups.append((q + "fused_in_proj", [q + "indexer.index_qk_proj.weight", q + "q_proj.weight",
                                                     q + "k_proj.weight", q + "v_proj.weight"]))
            m = p + "mlp."
            groups.append((m + "fused_shared_gate_up", [m + "shared_expert.gate_proj.weight",
                                                        m + "shared_expert.up_proj.weight"]))
            if lt == "linear_attention":  # FP8 release: qkv and z are F8_E4M3, b and a BF16
                groups.append((p + "linear_attn.fused_in_proj_qkv_z", [p + "linear_attn.in_proj_qkv.weight",
                                                                       p + "linear_attn.in_proj_z.weight"]))
        for key, names in groups:
            ws = [self.w.get(n) for n in names]
            if any(w is None or w.ndim != 2 for w in ws) or any(n in self.fused_members for n in names):
                continue
            quant = [isinstance(w, QuantWeight) for w in ws]
            if all(quant):  # stored formats: one stack when the scale blocks allow row views of it
                try:
                    fused = stack_rows(ws)
                    starts = np.cumsum([0] + [w.shape[0] for w in ws])
                    views = [fused.rows(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
                except ValueError:
                    continue
            elif any(quant) or len({(w.dtype, w.shape[1]) for w in ws}) != 1:
                continue
            else:
                fused = xp.concatenate(ws, axis=0)
                starts = np.cumsum([0] + [w.shape[0] for w in ws])
                views = [fused[int(a):int(b)] for a, b in zip(starts[:-1], starts[1:])]
            spans = []
            for n, v, a, b in zip(names, views, starts[:-1], starts[1:]):
                self.w[n] = v
                spans.append((n, int(a), int(b)))
            self.fused_members.update(names)
            self.w[key] = fused
            self.fused[key] = spans

    def _fused_linear(self, x, key):
        """``x @ W.T`` for every member of fused group ``key`` in one launch: a list of ``[T, rows_j]``
        column blocks (contiguous copies when ``T > 1``), or None when the group was not fused."""
        spans = self.fused.get(key)
        if spans is None:
            return None
        y = K_lin.linear(x, self.w[key])
        if y.shape[0] == 1:
            return [y[:, a:b] for _, a, b in spans]  # one row: column blocks are contiguous views
        return [self.xp.ascontiguousarray(y[:, a:b]) for _, a, b in spans]

    def _dev_mat(self, a: np.ndarray):
        """A host float32 matrix as a device weight of this precision (BF16 bits or float32).

        In BF16 mode a matrix whose values are not all exactly representable in BF16 (FP8 block-scaled
        weights dequantised on load, F32 checkpoints trained in higher precision) stays float32: the
        engine never adds a quantisation the checkpoint does not have. ``self.kept_float32`` counts
        them; load prints one notice."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        if self.precision == "bf16":
            bits = to_bf16_bits(a)
            if np.array_equal(bf16_bits_to_float32(bits), a):
                return self.xp.asarray(bits)
            self.kept_float32 = getattr(self, "kept_float32", 0) + 1
        return self.xp.asarray(a)

    def _bf16_raw(self, name: str):
        """The stored BF16 bits of ``name`` (host uint16, memory-mapped) when it is stored as BF16, else None."""
        try:
            if self.ck.dtype(name) != "BF16":
                return None
            return np.ascontiguousarray(np.asarray(self.ck.get_raw(name)).view(np.uint16))
        except Exception:  # overrides / in-memory weights: take the generic path
            return None

    def _quant(self, name: str) -> QuantWeight | None:
        """``name`` as a host QuantWeight when it is stored quantised (FP8 E4M3 with a block or per-tensor
        scale; NVFP4 U8 codes with ``weight_scale`` + ``weight_scale_2``) and ``quantized == 'stored'``,
        else None."""
        if self.quantized != "stored":
            return None
        try:
            dt = self.ck.dtype(name)
        except Exception:
            return None
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        if dt == "F8_E4M3":
            sc = self.ck._scale_for(name)
            if sc is None:
                return None  # the reader raises its own error when the weight is read
            return fp8_from_stored(self.ck.get_raw(name), self.ck.get_raw(sc), self.ck._block)
        if dt == "U8" and self.ck.has(base + ".weight_scale_2"):
            return nvfp4_from_stored(self.ck.get_raw(name), self.ck.get_raw(base + ".weight_scale"),
                                     self.ck.get_raw(base + ".weight_scale_2"))
        return None

    def _load(self, name: str, kind: str, src: str | None = None):
        """Device copy of weight ``name`` read from checkpoint tensor ``src`` (default ``name``)."""
        name = src or name
        if kind == "mat" and name != "embed_tokens.weight":  # the embedding is gathered by rows, never quantised
            qw = self._quant(name)
            if qw is not None:
                return qw.to(self.xp)
        if kind == "mat" and self.precision == "bf16":
            raw = self._bf16_raw(name)
            if raw is not None:  # stored BF16: upload the bits as they are (no float round trip)
                return self.xp.asarray(raw)
        a = self.ck.get(name, dtype=np.float32)
        if kind == "mat":
            return self._dev_mat(a)
        if kind == "conv":  # [C, 1, K] -> [C, K]
            return self.xp.asarray(np.ascontiguousarray(a.reshape(a.shape[0], a.shape[-1]), dtype=np.float32))
        # 'vec' and 'f32mat' (the router stays float32: a BF16 router would move top-k ties)
        return self.xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

    def _load_experts(self, progress: bool):
        c = self.config
        it = range(c.num_hidden_layers)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, desc="upload experts", unit="layer")
        for i in it:
            self._load_layer_experts(i, f"layers.{i}.mlp.experts.", i)

    def _load_layer_experts(self, i, m: str, expert_layer):
        """Routed experts of layer ``i`` into ``self.w`` (``layers.{i}.mlp.experts.{gate_up,down}``), read from the
        checkpoint prefix ``m`` (fused or per-expert) / ``ck.expert(expert_layer, e)``."""
        c = self.config
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        key = f"layers.{i}.mlp.experts."
        dev = getattr(self.ck, "device_experts", None)
        if dev is not None and m == key:  # synthetic weights built on the device (parity.bench.synthetic_device)
            self.w[key + "gate_up"], self.w[key + "down"] = dev(i, self.xp, self.precision)
            return
        q = self._quant_experts(i, m)
        if q is not None:  # stored FP8 / NVFP4: kept as stored, dequantised inside the kernels
            self.w[key + "gate_up"], self.w[key + "down"] = q[0].to(self.xp), q[1].to(self.xp)
            return
        if self.precision == "bf16" and self.ck.has(m + "gate_up_proj"):
            gu_raw, dn_raw = self._bf16_raw(m + "gate_up_proj"), self._bf16_raw(m + "down_proj")
            if gu_raw is not None and dn_raw is not None:  # fused BF16 layout == the kernel's layout
                self.w[f"layers.{i}.mlp.experts.gate_up"] = self.xp.asarray(gu_raw)
                self.w[f"layers.{i}.mlp.experts.down"] = self.xp.asarray(dn_raw)
                return
        if self.precision == "bf16" and self.ck.has(m + "0.gate_proj.weight") \
                and self._bf16_raw(m + "0.gate_proj.weight") is not None:  # per-expert BF16: stack the bits
            gu16 = np.empty((E, 2 * I, H), np.uint16)
            dn16 = np.empty((E, H, I), np.uint16)
            for e in range(E):
                gu16[e, :I] = self._bf16_raw(f"{m}{e}.gate_proj.weight")
                gu16[e, I:] = self._bf16_raw(f"{m}{e}.up_proj.weight")
                dn16[e] = self._bf16_raw(f"{m}{e}.down_proj.weight")
            self.w[f"layers.{i}.mlp.experts.gate_up"] = self.xp.asarray(gu16)
            self.w[f"layers.{i}.mlp.experts.down"] = self.xp.asarray(dn16)
            return
        gu = np.empty((E, 2 * I, H), np.float32)
        dn = np.empty((E, H, I), np.float32)
        for e in range(E):
            g, u, d = self.ck.expert(expert_layer, e, dtype=np.float32)
            gu[e, :I], gu[e, I:], dn[e] = g, u, d
        self.w[f"layers.{i}.mlp.experts.gate_up"] = self._dev_mat(gu)
        self.w[f"layers.{i}.mlp.experts.down"] = self._dev_mat(dn)

    def _load_mtp(self) -> None:
        """The MTP head's weights: its decoder layer as trunk-shaped ``layers.{L}.*`` (read from
        ``mtp.layers.0.*``), its fusion and mixer weights under their own ``mtp.*`` names."""
        L = self.config.num_hidden_layers
        self.mtp_layer = L
        pre = f"layers.{L}."
        for name, kind in self._layer_weight_names(L, "indexed_attention"):
            self.w[name] = self._load(name, kind, src="mtp.layers.0." + name[len(pre):])
        for n, kind in (("mtp.pre_fc_norm_embedding.weight", "vec"), ("mtp.pre_fc_norm_hidden.weight", "vec"),
                        ("mtp.fc_embedding.weight", "mat"), ("mtp.fc_hidden.weight", "mat"),
                        ("mtp.hyper_connection_mixer.hc_norm.weight", "vec"),
                        ("mtp.hyper_connection_mixer.input_mix_weight_down.weight", "mat"),
                        ("mtp.hyper_connection_mixer.input_mix_weight_up.weight", "mat")):
            self.w[n] = self._load(n, kind)
        from reference.checkpoint import MTP_LAYER
        self._load_layer_experts(L, "mtp.layers.0.mlp.experts.", MTP_LAYER)

    def _quant_experts(self, i: int, m: str | None = None):
        """Layer ``i``'s routed experts (checkpoint prefix ``m``, default ``layers.{i}.mlp.experts.``) as host
        QuantWeights ``(gate_up [E, 2I, H], down [E, H, I])`` when stored quantised (per-expert or fused FP8
        layout; per-expert NVFP4), else None."""
        E = self.config.num_experts
        m = m or f"layers.{i}.mlp.experts."
        if self.ck.has(m + "gate_up_proj"):
            gu, dn = self._quant(m + "gate_up_proj"), self._quant(m + "down_proj")
            if gu is None or dn is None:
                return None
            return gu, dn  # the fused layout's block scales are defined over the stacked gate + up rows
        if not self.ck.has(m + "0.gate_proj.weight") or self._quant(m + "0.gate_proj.weight") is None:
            return None
        gus, dns = [], []
        for e in range(E):
            g, u, d = (self._quant(f"{m}{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            if g is None or u is None or d is None:
                return None
            gus.append(stack_rows([g, u]))
            dns.append(d)
        return stack_experts(gus), stack_experts(dns)

    def weight_bytes(self) -> int:
        """Bytes held by the loaded weight arrays (sum of ``nbytes`` over ``self.w``; a fused stack counted
        once, not again through its members' row views)."""
        members = {n for spans in self.fused.values() for n, _, _ in spans}
        own = int(sum(a.nbytes for k, a in self.w.items() if k not in members))
        return own if self.ep is None else own + self.ep.weight_bytes()[0]
