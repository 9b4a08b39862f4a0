"""Shared helpers for the reference tests: tiny configs and a live official model (torch) with every
parameter randomised (the official init zeroes norms, dt_bias and the PLE conv, which would hide bugs).

Not a test module (no ``test_`` prefix); imported by tests/test_reference_*.py.
"""
from __future__ import annotations

import numpy as np

from reference.checkpoint import DictWeights
from reference.config import ModelConfig

EOS = 7


def tiny_config_dict(**over) -> dict:
    """A tiny qwen4_exp_text config exercising every block: 4 layers (GDN, GDN, GDN, QSA), PLE on 0-based
    layers 0 and 2, hc_count 2, partial rotary 0.5 with a non-trivial mrope section, QSA block_topk 2 of
    compress ratio 4, 8 experts top-2."""
    d = dict(model_type="qwen4_exp_text", vocab_size=256, hidden_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, moe_intermediate_size=16,
             shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
             ple_layer_ids=[1, 3], ple_embed_dim=16, heads_per_ngram=2, ngram_vocab_size_base=101,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
             indexer_compress_ratio=4, eos_token_id=EOS, output_gate_type="sigmoid",
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [2, 1, 1]})
    d.update(over)
    return d


def random_weights(cfg: ModelConfig, seed: int = 0) -> DictWeights:
    """Weights of every tensor the model needs (fused expert layout), drawn at random (no torch needed),
    scaled like :func:`official_model`'s so activations stay O(1)."""
    from reference.checkpoint import expected_shapes
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in expected_shapes(cfg).items():
        if ".mlp.experts." in name and not name.endswith(("gate_up_proj", "down_proj")):
            continue
        if ".ple_embedding.layer_multipliers" in name or ".ngram_heads_" in name:
            continue
        if name.endswith("A_log"):
            a = np.log(rng.uniform(0.1, 4.1, shape))
        elif name.endswith("linear_attn.norm.weight"):
            a = 1.0 + 0.3 * rng.standard_normal(shape)
        elif "norm" in name and len(shape) == 1:
            a = 0.3 * rng.standard_normal(shape)
        elif "ngram_embedding" in name:
            a = rng.standard_normal(shape)
        elif len(shape) >= 2:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            a = 0.5 * rng.standard_normal(shape)
        arrays[name] = a.astype(np.float32)
    return DictWeights(cfg, arrays)


def tiny_config(**over) -> ModelConfig:
    """:func:`tiny_config_dict` as a validated :class:`ModelConfig`."""
    return ModelConfig.from_dict(tiny_config_dict(**over))


def official_model(cfg_dict: dict, seed: int = 0):
    """The official ``Qwen4ExpForCausalLM`` (float32, eval) with all parameters randomised.

    Returns:
        ``(torch_model, DictWeights)`` sharing the same values.
    """
    import torch
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    d = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    tcfg = Qwen4ExpTextConfig(**d)
    tcfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = Qwen4ExpForCausalLM(tcfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name and p.ndim == 1:
                # zero-centred norms: w ~ N(0, 0.3); the gated norm (plain weight): around 1
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + torch.randn(p.shape, generator=g) * 0.3)
            elif "ngram_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    cfg = ModelConfig.from_dict(cfg_dict)
    arrays = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
    return m, DictWeights(cfg, arrays)


def official_logits(m, ids) -> np.ndarray:
    """Logits ``[T, V]`` float32 of one official full forward (no cache)."""
    import torch
    with torch.no_grad():
        out = m(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
    return out.logits[0].numpy()
