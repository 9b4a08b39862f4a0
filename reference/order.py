"""Evaluation orders of the float32 reference: the same function, other legitimate rounding sequences.

A correct float32 engine computes the model with the float32 unit roundoff but its own order of operations
(GEMM tiling and split-K accumulation, the chunked or the recurrent form of the gated delta rule). The
precision floor (``parity.harness.floor``) is measured as an envelope over several such orders, so that it
bounds any correct float32 evaluation, not only the reference's own (docs/parity.md, "The floor").

An order is selected for a block of code with :func:`evaluation_order`; every reference block reads it
through :func:`current`. The default (:data:`NATIVE`) is the reference's own order; nothing changes unless
a caller asks. float64 computations ignore the linear order (it only re-associates a float32 sum).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import numpy as np

from reference.errors import InputError
from reference.numba_kernels import split_k_matmul_t

__all__ = ["EvalOrder", "NATIVE", "ALTERNATIVES", "evaluation_order", "current", "blocked_matmul_t"]


@dataclass(frozen=True)
class EvalOrder:
    """One evaluation order.

    ``linear_block``: 0 -- linears (projections, experts, lm_head) as the reference does them (BLAS or the
    fused BF16 kernel); ``n > 0`` -- the contraction split into blocks of ``n`` input features, each block's
    partial product rounded to float32 and the partials accumulated one after another from the LAST block
    to the first (a split-K GEMM's order; :func:`blocked_matmul_t`). ``gdn``: the form of the gated delta
    rule for a multi-token step: 'auto' (chunked, the official prefill form), 'recurrent' (token by token)
    or 'chunked'.
    """

    name: str
    linear_block: int = 0
    gdn: str = "auto"

    def __post_init__(self):
        if self.linear_block < 0:
            raise InputError(f"evaluation order {self.name!r}: linear_block: expected >= 0, found {self.linear_block}")
        if self.gdn not in ("auto", "recurrent", "chunked"):
            raise InputError(f"evaluation order {self.name!r}: gdn: expected auto/recurrent/chunked, found {self.gdn!r}")


#: the reference's own order
NATIVE = EvalOrder("native")
#: the other orders the float32 floor is measured over (besides :data:`NATIVE`): split-K accumulations of
#: 4-feature partials with the recurrent delta rule, and of 16-feature partials with the chunked rule. Short
#: blocks accumulated one after another are the least accurate order a correct kernel uses (a running sum
#: over tiles); the two block sizes and both delta-rule forms vary the order where a correct engine may
#: vary it. Cost: ``K / block`` small products per linear (cheap on the fixtures; on a real-width model the
#: floor's forwards are dominated by these).
ALTERNATIVES = (EvalOrder("split-k4+recurrent", linear_block=4, gdn="recurrent"),
                EvalOrder("split-k16+chunked", linear_block=16, gdn="chunked"))

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("reference_evaluation_order", default=NATIVE)


def current() -> EvalOrder:
    """The evaluation order in effect (:data:`NATIVE` outside :func:`evaluation_order`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def evaluation_order(order: EvalOrder):
    """Run the enclosed reference code in ``order`` (restored on exit, also on an exception)."""
    if not isinstance(order, EvalOrder):
        raise InputError(f"evaluation order: expected an EvalOrder, found {type(order).__name__}")
    tok = _CURRENT.set(order)
    try:
        yield order
    finally:
        _CURRENT.reset(tok)


def blocked_matmul_t(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """``x @ w.T`` (x ``[..., K]``, w ``[O, K]``, same float dtype) as a split-K sum: the partial products of
    input-feature blocks ``[s, s + block)`` accumulated in ``x.dtype`` from the last block to the first
    (:func:`reference.numba_kernels.split_k_matmul_t`). Returns ``[..., O]``."""
    lead = x.shape[:-1]
    out = split_k_matmul_t(np.ascontiguousarray(x.reshape(-1, x.shape[-1])), w, block)
    return out.reshape(*lead, w.shape[0])
