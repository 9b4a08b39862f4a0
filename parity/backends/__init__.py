"""The parity backends: the Backend protocol (:mod:`parity.backends.base`, whose docstring states it),
one module per backend (:mod:`~parity.backends.reference`, :mod:`~parity.backends.engine`; outside
engines land here too), the one opener every caller uses (:func:`open_backend`,
:mod:`parity.backends.registry`) and snapshot files (:mod:`parity.backends.snapshot_file`).

Open a model on a backend only through :func:`open_backend` (``--backend NAME`` or ``module:Class``).
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
