"""The ``llama.cpp`` backend: llama-cpp-python's low-level API behind the parity protocol.

    --backend llama.cpp                        convert MODEL with the installed llama.cpp's converter
    --backend llama.cpp:gguf=PATH              use the user's own GGUF (MODEL still gives the config/truth)
    --backend llama.cpp:reparam=auto           apply the function-preserving re-parameterisations that
                                               get past llama.cpp's converter/loader limits (reported)
    other options (',' separated): threads=N, seqs=N (n_seq_max), ctx=N (n_ctx), rs=N (n_rs_seq, the
    recurrent-state snapshots kept for rollback), sdist=PATH (llama-cpp-python's source distribution)

One llama.cpp context holds every live sequence (``n_seq_max`` sequence ids, a unified KV cache).
Logits of every position come from ``batch.logits[i] = 1`` (``logits_all``); prefill is batched or
chunked, decode batches one token per sequence; snapshot/restore use ``llama_state_seq_get_data`` /
``llama_state_seq_set_data``; rollback uses ``llama_memory_seq_rm`` -- for the recurrent (GDN, PLE conv)
state llama.cpp can only remove the last ``n_rs_seq`` tokens, so rollback is *limited* to that many.

Taps: not recorded yet (the planned eval-callback map is in docs/outside-engines.md); failures are
located by position.

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

from parity.backends.base import Backend, BackendError, _check_ids
from parity.backends.refusal import EngineRefused

def _ll():
    try:
        import llama_cpp
    except ImportError as e:
        raise BackendError(f"llama.cpp backend: expected llama-cpp-python installed (pip install "
                           f"'qwen4exp-parity[llamacpp]'), found {e}") from e
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

    def __init__(self, model_path, cfg, gguf: str, conv: dict, *, threads=1, seqs=8, ctx=4096, rs=8):
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
        cp.n_seq_max, cp.n_rs_seq = int(seqs), int(rs)
        cp.n_threads = cp.n_threads_batch = int(threads)
        cp.kv_unified = True
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise EngineRefused(f"llama.cpp {self.version}", "loader", _loader_message())
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_rs = int(ll.llama_n_rs_seq(self._ctx))
        self.n_seq = int(seqs)
        self._free_ids = list(range(self.n_seq))[::-1]
        self._pos: dict[int, int] = {}
        self._next = 0
        self.capabilities = {
            "page_sizes": None, "batched_decode": True, "perturb": False, "state_arrays": False,
            "snapshot_file": False,
            # llama_memory_seq_rm of a recurrent state works only within the last n_rs_seq tokens
            "rollback": False, "rollback_limit": self.n_rs, "taps": False,
        }

    @classmethod
    def open(cls, model_path, *, gguf=None, reparam="none", threads=1, seqs=8, ctx=4096, rs=8, sdist=None,
             convert_timeout=None, page_size=None, perturb=None, **opts) -> "LlamaCppBackend":
        """Open llama.cpp on ``model_path`` (converted) or on ``gguf``.

        Raises:
            EngineRefused: llama.cpp's converter or loader refuses the checkpoint.
            BackendError: llama-cpp-python / its converter missing, ``perturb`` asked, unknown options.
        """
        from reference.config import load_config

        from parity.backends import gguf_convert as gc
        if opts:
            raise InputError(f"llama.cpp backend options: expected gguf, reparam, threads, seqs, ctx, rs, sdist, "
                             f"convert_timeout; found {sorted(opts)}")
        if perturb is not None:
            raise BackendError("llama.cpp backend: perturb: not supported (the weights live in a GGUF)")
        cfg = load_config(model_path)
        version = gc.installed_version()
        if gguf:
            if not Path(gguf).is_file():
                raise InputError(f"llama.cpp:gguf={gguf!r}: expected a GGUF file, found "
                                 f"{'a directory' if Path(gguf).is_dir() else 'nothing there'}")
            conv = {"gguf": str(gguf), "reparams": [], "checks": [], "converter": "user's GGUF"}
        else:
            kw = {"timeout": int(convert_timeout)} if convert_timeout else {}
            conv = gc.convert(model_path, version, reparams=gc.parse_reparams(reparam, model_path), sdist=sdist, **kw)
        return cls(model_path, cfg, conv["gguf"], conv, threads=int(threads), seqs=int(seqs), ctx=int(ctx), rs=int(rs))

    # --- sequences -------------------------------------------------------------------------------------
    def _seq(self, h) -> int:
        if h not in self._pos:
            raise BackendError(f"backend {self.name}: sequence handle {h!r}: expected a live handle of this "
                               f"backend, found none (freed or foreign)")
        return h

    def new_sequence(self):
        """A free llama.cpp sequence id (cleared); raises BackendError when all ``seqs`` are live."""
        if not self._free_ids:
            raise BackendError(f"backend {self.name}: expected at most {self.n_seq} live sequences (seqs=), "
                               f"found one more requested")
        s = self._free_ids.pop()
        self.ll.llama_memory_seq_rm(self._mem, s, -1, -1)
        self._pos[s] = 0
        return s

    def free(self, h) -> None:
        """Clear and release sequence ``h`` (an unknown handle is ignored)."""
        if h in self._pos:
            self.ll.llama_memory_seq_rm(self._mem, h, -1, -1)
            del self._pos[h]
            self._free_ids.append(h)

    def position(self, h) -> int:
        """Tokens in sequence ``h``'s state."""
        return self._pos[self._seq(h)]

    def _decode(self, items) -> np.ndarray:
        """``items``: [(seq, token, pos)] -> logits [n, V] (every token outputs logits)."""
        ll = self.ll
        n = len(items)
        batch = ll.llama_batch_init(n, 0, 1)
        try:
            for i, (s, tok, pos) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = 1
            batch.n_tokens = n
            rc = ll.llama_decode(self._ctx, batch)
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
        ids = _check_ids(ids, self.config.vocab_size)
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
        if len(hs) != len(ids):
            raise InputError(f"decode: expected one token per sequence, found {len(hs)} sequences, {len(ids)} tokens")
        toks = _check_ids(list(ids), self.config.vocab_size)
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
        if data:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            if ll.llama_state_seq_set_data(self._ctx, buf, len(data), s) == 0:
                raise BackendError(f"backend {self.name}: llama_state_seq_set_data refused a snapshot of {pos} tokens")
        self._pos[s] = pos

    # --- taps ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def taps(self, out_dir=None, **recorder_kw):
        """Not available yet: the eval-callback tap map is documented (docs/outside-engines.md) but not
        recorded. Raises BackendError (the harness then locates by position only)."""
        raise BackendError(f"backend {self.name}: taps: not supported yet (cb_eval capture not implemented)")
        yield  # pragma: no cover

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


