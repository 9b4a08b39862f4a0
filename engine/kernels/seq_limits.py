"""The limits the sequence kernels (GDN, QSA, RoPE) impose, stated at load.

:func:`seq_kernel_limits` returns them for a config and raises one clear error when the config exceeds one, so an
engine refuses a model up front instead of failing (or truncating) mid-request. None of the limits sits below
``max_position_embeddings``: positions, visible tokens and block counts are 64-bit throughout, angles are computed
on the fly (no RoPE table), and prefill token counts go on the unbounded grid axis.
"""
from __future__ import annotations

from reference.config import ConfigError

from engine.kernels.qsa import QSA_MAX_BLOCK_TOPK

#: carried conv rows the CUDA conv state update holds in registers (linear_conv_kernel_dim - 1)
GDN_MAX_CONV_STATE = 16
#: the CUDA scoring grid puts ceil(n_blocks / 8) on grid axis y (at most 65535)
QSA_MAX_SCORED_BLOCKS = 65535 * 8


def seq_kernel_limits(config, gpu: bool = True) -> dict:
    """The sequence kernels' limits for ``config`` (a :class:`reference.config.ModelConfig`).

    Returns:
        dict: ``block_topk`` / ``max_block_topk``, ``max_blocks`` (complete blocks at ``max_position_embeddings``)
        / ``max_scored_blocks``, ``conv_state_rows`` / ``max_conv_state_rows``, ``max_attended_tokens`` (the most
        tokens one query attends: ``indexer_budget + ratio - 1``).
    Raises:
        ConfigError: ``gpu`` and a limit is exceeded (the NumPy twins have none of these limits).
    """
    c = config
    out = {"conv_state_rows": c.linear_conv_kernel_dim - 1, "max_conv_state_rows": GDN_MAX_CONV_STATE}
    if c.qsa_enabled:
        out.update(block_topk=c.block_topk, max_block_topk=QSA_MAX_BLOCK_TOPK,
                   max_blocks=c.max_position_embeddings // c.indexer_compress_ratio,
                   max_scored_blocks=QSA_MAX_SCORED_BLOCKS, max_attended_tokens=c.qsa_bound)
    if not gpu:
        return out
    if out["conv_state_rows"] > GDN_MAX_CONV_STATE:
        raise ConfigError(f"linear_conv_kernel_dim: the CUDA GDN conv carries at most {GDN_MAX_CONV_STATE} state "
                          f"rows (kernel <= {GDN_MAX_CONV_STATE + 1}), found {c.linear_conv_kernel_dim}")
    if c.qsa_enabled:
        if c.block_topk > QSA_MAX_BLOCK_TOPK:
            raise ConfigError(f"indexer_budget / indexer_compress_ratio: the CUDA block top-k sorts at most "
                              f"{QSA_MAX_BLOCK_TOPK} blocks per query, found block_topk={c.block_topk}")
        if out["max_blocks"] > QSA_MAX_SCORED_BLOCKS:
            raise ConfigError(f"max_position_embeddings / indexer_compress_ratio: the CUDA indexer scores at most "
                              f"{QSA_MAX_SCORED_BLOCKS} blocks per query, found {out['max_blocks']}")
    return out
