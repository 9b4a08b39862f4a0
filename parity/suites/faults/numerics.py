"""Bug-class faults of the numerics and the weight loader."""
from __future__ import annotations

import numpy as np

from parity.backends.base import load_weights
from parity.suites.faults.base import _Fault
from reference.blocks.hyper_connection import hyper_connection as _hyper_connection


class NormGainShiftedTwice(_Fault):
    """R12: zero-centred RMSNorm gains stored pre-shifted (``1 + w``) and loaded by a ``(1 + w)`` norm:
    every such gain is effectively ``2 + w`` (the gated GDN norm, a plain gain, is not affected)."""

    fault_name = "norm-gain-shifted-twice"

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend on weights whose zero-centred norm gains are all shifted by +1."""
        ck = load_weights(model_path, opts.pop("perturb", None))
        suffixes = ("hc_norm.weight", "q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight",
                    "norm_key.weight", "norm_query.weight", "norm_conv.weight")
        for name in [n for n in ck.names() if n.endswith(suffixes)]:
            ck = ck.with_override(name, ck.get(name, dtype=np.float32) + 1.0)
        return super().open(model_path, weights=ck, **opts)


class HcMeanRounded(_Fault):
    """R13: the hyper-connection stream mean uses ``1 / hc_count`` rounded to bf16 (exact for hc 2 and 4,
    off by 0.2% for hc 3)."""

    fault_name = "hc-mean-rounded"

    def _inject(self):
        model, cfg = self.model, self.config
        inv = np.float32(1.0 / cfg.hc_count)
        bits = inv.view(np.uint32)
        inv_bf16 = np.uint32((int(bits) + 0x7FFF + ((int(bits) >> 16) & 1)) & 0xFFFF0000).view(np.float32)
        scale = model.dtype.type(float(inv_bf16) * cfg.hc_count) if hasattr(model.dtype, "type") else \
            np.dtype(model.dtype).type(float(inv_bf16) * cfg.hc_count)

        def hc_step(prefix, x, pos, rec, combine=True):
            taps = {} if rec is not None else None
            mixed, inj = _hyper_connection(x, *model._hc_w(prefix, combine), cfg.hc_count, cfg.hidden_size,
                                           cfg.rms_norm_eps, taps=taps)
            mixed = mixed * scale
            if rec is not None:
                rec.emit(prefix + ".hc_norm.out", taps["hc_norm"], positions=pos)
                rec.emit(prefix + ".out", mixed, positions=pos)
                if inj is not None:
                    rec.emit(prefix + ".injection_weights", inj, positions=pos)
            return mixed, inj
        model._hc_step = hc_step


class PleTableScaleShadowed(_Fault):
    """R14: the PLE table's block scale shadowed (an NVFP4 scale read from the wrong place): every gathered
    row comes out at 3/4 of its value."""

    fault_name = "ple-table-scale-shadowed"

    def _inject(self):
        self._patch_rows(lambda layer, rows, emb: emb * np.asarray(0.75, dtype=emb.dtype))


class NgramRowReadsPastEnd(_Fault):
    """R15: n-gram table unpacking off by one element (bits not dividing 32): each head's row reads one
    element late, the last one from the next row."""

    fault_name = "ngram-row-reads-past-end"

    def _inject(self):
        def fn(layer, rows, emb):
            flat = np.asarray(emb)
            return np.roll(flat, -1, axis=-1)
        self._patch_rows(fn)


class PleTableRowsInterleaved(_Fault):
    """R36: a PLE table converted with another storage layout (interleaved files) read as the native one:
    row ``r`` comes back as row ``r ^ 1``."""

    fault_name = "ple-table-rows-interleaved"

    def _inject(self):
        w = self.model.weights
        orig = w.ngram_rows
        w.ngram_rows = lambda layer, rows: orig(layer, np.bitwise_xor(np.asarray(rows), 1))


class NanInReturnedLogits(_Fault):
    """R18: an output-path defect: every decode at a position ``p`` with ``p % 5 == 4`` returns a logits
    row holding NaN (the sampler then emits an impossible id such as 4294967295)."""

    fault_name = "nan-in-returned-logits"

    def decode(self, hs, ids):
        """Injected fault: rows decoded at positions 4, 9, 14 ... get a NaN."""
        pos = [self.position(h) for h in hs]
        out = np.array(super().decode(hs, ids), copy=True)
        for b, p in enumerate(pos):
            if p % 5 == 4:
                out[b, 0] = np.nan
        return out


class SharedExpertDownScaledOneLayer(_Fault):
    """A loader defect confined to one block: layer 1's shared-expert ``down_proj`` read with a 2% gain
    (a wrong per-tensor scale). Every operation that runs layer 1's MLP meets the same bug, below and past the
    QSA bound alike: the report must name it as one root cause, at ``layers.1.mlp``."""

    fault_name = "shared-expert-down-scaled-one-layer"

    @classmethod
    def open(cls, model_path, **opts):
        """The reference backend on weights whose layer-1 shared-expert down projection is scaled by 1.02."""
        ck = load_weights(model_path, opts.pop("perturb", None))
        name = "layers.1.mlp.shared_expert.down_proj.weight"
        ck = ck.with_override(name, ck.get(name, dtype=np.float32) * np.float32(1.02))
        return super().open(model_path, weights=ck, **opts)
