"""The parity Backend protocol and its adapters.

A *backend* is anything that can run the qwen4exp model incrementally for several concurrent
sequences. The parity harness (KL harness, scenario suites, ``qwen4exp parity``) drives backends only
through this protocol, so the reference session, the engine (CPU and CUDA paths) and any outside
engine (``--backend my_pkg.my_mod:MyBackend``) are judged the same way.

The protocol (duck-typed; subclass :class:`Backend` for the defaults and the docs)::

    be = Cls.open(model_path, **opts)       # opts: page_size=int, perturb=(tensor_name, fn) (optional)
    be.name -> str ; be.precision -> 'float64'|'float32'|'bf16'|'fp8' ; be.config -> ModelConfig
    be.capabilities -> dict                 # see Backend.capabilities
    h = be.new_sequence()                   # opaque handle; several may be live at once
    be.prefill(h, ids, chunk_size=None) -> np.ndarray [T, V]   # logits of every prompt position
    be.decode([h1, h2, ...], [t1, t2, ...]) -> [B, V]           # one token for each sequence, batched
    be.forward_tokens(h, ids) -> [k, V]     # verify k drafted tokens (keeps what rollback needs)
    be.rollback(h, n)                       # forget the last n tokens
    be.snapshot(h) -> obj ; be.restore(h, obj)   # restore into any live handle (empty or not)
    be.position(h) -> int                   # tokens in the sequence's state (the KV length)
    be.free(h)
    be.logits(ids) -> [T, V]                # one-shot: a fresh sequence prefilled with ids, freed
    with be.taps(out_dir=None, include=...) as rec: ...   # record taps (taps.recorder.Recorder)
    be.close()

Logits are host NumPy arrays (float32, or float64 for ``reference-f64``), rows in token order.
Handles from one backend must never be passed to another. Errors from bad input are
:class:`reference.errors.UserError` subclasses.

The TRUTH for every comparison is :func:`truth_model` 's ``forward`` -- the reference's single full
forward over the same tokens.
"""
from parity.backends.base import (BACKEND_NAMES, Backend, BackendError, capabilities_of, load_weights,  # noqa: F401
                                   one_shot_logits, truth_model)
from parity.backends.engine import EngineBackend  # noqa: F401
from parity.backends.reference import ReferenceBackend  # noqa: F401
from parity.backends.registry import (BackendSpec, backend_class, open_backend, opener,  # noqa: F401
                                      parse_backend_spec)

__all__ = ["Backend", "ReferenceBackend", "EngineBackend", "BackendError", "open_backend", "backend_class",
           "BACKEND_NAMES", "truth_model", "load_weights", "capabilities_of", "one_shot_logits", "opener",
           "BackendSpec", "parse_backend_spec"]
