"""The ``llama.cpp`` backend: llama-cpp-python's low-level API behind the parity protocol.

    --backend llama.cpp                        convert MODEL with the installed llama.cpp's converter
    --backend llama.cpp:gguf=PATH              use the user's own GGUF (MODEL still gives the config/truth)
    --backend llama.cpp:reparam=auto           apply the function-preserving re-parameterisations that
                                               get past llama.cpp's converter/loader limits (reported)
    other options (',' separated): kv=f32|f16 (KV cache type; default f32, llama.cpp's own default is
    f16), fa=off|on|auto (flash attention; default off: on the CPU it is not float32-accurate), threads=N, seqs=N (n_seq_max), ctx=N (n_ctx), rs=N (n_rs_seq, the
    recurrent-state snapshots kept for rollback), sdist=PATH (llama-cpp-python's source distribution)

One llama.cpp context holds every live sequence (``n_seq_max`` sequence ids, a unified KV cache).
Logits of every position come from ``batch.logits[i] = 1`` (``logits_all``); prefill is batched or
chunked, decode batches one token per sequence; snapshot/restore use ``llama_state_seq_get_data`` /
``llama_state_seq_set_data``; rollback uses ``llama_memory_seq_rm`` -- for the recurrent (GDN, PLE conv)
state llama.cpp can only remove the last ``n_rs_seq`` tokens, so rollback is *limited* to that many.

Taps come from the eval callback (``cb_eval``): :data:`TAP_MAP` maps llama.cpp graph-node names onto
our tap names; the nodes without a counterpart are listed in :data:`NO_COUNTERPART` (and in
docs/outside-engines.md), never guessed.

A converter or loader that refuses a valid checkpoint raises
:class:`parity.backends.refusal.EngineRefused` with llama.cpp's own message (verdict REFUSED).
"""
from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Sequence

import numpy as np

from reference.errors import InputError

from reference.session import check_ids

from parity.backends.base import Backend, BackendEntry, BackendError, dead_handle, decode_args
from parity.backends.refusal import EngineRefused

#: llama.cpp graph node (``cb(t, name, il)`` names it "name-il") -> our tap ({i}: il). A name llama.cpp
#: gives two nodes per layer maps to a list, by occurrence (hc_mixed: attention half, then MLP half).
#: ggml's ne[0] is the fastest axis: a node [n_embd, hc, T] is our row-major [T, hc*n_embd].
TAP_MAP = {
    "model.input_embed": "embed_tokens.out",
    "ple_embd": "layers.{p}.ple.ple_embedding.out",      # un-padded when the GGUF was made with ple-pad
    "hc_mixed": ["layers.{i}.attn_hyper_connection.out", "layers.{i}.mlp_hyper_connection.out"],
    "linear_attn_out": "layers.{i}.linear_attn.out",
    "indexer_top_k": "layers.{i}.self_attn.indexer.selected_tokens",  # cells -> positions, masked cells dropped
    "indexer_score_tokens": None,                      # read for indexer_top_k (its -inf = not visible)
    "attn_pregate": "layers.{i}.self_attn.core_out",
    "attn_output": "layers.{i}.self_attn.out",         # attention layers only (see LAYER_TYPE_DROPS)
    "hc_combine": "layers.{i}.attn_hyper_connection.combine",
    "ffn_moe_logits": "layers.{i}.mlp.gate.router_logits",
    "ffn_out": "layers.{i}.mlp.out",
    "l_last": "layers.{i}.mlp_hyper_connection.combine",
    "result_norm": "hyper_connection_mixer.out",
    "result_output": "logits",
}

#: our taps with no llama.cpp node of the same definition (so never compared), and why
NO_COUNTERPART = {
    "layers.{i}.ple.ple_embedding.ngram_ids": "hashed row ids are a host-side input (rows), not a graph node",
    "layers.{i}.ple.gate": "llama.cpp names sigmoid(signed sqrt) (ple_gate); ours is before the sigmoid",
    "layers.{i}.ple.out": "llama.cpp names its two terms (ple_gated_value, ple_conv_out), not their sum",
    "layers.{i}.attn_hyper_connection.in": "the post-PLE residual is an unnamed ggml_add",
    "layers.{i}.attn_hyper_connection.injection_weights": "hc_inject is W x, before 2*sigmoid(./hc)",
    "layers.{i}.mlp_hyper_connection.injection_weights": "hc_inject is W x, before 2*sigmoid(./hc)",
    "layers.{i}.linear_attn.conv_out": "the converter reorders the value heads (_LinearAttentionVReorderBase)",
    "layers.{i}.linear_attn.core_out": "value heads reordered by the converter",
    "layers.{i}.self_attn.indexer.block_scores": "indexer_score has every block incl. the incomplete one, unscaled",
    "layers.{i}.self_attn.indexer.selected_blocks": "llama.cpp selects tokens (see selected_tokens)",
    "layers.{i}.mlp.gate.topk_ids": "ffn_moe_topk is ggml_top_k's order, not ours (prob desc, then id)",
    "layers.{i}.mlp.gate.topk_weights": "weights are an unnamed intermediate",
}


#: (llama.cpp node, our layer type) -> why that node is not recorded in layers of that type: llama.cpp
#: gives one name to different quantities depending on the layer
LAYER_TYPE_DROPS = {
    ("attn_output", "linear_attention"): "in a GDN layer llama.cpp's attn_output is the gated delta rule's "
        "core output (delta-net-base.cpp), before the gated norm, with the value heads reordered by the "
        "converter: our layers.{i}.linear_attn.core_out, which has no counterpart (NO_COUNTERPART); a GDN "
        "layer has no self_attn",
}


def _mtp_layers(cfg) -> int:
    n = (getattr(cfg, "extra", None) or {}).get("mtp_num_hidden_layers") or 0
    return n if isinstance(n, int) else 0


def mtp_capability(cfg, version: str):
    """The ``mtp`` declaration: unsupported, and when the checkpoint HAS an MTP head the reason names the
    engine's defect (its converter drops the head: ``no_mtp = True`` in conversion/qwen4exp.py), so the
    skipped mtp_* cases say why instead of skipping silently."""
    n = _mtp_layers(cfg)
    if not n:
        return False
    return {"status": "unsupported",
            "limit": f"llama.cpp {version} does not load the checkpoint's MTP head (mtp_num_hidden_layers={n}): "
                     f"its converter drops it (conversion/qwen4exp.py: no_mtp = True) -- the engine's defect"}


def engine_findings(cfg, version: str) -> list[dict]:
    """Parts of the checkpoint llama.cpp ``version`` does not run, each located (``id``, ``where``,
    ``message``); reported in report.json ``meta.engine_findings`` (docs/outside-engines.md, defect F)."""
    out = []
    n = _mtp_layers(cfg)
    if n:
        out.append({"id": "llama.cpp:mtp-head-dropped", "where": "converter: conversion/qwen4exp.py no_mtp = True",
                    "message": f"the checkpoint's MTP head (mtp_num_hidden_layers={n}, mtp.* tensors) is not "
                               f"converted, so llama.cpp {version} cannot draft with it; the mtp_* cases of "
                               f"speculative-rollback are skipped for that reason"})
    return out


def _ll():
    try:
        import llama_cpp
    except ImportError as e:
        from reference.paths import install_command
        raise BackendError(f"llama.cpp backend: expected llama-cpp-python installed (the `llamacpp` extra), found "
                           f"{e}; install it: {install_command('llamacpp')}") from e
    return llama_cpp


_LOG_LINES: list[str] = []
_LOG_CB = None


def _install_log_capture():
    """Route llama.cpp's log into a buffer (its loader's own error messages are read from it)."""
    global _LOG_CB
    ll = _ll()
    if _LOG_CB is None:
        @ll.llama_log_callback
        def cb(level, text, user_data):  # noqa: ARG001
            try:
                _LOG_LINES.append(text.decode("utf-8", "replace"))
                if len(_LOG_LINES) > 4000:
                    del _LOG_LINES[:2000]
            except Exception:  # never raise into C
                pass
        _LOG_CB = cb
        ll.llama_log_set(_LOG_CB, ctypes.c_void_p())
        ll.llama_backend_init()


def _loader_message() -> str:
    text = "".join(_LOG_LINES)
    for ln in reversed(text.splitlines()):
        if "error loading model" in ln:
            return ln.split("error loading model:", 1)[-1].strip()
    errs = [ln for ln in text.splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
    return errs[-1].strip() if errs else "llama_model_load_from_file returned NULL (no message logged)"


def parse_options(text: str) -> dict:
    """``k=v,k=v`` (the part after ``llama.cpp:`` / ``openai:``) -> dict. Raises InputError on a bad item."""
    out = {}
    for item in [t for t in (text or "").split(",") if t.strip()]:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise InputError(f"backend option {item!r}: expected key=value, found no '='")
        out[k.strip()] = v.strip()
    return out


class LlamaCppBackend(Backend):
    """llama.cpp (through llama-cpp-python) as a parity backend; see the module docstring."""

    precision = "float32"
    #: the taps :data:`TAP_MAP` records (a located cell lists only these as missing; NO_COUNTERPART never)
    produces_taps = tuple(dict.fromkeys(t for v in TAP_MAP.values() if v is not None
                                        for t in (v if isinstance(v, list) else [v])))

    def __init__(self, model_path, cfg, gguf: str, conv: dict, *, threads=1, seqs=8, ctx=4096, rs=8, kv="f32", fa="off"):
        ll = _ll()
        _install_log_capture()
        self.ll = ll
        self.config = cfg
        self.model_path = model_path
        self.name = "llama.cpp"
        self.gguf = gguf
        self.conversion = conv
        self.version = str(ll.__version__)
        mp = ll.llama_model_default_params()
        _LOG_LINES.clear()
        self._model = ll.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self._model:
            msg = _loader_message()
            from parity.backends.gguf_convert import offer_for
            raise EngineRefused(f"llama.cpp {self.version}", "loader", msg,
                                offer_for(msg, model_path, conv.get("reparams", [])))
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
        if self.n_vocab != cfg.vocab_size:
            raise BackendError(f"llama.cpp backend: GGUF {gguf!r}: expected vocab {cfg.vocab_size} (the model's "
                               f"config), found {self.n_vocab}")
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = int(ctx), 512, 512
        self.n_ctx = int(ctx)
        cp.n_seq_max, cp.n_rs_seq = int(seqs), int(rs)
        cp.n_threads = cp.n_threads_batch = int(threads)
        cp.kv_unified = True
        # llama.cpp's default KV cache is F16 (a 5e-4 relative rounding of every K/V); judged as float32
        # unless kv=f16 is asked for (then its precision is 'bf16'-class: the thresholds widen)
        if kv not in ("f32", "f16"):
            raise InputError(f"llama.cpp:kv={kv!r}: expected f32 or f16")
        cp.type_k = cp.type_v = GGML_TYPE_F32 if kv == "f32" else 1  # 1: GGML_TYPE_F16
        # flash attention (llama.cpp's default 'auto' turns it on) is 3e-4..1e-3 off on the CPU even with
        # an F32 cache (docs/outside-engines.md, finding 7): off unless asked (then the bf16 thresholds)
        if fa not in ("on", "off", "auto"):
            raise InputError(f"llama.cpp:fa={fa!r}: expected on, off or auto")
        cp.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[fa]
        if fa != "off":
            self.precision = "bf16"
        if kv == "f16":
            self.precision = "bf16"
        self._sink = None
        self.cells = CellMap()      # KV cache cell -> (sequence, position), for the indexer's selections
        self._scores: list = []     # indexer_score_tokens of the first QSA layer, one array per ubatch
        self._score_node = None
        self._cb = ll.ggml_backend_sched_eval_callback(self._eval_cb)  # kept alive with the backend
        cp.cb_eval = self._cb
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise EngineRefused(f"llama.cpp {self.version}", "loader", _loader_message())
        self._mem = ll.llama_get_memory(self._ctx)
        # llama.cpp caps n_batch at n_ctx (ctx=) and aborts the process (GGML_ASSERT, no exception) on a
        # llama_decode of more tokens than n_batch: a larger batch is a BackendError naming ctx= here
        self.n_batch = int(ll.llama_n_batch(self._ctx))
        self.n_rs = int(ll.llama_n_rs_seq(self._ctx))
        self.n_seq = int(seqs)
        self._free_ids = list(range(self.n_seq))[::-1]
        self._pos: dict[int, int] = {}
        self._next = 0
        self.capabilities = {
            "page_sizes": None, "batched_decode": True, "perturb": False, "state_arrays": False,
            "snapshot_file": False, "taps": True,
            # llama_memory_seq_rm of a recurrent state works only within the last n_rs_seq tokens: declared
            # limited with that count, which the suites read (Run.rollback_refusal narrows longer rollbacks);
            # within it rollback runs and is judged -- llama.cpp's own defect there (docs/outside-engines.md,
            # defect D) must show as a FAIL, never as a skip
            "rollback": {"status": "limited", "max_tokens": self.n_rs,
                         "limit": f"at most {self.n_rs} tokens (n_rs_seq, option rs=: the recurrent-state "
                                  f"snapshots llama.cpp keeps)"},
            "mtp": mtp_capability(cfg, self.version),
        }
        #: what this engine leaves out of the checkpoint, located (report.json meta.engine_findings)
        self.findings = engine_findings(cfg, self.version)
        from parity.backends.gguf_meta import rounding_finding
        rounded = rounding_finding(gguf, conv.get("storage_types"))
        if rounded is not None:   # the user's GGUF in F16 / BF16 / a quantised type: a FAIL there is its rounding
            self.findings.append(rounded)

    @classmethod
    def open(cls, model_path, *, gguf=None, reparam="none", threads=1, seqs=8, ctx=4096, rs=8, kv="f32", fa="off", sdist=None,
             convert_timeout=None, page_size=None, perturb=None, **opts) -> "LlamaCppBackend":
        """Open llama.cpp on ``model_path`` (converted) or on ``gguf``.

        Raises:
            EngineRefused: llama.cpp's converter or loader refuses the checkpoint.
            BackendError: llama-cpp-python / its converter missing, ``perturb`` asked, unknown options.
            CheckpointError: MODEL is no checkpoint the reference runs (no weights; a tensor missing, mis-shaped
                or truncated): checked before any conversion, so llama.cpp is never blamed for it.
            InputError: bad option values; a ``gguf`` that is not a GGUF, or whose metadata (architecture, layer
                count, hidden size, vocabulary size) does not match MODEL's config (parity.backends.gguf_meta).
        """
        from reference.config import load_config

        from parity.backends import gguf_convert as gc
        if opts:
            raise InputError(f"llama.cpp backend options: expected gguf, reparam, threads, seqs, ctx, rs, kv, fa, sdist, "
                             f"convert_timeout; found {sorted(opts)}")
        if perturb is not None:
            raise BackendError("llama.cpp backend: perturb: not supported (the weights live in a GGUF)")
        if gguf:  # the options of the tool's own conversion mean nothing for a GGUF loaded as is: never dropped
            given = [f"{k}={v}" for k, v in (("reparam", reparam), ("sdist", sdist),
                                            ("convert_timeout", convert_timeout))
                     if v is not None and not (k == "reparam" and str(v) in ("", "none"))]
            if given:
                raise InputError(f"llama.cpp:gguf={gguf!r}: expected no conversion option with gguf= (the GGUF is "
                                 f"loaded as is; reparam=, sdist= and convert_timeout= act on the tool's own "
                                 f"conversion of MODEL, without gguf=), found {', '.join(given)}")
        if kv not in ("f32", "f16"):  # checked before a conversion is spent on them
            raise InputError(f"llama.cpp:kv={kv!r}: expected f32 or f16")
        if fa not in ("on", "off", "auto"):
            raise InputError(f"llama.cpp:fa={fa!r}: expected on, off or auto")
        for k, v in (("threads", threads), ("seqs", seqs), ("ctx", ctx), ("rs", rs)):
            if not str(v).isdigit() or (int(v) == 0 and k != "rs"):
                raise InputError(f"llama.cpp:{k}={v!r}: expected "
                                 f"{'an integer >= 0' if k == 'rs' else 'a positive integer'}")
        cfg = load_config(model_path)
        # the reader's checks first (headers only): a checkpoint the reference cannot run either (no weights, a
        # missing, mis-shaped or truncated tensor) is the user's input error naming the tensor, never llama.cpp's
        # converter refusing it (verdict REFUSED blames the engine for a checkpoint the reference runs)
        from reference.checkpoint import Checkpoint
        ck = Checkpoint.open(model_path)
        try:
            ck.validate()
        finally:
            ck.close()
        if gguf:
            if not Path(gguf).is_file():
                raise InputError(f"llama.cpp:gguf={gguf!r}: expected a GGUF file, found "
                                 f"{'a directory' if Path(gguf).is_dir() else 'nothing there'}")
            from parity.backends.gguf_meta import check_gguf_matches
            check_gguf_matches(gguf, cfg, model_path)  # a GGUF of another model: refused before llama.cpp loads it
            from parity.backends.gguf_meta import storage_types
            conv = {"gguf": str(gguf), "reparams": [], "checks": [], "converter": "user's GGUF",
                    "storage_types": storage_types(gguf)}
            gc.installed_version()  # llama-cpp-python itself (BackendError when missing), after the input checks
        else:
            version = gc.installed_version()
            kw = {"timeout": int(convert_timeout)} if convert_timeout else {}
            conv = gc.convert(model_path, version, reparams=gc.parse_reparams(reparam, model_path), sdist=sdist, **kw)
        return cls(model_path, cfg, conv["gguf"], conv, threads=int(threads), seqs=int(seqs), ctx=int(ctx), rs=int(rs),
                   kv=kv, fa=fa)

    # --- sequences -------------------------------------------------------------------------------------
    def _seq(self, h) -> int:
        if h not in self._pos:
            raise dead_handle(self.name, h)
        return h

    def new_sequence(self):
        """A free llama.cpp sequence id (cleared); raises BackendError when all ``seqs`` are live."""
        if not self._free_ids:
            raise BackendError(f"backend {self.name}: expected at most {self.n_seq} live sequences (seqs=), "
                               f"found one more requested")
        s = self._free_ids.pop()
        self.ll.llama_memory_seq_rm(self._mem, s, -1, -1)
        self.cells.drop(s)
        self._pos[s] = 0
        return s

    def free(self, h) -> None:
        """Clear and release sequence ``h`` (an unknown handle is ignored)."""
        if h in self._pos:
            self.ll.llama_memory_seq_rm(self._mem, h, -1, -1)
            self.cells.drop(h)
            del self._pos[h]
            self._free_ids.append(h)

    def position(self, h) -> int:
        """Tokens in sequence ``h``'s state."""
        return self._pos[self._seq(h)]

    def _decode(self, items) -> np.ndarray:
        """``items``: [(seq, token, pos)] -> logits [n, V] (every token outputs logits)."""
        ll = self.ll
        n = len(items)
        if n > self.n_batch:
            raise BackendError(f"backend {self.name}: a llama_decode of {n} tokens: expected at most n_batch="
                               f"{self.n_batch} (llama.cpp caps n_batch at ctx={self.n_ctx} and aborts the process "
                               f"beyond it): raise ctx=")
        batch = ll.llama_batch_init(n, 0, 1)
        try:
            for i, (s, tok, pos) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = 1
            batch.n_tokens = n
            if self._sink is not None:
                self._sink.begin(items)
            self._scores = []
            rc = ll.llama_decode(self._ctx, batch)
            if rc == 0:
                for sc in self._scores:  # ubatch by ubatch, in compute order: the cells this call wrote
                    self.cells.update(sc, items)
            self._scores = []
            if self._sink is not None:
                self._sink.end()
            if rc != 0:
                raise BackendError(f"backend {self.name}: llama_decode returned {rc} for {n} tokens "
                                   f"(expected 0; 1 = no KV slot: raise ctx=)")
            out = np.empty((n, self.n_vocab), np.float32)
            for i in range(n):
                p = ll.llama_get_logits_ith(self._ctx, i)
                out[i] = np.ctypeslib.as_array(p, shape=(self.n_vocab,))
            return out
        finally:
            ll.llama_batch_free(batch)

    def prefill(self, h, ids, chunk_size=None) -> np.ndarray:
        """Feed ``ids`` to ``h`` in one batch (or chunks of ``chunk_size``); logits ``[T, V]``."""
        s = self._seq(h)
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        step = int(chunk_size) if chunk_size else 512
        if step <= 0:
            raise InputError(f"chunk_size: expected a positive int, found {chunk_size}")
        outs = []
        for a in range(0, len(ids), step):
            chunk = ids[a:a + step]
            p0 = self._pos[s]
            outs.append(self._decode([(s, t, p0 + j) for j, t in enumerate(chunk)]))
            self._pos[s] = p0 + len(chunk)
        return np.concatenate(outs, axis=0)

    def forward_tokens(self, h, ids) -> np.ndarray:
        """Verify ``ids`` on ``h`` (one batch); logits ``[k, V]``."""
        return self.prefill(h, ids)

    def decode(self, hs: Sequence, ids: Sequence[int]) -> np.ndarray:
        """One token per sequence, all in one llama.cpp batch; logits ``[B, V]``."""
        toks = decode_args(hs, ids, self.config.vocab_size)
        items = [(self._seq(h), t, self._pos[h]) for h, t in zip(hs, toks)]
        out = self._decode(items)
        for h in hs:
            self._pos[h] += 1
        return out

    def rollback(self, h, n: int) -> None:
        """Forget the last ``n`` tokens through ``llama_memory_seq_rm``.

        Raises:
            BackendError: llama.cpp refuses (a recurrent state rolls back at most ``n_rs_seq`` tokens).
        """
        s = self._seq(h)
        n = int(n)
        if n < 0 or n > self._pos[s]:
            raise InputError(f"rollback: expected 0 <= n <= {self._pos[s]}, found {n}")
        if n == 0:
            return
        ok = self.ll.llama_memory_seq_rm(self._mem, s, self._pos[s] - n, -1)
        if ok:
            self.cells.drop(s, from_pos=self._pos[s] - n)
        if not ok:
            raise BackendError(f"backend {self.name}: rollback of {n} token(s): llama_memory_seq_rm returned false "
                               f"(llama.cpp keeps n_rs_seq={self.n_rs} recurrent-state snapshots)")
        self._pos[s] -= n

    def snapshot(self, h):
        """``(position, bytes)`` from ``llama_state_seq_get_data``."""
        s = self._seq(h)
        ll = self.ll
        size = ll.llama_state_seq_get_size(self._ctx, s)
        buf = (ctypes.c_uint8 * size)()
        got = ll.llama_state_seq_get_data(self._ctx, buf, size, s)
        if got == 0 and self._pos[s] > 0:
            raise BackendError(f"backend {self.name}: llama_state_seq_get_data wrote 0 bytes for a sequence of "
                               f"{self._pos[s]} tokens")
        return (self._pos[s], bytes(buf[:got]))

    def restore(self, h, snap) -> None:
        """Clear ``h`` and load ``snap`` into it with ``llama_state_seq_set_data``."""
        s = self._seq(h)
        pos, data = snap
        ll = self.ll
        ll.llama_memory_seq_rm(self._mem, s, -1, -1)
        self.cells.drop(s)  # llama.cpp puts the restored tokens in cells of its choosing: positions unknown
        if data:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            if ll.llama_state_seq_set_data(self._ctx, buf, len(data), s) == 0:
                raise BackendError(f"backend {self.name}: llama_state_seq_set_data refused a snapshot of {pos} tokens")
        self._pos[s] = pos

    # --- taps ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def taps(self, out_dir=None, **recorder_kw):
        """Record the llama.cpp graph nodes of :data:`TAP_MAP` (through ``cb_eval``) under our tap names,
        for the calls inside the block; yields the Recorder. Only single-sequence llama_decode calls are
        recorded (a batch of several sequences has no one position per row: the harness replays a
        failing batch one sequence at a time)."""
        from taps.recorder import Recorder
        meta = dict(recorder_kw.pop("meta", None) or {})
        meta.setdefault("backend", self.name)
        meta.setdefault("dtype", self.precision)
        with Recorder(out_dir, meta=meta, **recorder_kw) as rec:
            self._sink = _TapSink(self, rec)
            try:
                yield rec
            finally:
                self._sink = None

    def _eval_cb(self, t, ask, user_data):  # noqa: ARG002 -- called by ggml for every graph node
        sink = self._sink
        try:
            name = _tensor_name(t)
            # the first QSA layer's token scores are read on every call, taps or not: their finite entries
            # are the cells each query sees, which keep the cell -> position map (CellMap) current
            score = name.startswith("indexer_score_tokens-") and name == (self._score_node or name)
            if ask:
                if score and self._score_node is None:
                    self._score_node = name
                return bool(score or (sink is not None and sink.wants(name)))
            if score:
                self._scores.append(np.isfinite(_tensor_array(t)))
            if sink is None:
                return True
            sink.take(t)
        except Exception as e:  # never raise into C; the failure is reported when the block ends
            if sink is not None:
                sink.error = sink.error or e
        return True

    def close(self) -> None:
        """Free the llama.cpp context and model."""
        if getattr(self, "_ctx", None):
            self.ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self.ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()




# --- ggml tensor access for the eval callback --------------------------------------------------------------

GGML_MAX_DIMS, GGML_MAX_OP_PARAMS, GGML_MAX_SRC, GGML_MAX_NAME = 4, 64, 10, 64
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26


class _GgmlTensor(ctypes.Structure):
    """The head of ``struct ggml_tensor`` (vendor/llama.cpp/ggml/include/ggml.h of llama-cpp-python 0.3.36)."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
    ]


def _tensor_name(t) -> str:
    return _GgmlTensor.from_address(t).name.decode("utf-8", "replace")


def _tensor_array(t) -> np.ndarray:
    """A host copy of a CPU ggml tensor, numpy axes = ggml axes reversed (ne[0] last)."""
    g = _GgmlTensor.from_address(t)
    dt = {GGML_TYPE_F32: np.float32, GGML_TYPE_I32: np.int32}[g.type]
    ne = [int(g.ne[k]) for k in range(GGML_MAX_DIMS)]
    nb = [int(g.nb[k]) for k in range(GGML_MAX_DIMS)]
    span = sum((ne[k] - 1) * nb[k] for k in range(GGML_MAX_DIMS)) + np.dtype(dt).itemsize
    buf = (ctypes.c_uint8 * span).from_address(g.data)
    base = np.frombuffer(buf, dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(base.view(dt) if span % np.dtype(dt).itemsize == 0 else base,
                                           shape=ne[::-1], strides=nb[::-1]).copy()


class _TapSink:
    """Collects the mapped nodes of one llama_decode call, then emits them at the call's positions."""

    def __init__(self, be, rec):
        self.be, self.rec, self.error = be, rec, None
        cfg = be.config
        self.ple_layer = sorted(cfg.ple_layers)[0] if cfg.ple_layers else 0
        self.pad = "ple-pad" in (be.conversion.get("reparams") or [])
        self.nodes: dict[str, list] = {}
        self.items = None
        self.unmapped = 0   # selected_tokens rows left out: cells of unknown position (after a restore)

    def _parse(self, name):
        base, dash, il = name.rpartition("-")
        if dash and il.isdigit():
            return base, int(il)
        return name, -1

    def wants(self, name) -> bool:
        base, _ = self._parse(name)
        return base in TAP_MAP and self.items is not None

    def begin(self, items):
        # one sequence only: several sequences in one ubatch have no single position per row
        self.items = items if len({s for s, _, _ in items}) == 1 else None
        self.nodes = {}

    def take(self, t):
        name = _tensor_name(t)
        g = _GgmlTensor.from_address(t)
        if g.type not in (GGML_TYPE_F32, GGML_TYPE_I32) or not g.data:
            return
        self.nodes.setdefault(name, []).append(_tensor_array(t))

    def end(self):
        items, self.items = self.items, None
        if items is None:
            return
        if self.error is not None:
            e, self.error = self.error, None
            raise BackendError(f"backend llama.cpp: taps: reading a graph node failed: {type(e).__name__}: {e}")
        pos = np.array([p for _, _, p in items], dtype=np.int64)
        T, cfg = len(items), self.be.config
        for name, arrs in self.nodes.items():
            base, il = self._parse(name)
            tmpl = TAP_MAP.get(base)
            if tmpl is None:
                continue
            if 0 <= il < len(cfg.layer_types) and (base, cfg.layer_types[il]) in LAYER_TYPE_DROPS:
                continue
            for k, a in enumerate(arrs):
                ours = tmpl[k] if isinstance(tmpl, list) else tmpl
                if isinstance(tmpl, list) and k >= len(tmpl):
                    break
                ours = ours.format(i=il, p=self.ple_layer)
                if not self.rec.wants(ours):
                    continue
                if base == "indexer_top_k":
                    sc = self.nodes.get(f"indexer_score_tokens-{il}")
                    v = self._selected_tokens(a, sc[0] if sc else None, items, cfg, self.be.cells)
                    if v is None:  # a selection among cells whose positions are unknown: not comparable
                        self.unmapped += 1
                        continue
                else:
                    v = a.reshape(T, -1) if a.size % T == 0 else None
                    if v is None:
                        continue
                    if base == "ple_embd" and v.shape[1] != cfg.ple_embed_dim:
                        v = self._unpadded(v, cfg)
                        if v is None:  # a GGUF of another layout: not comparable
                            continue
                self.rec.emit(ours, v, positions=pos)
        self.nodes = {}

    def _unpadded(self, v, cfg):
        """``ple_embd`` rows ``[T, nh * r2]`` of a GGUF made with the ple-pad re-parameterisation, back in the
        checkpoint's layout ``[T, nh * r]`` (its inverse: each n-gram head's first ``r`` columns), else None. A
        GGUF given with ``gguf=`` (e.g. this tool's own conversion, used again) carries no re-param list: its rows
        are taken as padded when they have ple-pad's width and every padding column is exactly zero."""
        nh = cfg.ngram_heads
        r = cfg.ple_embed_dim // nh if nh else 0
        if not nh or v.shape[1] % nh or v.shape[1] // nh < r or r * nh != cfg.ple_embed_dim:
            return None
        w = v.reshape(v.shape[0], nh, v.shape[1] // nh)
        if not self.pad and (v.shape[1] != cfg.hidden_size or np.any(w[:, :, r:])):
            return None
        return w[:, :, :r].reshape(v.shape[0], nh * r)

    @staticmethod
    def _selected_tokens(top, scores, items, cfg, cells):
        """indexer_top_k [.., T, width] KV cache cells -> the ascending positions of the query's sequence
        (through ``cells``, a :class:`CellMap`), masked (-inf score) cells dropped, -1 padded to budget +
        ratio - 1. None when a selection cannot be mapped: it holds some, not all, of the visible cells whose
        positions are unknown (after a restore; taking all of them maps as a set)."""
        T = len(items)
        top = top.reshape(T, -1)
        width = cfg.qsa_bound
        out = np.full((T, width), -1, np.int64)
        sc = None if scores is None else np.isfinite(scores.reshape(T, -1))
        for t, (seq, _tok, p) in enumerate(items):
            sel = top[t].astype(np.int64)
            if sc is not None:
                sel = sel[sc[t, sel]]
                visible = np.flatnonzero(sc[t])
            else:
                visible = sel
            known = cells.positions(seq)
            pos = [known[c] for c in sel.tolist() if c in known]
            unknown_sel = {c for c in sel.tolist() if c not in known}
            if unknown_sel:
                unknown_vis = {c for c in visible.tolist() if c not in known}
                if unknown_sel != unknown_vis:
                    return None
                # every cell of unknown position is selected: as a set they are the positions not mapped
                pos += sorted(set(range(p + 1)) - set(known[c] for c in visible.tolist() if c in known))
            pos = np.sort(np.asarray(pos, np.int64))[:width]
            out[t, :len(pos)] = pos
        return out


class CellMap:
    """Which (sequence, position) each llama.cpp KV cache cell holds: the indexer's ``indexer_top_k`` names
    cells of the unified cache, not positions, and sequences sharing the cache interleave their cells.

    Kept from the first QSA layer's ``indexer_score_tokens`` of every ubatch: its finite entries in row t are
    the cells query t sees, i.e. the cells of positions 0..p_t of t's sequence (this backend keeps every
    sequence contiguous from 0; the causal mask includes the query's own cell). Rows whose visible sets
    overlap are one sequence; the smallest set adds the cell of position |V| - 1, each next row one more.
    A row whose sequence or new cell cannot be told (several unknown cells: after a restore, which places
    tokens in cells of llama.cpp's choosing) maps nothing: those cells stay unknown, never guessed."""

    def __init__(self):
        self._pos: dict[int, dict[int, int]] = {}   # seq -> {cell: position}

    def positions(self, seq) -> dict[int, int]:
        """``{cell: position}`` of sequence ``seq`` (the cells known)."""
        return self._pos.get(seq, {})

    def drop(self, seq, from_pos: int = 0) -> None:
        """Forget ``seq``'s cells at positions >= ``from_pos`` (freed by llama_memory_seq_rm)."""
        m = self._pos.get(seq)
        if m:
            for c in [c for c, p in m.items() if p >= from_pos]:
                del m[c]

    def update(self, visible: np.ndarray, items) -> None:
        """One ubatch: ``visible`` bool [.., n_tokens, n_kv] (finite token scores), ``items`` the call's
        [(seq, token, pos)] (the ubatch's rows are some of them, possibly reordered by llama.cpp)."""
        vis = np.asarray(visible, bool)
        vis = vis.reshape(-1, vis.shape[-1])
        sets = [frozenset(np.flatnonzero(r).tolist()) for r in vis]
        groups: list[list[int]] = []  # rows of one sequence: their visible sets overlap
        for t in sorted(range(len(sets)), key=lambda i: len(sets[i])):
            g = next((g for g in groups if sets[g[-1]] & sets[t]), None)
            (g.append(t) if g is not None else groups.append([t]))
        fresh = [s for s, _tok, p in items if p == 0]
        want = {}
        for s, _tok, p in items:
            want.setdefault(s, set()).add(p)
        for g in groups:
            cells_g = sets[g[-1]]
            owners = {s for s, m in self._pos.items() if any(c in m for c in cells_g)}
            if len(owners) == 1:
                seq = owners.pop()
            elif not owners and len(sets[g[0]]) == 1 and len(fresh) == 1:
                seq = fresh[0]  # a sequence's first token: the only fresh one in the call
            elif not owners and len(want) == 1:
                seq = next(iter(want))  # the call's only sequence (its cells are not known yet: restored)
            else:
                continue
            m = self._pos.setdefault(seq, {})
            prev: frozenset = frozenset()
            for t in g:
                new = [c for c in sets[t] - prev if c not in m or m[c] >= len(sets[t]) - 1]
                p = len(sets[t]) - 1
                if len(new) == 1 and p in want.get(seq, ()):
                    c = new[0]
                    for o, om in self._pos.items():  # a reused cell belongs to this sequence only
                        if o != seq and c in om:
                            del om[c]
                    m[c] = p
                prev = sets[t]


# an outside engine (docs/outside-engines.md); str options are checked by LlamaCppBackend.open
BACKEND = BackendEntry(
    "llama.cpp", LlamaCppBackend,
    {"gguf": str, "reparam": str, "kv": ("f32", "f16"), "fa": ("off", "on", "auto"), "threads": int, "seqs": int,
     "ctx": int, "rs": str, "sdist": str, "convert_timeout": int, "page_size": int},
    help="llama.cpp in process through llama-cpp-python, docs/outside-engines.md")
