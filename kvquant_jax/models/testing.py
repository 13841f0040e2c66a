"""Tiny random LLaMA / Gemma-3-shaped models for fast tests and examples (no download)."""
from __future__ import annotations

import numpy as np

from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.llama import cast_params


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6, num_kv_heads=2,
                head_dim=8, rope_theta=10000.0, rope_pairing="half_split", rms_eps=1e-5, max_position=512,
                tie_embeddings=True, bos_id=1, eos_id=2, name="tiny-random")
    base.update(kw)
    return LlamaConfig(**base)


def tiny_gemma_config(**kw) -> LlamaConfig:
    """A tiny Gemma-3-shaped config: MQA, QK-norm, post-norms, GeGLU, local/global layers (window 8, local RoPE
    base 1e4, global 1e6), embedding scale sqrt(H), query scale (D/2)**-0.5 (not 1/sqrt(D): exercises the fold)."""
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=1,
                head_dim=16, rope_theta=1e6, rope_pairing="half_split", rms_eps=1e-6, max_position=512,
                tie_embeddings=True, bos_id=2, eos_id=1, name="tiny-gemma3", arch="gemma3", qk_norm=True,
                post_norms=True, mlp_activation="gelu_tanh", layer_types=("local", "local", "global", "local"),
                sliding_window=8, rope_theta_local=1e4, query_scale=8 ** -0.5, embed_scale=float(np.float32(32 ** 0.5)))
    base.update(kw)
    return LlamaConfig(**base)


def random_params(cfg: LlamaConfig, seed: int = 0, dtype: str = "fp32") -> dict:
    """Random weights with LLaMA-like scales (so activations stay O(1) through the layers)."""
    rng = np.random.default_rng(seed)
    h, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def w(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    params = {
        "embed": w(cfg.vocab_size, h, fan_in=1) * 0.5,
        "final_norm": (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "layers": {
            "attn_norm": (1.0 + 0.1 * rng.standard_normal((l, h))).astype(np.float32),
            "wq": w(l, h, qd, fan_in=h), "wk": w(l, h, kd, fan_in=h), "wv": w(l, h, kd, fan_in=h),
            "wo": w(l, qd, h, fan_in=qd),
            "ffn_norm": (1.0 + 0.1 * rng.standard_normal((l, h))).astype(np.float32),
            "w_gate": w(l, h, f, fan_in=h), "w_up": w(l, h, f, fan_in=h), "w_down": w(l, f, h, fan_in=f),
        },
    }
    if cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            params["layers"][n] = (1.0 + 0.1 * rng.standard_normal((l, cfg.head_dim))).astype(np.float32)
    if cfg.post_norms:
        for n in ("post_attn_norm", "post_ffn_norm"):
            params["layers"][n] = (1.0 + 0.1 * rng.standard_normal((l, h))).astype(np.float32)
    if cfg.arch == "gemma3":           # embeddings scaled by sqrt(H) keep O(1) activations
        params["embed"] = params["embed"] / np.float32(max(cfg.embed_scale, 1.0))
    if not cfg.tie_embeddings:
        params["lm_head"] = w(h, cfg.vocab_size, fan_in=h)
    return cast_params(params, dtype)
