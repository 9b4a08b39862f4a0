"""The parity backends: the Backend protocol (:mod:`parity.backends.base`, whose docstring states it),
one module per backend (:mod:`~parity.backends.reference`, :mod:`~parity.backends.engine`; outside
engines land here too; the server backends -- :class:`~parity.backends.base.TopkServer` -- build on
:mod:`~parity.backends.openai`), the one opener every caller uses (:func:`open_backend`,
:mod:`parity.backends.registry`) and snapshot files (:mod:`parity.backends.snapshot_file`).

Open a model on a backend only through :func:`open_backend` (``--backend NAME`` or ``module:Class``).
"""
from parity.backends.base import (Backend, BackendEntry, BackendError, BackendRaised, capabilities_of,  # noqa: F401
                                   describe_exception, load_weights, one_shot_logits, truth_model)
from parity.backends.engine import EngineBackend  # noqa: F401
from parity.backends.reference import ReferenceBackend  # noqa: F401
from parity.backends.registry import (BACKEND_NAMES, BACKENDS, BackendSpec, backend_class,  # noqa: F401
                                      open_backend, opener, parse_backend_spec)

__all__ = ["Backend", "ReferenceBackend", "EngineBackend", "BackendError", "BackendRaised", "open_backend",
           "backend_class", "describe_exception",
           "BACKEND_NAMES", "BACKENDS", "BackendEntry", "truth_model", "load_weights", "capabilities_of", "one_shot_logits", "opener",
           "BackendSpec", "parse_backend_spec"]
