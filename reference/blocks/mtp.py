"""The MTP (multi-token prediction) head's input fusion, and the named options where public ports disagree.

Provenance, stated plainly: **no official implementation exists.** transformers' ``modeling_qwen4_exp.py``
builds no MTP module and drops the checkpoint's ``mtp.*`` tensors (``_keys_to_ignore_on_load_unexpected``).
What is implemented here is the dataflow of the public serving ports, as collected in
``../shared/model-facts.md`` section 3: vLLM ``vllm/models/qwen4_exp/{nvidia,amd}/mtp.py`` and SGLang
``python/sglang/srt/models/qwen4_exp_mtp.py`` (the reference dataflow), with llama.cpp
``src/models/qwen4exp.cpp`` (``graph_mtp``) as the dissenting port. Its draft logits are therefore a
*consensus* truth, not an official one; reports say so (``truth_provenance``).

Dataflow of one MTP step over ``T`` pairs ``(R_q, x_{q+1})`` at positions ``q`` (the trunk's position of
``R_q``; vLLM feeds the drafter the target's positions with the token ids shifted by one):

1. ``e = fc_embedding(RMSNorm_H(embed_tokens[x_{q+1}]))``  ``[T, H]`` (``pre_fc_norm_embedding``, zero-centred);
2. ``hn = RMSNorm_{hc*H}(R_q)`` with ``pre_fc_norm_hidden [hc*H]`` -- see :data:`HNORM_GROUPINGS`;
3. ``x_c = fc_hidden(hn_c) + e`` for every stream ``c`` (one shared ``fc_hidden`` applied per stream; "unit
   injection", vLLM/SGLang's ``residual_linear_shared``) -> the layer's multi-stream input ``[T, hc*H]``;
4. one decoder layer (attention hyper-connection, QSA with the head's own KV and indexer caches, PLE off,
   MLP hyper-connection, MoE), weights ``mtp.layers.0.*``;
5. ``mtp.hyper_connection_mixer`` collapses the streams; the **shared** ``lm_head`` gives the draft logits.
   The pre-mixer multi-stream state is the ``R`` of the next draft step (vLLM reuses the one layer for every
   step, ``spec_step_idx % num_mtp_layers``).

Options (where the ports disagree):

* ``hnorm`` (:data:`HNORM_GROUPINGS`): ``'global'`` (default; vLLM nvidia + amd and SGLang: one RMS over all
  ``hc*H`` values) or ``'per_stream'`` (llama.cpp: ``ggml_rms_norm`` over each ``H``-wide stream, then the
  ``[hc*H]`` gain; community notes call it the outlier).
* ``draft_selection`` (:data:`DRAFT_SELECTIONS`): ``'fresh'`` (default: every draft step runs its own
  indexer top-k, as the trunk does at every position; llama.cpp and ik_llama attend densely, which equals a
  fresh selection while the visible blocks fit the top-k budget) or ``'reuse_step0'`` (vLLM ``set_skip_topk``:
  the blocks selected at draft step 0 are reused by later steps; here the tokens written after step 0 --
  step 0's incomplete tail onwards -- stay visible). Majority of the three ports: not reusing.
"""
from __future__ import annotations

import numpy as np

from reference.blocks.linear import linear
from reference.blocks.norms import rms_norm
from reference.errors import InputError

__all__ = ["HNORM_GROUPINGS", "DRAFT_SELECTIONS", "MTP_PREFIX", "check_mtp_options", "mtp_fuse"]

#: ``hnorm`` grouping options (first = default, the vLLM/SGLang majority)
HNORM_GROUPINGS = ("global", "per_stream")
#: draft-step QSA selection options (first = default)
DRAFT_SELECTIONS = ("fresh", "reuse_step0")
#: canonical name prefix of the head's tensors
MTP_PREFIX = "mtp."


def check_mtp_options(hnorm: str, draft_selection: str) -> None:
    """Raise :class:`InputError` naming the option when ``hnorm`` / ``draft_selection`` is not a known value."""
    if hnorm not in HNORM_GROUPINGS:
        raise InputError(f"mtp hnorm: expected one of {list(HNORM_GROUPINGS)}, found {hnorm!r}")
    if draft_selection not in DRAFT_SELECTIONS:
        raise InputError(f"mtp draft_selection: expected one of {list(DRAFT_SELECTIONS)}, found {draft_selection!r}")


def mtp_fuse(residual: np.ndarray, next_embed: np.ndarray, w: dict, hc_count: int, hidden_size: int, eps: float,
             hnorm: str = "global"):
    """Steps 1-3 of the MTP head: the layer input from the trunk's (or the previous draft step's) multi-stream
    state and the embedding of the next token.

    Args:
        residual: ``R [T, hc*H]`` pre-final-mixer multi-stream residual.
        next_embed: ``[T, H]`` ``embed_tokens`` rows of the tokens ``x_{q+1}``.
        w: ``pre_fc_norm_embedding [H]``, ``pre_fc_norm_hidden [hc*H]`` (zero-centred), ``fc_embedding``,
           ``fc_hidden`` ``[H, H]`` (arrays or ``BF16Matrix``).
        hnorm: ``'global'`` (one RMS over ``hc*H``) or ``'per_stream'`` (RMS per ``H``-wide stream).
    Returns:
        ``(x [T, hc*H], taps)`` with taps ``fc_embedding.out [T, H]`` and ``fc_hidden.out [T, hc*H]``.
    Raises:
        InputError: unknown ``hnorm``.
    Source: vLLM/SGLang Qwen4Exp MTP (model-facts.md section 3, steps 2-4); no official implementation.
    """
    if hnorm not in HNORM_GROUPINGS:
        raise InputError(f"mtp hnorm: expected one of {list(HNORM_GROUPINGS)}, found {hnorm!r}")
    T = residual.shape[0]
    e = linear(rms_norm(next_embed, w["pre_fc_norm_embedding"], eps), w["fc_embedding"])
    hn = rms_norm(residual, w["pre_fc_norm_hidden"], eps, group_size=hidden_size if hnorm == "per_stream" else None)
    fh = linear(hn.reshape(T * hc_count, hidden_size), w["fc_hidden"]).reshape(T, hc_count * hidden_size)
    x = (fh.reshape(T, hc_count, hidden_size) + e[:, None, :]).reshape(T, hc_count * hidden_size)
    return x, {"fc_embedding.out": e, "fc_hidden.out": fh}
