"""An independent float64 implementation of the MTP head's formulas, for cross-checking the reference
(``reference.blocks.mtp`` + ``ReferenceModel._mtp_run``) in tests. Written from the formulas (model-facts.md
section 3 for the head's dataflow; modeling_qwen4_exp.py for the decoder layer it reuses: the gated
residual, the QSA indexer and gated attention, the MoE), reading weights only through the checkpoint
reader; it imports nothing else of ours. Import: ``from mtp_f64 import F64MTP``.
"""
from __future__ import annotations

import numpy as np


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _rms(x, w, eps, group=None):
    """x / sqrt(mean(x^2) + eps) * (1 + w), the mean over the last axis or per ``group`` channels."""
    shp = x.shape
    g = x.reshape(*shp[:-1], -1, group) if group else x
    y = g / np.sqrt((g * g).mean(-1, keepdims=True) + eps)
    return y.reshape(shp) * (1.0 + w)


class F64MTP:
    """The MTP head in float64 over a checkpoint (``reference.checkpoint.Checkpoint``-like ``get``/``expert``)."""

    def __init__(self, ck, hnorm: str = "global"):
        self.ck = ck
        self.c = ck.config
        self.hnorm = hnorm
        self._w = {}
        self.reset()

    def W(self, n):
        if n not in self._w:
            self._w[n] = self.ck.get(n, np.float64)
        return self._w[n]

    def reset(self):
        """Empty head caches (position 0)."""
        self.K, self.V, self.raw = [], [], []
        self.pos = 0

    def truncate(self, n):
        self.K, self.V, self.raw = self.K[:n], self.V[:n], self.raw[:n]
        self.pos = n

    # -------------------------------------------------------------- pieces
    def _rope(self, x, p):
        """Rotate-half RoPE of the first rotary_dim channels at integer position p (text: mrope rows equal)."""
        c = self.c
        rd = c.rotary_dim
        inv = 1.0 / (float(c.rope_theta) ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
        f = p * inv
        cos, sin = np.cos(np.concatenate([f, f])), np.sin(np.concatenate([f, f]))
        xr, rest = x[..., :rd], x[..., rd:]
        h = rd // 2
        rot = np.concatenate([-xr[..., h:], xr[..., :h]], -1)
        return np.concatenate([xr * cos + rot * sin, rest], -1)

    def _hc(self, pre, x, combine=True):
        c = self.c
        n = _rms(x, self.W(pre + ".hc_norm.weight"), c.rms_norm_eps, c.hidden_size)
        a = n @ self.W(pre + ".input_mix_weight_down.weight").T / c.hc_count
        m = _sig((a * _sig(a)) @ self.W(pre + ".input_mix_weight_up.weight").T)
        mixed = (m * n).reshape(c.hc_count, c.hidden_size).mean(0)
        inj = 2.0 * _sig(n @ self.W(pre + ".block_inject_weight.weight").T / c.hc_count) if combine else None
        return mixed, inj

    def _moe(self, x):
        c = self.c
        p = "mtp.layers.0.mlp."
        lg = self.W(p + "gate.weight") @ x
        pr = np.exp(lg - lg.max())
        pr /= pr.sum()
        ids = sorted(range(c.num_experts), key=lambda e: (-pr[e], e))[:c.num_experts_per_tok]
        wt = pr[ids] / (pr[ids].sum() if c.norm_topk_prob else 1.0)
        out = np.zeros(c.hidden_size)
        for e, wgt in zip(ids, wt):
            g, u, d = (a.astype(np.float64) for a in self.ck.expert("mtp", e, dtype=np.float64))
            gx = g @ x
            out += wgt * (d @ (gx * _sig(gx) * (u @ x)))
        sg = self.W(p + "shared_expert.gate_proj.weight") @ x
        sh = self.W(p + "shared_expert.down_proj.weight") @ (sg * _sig(sg) * (self.W(p + "shared_expert.up_proj.weight") @ x))
        return out + _sig(self.W(p + "shared_expert_gate.weight") @ x)[0] * sh

    def _attn(self, x, reuse=None):
        """One query at position self.pos (its K/V/raw key appended first). Returns (out [H], (sel, n_complete))."""
        c = self.c
        p = "mtp.layers.0.self_attn."
        eps, r, D, nh = c.rms_norm_eps, c.indexer_compress_ratio, c.indexer_head_dim, c.indexer_n_heads
        q_pos = self.pos
        qk = self.W(p + "indexer.index_qk_proj.weight") @ x
        qi = self._rope(_rms(qk[:nh * D].reshape(nh, D), self.W(p + "indexer.q_layernorm.weight"), eps), q_pos)
        self.raw.append(qk[nh * D:])
        L = len(self.raw)
        nc = (q_pos + 1) // r
        blocks = []
        for b in range(nc):
            pooled = np.mean(self.raw[b * r:(b + 1) * r], axis=0)
            blocks.append(self._rope(_rms(pooled, self.W(p + "indexer.k_layernorm.weight"), eps), b * r))
        scores = [float(np.maximum(qi @ kb, 0).sum() / np.sqrt(D)) for kb in blocks]
        sel = sorted(range(nc), key=lambda b: (-scores[b], b))[:min(c.block_topk, nc)]
        if reuse is not None:
            sel, nc = reuse
        vis = sorted({t for b in sel for t in range(b * r, b * r + r)} | set(range(nc * r, q_pos + 1)))
        nH, nKV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg = (self.W(p + "q_proj.weight") @ x).reshape(nH, 2 * hd)
        q = self._rope(_rms(qg[:, :hd], self.W(p + "q_norm.weight"), eps), q_pos)
        gate = qg[:, hd:].reshape(-1)
        self.K.append(self._rope(_rms((self.W(p + "k_proj.weight") @ x).reshape(nKV, hd), self.W(p + "k_norm.weight"),
                                      eps), q_pos))
        self.V.append((self.W(p + "v_proj.weight") @ x).reshape(nKV, hd))
        assert len(self.K) == L
        core = np.zeros((nH, hd))
        for h in range(nH):
            kv = h // (nH // nKV)
            s = np.array([q[h] @ self.K[t][kv] for t in vis]) * hd ** -0.5
            a = np.exp(s - s.max())
            a /= a.sum()
            core[h] = sum(w * self.V[t][kv] for w, t in zip(a, vis))
        return self.W(p + "o_proj.weight") @ (core.reshape(-1) * _sig(gate)), (list(sel), nc)

    # -------------------------------------------------------------- the head
    def step(self, R, next_id, reuse=None):
        """One pair (R [hc*H], x_{q+1}) at position self.pos. Returns (logits [V], state_out [hc*H], selection)."""
        c = self.c
        H, hc = c.hidden_size, c.hc_count
        emb = self.W("embed_tokens.weight")[int(next_id)]
        e = self.W("mtp.fc_embedding.weight") @ _rms(emb, self.W("mtp.pre_fc_norm_embedding.weight"), c.rms_norm_eps)
        hn = _rms(np.asarray(R, np.float64), self.W("mtp.pre_fc_norm_hidden.weight"), c.rms_norm_eps,
                  H if self.hnorm == "per_stream" else None)
        x = (hn.reshape(hc, H) @ self.W("mtp.fc_hidden.weight").T + e).reshape(-1)
        mixed, inj = self._hc("mtp.layers.0.attn_hyper_connection", x)
        out, sel = self._attn(mixed, reuse)
        x = x + (out[None, :] * inj[:, None]).reshape(-1)
        mixed, inj = self._hc("mtp.layers.0.mlp_hyper_connection", x)
        x = x + (self._moe(mixed)[None, :] * inj[:, None]).reshape(-1)
        fin, _ = self._hc("mtp.hyper_connection_mixer", x, combine=False)
        lm = self.W("lm_head.weight") if self.ck.has("lm_head.weight") else self.W("embed_tokens.weight")
        self.pos += 1
        return lm @ fin, x, sel

    def forward(self, R, next_ids):
        """Pairs at positions 0..T-1 from an empty head: (logits [T, V], states [T, hc*H])."""
        self.reset()
        outs = [self.step(R[t], next_ids[t]) for t in range(len(next_ids))]
        return np.stack([o[0] for o in outs]), np.stack([o[1] for o in outs])

    def draft(self, R, next_ids, k, reuse_step0=False):
        """Consume the pairs from an empty head, then k greedy drafts (later steps on the head's own state)."""
        self.reset()
        for t in range(len(next_ids)):
            lg, st, sel = self.step(R[t], next_ids[t])
        keep = self.pos
        ids, lgs = [int(np.argmax(lg))], [lg]
        for _ in range(k - 1):
            lg, st, _ = self.step(st, ids[-1], reuse=sel if reuse_step0 else None)
            ids.append(int(np.argmax(lg)))
            lgs.append(lg)
        self.truncate(keep)
        return np.asarray(ids), np.stack(lgs)
